"""Assistant-only labels on a three-row example, checked by decoding the trained spans."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from open_sft.data.formats import RowError
from open_sft.data.chat.examples import row_examples, trained_spans
from open_sft.data.chat.render import special_markers
from open_sft.data.labels import (IGNORE_INDEX, Example, count_trained, label_and_check, label_tokens,
                                   tokenize_conversations, trained_token_runs, truncate_example)

ROWS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Reverse the word cat."}, {"role": "assistant", "content": "tac"},
     {"role": "user", "content": "Now uppercase it."}, {"role": "assistant", "content": "TAC"}],
    [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": "How many m in 3 km?"},
     {"role": "assistant", "content": "3000 m"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def label(tokenizer, rows, train_on="all_assistant") -> list[Example]:
    markers = special_markers(tokenizer)
    return tokenize_conversations(tokenizer, [trained_spans(tokenizer, r, train_on, markers) for r in rows])


def trained_runs(tokenizer, example: Example) -> list[str]:
    """Decoded contiguous runs of trained tokens (each trained label is its own token id)."""
    assert all(lab in (IGNORE_INDEX, token) for token, lab in zip(example.input_ids, example.labels))
    return [tokenizer.decode(run) for run in trained_token_runs(example.input_ids, example.labels)]


def test_only_assistant_content_and_eos_are_trained(tokenizer) -> None:
    examples = label(tokenizer, ROWS)
    eos = tokenizer.eos_token
    assert trained_runs(tokenizer, examples[0]) == ["5" + eos]
    assert trained_runs(tokenizer, examples[1]) == ["tac" + eos, "TAC" + eos]
    assert trained_runs(tokenizer, examples[2]) == ["3000 m" + eos]
    # The whole rendered conversation is tokenized: untrained tokens hold the headers and prompts.
    untrained = tokenizer.decode([t for t, l in zip(examples[2].input_ids, examples[2].labels) if l == IGNORE_INDEX])
    assert "<|system|>" in untrained and "Reply with a number." in untrained and "<|assistant|>" in untrained
    assert "3000" not in untrained


def test_train_on_last_assistant_and_all(tokenizer) -> None:
    last = label(tokenizer, ROWS[1:2], "last_assistant")[0]
    assert trained_runs(tokenizer, last) == ["TAC" + tokenizer.eos_token]
    everything = label(tokenizer, ROWS[1:2], "all")[0]
    assert everything.labels == everything.input_ids


def test_truncation(tokenizer) -> None:
    example = label(tokenizer, ROWS[2:3])[0]
    n = len(example.input_ids)
    kept, reason = truncate_example(example, n, "truncate")
    assert (kept, reason) == (example, "kept")
    assert truncate_example(example, n - 1, "drop") == (None, "too_long")
    cut, reason = truncate_example(example, n - 1, "truncate")
    assert reason == "truncated" and len(cut.input_ids) == n - 1 and count_trained(cut.labels) >= 1
    # A window the prompt fills alone keeps no trained token: the row is dropped, not kept useless.
    first_trained = next(i for i, l in enumerate(example.labels) if l != IGNORE_INDEX)
    assert truncate_example(example, first_trained, "truncate") == (None, "no_trained_tokens_after_truncation")


TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_tools_column_reaches_the_template_and_is_never_trained(tokenizer) -> None:
    from open_sft.data.formats import to_messages

    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    tokenizer.chat_template = TOOLS_TEMPLATE
    schema = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    row = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": "get_weather(city='Oslo')"},
                        {"role": "tool", "content": "rain, 4 C"},
                        {"role": "assistant", "content": "Rain and 4 C."}],
           "tools": [schema]}
    with_tools = label(tokenizer, [to_messages(row, "messages")])[0]
    as_json_string = label(tokenizer, [to_messages({**row, "tools": json.dumps([schema])}, "messages")])[0]
    without = label(tokenizer, [to_messages({"messages": row["messages"]}, "messages")])[0]
    text = tokenizer.decode(with_tools.input_ids)
    assert "get_weather" in text.split("<|user|>")[0]  # the schema is rendered before the conversation
    assert "get_weather" not in tokenizer.decode(without.input_ids).split("<|user|>")[0]
    assert as_json_string == with_tools
    eos = tokenizer.eos_token
    for example in (with_tools, without):  # tool schemas and the tool turn carry no loss
        assert trained_runs(tokenizer, example) == ["get_weather(city='Oslo')" + eos, "Rain and 4 C." + eos]


@pytest.mark.parametrize("tools", [{"name": "x"}, ["not an object"], "{not json"])
def test_bad_tools_column_is_a_row_error(tools) -> None:
    from open_sft.data.formats import RowError, to_messages

    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "tools": tools}
    with pytest.raises(RowError) as error:
        to_messages(row, "messages")
    assert error.value.reason == "bad_tools" and "'tools'" in str(error.value)


def test_batch_labels_equal_the_row_by_row_definition(tokenizer) -> None:
    """The batch path (one encode call, array labelling) gives the ids of `tokenizer(...)` and the labels
    of `label_tokens`, row by row, on the bundled sample and all three train_on modes."""
    from conftest import SAMPLE
    from open_sft.data.formats import to_messages

    rows = [to_messages(json.loads(line), "messages") for line in SAMPLE.read_text().splitlines()[:300]] + ROWS
    markers = special_markers(tokenizer)
    for train_on in ("all_assistant", "last_assistant", "all"):
        texts_and_spans = [trained_spans(tokenizer, r, train_on, markers) for r in rows]
        examples = tokenize_conversations(tokenizer, texts_and_spans)
        encoded = tokenizer([text for text, _ in texts_and_spans], add_special_tokens=False,
                            return_offsets_mapping=True)
        for example, ids, offsets, (_, spans) in zip(examples, encoded["input_ids"], encoded["offset_mapping"],
                                                     texts_and_spans):
            assert example.input_ids == ids
            assert example.labels == label_tokens(ids, offsets, spans)
        assert sum(count_trained(e.labels) for e in examples) > 0


def _wordpiece_tokenizer():
    """A BERT-style tokenizer: lowercased, whitespace held by no token (the trimmed-offsets case)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, naïve café", "answer: 42 and 7!"] * 20
    backend.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("kind", ["byte_level", "wordpiece", "llama2", "metaspace"])
