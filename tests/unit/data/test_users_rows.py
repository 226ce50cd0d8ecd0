"""Rows as users' datasets hold them train as their plain equivalents do: tool calls read from parquet (Arrow's
filled-in nulls removed), arguments given as JSON strings, OpenAI content parts, role/content messages under
`conversations`, a row's own `system` column, turns after the last answer, LLaMA-Factory's sharegpt
function_call/observation turns, OpenAI's legacy functions/function_call rows, and decomposed Unicode under a
tokenizer that composes it.

Each case builds the row and its plain form through the real data build (the chat templates the model
repositories ship, tests/data/chat_templates) and compares the examples token for token."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import datasets
import pytest
from tokenizers import normalizers

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.chunks import Reader
from open_sft.data.formats import RowError, to_messages
from open_sft.data.labels import trained_token_runs
from open_sft.data.sources import parse_mixer_list, read_source
from tests.unit.data.test_reasoning_tool_calls import TOOLS, call, family_tokenizer, tool

WEATHER = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"}, 1)]},
    tool('{"temp_c": -3}', 1), {"role": "assistant", "content": "It is -3 in Oslo."}]}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"]}}}
SEARCH = {"tools": [SEARCH_TOOL], "messages": [
    {"role": "user", "content": "News on the weather?"},
    {"role": "assistant", "content": "", "tool_calls": [call("search", {"query": "weather news", "limit": 3}, 2)]},
    tool('["storm ahead"]', 2), {"role": "assistant", "content": "A storm is coming."}]}


def examples_of(tokenizer, tmp_path: Path, rows: list[dict], name: str = "rows.jsonl", **flags) -> list:
    path = tmp_path / name
    if name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=4096, **flags)
    return [(e.input_ids, e.labels) for e in build_examples(args, tokenizer, 0)[0]]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return family_tokenizer(tiny_model_dir, "qwen3")


def test_tool_calls_read_from_parquet_lose_the_nulls_arrow_filled_in(qwen3, tmp_path) -> None:
    """Two rows whose calls (and tool schemas) have other keys: Arrow's struct gives each the other's keys as
    null; read whole and streamed, the rows are back as written, and they train as the JSON Lines rows do."""
    path = tmp_path / "tools.parquet"
    datasets.Dataset.from_list([WEATHER, SEARCH]).to_parquet(str(path))
    filled = datasets.Dataset.from_parquet(str(path))[0]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert filled == {"city": "Oslo", "query": None, "limit": None}  # what the fix is for
    spec, = parse_mixer_list([str(path), "1.0"], ["train"])
    streamed = [row for _, rows, _ in Reader.open(spec).chunks() for row in rows]
    for rows in (read_source(spec).rows, streamed):
        assert [list(to_messages(row, "messages")) for row in rows] == [WEATHER["messages"], SEARCH["messages"]]
        assert [row["tools"] for row in rows] == [TOOLS, [SEARCH_TOOL]]
    assert examples_of(qwen3, tmp_path, [WEATHER, SEARCH], "tools.parquet") == examples_of(qwen3, tmp_path,
                                                                                          [WEATHER, SEARCH])


def as_string_arguments(row: dict) -> dict:
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], separators=(",", ":"))}} for c in m["tool_calls"]]} if m.get("tool_calls")
        else m for m in row["messages"]]
    return {**row, "messages": messages}


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3"])
def test_arguments_as_a_json_string_train_as_the_object(family, tiny_model_dir, tmp_path) -> None:
    """gpt-oss writes arguments with `tojson`: a JSON string of them trained a string of JSON, `"{\\"city\\"..."`."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    assert (examples_of(tokenizer, tmp_path, [as_string_arguments(WEATHER), as_string_arguments(SEARCH)])
            == examples_of(tokenizer, tmp_path, [WEATHER, SEARCH]))
    runs = [tokenizer.decode(run) for e in examples_of(tokenizer, tmp_path, [as_string_arguments(WEATHER)])
            for run in trained_token_runs(*e)]
    assert any('{"city": "Oslo"}' in run for run in runs) and not any('\\"' in run for run in runs)


