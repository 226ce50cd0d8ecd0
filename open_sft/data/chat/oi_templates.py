"""open-instruct's chat templates, by the names its `--chat_template_name` knows.

Written here from what each of open-instruct's templates renders (its CHAT_TEMPLATES table,
open_instruct/dataset_transformation.py), not copied: the tests hold open-instruct's own renderings of
a set of conversations and check these byte for byte. One difference on purpose: where open-instruct's
template silently writes nothing for a message of a role it has no turn for (a `tool` message under
`tulu`, a system prompt under `qwen_instruct_user_boxed_math`), these raise, so such a row is reported
as a bad row (or skipped with --on_bad_row drop) instead of being trained with a hole in it. Templates
that write every role without naming it (the concatenations, the R1 and RL-zero prompts) accept any.

Jinja is rendered by transformers with trim_blocks and lstrip_blocks, so every literal here is a Jinja
expression: text between tags would lose a newline that follows a tag.
"""

from __future__ import annotations


def _q(text: str) -> str:
    """`text` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _raise_for_other_roles(name: str) -> str:
    return ("{% else %}{{ raise_exception('the " + name + " chat template has no turn for role ' + message['role']) }}")


def _when_last(generation_prompt: str, closing: str = "") -> str:
    """What open-instruct's templates write after the last message: the generation prompt if asked
    for, else `closing` (eos, for the concatenations)."""
    text = "{% if loop.last and add_generation_prompt %}{{ " + _q(generation_prompt) + " }}"
    if closing:
        text += "{% elif loop.last %}{{ " + closing + " }}"
    return text + "{% endif %}"


def _joined(separator: str, item: str, generation_prompt: str = "", closing: str = "", preamble: str = "") -> str:
    """Every message's `item` (a Jinja expression), `separator` between them, whatever its role."""
    return ("{{ " + _q(preamble) + " }}{% for message in messages %}"
            "{% if not loop.first %}{{ " + _q(separator) + " }}{% endif %}{{ " + item + " }}"
            + _when_last(generation_prompt, closing) + "{% endfor %}")


_CAPITALIZED = "message['role'].capitalize() + ': '"

SIMPLE_CONCAT_WITH_SPACE = _joined(" ", "message['content']", closing="eos_token")
SIMPLE_CONCAT_WITH_NEW_LINE = _joined("\n", "message['content']", closing="eos_token")
SIMPLE_CHAT = _joined("\n\n", _CAPITALIZED + " + message['content']", closing="eos_token")
ASSISTANT_MESSAGE_ONLY = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                          "{{ message['content'] }}{% endif %}{% endfor %}")


def _tagged(name: str, generation_prompt: str, *, eos_after_every_turn: bool = False, answer_only: bool = False,
            preamble: str = "") -> str:
    """`<|role|>` newline content turns (tulu, zephyr). Assistant turns end with eos, and a newline
    unless last; zephyr closes system and user turns with eos too and always adds the newline;
    `answer_only` writes what follows the last `</think>` of an assistant content."""
    closing = " + eos_token + '\\n'" if eos_after_every_turn else " + '\\n'"
    answer = ("{% set content = message['content'] %}{% if '</think>' in content %}"
              "{% set content = content.split('</think>')[-1] %}{% endif %}") if answer_only else ""
    content = "content" if answer_only else "message['content']"
    assistant_end = ("{{ eos_token + '\\n' }}" if eos_after_every_turn
                     else "{{ eos_token }}{% if not loop.last %}{{ '\\n' }}{% endif %}")
    return ("{{ " + _q(preamble) + " }}{% for message in messages %}"
            "{% if message['role'] in ['system', 'user'] %}{{ '<|' + message['role'] + '|>\\n' + message['content']"
            + closing + " }}"
            "{% elif message['role'] == 'assistant' %}" + answer + "{{ '<|assistant|>\\n' + " + content + " }}"
            + assistant_end + _raise_for_other_roles(name) + "{% endif %}"
            + _when_last(generation_prompt) + "{% endfor %}")