def test_boundary_labels_equal_the_definition_on_random_spans(tokenizer, kind) -> None:
    """label_batch finds each span's trained tokens from the tokens holding its boundary characters;
    on random texts (accents, emoji split into byte tokens, runs of spaces no WordPiece token holds,
    longer than the look-ahead, SentencePiece-style "▁" spaces and byte fallback) and random ordered
    spans (inside tokens, on whitespace, empty, at the end, reaching the end) every row labels as
    `label_tokens` says."""
    import random

    from open_sft.data.labels import label_batch

    if kind == "wordpiece":
        tokenizer = _wordpiece_tokenizer()
    elif kind != "byte_level":  # SentencePiece-style: Llama 2's "▁" normalizer, or the Metaspace pre-tokenizer
        from tokenizer_kinds import sentencepiece_like

        corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld, naïve café", "answer: 42 and 7!"] * 20
        tokenizer = sentencepiece_like(corpus, kind, vocab_size=300)
    rng = random.Random(3)
    words = ["the", "quick", "héllo", "wörld", "😀", "naïve", "42", "!", "\n", "  ", " " * 20, "café", "<|assistant|>"]
    rows = []
    for _ in range(400):
        text = "".join(rng.choice(words) + rng.choice(["", " ", "  "]) for _ in range(rng.randint(1, 25)))
        cuts = sorted(rng.choices(range(len(text) + 1), k=2 * rng.randint(1, 3)))
        rows.append((text, list(zip(cuts[::2], cuts[1::2]))))
    batch = label_batch(tokenizer, rows, check=False)
    encoded = tokenizer([text for text, _ in rows], add_special_tokens=False, return_offsets_mapping=True)
    for r, ((text, spans), ids, offsets) in enumerate(zip(rows, encoded["input_ids"], encoded["offset_mapping"])):
        assert batch.rows.row(r) == (ids, label_tokens(ids, offsets, spans)), (text, spans)
    trained = batch.rows.labels != IGNORE_INDEX
    assert 0 < trained.sum() < len(trained)  # the case mixes trained and untrained tokens


