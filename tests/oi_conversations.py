"""Conversations open-instruct's chat templates are checked on (tests/data/open_instruct_renderings.json
holds open-instruct's own renderings of them; test_oi_templates.py compares)."""

_FUNCTIONS = '[{"name": "add", "parameters": {"a": "number", "b": "number"}}]'

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "The sum is 5."}],
    "system": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3 km in m?"},
               {"role": "assistant", "content": "3000"}],
    "multi": [{"role": "user", "content": "Reverse cat."}, {"role": "assistant", "content": "tac"},
              {"role": "user", "content": "Uppercase it."}, {"role": "assistant", "content": "TAC"}],
    "system_multi": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"},
                     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."},
                     {"role": "assistant", "content": "Goodbye."}],
    "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime."}],
    "multi_prompt": [{"role": "user", "content": "Reverse cat."}, {"role": "assistant", "content": "tac"},
                     {"role": "user", "content": "Now dog."}],
    "thinking": [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "<think>Two and two.</think>\n\nIt is 4."},
                 {"role": "user", "content": "3+3?"},
                 {"role": "assistant", "content": "<think>Three and three.</think>It is 6."}],
    "whitespace": [{"role": "user", "content": "  Sag  hallo\n"},
                   {"role": "assistant", "content": "  Hallo, Welt! café 😀 {braces} \\boxed{} \n"}],
    "functions": [{"role": "system", "content": "You add numbers.", "functions": _FUNCTIONS},
                  {"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "content": "", "function_calls": "add(a=2, b=3)"},
                  {"role": "environment", "content": "5"},
                  {"role": "assistant", "content": "It is 5."}],
    "user_functions": [{"role": "user", "content": "Add 1 and 1.", "functions": _FUNCTIONS},
                       {"role": "assistant", "content": "Let me add.", "function_calls": "add(a=1, b=1)"},
                       {"role": "environment", "content": "2"}, {"role": "assistant", "content": "2"}],
    "tool": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Calling the tool."},
             {"role": "tool", "content": "{\"temp\": 4}"}, {"role": "assistant", "content": "It is 4 degrees."}],
}

_TAGGED = {"system", "user", "assistant"}
_OLMO = {"system", "user", "assistant", "environment"}
# The roles each template writes a turn for (None: any role); open_sft's templates reject a conversation
# with another role where open-instruct's silently leave the message out.
ROLES_WRITTEN = {
    "zephyr": _TAGGED, "tulu": _TAGGED, "tulu_thinker": _TAGGED, "tulu_thinker_r1_style": _TAGGED,
    "olmo": _OLMO, "olmo_old": _OLMO, "olmo_thinker": _OLMO, "olmo_thinker_no_think_7b": _OLMO,
    "olmo_thinker_remove_intermediate_thinking": _OLMO, "olmo_thinker_no_think_sft_tokenization": _OLMO,
    "qwen_instruct_user_boxed_math": {"user", "assistant"},
}