_R1 = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
       "The assistant first thinks about the reasoning process in the mind and then provides the user with "
       "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
       "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n\n")
_R1_TOOL = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "\n\nWhen given a question, the Assistant must conduct reasoning inside the <think> and </think> tags. During "
    "reasoning, the Assistant may write and execute python code using the <code> </code> tag, in order to solve "
    "the problem or verify the answer. Then the Assistant will get the stdout and stderr in the <output> and "
    "</output> tags. For example, the code could be\n<code>\nx, y = 1, 2\nresult = x + y\nprint(result)\n</code>\n"
    "or\n<code>\nimport sympy as sp\nfrom sympy import Symbol\nx = Symbol('x')\ny = Symbol('y')\nsolution = "
    "sp.solve(x**2 + y**2 - 1, (x, y))\nprint(solution)\n</code>\nThe Assistant will always `print` the result of "
    "the code execution in order to see it in the <output> tag. The Assistant may use the <code> </code> tag "
    "multiple times. When the Assistant is done reasoning, it should provide the answer inside the <answer> and "
    "</answer> tag.\n\n")
_ORZ = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your "
        "final answer will be extracted automatically by the \\boxed{} tag. This is the problem: ")


def _r1(preamble: str, generation_prompt: str, instruction: str = "") -> str:
    return _joined("\n\n", _CAPITALIZED + " + " + _q(instruction) + " + message['content'] + '\\n'",
                   generation_prompt, preamble=preamble)


def _rlzero(preamble: str, reminder: str) -> str:
    return _joined("\n\n", "message['content'] + '\\n'", reminder, preamble=preamble)


_OLMO_IDENTITY = ("You are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff is November "
                  "2024, and your model weights are available at https://huggingface.co/allenai. You do not "
                  "currently have access to any functions. <functions></functions>")
_OLMO_7B_IDENTITY = ("You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, and your "
                     "model weights are available at https://huggingface.co/allenai.")
_HELPFUL = "You are a helpful AI assistant."


def _olmo(name: str, default_system: str, generation_prompt: str, drop_earlier_thinking: bool = False) -> str:
    """ChatML turns as OLMo-core writes them: a default system prompt when the conversation has none,
    `functions` (on system and user messages) and `function_calls` (assistant) as tagged text, tool
    results as `environment` turns, the last assistant turn closed with eos instead of <|im_end|>.
    `drop_earlier_thinking`: an assistant turn that is not the last keeps only what follows `</think>`."""
    content = "{{ message['content'] }}"
    if drop_earlier_thinking:
        content = ("{% set content = message['content'] | string %}"
                   "{% if not loop.last and '</think>' in content and '<think>' in content %}"
                   "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}{{ content }}")
    no_functions = " You do not currently have access to any functions. <functions></functions>"
    return (
        "{% if messages | selectattr('role', 'equalto', 'system') | list | length == 0 %}"
        "{{ " + _q("<|im_start|>system\n" + default_system + "<|im_end|>\n") + " }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ '<|im_start|>system\\n' + message['content'] }}"
        "{% if message.get('functions', none) is not none %}{{ ' <functions>' + message['functions'] + '</functions>' }}"
        "{% else %}{{ " + _q(no_functions) + " }}{% endif %}{{ '<|im_end|>\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '<|im_start|>user\\n' + message['content'] }}"
        "{% if message.get('functions', none) is not none %}{{ '\\n<functions>' + message['functions'] + '</functions>' }}"
        "{% endif %}{{ '<|im_end|>\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        "{% if message.get('content', none) is not none %}" + content + "{% endif %}"
        "{% if message.get('function_calls', none) is not none %}"
        "{{ '<function_calls>' + message['function_calls'] + '</function_calls>' }}{% endif %}"
        "{% if loop.last %}{{ eos_token }}{% else %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% elif message['role'] == 'environment' %}{{ '<|im_start|>environment\\n' + message['content'] + '<|im_end|>\\n' }}"
        + _raise_for_other_roles(name) + "{% endif %}" + _when_last(generation_prompt) + "{% endfor %}"
    )