def test_label_check_catches_a_span_that_cuts_a_token(tokenizer) -> None:
    text = "<|user|>\nhello there\n<|assistant|>\nwonderful answer" + tokenizer.eos_token
    right = (text.index("wonderful"), len(text))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = next(a + 1 for a, b in offsets if a >= right[0] and b - a >= 2)  # within a token of the answer
    examples, ok = label_and_check(tokenizer, [(text, [right]), (text, [(inside, len(text))]),
                                               (text, [right, (len(text), len(text))])])
    assert ok == [True, False, True]
    assert trained_runs(tokenizer, examples[0]) == ["wonderful answer" + tokenizer.eos_token]


CONTENT_READING_TEMPLATE = (  # renders an assistant content twice when it mentions a tool: no layout for such rows
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.role == 'assistant' %}{% if 'tool' in m.content %} (again: {{ m.content }}){% endif %}"
    "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("template", ["tulu", "chatml", "llama3", "zephyr", "embedded", "reading"])
def test_layout_spans_equal_prefix_rendering(tokenizer, template, monkeypatch) -> None:
    """Rows whose text and spans come from their shape's layout get the same text and spans as rendering
    the row and every prefix with the template: both when the layout is filled without rendering (the
    templates open_sft ships) and when the rendered row is checked against it; including padded
    contents (llama3 trims them), braces, NULs and markers in contents, an answer repeated in the prompt,
    and a template that reads the contents (such rows take the prefix path)."""
    from conftest import SAMPLE
    from open_sft.data.chat import render as render_module
    from open_sft.data.formats import to_messages
    from open_sft.data.chat.templates import apply_chat_template_choice

    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    if template == "reading":
        tokenizer.chat_template = CONTENT_READING_TEMPLATE
    elif template != "embedded":
        apply_chat_template_choice(tokenizer, template, None)
    rows = [to_messages(json.loads(line), "messages") for line in SAMPLE.read_text().splitlines()[:200]] + ROWS + [
        [{"role": "user", "content": "  Say 7.\n"}, {"role": "assistant", "content": " 7 \n"}],
        [{"role": "user", "content": "Echo: tool"}, {"role": "assistant", "content": "tool"},
         {"role": "user", "content": "{braces} and }{"}, {"role": "assistant", "content": "ok {x} {0} {}"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "\x000\x00 and {{ messages }}"}, {"role": "assistant", "content": "\u3000 x\t\u3000"},
         {"role": "user", "content": "<|assistant|>\n"}, {"role": "assistant", "content": "\n<|user|>\nno\n"}],
    ]
    markers = special_markers(tokenizer)
    state = render_module.template_state(tokenizer)
    assert (state.contents is not None) == (template != "reading")  # shipped templates are filled, not rendered
    text_and_ends = render_module.text_and_ends
    used = []
    monkeypatch.setattr(render_module, "text_and_ends", lambda *a: used.append(text_and_ends(*a)) or used[-1])
    def spans(row, train_on):
        try:
            return row_examples(tokenizer, row, train_on, markers).examples
        except RowError as error:
            return f"rejected: {error}"

    naming_tool = [any(m["role"] == "assistant" and "tool" in m["content"] for m in r) for r in rows]
    last_naming_tool = [[m for m in r if m["role"] == "assistant"][-1]["content"].count("tool") > 0 for r in rows]
    for train_on in ("all_assistant", "last_assistant", "all"):
        fast = [spans(r, train_on) for r in rows]
        with monkeypatch.context() as patch:
            patch.setattr(state, "contents", None)  # render with Jinja, check against the layout
            rendered = [spans(r, train_on) for r in rows]
            patch.setattr(render_module, "text_and_ends", lambda state, m: (state.draw(m, False, None), None))
            slow = [spans(r, train_on) for r in rows]
        assert fast == rendered == slow
        # The reading template writes a content naming "tool" twice: the turn is all it writes (what the model
        # generates), so no row is rejected
        assert not any(isinstance(result, str) for result in fast)
        if template == "reading" and train_on != "all":
            assert all(text[a:b].count("tool") >= 2 for r, result, named in zip(rows, fast, naming_tool) if named
                       for text, trained in result[-1:] for a, b in trained[-1:] if "tool" in r[-1]["content"])
    draw = state.draw
    for row in rows:  # the text is the template's, and the ends are the prefix renderings' lengths
        text, ends = text_and_ends(state, row)
        assert text == tokenizer.apply_chat_template(row, tokenize=False)
        assert ends is None or {i: (p, t) for i, (p, _, t) in ends.items()} == {
            i: (len(draw(row[:i], True, None)), len(draw(row[: i + 1], False, None)))
            for i, m in enumerate(row) if m["role"] == "assistant"}
        # each content is where the layout says it was written, as is or stripped
        assert ends is None or all(text.startswith(row[i]["content"], c) or text.startswith(row[i]["content"].strip(), c)
                                   for i, (_, c, _) in ends.items())
    naming_tool = sum(naming_tool)
    assert 0 < naming_tool < 4
    by_layout = sum(ends is not None for _, ends in used)  # all rows, but (reading) those naming "tool"
    assert by_layout == len(used) - (2 * 3 * naming_tool if template == "reading" else 0)  # 2 passes × 3 modes


