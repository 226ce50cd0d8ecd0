"""A turn closer spelled like an XML tag (Gemma's <end_of_turn>) is a turn closer: training ends turns with it and
generation stops at it. A tag closing an element the turn itself opened (</tool_call> after a call's
<tool_call>) is the turn's text, not its end."""

from __future__ import annotations

from tokenizers import AddedToken
from transformers import AutoTokenizer

from open_sft.data.chat.examples import row_examples
from open_sft.data.chat.render import renderer_for, special_markers
from open_sft.data.chat.turn_render import turn_enders
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
