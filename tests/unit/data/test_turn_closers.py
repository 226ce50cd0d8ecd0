"""A turn closer spelled like an XML tag (Gemma's <end_of_turn>) is a turn closer: training ends turns with it and
generation stops at it. A tag closing an element the turn itself opened (</tool_call> after a call's
<tool_call>) is the turn's text, not its end."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.data.chat.examples import row_examples
from open_sft.data.chat.render import renderer_for, special_markers
from open_sft.data.chat.turn_enders import turn_enders
from open_sft.data.formats import to_messages
from open_sft.export.save import end_of_turn_ids

# as Gemma-2/3's templates close turns: <end_of_turn> after the trimmed content, eos never written
GEMMA_LIKE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
              "else m['role']) + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# a call written between special <tool_call> tags, the turn closed with <|im_end|> (as Qwen's, Hermes')
TAGGED_CALLS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}{% for c in "
                "m.tool_calls or [] %}{{ '<tool_call>\n' + c.function | tojson + '\n</tool_call>' }}{% endfor %}"
                "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")


def _tokenizer(tiny_model_dir, template: str, specials: list[str], eos: str = "<|endoftext|>"):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tokenizer.eos_token, tokenizer.chat_template = eos, template
    return tokenizer


def test_gemma_end_of_turn_is_a_stop_and_ends_every_trained_turn(tiny_model_dir) -> None:
    """Real Gemma-2-it ships eos [<eos>, <end_of_turn>]; the export stopped at eos alone, which the template never
    writes, and a row trained turn by turn was cut into one example a turn (no turn was closed by a known ender)."""
    tokenizer = _tokenizer(tiny_model_dir, GEMMA_LIKE, ["<start_of_turn>", "<end_of_turn>"])
    assert end_of_turn_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<end_of_turn>"])
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "name": "a"},
                        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye now", "name": "a"}]}
    examples = row_examples(tokenizer, to_messages(row, "messages"), "all_assistant", special_markers(tokenizer))
    (text, spans), = examples.examples  # the name field sends the row through the per-turn path
    assert [text[a:b] for a, b in spans] == ["Hello<end_of_turn>", "Bye now<end_of_turn>"]


def test_a_tag_closing_what_the_turn_opened_is_not_its_end(tiny_model_dir) -> None:
    tokenizer = _tokenizer(tiny_model_dir, TAGGED_CALLS, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    enders = turn_enders(renderer_for(tokenizer), special_markers(tokenizer), tokenizer.eos_token)
    assert enders.tokens == ("<|endoftext|>", "<|im_end|>") and enders.stops == ("<|endoftext|>", "<|im_end|>")


@pytest.mark.parametrize("template, closer, specials", [
    (GEMMA_LIKE, "<end_of_turn>", ["<start_of_turn>"]),
    ("deepseek_r1_distill.jinja", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"])])
def test_a_tag_shaped_closer_that_is_not_one_token_is_warned_about(tiny_model_dir, caplog, template, closer,
                                                                    specials) -> None:
    """Gemma's <end_of_turn> or DeepSeek-R1's <｜end▁of▁sentence｜>, under a tokenizer that lacks it, trains as pieces
    and generation cannot stop at it: warned about with the fix, as <|im_end|>-like closers are (tag-shaped ones
    were not looked at); silent once it is one token of the tokenizer."""
    from open_sft.data.chat.render import warn_split_turn_closers
    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES

    text = (TEMPLATES / template).read_text() if template.endswith(".jinja") else template
    tokenizer = _tokenizer(tiny_model_dir, text, specials)
    assert len(tokenizer.tokenize(closer)) > 1
    with caplog.at_level("WARNING"):
        warn_split_turn_closers(tokenizer)
    warned = [r.getMessage() for r in caplog.records if "splits into" in r.getMessage()]
    assert len(warned) == 1 and closer in warned[0] and f"a file with the line {closer}" in warned[0]
    caplog.clear()
    tokenizer.add_tokens([AddedToken(closer, special=True, normalized=False)], special_tokens=True)
    with caplog.at_level("WARNING"):
        warn_split_turn_closers(tokenizer)
    assert not [r for r in caplog.records if "splits into" in r.getMessage()]


def test_a_tag_in_the_text_after_an_answer_is_not_a_closer(tiny_model_dir, caplog) -> None:
    """open-instruct's orz-style template writes no closer, and its next user turn quotes <answer> tags: no warning
    (the marker that counts follows the answer at once)."""
    from open_sft.data.chat.render import warn_split_turn_closers
    from open_sft.data.chat.templates import apply_chat_template_choice

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    apply_chat_template_choice(tokenizer, "r1_simple_chat_postpend_think_orz_style", None)
    with caplog.at_level("WARNING"):
        warn_split_turn_closers(tokenizer)
    assert not [r for r in caplog.records if "splits into" in r.getMessage()]