# Mistral-style: the system prompt goes into the last user turn, so rendering the first messages of a
# multi-turn conversation with a system prompt is not a prefix of rendering all of them.
SYSTEM_IN_LAST_USER_TURN = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set turns = messages %}{%- endif %}"
    "{%- set last_user = namespace(index=-1) %}{%- for m in turns %}{%- if m['role'] == 'user' %}"
    "{%- set last_user.index = loop.index0 %}{%- endif %}{%- endfor %}{{- bos_token }}"
    "{%- for m in turns %}{%- if m['role'] == 'user' %}"
    "{%- if loop.index0 == last_user.index and system is defined %}{{- '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('unknown role ' + m['role']) }}{%- endif %}{%- endfor %}"
)


def test_a_template_that_is_not_prefix_stable_trains_each_turn_after_its_own_context(tokenizer) -> None:
    """Multi-turn rows with a system prompt under a template that moves it into the last user turn: when
    turn k is generated, the system prompt sits before the user message it answers, so each assistant turn
    makes its own example, its context exactly the template's rendering of the messages before it with the
    generation prompt (labels checked by decoding). Under open-instruct's templates (for parity) and where the
    one rendering serves every turn (rows[1]), a row stays one example."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    tokenizer.chat_template = SYSTEM_IN_LAST_USER_TURN
    rows = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse cat."},
             {"role": "assistant", "content": "tac"}, {"role": "user", "content": "Uppercase it."},
             {"role": "assistant", "content": " TAC\n"}, {"role": "user", "content": "Twice?"},
             {"role": "assistant", "content": "TACTAC"}],
            ROWS[1]]
    markers = special_markers(tokenizer)
    text = tokenizer.apply_chat_template(rows[0], tokenize=False)
    assert not text.startswith(tokenizer.apply_chat_template(rows[0][:3], tokenize=False))  # not prefix-stable
    rendered = [row_examples(tokenizer, r, "all_assistant", markers).examples for r in rows]
    assert [len(r) for r in rendered] == [3, 1]
    examples, right = label_and_check(tokenizer, rendered[0] + rendered[1])
    eos = tokenizer.eos_token
    assert right == [True] * 4
    for k, (example, (example_text, _)) in enumerate(zip(examples[:3], rendered[0])):
        answer = 2 * k + 2
        assert example_text == tokenizer.apply_chat_template(rows[0][: answer + 1], tokenize=False)
        context = tokenizer.apply_chat_template(rows[0][:answer], tokenize=False, add_generation_prompt=True)
        assert example_text.startswith(context)
        assert [run.strip() for run in trained_runs(tokenizer, example)][-1] == (rows[0][answer]["content"] + eos).strip()
    assert [run.strip() for run in trained_runs(tokenizer, examples[3])] == ["tac" + eos, "TAC" + eos]

    tokenizer.chat_template = SYSTEM_IN_LAST_USER_TURN.replace(  # writes more after short answers
        "{{- ' ' + m['content'] + eos_token }}",
        "{{- ' ' + m['content'] + (' (short)' if m['content'] | length < 4 else '') + eos_token }}")
    runs = [trained_runs(tokenizer, e)[-1].strip() for e in
            label_and_check(tokenizer, row_examples(tokenizer, rows[0], "all_assistant", markers).examples)[0]]
    assert runs == ["tac (short)" + eos, "TAC\n" + eos, "TACTAC" + eos]


def test_a_system_prompt_written_only_into_a_last_user_message_is_in_every_turns_context(tokenizer) -> None:
    """Mistral v0.3's and Nemo's templates write the system prompt into the last user turn only while it is the last
    message: the whole conversation renders without it, yet every turn is generated after it. Each turn trains after
    its own generation context (its own example, the system prompt in it), a one-turn row too."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    tokenizer.chat_template = SYSTEM_IN_LAST_USER_TURN.replace("loop.index0 == last_user.index", "loop.last")
    row = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse cat."},
           {"role": "assistant", "content": "tac"}, {"role": "user", "content": "Uppercase it."},
           {"role": "assistant", "content": "TAC"}]
    assert "Be brief." not in tokenizer.apply_chat_template(row, tokenize=False)
    markers, eos = special_markers(tokenizer), tokenizer.eos_token
    for conversation, answers in ((row, [2, 4]), (row[:3], [2])):
        rendered = row_examples(tokenizer, conversation, "all_assistant", markers).examples
        examples, right = label_and_check(tokenizer, rendered)
        assert right == [True] * len(answers)
        for answer, (text, _), example in zip(answers, rendered, examples):
            context = tokenizer.apply_chat_template(conversation[:answer], tokenize=False, add_generation_prompt=True)
            assert "Be brief." in context and text == context + " " + conversation[answer]["content"] + eos
            assert [run.strip() for run in trained_runs(tokenizer, example)] == [conversation[answer]["content"] + eos]