def test_openai_content_parts_are_their_texts(qwen3, tmp_path) -> None:
    parts = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Two lines:"}, {"type": "text", "text": "a and b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]}  # the Responses API's
    plain = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two lines:\na and b"},
                          {"role": "assistant", "content": "Done."}]}
    assert examples_of(qwen3, tmp_path, [parts]) == examples_of(qwen3, tmp_path, [plain])
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(RowError, match=r"message 1 \(user\) content part 1 is 'image_url'; only text parts"):
        to_messages(image, "messages")


def test_conversations_of_role_and_content_are_messages(qwen3, tmp_path) -> None:
    as_conversations = {"conversations": WEATHER["messages"], "tools": TOOLS}
    assert examples_of(qwen3, tmp_path, [as_conversations]) == examples_of(qwen3, tmp_path, [WEATHER])


def test_a_rows_system_column_opens_its_messages(qwen3, tmp_path) -> None:
    system = {"role": "system", "content": "You are a pirate."}
    row = {"system": system["content"], "messages": WEATHER["messages"], "tools": TOOLS}
    with_turn = {"messages": [system] + WEATHER["messages"], "tools": TOOLS}
    assert examples_of(qwen3, tmp_path, [row]) == examples_of(qwen3, tmp_path, [with_turn])
    assert examples_of(qwen3, tmp_path, [{**with_turn, "system": "Another."}]) == examples_of(qwen3, tmp_path,
                                                                                           [with_turn])


def test_turns_after_the_last_answer_are_left_out(qwen3, tmp_path) -> None:
    """They train nothing and nothing before them sees them; a row with no answer at all is still refused."""
    follow_up = {**WEATHER, "messages": WEATHER["messages"] + [{"role": "user", "content": "And Rome?"}]}
    after_call = {**WEATHER, "messages": WEATHER["messages"][:3]}  # ends with the tool's result
    assert examples_of(qwen3, tmp_path, [follow_up]) == examples_of(qwen3, tmp_path, [WEATHER])
    assert examples_of(qwen3, tmp_path, [after_call]) == examples_of(qwen3, tmp_path, [
        {**WEATHER, "messages": WEATHER["messages"][:2]}])
    with pytest.raises(RowError, match="the conversation has no assistant turn \\(it ends with a user turn\\)"):
        to_messages({"messages": [{"role": "user", "content": "Hi"}]}, "messages")