QWEN_BOXED_MATH = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|im_start|>user\\n' + message['content'] + "
    + _q("\n\nPlease reason step by step, and put your final answer within \\boxed{}<|im_end|>\n") + " }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}"
    + _raise_for_other_roles("qwen_instruct_user_boxed_math") + "{% endif %}"
    + _when_last("<|im_start|>assistant\n") + "{% endfor %}"
)

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

# name → (Jinja source, special tokens it needs as single tokens)
OPEN_INSTRUCT_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "simple_concat_with_space": (SIMPLE_CONCAT_WITH_SPACE, ()),
    "simple_concat_with_new_line": (SIMPLE_CONCAT_WITH_NEW_LINE, ()),
    "simple_chat": (SIMPLE_CHAT, ()),
    "assistant_message_only": (ASSISTANT_MESSAGE_ONLY, ()),
    "zephyr": (_tagged("zephyr", "<|assistant|>\n", eos_after_every_turn=True), ()),
    "olmo": (_olmo("olmo", _OLMO_IDENTITY, "<|im_start|>assistant\n"), CHATML_TOKENS),
    "tulu": (_tagged("tulu", "<|assistant|>\n"), ()),
    "tulu_thinker": (_tagged("tulu_thinker", "<|assistant|>\n<think>"), ()),
    "tulu_thinker_r1_style": (_tagged("tulu_thinker_r1_style", "<|assistant|>\n<think>", answer_only=True,
                                      preamble=_R1), ()),
    "olmo_old": (_olmo("olmo_old", _OLMO_IDENTITY, "<|im_start|>assistant\n"), CHATML_TOKENS),
    "olmo_thinker": (_olmo("olmo_thinker", _HELPFUL, "<|im_start|>assistant\n<think>"), CHATML_TOKENS),
    "olmo_thinker_no_think_7b": (_olmo("olmo_thinker_no_think_7b", _OLMO_7B_IDENTITY, "<|im_start|>assistant\n"),
                                 CHATML_TOKENS),
    "olmo_thinker_remove_intermediate_thinking": (
        _olmo("olmo_thinker_remove_intermediate_thinking", _HELPFUL, "<|im_start|>assistant\n<think>",
              drop_earlier_thinking=True), CHATML_TOKENS),
    "olmo_thinker_no_think_sft_tokenization": (
        _olmo("olmo_thinker_no_think_sft_tokenization", _HELPFUL, "<|im_start|>assistant\n"), CHATML_TOKENS),
    "olmo_thinker_rlzero": (_rlzero(
        "Solve the following problem step by step. The last line of your response should be the answer to the "
        "problem in form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
        '\nRemember to put your answer on its own line after "Answer:"'), ()),
    "olmo_thinker_code_rlzero": (_rlzero(
        "Solve the following code problem step by step. The last part of your response should be the solution to "
        "the problem in form ```\npython\nCODE\n``` where CODE is the solution for the problem.\n\n",
        # open-instruct writes this reminder as template text right after a tag, whose newline Jinja's
        # trim_blocks removes: its rendering starts at "Remember"
        "Remember to put your solution inside the ```\npython\nCODE\n``` tags"), ()),
    "r1_simple_chat": (_r1(_R1, "Assistant:"), ()),
    "r1_simple_chat_postpend_think": (_r1(_R1, "Assistant: <think>"), ()),
    "r1_simple_chat_postpend_think_orz_style": (_r1(_R1, "Assistant: <think>", _ORZ), ()),
    "r1_simple_chat_postpend_think_tool_vllm": (_r1(_R1_TOOL, "Assistant: <think>", _ORZ), ()),
    "qwen_instruct_user_boxed_math": (QWEN_BOXED_MATH, CHATML_TOKENS),
}