def test_mistral_v0_3_a_turn_that_cannot_be_located_leaves_the_others_their_system_prompt(tokenizer) -> None:
    """Mistral v0.3's own template (tests/data/chat_templates): a turn answering an empty user message cannot be
    located after its own context, and the whole row fell back to its one rendering, which has no system prompt:
    every turn of it trained without "Be brief.". Now only that turn does (in the one rendering, as before); the
    first trains after its generation context, the system prompt in it, token by token."""
    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES

    mistral = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy: the template changes
    mistral.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>",
                                "additional_special_tokens": ["[INST]", "[/INST]"]})
    mistral.chat_template = (TEMPLATES / "mistral_v0_3.jinja").read_text()
    row = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": ""},
           {"role": "assistant", "content": "Yes?"}]
    whole_render = row_examples(mistral, row, "all_assistant", special_markers(mistral))
    rendered = whole_render.examples
    assert whole_render.turns_in_one_rendering  # counted per source and warned (summary._NOTES)
    assert not row_examples(mistral, row[:3], "all_assistant", special_markers(mistral)).turns_in_one_rendering
    first = mistral.apply_chat_template(row[:2], tokenize=False, add_generation_prompt=True)
    assert first == "<s>[INST] Be brief.\n\nHi[/INST]"
    whole = mistral.apply_chat_template(row, tokenize=False)
    assert [text for text, _ in rendered] == [first + " Hello!</s>", whole] and "Be brief." not in whole
    examples, right = label_and_check(mistral, rendered)
    assert right == [True, True]
    for example, (text, _) in zip(examples, rendered):
        assert example.input_ids == mistral(text, add_special_tokens=False)["input_ids"]
    assert [run.strip() for example in examples for run in trained_runs(mistral, example)] == ["Hello!</s>", "Yes?</s>"]
    context = examples[0].labels.index(next(label for label in examples[0].labels if label != IGNORE_INDEX))
    assert mistral.decode(examples[0].input_ids[:context]) == first


def test_turns_trained_in_the_one_rendering_are_counted_per_source_and_warned(tokenizer, tmp_path, caplog) -> None:
    """The Mistral v0.3 turns above that train without the system prompt the template gives a generated turn are
    counted in the source's report (data_report.json) and said once, naming the first row; rows whose turns all
    train after their own context are not."""
    from tests.unit.data.test_reasoning_tool_calls import TEMPLATES, build

    mistral = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    mistral.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>",
                                "additional_special_tokens": ["[INST]", "[/INST]"]})
    mistral.chat_template = (TEMPLATES / "mistral_v0_3.jinja").read_text()
    whole = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}]
    empty = whole + [{"role": "user", "content": ""}, {"role": "assistant", "content": "Yes?"}]
    with caplog.at_level("WARNING"):
        _, (report,) = build(mistral, tmp_path, [{"messages": whole}, {"messages": empty}, {"messages": empty}])
    assert report.turns_in_one_rendering == 2 and report.to_dict()["turns_in_one_rendering"] == 2
    warned = [r.getMessage() for r in caplog.records if "without what the template" in r.getMessage()]
    assert len(warned) == 1 and "2 row(s)" in warned[0] and "line 2" in warned[0], warned