def test_llama_factory_sharegpt_function_calls_train_as_tool_calls(qwen3, tmp_path) -> None:
    """LLaMA-Factory's sharegpt tool rows: a function_call turn ({name, arguments} JSON) is the assistant's tool
    call and an observation the tool's result, written by the template as OpenAI tool_calls and tool turns are."""
    sharegpt = {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": '{"temp_c": -3}'}, {"from": "gpt", "value": "It is -3 in Oslo."}]}
    openai = {"tools": TOOLS, "messages": [
        WEATHER["messages"][0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": '{"temp_c": -3}'}, WEATHER["messages"][3]]}
    assert examples_of(qwen3, tmp_path, [sharegpt]) == examples_of(qwen3, tmp_path, [openai])
    runs = [qwen3.decode(run) for e in examples_of(qwen3, tmp_path, [sharegpt]) for run in trained_token_runs(*e)]
    assert "<tool_call>" in runs[0] and '"arguments": {"city": "Oslo"}' in runs[0]
    prose = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "not JSON"}]}
    assert to_messages(prose, "sharegpt")[1] == {"role": "assistant", "content": "not JSON"}


def test_openai_legacy_function_calling_trains_as_tool_calls(qwen3, tmp_path) -> None:
    """OpenAI's legacy function-calling fine-tuning rows: a `functions` column of bare schemas, an assistant
    `function_call` {name, arguments as a JSON string} and a `function` message with its result train as the
    tools/tool_calls/tool row does (read whole or from parquet). Neither was read: a call beside text trained the
    text alone, with no schemas in the context, and one with a null content was refused as a null content."""
    arguments = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    result = {"role": "function", "name": "get_weather", "content": '{"temp_c": -3}'}
    legacy = {"functions": [tool["function"] for tool in TOOLS], "messages": [
        WEATHER["messages"][0], {"role": "assistant", "content": None, "function_call": arguments}, result,
        WEATHER["messages"][3]]}
    openai = {"tools": TOOLS, "messages": [
        WEATHER["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {**result, "role": "tool"}, WEATHER["messages"][3]]}
    expected = examples_of(qwen3, tmp_path, [openai])
    assert examples_of(qwen3, tmp_path, [legacy]) == expected
    assert examples_of(qwen3, tmp_path, [legacy], name="legacy.parquet") == expected
    no_content = {**legacy, "messages": [legacy["messages"][0], {"role": "assistant", "function_call": arguments}]}
    assert examples_of(qwen3, tmp_path, [no_content]) == examples_of(qwen3, tmp_path, [
        {**openai, "messages": openai["messages"][:2]}])
    calls = openai["messages"][1]["tool_calls"]  # no content key beside tool_calls either (a KeyError: 'content')
    assert to_messages({"messages": [WEATHER["messages"][0], {"role": "assistant", "tool_calls": calls}]},
                       "messages")[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    beside = {**legacy, "messages": [legacy["messages"][0], {"role": "assistant", "content": "Let me look that up.",
                                                             "function_call": arguments}]}
    (ids, labels), = examples_of(qwen3, tmp_path, [beside])
    run, = [qwen3.decode(run) for run in trained_token_runs(ids, labels)]
    assert run.endswith('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                        '\n</tool_call><|im_end|>')
    assert '"name": "get_weather"' in qwen3.decode(ids[: labels.index(next(x for x in labels if x != -100))])
    with pytest.raises(RowError, match=r"message 2 \(assistant\) has a function_call that is not OpenAI's legacy "
                                       r"form: an object \{name, arguments\}"):
        to_messages({"messages": [WEATHER["messages"][0],
                                  {"role": "assistant", "content": "", "function_call": "auto"}]}, "messages")
    with pytest.raises(RowError, match=r"message 2 \(assistant\) has content of type NoneType; expected a string "
                                       r"\(or a list of text parts\) \(null only beside the turn's tool_calls, or "
                                       r"OpenAI's legacy function_call\)"):
        to_messages({"messages": [WEATHER["messages"][0], {"role": "assistant", "content": None}]}, "messages")


def test_tool_results_that_carry_the_templates_own_tags_are_counted(qwen3, tmp_path, caplog) -> None:
    """Hermes-style sharegpt rows (NousResearch/hermes-function-calling-v1) give a tool turn's value already inside
    <tool_response> tags, which Qwen3's template writes around every tool message again: a doubled context the model
    never sees at inference. Counted per source and warned with the fix; the same row without the tags is not."""
    def hermes(result: str) -> dict:
        return {"tools": json.dumps(TOOLS), "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "gpt", "value": "<tool_call>\n"
             + json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}) + "\n</tool_call>"},
            {"from": "tool", "value": result}, {"from": "gpt", "value": "It is -3 in Oslo."}]}

    wrapped, plain = hermes('<tool_response>\n{"temp_c": -3}\n</tool_response>'), hermes('{"temp_c": -3}')
    path = tmp_path / "hermes.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [plain, wrapped]))
    with caplog.at_level("WARNING"):
        _, (report,) = build_examples(DataArguments(dataset_mixer_list=[str(path), "1.0"]), qwen3, 0)
    assert report.tool_results_wrapped_twice == 1 and report.to_dict()["tool_results_wrapped_twice"] == 1
    warned = [r.getMessage() for r in caplog.records if "writes around every tool result again" in r.getMessage()]
    assert len(warned) == 1 and "line 2" in warned[0] and "remove those tags" in warned[0]


def test_decomposed_unicode_trains_under_a_tokenizer_that_composes_it(tiny_model_dir, tmp_path) -> None:
    """GPT-NeoX's and OLMo's tokenizers normalise to NFC: the trained tokens decode to the composed text, which
    the label check took for a turn boundary crossed (the row refused)."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    answer = unicodedata.normalize("NFD", "Café déjà vu, 한국어 답변입니다")
    row = {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": answer}]}
    (ids, labels), = examples_of(tokenizer, tmp_path, [row])
    run, = [tokenizer.decode(run) for run in trained_token_runs(ids, labels)]
    assert run.endswith(unicodedata.normalize("NFC", answer) + "<|im_end|>")


def trl_prompt_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """TRL 1.x SFTTrainer on a standard (string) prompt-completion row: eos added to the completion, the prompt and
    prompt + completion tokenized with the special tokens, the tokens after the prompt's trained."""
    completion += "" if completion.endswith(tokenizer.eos_token) else tokenizer.eos_token
    prompt_ids = tokenizer(text=prompt)["input_ids"]
    ids = tokenizer(text=prompt + completion)["input_ids"]
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids):]


