"""open-instruct's chat templates: byte-identical to open-instruct's own renderings, rows of a role a
template has no turn for rejected, and the trained tokens of each template what its turns write."""

from __future__ import annotations

import json
import re

import pytest
from jinja2 import TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

from conftest import TESTS
from oi_conversations import CONVERSATIONS, ROLES_WRITTEN
from open_sft.data.chat.oi_templates import OPEN_INSTRUCT_TEMPLATES

EXPECTED = json.loads((TESTS / "data" / "open_instruct_renderings.json").read_text())["renderings"]
CASES = [(name, case) for name in sorted(OPEN_INSTRUCT_TEMPLATES) for case in sorted(CONVERSATIONS)]


def _render(name: str, messages: list, generation_prompt: bool) -> str:
    texts, _ = render_jinja_template([messages], chat_template=OPEN_INSTRUCT_TEMPLATES[name][0],
                                     add_generation_prompt=generation_prompt, bos_token="<s>", eos_token="</s>")
    return texts[0]


def test_every_open_instruct_template_name_is_here() -> None:
    assert sorted(OPEN_INSTRUCT_TEMPLATES) == sorted(EXPECTED)
    assert len(EXPECTED) == 21


@pytest.mark.parametrize("name,case", CASES)
def test_renders_byte_identical_to_open_instruct(name, case) -> None:
    messages = CONVERSATIONS[case]
    expected = EXPECTED[name]
    if case not in expected:  # a role the template has no turn for: rejected, not left out
        roles = {m["role"] for m in messages} - ROLES_WRITTEN[name]
        with pytest.raises(TemplateError, match=f"the {name} chat template has no turn for role ({'|'.join(roles)})"):
            _render(name, messages, False)
        return
    assert _render(name, messages, False) == expected[case]
    if messages[-1]["role"] != "assistant":
        assert _render(name, messages, True) == expected[f"{case}+prompt"]


LABELS = [  # template, conversation → the trained text of each assistant turn ("eos": the tokenizer's)
    ("tulu_thinker_r1_style", "thinking", ["It is 4.eos", "It is 6.eos"]),  # it writes only the answers
    ("olmo_thinker_remove_intermediate_thinking", "thinking",
     ["It is 4.<|im_end|>", "<think>Three and three.</think>It is 6.eos"]),
    ("olmo", "multi", ["tac<|im_end|>", "TACeos"]),  # eos closes only the last turn, <|im_end|> the others
    ("olmo", "functions", ["<function_calls>add(a=2, b=3)</function_calls><|im_end|>", "It is 5.eos"]),
    ("olmo_thinker", "user_functions",
     ["Let me add.<function_calls>add(a=1, b=1)</function_calls><|im_end|>", "2eos"]),
    ("simple_chat", "multi", ["tac", "TACeos"]),  # no end of turn between turns: none trained
    ("r1_simple_chat", "multi", ["tac", "TAC"]),
    ("qwen_instruct_user_boxed_math", "multi", ["tac<|im_end|>", "TAC<|im_end|>"]),
    ("zephyr", "system_multi", ["Hello.eos", "Goodbye.eos"]),
]


@pytest.mark.parametrize("name,case,expected", LABELS)
def test_trained_tokens_are_what_each_assistant_turn_writes(tiny_model_dir, tmp_path, name, case, expected) -> None:
    """Through the data pipeline, with a real tokenizer: templates that are not prefix-stable (eos only
    after the last turn, a generation prompt the turn does not start with, answers cut from their
    thinking) still train exactly each assistant turn and its end of turn, and nothing of the prompts."""
    from transformers import AutoTokenizer

    from open_sft.config.args import DataArguments
    from open_sft.data.build import build_examples
    from open_sft.data.chat.templates import apply_chat_template_choice
    from open_sft.data.labels import trained_token_runs
    from open_sft.export.save import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    apply_chat_template_choice(tokenizer, name, None)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[case]}) + "\n")
    examples, _ = build_examples(DataArguments(dataset_mixer_list=[str(data), "1.0"]), tokenizer, 0)
    runs = [tokenizer.decode(run).strip() for run in trained_token_runs(examples[0].input_ids, examples[0].labels)]
    assert runs == [text.replace("eos", tokenizer.eos_token) for text in expected]
    # generation stops at every token a trained turn ends with (OLMo's <|im_end|> too, not eos alone)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ends = {next(i for i in reversed(run) if i in special)
            for run in trained_token_runs(examples[0].input_ids, examples[0].labels) if special & set(run)}
    assert ends <= set(end_of_turn_ids(tokenizer)) and (ends or name.endswith("simple_chat"))


OPENAI_TOOL_ROW = {"tools": [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}], "messages": [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]}
HINT = ("this template (OLMo's, as open-instruct and Olmo 3's Think models write it) has no 'tool' role and reads no "
        "OpenAI 'tool_calls': it writes a tool's result as an 'environment' turn")


def test_openai_tool_rows_under_olmo_templates_say_the_form_they_need(tiny_model_dir) -> None:
    """OLMo's templates (open-instruct's olmo*, Olmo 3 Think's own) write tool results as `environment` turns and
    calls from a `function_calls` string: an OpenAI tool row was refused with 'the olmo chat template has no turn for
    role tool' (open_sft's copy of open-instruct's olmo), or, under open-instruct's form that leaves the turn out,
    'does not write its tool calls', neither saying what the template reads. Both errors say it now, and how to give
    the row; the row in that form trains its calls."""
    from transformers import AutoTokenizer

    from open_sft.data.chat.examples import row_examples
    from open_sft.data.chat.render import special_markers
    from open_sft.data.chat.templates import apply_chat_template_choice
    from open_sft.data.formats import RowError, to_messages
    from tests.unit.data.test_reasoning_tool_calls import family_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    apply_chat_template_choice(tokenizer, "olmo", None)
    markers = special_markers(tokenizer)
    with pytest.raises(RowError, match=re.escape("no turn for role tool; " + HINT)) as refused:
        row_examples(tokenizer, to_messages(OPENAI_TOOL_ROW, "messages"), "all_assistant", markers)
    assert refused.value.reason == "template_error" and "--chat_template_path FILE" in str(refused.value)
    source = OPEN_INSTRUCT_TEMPLATES["olmo"][0]
    tokenizer.chat_template = source[:source.index("{% else %}{{ raise_exception")] + source[source.rindex(
        "{% endif %}{% if loop.last and add_generation_prompt"):]  # open-instruct's own: a tool turn left out
    with pytest.raises(RowError, match="does not write its tool calls .*; " + re.escape(HINT)) as refused:
        row_examples(tokenizer, to_messages(OPENAI_TOOL_ROW, "messages"), "all_assistant", markers)
    assert refused.value.reason == "tool_calls_not_rendered"
    olmo_form = [OPENAI_TOOL_ROW["messages"][0],
                 {"role": "assistant", "content": "", "function_calls": "add(a=2, b=3)"},
                 {"role": "environment", "content": "5"}, OPENAI_TOOL_ROW["messages"][3]]
    examples = row_examples(tokenizer, to_messages({"messages": olmo_form}, "messages"), "all_assistant",
                            markers).examples
    assert [text[a:b] for text, spans in examples for a, b in spans] == [
        "<function_calls>add(a=2, b=3)</function_calls>" + tokenizer.eos_token, "It is 5." + tokenizer.eos_token]
    qwen3 = family_tokenizer(tiny_model_dir, "qwen3")  # a template of OpenAI's form: no such hint
    assert row_examples(qwen3, to_messages(OPENAI_TOOL_ROW, "messages"), "all_assistant", special_markers(qwen3))