@pytest.mark.parametrize("kind", ["byte_level", "byte_level_bos", "metaspace_bos", "llama2_bos"])
def test_trl_string_prompt_completion_rows_train_as_trl_trains_them(tiny_model_dir, tmp_path, kind) -> None:
    """Raw text, no chat template (a base model's tokenizer without one will do): the tokens and the trained ones
    are TRL's, with a tokenizer that opens every text with bos too (Llama-3's; Mistral's and Llama 2's
    sentencepiece-style ones, whose prompt lost its first "▁" when bos was written as text before it)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from tokenizer_kinds import sentencepiece_like

    rows = [{"prompt": "### Instruction:\nAdd 7 and 5.\n\n### Response:\n", "completion": "12"},
            {"prompt": "Capital of France?", "completion": " Paris.</s>"}]
    if kind.startswith("byte_level"):
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        rows[1]["completion"] = " Paris." + tokenizer.eos_token
    else:
        corpus = ["Capital of France? Paris is the capital.", "Add 7 and 5. The answer is 12."] * 50
        tokenizer = sentencepiece_like(corpus, kind.removesuffix("_bos"), vocab_size=300)
    tokenizer.chat_template = None
    if kind.endswith("_bos"):
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    built = examples_of(tokenizer, tmp_path, rows, dataset_format="prompt_completion")
    assert built == [trl_prompt_completion(tokenizer, r["prompt"], r["completion"]) for r in rows]
    assert tokenizer.decode([t for t, l in zip(*built[0]) if l != -100]) == "12" + tokenizer.eos_token
    assert (built[0][0][0] == tokenizer.bos_token_id) is kind.endswith("_bos")
    every = examples_of(tokenizer, tmp_path, rows, dataset_format="prompt_completion", train_on="all")
    assert [ids for ids, _ in every] == [ids for ids, _ in built] and all(ids == labels for ids, labels in every)


@pytest.mark.parametrize("written", ["<think>\n{trace}\n</think>\n\n{answer}", "{trace}\n</think>\n\n{answer}"])
def test_reasoning_loss_mask_masks_a_trace_written_in_the_content(qwen3, tmp_path, written) -> None:
    """R1-distill rows carry the trace inline: under --reasoning_loss mask it is context, as a reasoning_content
    field's is (Qwen3's template writes both alike: the same examples)."""
    trace, answer = "Two plus two is four.", "The answer is 4."
    inline = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": written.format(trace=trace, answer=answer)}]}
    field = {"messages": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": answer, "reasoning_content": trace}]}
    masked = examples_of(qwen3, tmp_path, [inline], reasoning_loss="mask")
    assert masked == examples_of(qwen3, tmp_path, [field], reasoning_loss="mask")
    runs = "".join(qwen3.decode(run) for e in masked for run in trained_token_runs(*e))
    assert trace not in runs and answer in runs
    assert trace in "".join(qwen3.decode(run) for e in examples_of(qwen3, tmp_path, [inline])
                            for run in trained_token_runs(*e))  # trained without the flag


def test_openai_weight_0_keeps_an_answer_as_context(qwen3, tmp_path) -> None:
    """OpenAI's fine-tuning rows: `"weight": 0` on an assistant message keeps it in the context, untrained (it
    trained); 1 or none trains; another value or every answer at 0 is the row's error."""
    bad, good = {"role": "assistant", "content": "BAD ANSWER", "weight": 0}, {"role": "assistant", "content": "Good."}
    row = {"messages": [{"role": "user", "content": "Hi"}, bad, {"role": "user", "content": "Again"},
                        {**good, "weight": 1}]}
    (ids, labels), = examples_of(qwen3, tmp_path, [row])
    runs = [qwen3.decode(run) for run in trained_token_runs(ids, labels)]
    assert len(runs) == 1 and "Good." in runs[0] and "BAD ANSWER" in qwen3.decode(ids)
    unweighted = examples_of(qwen3, tmp_path, [{"messages": [{k: v for k, v in m.items() if k != "weight"}
                                                             for m in row["messages"]]}])
    assert len([r for e in unweighted for r in trained_token_runs(*e)]) == 2  # both trained without weights
    with pytest.raises(RowError, match="message 2 \\(assistant\\) has weight 0.5; OpenAI's weight is 0"):
        to_messages({"messages": [row["messages"][0], {**bad, "weight": 0.5}]}, "messages")
    with pytest.raises(RowError, match="every assistant turn has weight 0"):
        to_messages({"messages": [row["messages"][0], bad]}, "messages")


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_openai_developer_turns(family, tiny_model_dir, tmp_path) -> None:
    """`developer` (OpenAI's newer system role; it was refused) is the template's own where it has it (gpt-oss), else a
    system turn."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    rows = lambda role: [{"messages": [{"role": role, "content": "Answer in French."},  # noqa: E731
                                       *WEATHER["messages"][:1], {"role": "assistant", "content": "Il fait froid."}]}]
    developer, system = examples_of(tokenizer, tmp_path, rows("developer")), examples_of(tokenizer, tmp_path,
                                                                                       rows("system"))
    assert developer == system  # Qwen3: a system turn; gpt-oss's template writes either as its developer message
    assert "Answer in French." in tokenizer.decode(developer[0][0])


def test_tools_a_template_does_not_write_are_counted_and_named(tiny_model_dir, tmp_path, caplog) -> None:
    """A template without tools (chatml) trains a row with a tools column but no calls without the schemas in its
    context: counted per source and warned about once, as reasoning a template leaves out is; the model's own
    template writes them (nothing counted)."""
    from transformers import AutoTokenizer

    from open_sft.data.chat.templates import apply_chat_template_choice

    rows = [{"tools": TOOLS, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = DataArguments(dataset_mixer_list=[str(path), "1.0"], max_seq_length=4096)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    apply_chat_template_choice(tokenizer, "chatml", None)
    with caplog.at_level("WARNING"):
        _, (report,) = build_examples(args, tokenizer, 0)
    assert report.to_dict()["tools_not_rendered"] == 1
    warned = [r.getMessage() for r in caplog.records if "tool schemas" in r.getMessage()]
    assert len(warned) == 1 and "1 row(s)" in warned[0] and "line 1" in warned[0]
    _, (report,) = build_examples(args, family_tokenizer(tiny_model_dir, "qwen3"), 0)
    assert report.tools_not_rendered == 0


def built_and_warned(tokenizer, tmp_path, caplog, rows: list[dict], phrase: str) -> tuple:
    """The source of `rows` built (one .jsonl file): its report, and the warnings that hold `phrase`."""
    path = tmp_path / "rows_warned.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level("WARNING"):
        _, (report,) = build_examples(DataArguments(dataset_mixer_list=[str(path), "1.0"]), tokenizer, 0)
    return report, [r.getMessage() for r in caplog.records if phrase in r.getMessage()]


def test_tool_arguments_that_are_not_a_json_object_are_counted_and_named(qwen3, tmp_path, caplog) -> None:
    """Arguments as a Python dict's repr, cut-off JSON or a JSON list train as written (the model would learn to
    call tools so): counted per source and warned about once, naming the first rows; a JSON object string or an
    object is not counted."""
    def with_arguments(arguments) -> dict:
        return {**WEATHER, "messages": [WEATHER["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            *WEATHER["messages"][2:]]}

    rows = [with_arguments({"city": "Oslo"}), with_arguments("{'city': 'Oslo'}"), with_arguments('{"city": "Os'),
            with_arguments('{"city": "Oslo"}'), with_arguments('["Oslo"]')]
    report, warned = built_and_warned(qwen3, tmp_path, caplog, rows, "not a JSON object")
    assert report.rows_kept == 5 and report.to_dict()["tool_arguments_not_json"] == 3
    assert len(warned) == 1 and "3 row(s)" in warned[0] and "line 2" in warned[0] and "line 5" in warned[0]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3"])
def test_bare_tool_schemas_are_wrapped_as_templates_read_them(family, tiny_model_dir, tmp_path) -> None:
    """LLaMA-Factory's sharegpt tools (and OpenAI's older functions) are bare {name, parameters} schemas: handed over
    as {type: function, function: ...}, as LLaMA-Factory wraps them (gpt-oss's template refused a bare one)."""
    tokenizer = family_tokenizer(tiny_model_dir, family)
    bare = {**WEATHER, "tools": json.dumps([t["function"] for t in TOOLS])}
    assert examples_of(tokenizer, tmp_path, [bare]) == examples_of(tokenizer, tmp_path, [WEATHER])


def test_a_rows_system_column_gives_way_to_a_developer_turn(qwen3, tmp_path) -> None:
    developer = {"messages": [{"role": "developer", "content": "DEV"}, *WEATHER["messages"][:1],
                              {"role": "assistant", "content": "Hello"}]}
    assert examples_of(qwen3, tmp_path, [{**developer, "system": "ROWSYS"}]) == examples_of(qwen3, tmp_path,
                                                                                          [developer])


def test_a_row_of_messages_among_raw_prompt_completion_rows_needs_a_template(tiny_model_dir, tmp_path) -> None:
    """The template check is made on a source's first row: a later row of messages without a template is that
    row's error, named (it was a TypeError)."""
    from transformers import AutoTokenizer

    from open_sft.errors import UserError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    rows = [{"prompt": "Add 1 and 1.", "completion": "2"},
            {"prompt": [{"role": "user", "content": "Add 2 and 2."}], "completion": [{"role": "assistant",
                                                                                  "content": "4"}]}]
    with pytest.raises(UserError, match="line 2: a row of messages needs a chat template and the tokenizer has none"):
        examples_of(tokenizer, tmp_path, rows)
    assert len(examples_of(tokenizer, tmp_path, rows, on_bad_row="drop")) == 1


def test_a_raw_prompt_completion_merged_at_its_boundary_says_so(tiny_model_dir, tmp_path) -> None:
    """A raw prompt + completion (no template) whose boundary the tokenizer merges into one token was refused as a
    chat row is: "assistant turns ... try another chat template", though no template is involved. The message says
    what is wrong for such a row and how to fix it; a row of messages keeps the template's message."""
    from transformers import AutoTokenizer

    from open_sft.errors import UserError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(UserError, match=r"line 1: the completion's first token merges with the end of the prompt "
                                        r"\(a raw prompt \+ completion, no chat template\).*start the completion "
                                        "with a space"):
        examples_of(tokenizer, tmp_path, [{"prompt": "Say hel", "completion": "lo world"}])
    assert len(examples_of(tokenizer, tmp_path, [{"prompt": "Say hel", "completion": " lo world"}])) == 1


def test_messages_holding_a_special_tokens_text_are_counted_and_named(qwen3, tmp_path, caplog) -> None:
    """A scraped answer with a stray `<|im_end|>` trains a fake end of turn mid-answer (the tokenizer encodes the
    text as the token): counted per source and warned about, naming the first rows; text of a token that is not
    special (Qwen3's <think>) is not counted."""
    def row(user: str, answer: str) -> dict:
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    rows = [row("Hi", "Hello"), row("Hi", "Hello<|im_end|> and more"), row("What is <|endoftext|>?", "A token."),
            row("Think", "<think>\nhmm\n</think>\n\nYes"), row("Hi", "Hello")]
    report, warned = built_and_warned(qwen3, tmp_path, caplog, rows, "literal text of a special token")
    assert report.rows_kept == 5 and report.to_dict()["special_tokens_in_text"] == 2
    assert len(warned) == 1 and "2 row(s)" in warned[0] and "line 2" in warned[0] and "line 3" in warned[0]
    assert "(<|endoftext|> in 1 row, <|im_end|> in 1 row)" in warned[0]  # ties by name
