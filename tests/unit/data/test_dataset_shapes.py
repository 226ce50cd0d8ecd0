"""Popular reasoning, tool-calling and chat datasets in their own row shapes (field names, nesting, JSON-string
columns as their cards and parquet files give them) train as the messages rows they mean, under Qwen3's template:
each is compared token for token with its plain messages form, and its trained text is spelt out."""

from __future__ import annotations

import json

import pytest

from open_sft.config.args import DataArguments
from open_sft.data.build import build_examples
from open_sft.data.format_detect import detect_format
from open_sft.data.formats import RowError, to_messages
from open_sft.data.labels import trained_token_runs
from open_sft.data.python_types import json_schema_types
from open_sft.data.tool_schemas import listed_in_system
from open_sft.errors import UserError
from tests.unit.data.test_reasoning_tool_calls import family_tokenizer
from tests.unit.data.test_users_rows import built_and_warned, examples_of

EMPTY_THINK = "<think>\n\n</think>\n\n"
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city.",
                "parameters": {"city": {"description": "The city.", "type": "str", "default": "Oslo"}}}


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return family_tokenizer(tiny_model_dir, "qwen3")


def trained_texts(tokenizer, examples: list) -> list[str]:
    return [tokenizer.decode(run) for ids, labels in examples for run in trained_token_runs(ids, labels)]


def test_openhermes_per_turn_weight_0_is_context(qwen3, tmp_path) -> None:
    """OpenHermes-2.5's from/value turns carry `weight` (null, 0.0 or 1.0): a 0 answer was trained as any other."""
    row = {"conversations": [{"from": "system", "value": "You are helpful.", "weight": None},
                             {"from": "human", "value": "Hi", "weight": 0.0},
                             {"from": "gpt", "value": "Hello there.", "weight": 0.0},
                             {"from": "human", "value": "Bye", "weight": None},
                             {"from": "gpt", "value": "Goodbye.", "weight": 1.0}], "source": "airoboros2.2"}
    examples = examples_of(qwen3, tmp_path, [row])
    assert trained_texts(qwen3, examples) == [EMPTY_THINK + "Goodbye.<|im_end|>"]
    assert "<|im_start|>assistant\nHello there.<|im_end|>" in qwen3.decode(examples[0][0])  # context
    with pytest.raises(RowError, match="every assistant turn has weight 0"):
        to_messages({"conversations": row["conversations"][:3]}, "sharegpt")


def test_a_conversation_stored_as_a_json_string_is_read(qwen3, tmp_path) -> None:
    """Toucan-1.5M's parquet holds `messages` as a JSON string (legacy function_call/function turns inside); a
    from/value list stored so is sharegpt: both were refused ("'messages' must be a non-empty list")."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "function_call": {"name": "get_weather",
                                                                       "arguments": "{\"city\": \"Oslo\"}"}},
                {"role": "function", "name": "get_weather", "content": "{\"temp_c\": -3}"},
                {"role": "assistant", "content": "It is -3 in Oslo."}]
    toucan = {"uuid": "u1", "subset_name": "single-turn", "messages": json.dumps(messages), "question": "Weather?"}
    assert detect_format(toucan, "f") == "messages"
    examples = examples_of(qwen3, tmp_path, [toucan])
    assert examples == examples_of(qwen3, tmp_path, [{"messages": messages}])
    assert trained_texts(qwen3, examples) == [
        EMPTY_THINK + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        EMPTY_THINK + "It is -3 in Oslo.<|im_end|>"]
    sharegpt = {"conversations": json.dumps([{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}])}
    assert detect_format(sharegpt, "f") == "sharegpt"
    assert list(to_messages(sharegpt, "sharegpt")) == [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello."}]


def test_lmsys_and_wildchat_conversation_columns_are_messages(qwen3, tmp_path) -> None:
    """LMSYS-Chat-1M and WildChat keep role/content turns under `conversation`: the format was not told (only
    --sft_messages_key conversation read them); their turns' own keys (WildChat's country, header, ...) stay out of
    the text."""
    lmsys = {"conversation_id": "c1", "model": "vicuna-13b", "turn": 1, "language": "English", "redacted": False,
             "conversation": [{"content": "Hi", "role": "user"}, {"content": "Hello.", "role": "assistant"}],
             "openai_moderation": [{"categories": {"harassment": False}, "flagged": False}]}
    wildchat = {"conversation_hash": "h", "model": "gpt-4", "turn": 1, "toxic": False, "conversation": [
        {"content": "Hi", "role": "user", "country": "US", "header": {"accept-language": "en"}, "timestamp": None,
         "toxic": False, "turn_identifier": 1},
        {"content": "Hello.", "role": "assistant", "country": None, "header": None, "language": "English",
         "timestamp": "2023-04-09 00:02:53+00:00", "toxic": False, "turn_identifier": 1}]}
    plain = examples_of(qwen3, tmp_path, [{"messages": lmsys["conversation"]}])
    for row in (lmsys, wildchat):
        assert detect_format(row, "f") == "messages:conversation"
        assert examples_of(qwen3, tmp_path, [row]) == plain
    assert qwen3.decode(plain[0][0]) == f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}" \
                                        "Hello.<|im_end|>\n"
    assert detect_format({"conversation": "A: hi B: hello", "text": "A: hi B: hello"}, "f") == "text"  # not turns


def test_xlam_rows_train_their_calls_with_their_tools(qwen3, tiny_model_dir, tmp_path) -> None:
    """Salesforce/xlam-function-calling-60k: `query`, `answers` and `tools`, the last two JSON strings (refused:
    "cannot tell the data format"); a schema's `parameters` are JSON Schema's `properties`, handed over within the
    object schema, which gpt-oss's template needs to write them."""
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments":
                                                                          {"city": "Bern"}}]
    row = {"id": 0, "query": "Weather in Oslo and Bern?", "answers": json.dumps(calls),
           "tools": json.dumps([WEATHER_TOOL])}
    assert detect_format(row, "f") == "xlam"
    schema = {**WEATHER_TOOL, "parameters": {"type": "object", "properties": {"city": {  # Python's str: string
        "description": "The city.", "type": "string", "default": "Oslo"}}}}  # a default: not required
    examples = examples_of(qwen3, tmp_path, [row])
    assert examples == examples_of(qwen3, tmp_path, [{"tools": [{"type": "function", "function": schema}],
                                                      "messages": [{"role": "user", "content": row["query"]}, {
        "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}]}])
    assert trained_texts(qwen3, examples) == [EMPTY_THINK + "".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>' + end
        for city, end in (("Oslo", "\n"), ("Bern", "<|im_end|>")))]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", ' \
           '"parameters": {"type": "object", "properties": {"city": {"description": "The city.", "type": "string", ' \
           '"default": "Oslo"}}}}}\n</tools>' in qwen3.decode(examples[0][0])
    gpt_oss = family_tokenizer(tiny_model_dir, "gpt_oss")
    (ids, _), = examples_of(gpt_oss, tmp_path, [{**row, "answers": json.dumps(calls[:1])}])
    written = '// Weather of a city.\ntype get_weather = (_: {\n// The city.\ncity?: string, // default: "Oslo",\n}) ' \
              '=> any;'
    assert written in gpt_oss.decode(ids)  # without the object schema: "type get_weather = () => any;"
    with pytest.raises(RowError, match="xLAM row's 'answers' is empty: the row has no call to train"):
        to_messages({**row, "answers": "[]"}, "xlam")


def test_llama_nemotron_rows_open_with_their_system_prompt(qwen3, tmp_path) -> None:
    """nvidia/Llama-Nemotron-Post-Training-Dataset: `input` messages, `output` (trace inline) and `system_prompt`,
    the thinking switch the model learns to follow (refused: "cannot tell the data format")."""
    row = {"input": [{"role": "user", "content": "What is 7+5?"}], "output": "<think>\nSeven and five.\n</think>\n\n12",
           "category": "math", "license": "cc-by-4.0", "reasoning": "on", "generator": "DeepSeek-R1",
           "used_in_training": "Ultra, Super, Nano", "version": "v1.1", "system_prompt": "detailed thinking on"}
    assert detect_format(row, "f") == "nemotron"
    examples = examples_of(qwen3, tmp_path, [row])
    assert qwen3.decode(examples[0][0]).startswith("<|im_start|>system\ndetailed thinking on<|im_end|>\n")
    assert trained_texts(qwen3, examples) == ["<think>\nSeven and five.\n</think>\n\n12<|im_end|>"]
    with pytest.raises(RowError, match="Nemotron row's 'input' is a str; this shape needs the conversation so far"):
        to_messages({**row, "input": "<|start_header_id|>user<|end_header_id|>\n\nWhat is 7+5?<|eot_id|>"},
                    "nemotron")


def test_math_reasoning_rows_train_trace_and_answer(qwen3, tmp_path) -> None:
    """nvidia/OpenMathReasoning (`problem`, `generated_solution` with its trace inline), simplescaling/s1K
    (`question`, `thinking_trajectories`, `attempt`; s1K-1.1's `deepseek_*` columns), OpenThoughts-114k's metadata
    config (`problem`, `deepseek_reasoning`, `deepseek_solution`), NuminaMath-1.5 (`problem`, `solution`) and GSM8K
    (`question`, `answer`): all were refused ("cannot tell the data format")."""
    openmath = {"expected_answer": "12", "problem_type": "has_answer_extracted", "problem_source": "aops_c4",
                "generation_model": "DeepSeek-R1", "pass_rate_72b_tir": "0.9", "problem": "What is 7+5?",
                "generated_solution": "<think>\nSeven and five.\n</think>\n\n\\boxed{12}", "inference_mode": "cot",
                "used_in_kaggle": True}
    s1k = {"solution": "12", "question": "What is 7+5?", "cot_type": "math", "source_type": "x", "metadata": "{}",
           "cot": None, "thinking_trajectories": ["Seven and five."], "attempt": "\\boxed{12}"}
    s1k_1_1 = {"solution": "12", "question": "What is 7+5?", "gemini_thinking_trajectory": "Other.",
               "gemini_attempt": "12", "deepseek_thinking_trajectory": "Seven and five.",
               "deepseek_attempt": "\\boxed{12}"}
    openthoughts = {"problem": "What is 7+5?", "deepseek_reasoning": "Seven and five.",
                    "deepseek_solution": "\\boxed{12}", "ground_truth_solution": "12", "domain": "math",
                    "source": "amc_aime", "test_cases": None, "starter_code": None}
    expected = ["<think>\nSeven and five.\n</think>\n\n\\boxed{12}<|im_end|>"]
    for row, shape in ((openmath, "openmath"), (s1k, "s1k"), (s1k_1_1, "s1k"), (openthoughts, "openthoughts")):
        assert detect_format(row, "f") == shape
        examples = examples_of(qwen3, tmp_path, [row])
        assert qwen3.decode(examples[0][0]).startswith("<|im_start|>user\nWhat is 7+5?<|im_end|>\n")
        assert trained_texts(qwen3, examples) == expected
    with pytest.raises(RowError, match="s1K row's 'thinking_trajectories' must be a list of strings"):
        to_messages({**s1k, "thinking_trajectories": None}, "s1k")
    numina = {"problem": "What is 7+5?", "solution": "7+5=12", "answer": "12", "problem_type": "Algebra",
              "question_type": "math-word-problem", "problem_is_valid": "Yes", "solution_is_valid": "Yes",
              "source": "amc_aime", "synthetic": False}  # NuminaMath-1.5
    assert detect_format(numina, "f") == "problem_solution"
    assert trained_texts(qwen3, examples_of(qwen3, tmp_path, [numina])) == [EMPTY_THINK + "7+5=12<|im_end|>"]
    gsm8k = {"question": "What is 7+5?", "answer": "7+5=<<7+5=12>>12\n#### 12"}
    assert detect_format(gsm8k, "f") == "question_answer"
    assert trained_texts(qwen3, examples_of(qwen3, tmp_path, [gsm8k])) == [
        EMPTY_THINK + "7+5=<<7+5=12>>12\n#### 12<|im_end|>"]
    with pytest.raises(RowError, match="question/answer row needs a string 'answer', got dict"):
        to_messages({"question": "Who?", "answer": {"aliases": ["Ada"], "value": "Ada"}}, "question_answer")


def test_glaive_function_calling_rows_are_parsed_into_tools_calls_and_results(qwen3, tmp_path) -> None:
    """glaiveai/glaive-function-calling-v2: a `system` string holding the schemas and one `chat` string of turns,
    calls as `<functioncall>` text with single-quoted arguments (refused: "cannot tell the data format")."""
    news = {"name": "get_news", "description": "Latest headlines.", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}
    bmi = {"name": "bmi", "description": "Body mass index.", "parameters": {"type": "object", "properties": {}}}
    system = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
              + json.dumps(news, indent=4) + "\n\n" + json.dumps(bmi, indent=4) + "\n")
    chat = ("USER: News for the US?\n\n\nASSISTANT: <functioncall> {\"name\": \"get_news\", \"arguments\": "
            "'{\"country\": \"United States\"}'} <|endoftext|>\n\n\nFUNCTION RESPONSE: {\"headlines\": [\"Rain\"]}"
            "\n\n\nASSISTANT: Today's headline: Rain. <|endoftext|>\n\n\nUSER: Thanks!\n\n\nASSISTANT: You're "
            "welcome! <|endoftext|>\n")
    row = {"system": system, "chat": chat}
    assert detect_format(row, "f") == "glaive"
    plain = {"tools": [{"type": "function", "function": news}, {"type": "function", "function": bmi}], "messages": [
        {"role": "system", "content": "You are a helpful assistant with access to the following functions. Use "
                                      "them if required -"},
        {"role": "user", "content": "News for the US?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_news", "arguments": {"country": "United States"}}}]},
        {"role": "tool", "content": "{\"headlines\": [\"Rain\"]}"},
        {"role": "assistant", "content": "Today's headline: Rain."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome!"}]}
    examples = examples_of(qwen3, tmp_path, [row])
    assert examples == examples_of(qwen3, tmp_path, [plain])
    assert trained_texts(qwen3, examples) == [
        EMPTY_THINK + '<tool_call>\n{"name": "get_news", "arguments": {"country": "United States"}}\n</tool_call>'
        "<|im_end|>", EMPTY_THINK + "Today's headline: Rain.<|im_end|>", EMPTY_THINK + "You're welcome!<|im_end|>"]
    no_tools = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
                "chat": "USER: Hi\n\n\nASSISTANT: Hello! <|endoftext|>\n"}
    converted = to_messages(no_tools, "glaive")
    assert (list(converted), converted.tools) == ([
        {"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None)
    with pytest.raises(RowError, match="glaive row's call 'get_news\\(country=\"US\"\\)' is not"):
        to_messages({**no_tools, "chat": "USER: Hi\n\n\nASSISTANT: <functioncall> get_news(country=\"US\")"}, "glaive")


def test_tool_schemas_each_given_as_a_json_string_are_read(qwen3, tmp_path) -> None:
    """When2Call's `tools` (a list<string> column: each schema a JSON string of its own) were a bad row ("'tools'
    must be a list of tool schemas"); they reach the template as the objects."""
    schema = {"type": "function", "function": WEATHER_TOOL}
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "<TOOLCALL>[{\"name\": \"get_weather\", \"arguments\": "
                                                 "{\"city\": \"Oslo\"}}]</TOOLCALL>"}]
    row = {"uuid": "u", "source": "BFCL", "tools": [json.dumps(WEATHER_TOOL)], "messages": messages}
    assert to_messages(row, "messages").tools == [schema]
    examples = examples_of(qwen3, tmp_path, [row])
    assert examples == examples_of(qwen3, tmp_path, [{"tools": [schema], "messages": messages}])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in qwen3.decode(examples[0][0])
    with pytest.raises(RowError, match="'tools' must be a list of tool schemas \\(JSON objects, or each such"):
        to_messages({**row, "tools": ["get_weather(city)"]}, "messages")


def test_tools_a_system_message_lists_and_a_tools_column_repeats_are_counted(qwen3, tmp_path, caplog) -> None:
    """interstellarninja/hermes_reasoning_tool_use (and NousResearch's Hermes sets with a tools column): the system
    turn lists the schemas in <tools> and the `tools` column holds them again; the template writes both, so the
    context shows every tool twice: counted and named. APIGen-MT's system prompt without the list is not."""
    schema = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a \"city\".",
                                               "parameters": {"type": "object", "properties": {}}}}
    system = ("You are a function calling AI model. You are provided with function signatures within <tools> "
              f"</tools> XML tags. <tools>\n{json.dumps([schema])}\n</tools>")
    turns = [{"from": "human", "value": "Weather in Oslo?"}, {"from": "gpt", "value": "<think>\nNo call needed."
             "\n</think>\nIt is cold."}]
    hermes = {"conversations": [{"from": "system", "value": system}, *turns], "tools": json.dumps([schema]),
              "task": "t", "category": "c", "source": "s", "scenario_category": "relevance"}
    report, warned = built_and_warned(qwen3, tmp_path, caplog, [hermes], "tool schemas in a system message")
    assert report.tools_listed_twice == 1 and len(warned) == 1 and "drop the tools column" in warned[0]
    (ids, _), = examples_of(qwen3, tmp_path, [hermes])
    assert qwen3.decode(ids).count('"description": "Weather of a \\"city\\"."') == 2  # the system's and the template's
    apigen = {"conversations": turns, "tools": json.dumps([schema]), "system": "You are a weather agent."}
    assert built_and_warned(qwen3, tmp_path, caplog, [apigen], "tool schemas in a system")[0].tools_listed_twice == 0


def test_a_text_column_beside_question_and_answer_is_documents() -> None:
    """A row with `text` and question/answer (or problem/solution) columns was read as a user turn and its answer,
    the text dropped; it is text documents, as before the dataset shapes."""
    assert detect_format({"text": "A document.", "question": "Q?", "answer": "A."}, "f") == "text"
    assert detect_format({"text": "A document.", "problem": "P?", "solution": "S."}, "f") == "text"
    assert detect_format({"question": "Q?", "answer": "A."}, "f") == "question_answer"


def test_question_answer_rows_with_columns_the_answer_needs_are_refused() -> None:
    """{context, question, answer} (RAG) and {question, answer, choices} were read as question/answer, dropping the
    passage or the choices the answer is about; detection refuses them, naming the columns and the fix. Metadata
    columns (MATH's level and type, an id) are no reason to."""
    with pytest.raises(UserError, match=r"^f: the columns 'answer' and 'question' would be read as a user turn and its "
                                        r"answer \(question_answer\), dropping the columns \['context'\], .* Convert "
                                        r"the rows to messages .* or prompt_completion"):
        detect_format({"context": "Oslo is cold.", "question": "Is Oslo cold?", "answer": "Yes."}, "f")
    with pytest.raises(UserError, match=r"dropping the columns \['choices', 'label'\]"):
        detect_format({"question": "2+2?", "answer": "B", "choices": ["3", "4"], "label": 1, "id": "q1"}, "f")
    with pytest.raises(UserError, match=r"'problem' and 'solution' would be read .* dropping the columns \['hint'\]"):
        detect_format({"problem": "P?", "solution": "S.", "hint": "Use symmetry."}, "f")
    math = {"problem": "What is 7+5?", "level": "Level 1", "type": "Algebra", "solution": "12", "unique_id": "t/1"}
    assert detect_format(math, "f") == "problem_solution"
    assert detect_format({"id": 3, "question": "Q?", "answer": "A.", "source": "gsm8k"}, "f") == "question_answer"


def test_a_system_prompt_naming_a_tool_does_not_list_its_schema() -> None:
    """A system prompt that only names the tool ("Always search ...") and says what it does was taken for the
    schemas listed again, and the warning advised dropping the row's only schemas; a listing is the quoted name and
    description as a JSON list of the schemas writes them (non-ASCII characters escaped or not)."""
    search = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                               "parameters": {"type": "object", "properties": {}}}}
    assert not listed_in_system([search], [{"role": "system", "content": "Always search before answering. You "
                                            "can Search the web."}])
    assert listed_in_system([search], [{"role": "system", "content": f"<tools>{json.dumps([search])}</tools>"}])
    meteo = {"name": "météo", "description": "Le temps qu'il fait à \"Oslo\"."}
    for listing in (json.dumps([meteo]), json.dumps([meteo], ensure_ascii=False)):
        assert listed_in_system([meteo], [{"role": "developer", "content": listing}])
    assert not listed_in_system([meteo], [{"role": "user", "content": json.dumps([meteo])}])


def test_glaive_calls_and_columns_of_other_kinds_are_named() -> None:
    """A glaive call whose name is not a string or whose arguments are not a JSON object, and a call in a row whose
    system text gives no schemas, were read as they were (a call trained with no tools given): each is a named bad
    row. A `chat` that is a list of messages is some other dataset's conversation, not glaive's string of turns."""
    system = "SYSTEM: You may call -\n" + json.dumps({"name": "get_news", "parameters": {"type": "object"}})

    def error_of(call: str, system: str = system) -> tuple[str, str]:
        with pytest.raises(RowError) as caught:
            to_messages({"system": system, "chat": f"USER: News?\n\n\nASSISTANT: <functioncall> {call}"}, "glaive")
        return str(caught.value), caught.value.reason

    assert error_of("{\"name\": \"get_news\", \"arguments\": '{country: US}'}") == (
        "glaive row's call '{\"name\": \"get_news\", \"arguments\": \\'{country: US}\\'}' has arguments that are not "
        "JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))", "bad_tool_calls")
    assert error_of("{\"name\": \"get_news\", \"arguments\": '[\"US\"]'}")[0].endswith(
        "has arguments of type list; a call's arguments are a JSON object")
    assert error_of('{"name": 7, "arguments": {}}') == (
        "glaive row's call '{\"name\": 7, \"arguments\": {}}' has a name of type int; a call's name is a non-empty "
        "string", "bad_tool_calls")
    no_schemas = error_of('{"name": "get_news", "arguments": {"country": "US"}}', "SYSTEM: You may call get_news.")
    assert no_schemas == ("glaive row calls a tool but its 'system' text holds no tool schemas (JSON objects one "
                          "after another after the prompt): its calls would train with no tools given", "bad_tools")
    call = to_messages({"system": system, "chat": "USER: News?\n\n\nASSISTANT: <functioncall> {\"name\": "
                        "\"get_news\", \"arguments\": '{\"country\": \"US\"}'}"}, "glaive")[2]["tool_calls"]
    assert call == [{"type": "function", "function": {"name": "get_news", "arguments": {"country": "US"}}}]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    with pytest.raises(UserError, match=r"^f: cannot tell the data format from the columns \['chat', 'system'\] "
                                        r"\(the column 'chat' holds turns: --sft_messages_key chat\); accepted"):
        detect_format({"system": "Be brief.", "chat": chat}, "f")
    assert detect_format({"system": "Be brief.", "chat": chat}, "f", messages_key="chat") == "messages:chat"


def test_s1k_xlam_and_nemotron_rows_read_by_the_columns_they_have() -> None:
    """s1K-1.1's columns beside an `attempt` of some other kind were read as s1K's (thinking_trajectories, missing);
    an xLAM parameter named `properties` kept its schema from being wrapped; Nemotron's refusal of a string input
    said it was a chat template's text, which a plain prompt is not."""
    s1k_1_1 = {"question": "What is 7+5?", "deepseek_thinking_trajectory": "Seven and five.",
               "deepseek_attempt": "12", "attempt": None}
    assert detect_format(s1k_1_1, "f") == "s1k"
    assert list(to_messages(s1k_1_1, "s1k"))[1] == {"role": "assistant", "content": "12",
                                                    "reasoning_content": "Seven and five."}
    columns = {"name": "pick", "description": "Columns to pick.", "parameters": {
        "properties": {"type": "List[str]", "description": "The columns."}}}
    given = {"name": "pick", "parameters": {"type": "object", "properties": {}}}
    row = {"query": "Pick.", "answers": json.dumps([{"name": "pick", "arguments": {"properties": ["a"]}}])}
    assert to_messages({**row, "tools": json.dumps([columns, given])}, "xlam").tools == [
        {"type": "function", "function": {**columns, "parameters": {"type": "object", "properties": {"properties": {
            "type": "array", "description": "The columns.", "items": {"type": "string"}}},
            "required": ["properties"]}}},
        {"type": "function", "function": given}]
    with pytest.raises(RowError) as caught:
        to_messages({"input": "What is 7+5?", "output": "12", "system_prompt": ""}, "nemotron")
    assert str(caught.value) == (
        "Nemotron row's 'input' is a str; this shape needs the conversation so far as a non-empty list of role/content "
        "messages (or that list as a JSON string); convert the row to messages (a plain prompt: one user turn; one "
        "written in a chat template's text: the turns it writes)")


def test_a_conversation_column_that_is_not_json_names_the_error() -> None:
    """A messages, conversations or xLAM answers column stored as a JSON string that does not parse was refused as
    not a list, the JSON error (and where it is) hidden."""
    broken = '[{"role": "user" "content": "Hi"}]'
    where = "(not JSON: Expecting ',' delimiter: line 1 column 18 (char 17))"
    for row, fmt in (({"messages": broken}, "messages"), ({"conversations": broken}, "sharegpt"),
                     ({"query": "Q", "answers": broken, "tools": "[]"}, "xlam"),
                     ({"input": broken, "output": "A", "system_prompt": ""}, "nemotron")):
        with pytest.raises(RowError) as caught:
            to_messages(row, fmt)
        assert str(caught.value).endswith(where), str(caught.value)


def test_xlam_python_type_names_are_written_as_json_schema_types(tiny_model_dir, tmp_path) -> None:
    """xLAM types its parameters by Python's names (`str`, `List[int]`, `int, optional`) and lists no `required`:
    gpt-oss's template wrote every parameter `any`, optional (`a?: any`). The unambiguous names are JSON Schema's
    now, `, optional` ones and those with a default not required, the others required; a name that is not one of
    them is left as written; the data report counts the rows (tool_types_mapped)."""
    tools = [{"name": "f", "description": "F.", "parameters": {
        "a": {"type": "str", "description": "A."}, "b": {"type": "List[int]", "description": "B.", "default": [1]},
        "c": {"type": "int, optional", "description": "C.", "default": 3},
        "d": {"type": "Callable", "description": "D."}, "e": {"type": "Dict[str, Any]", "description": "E."},
        "g": {"type": "bool, optional", "description": "G."}}}]
    row = {"query": "Call f.", "answers": json.dumps([{"name": "f", "arguments": {"a": "x"}}]),
           "tools": json.dumps(tools)}
    parameters = to_messages(row, "xlam").tools[0]["function"]["parameters"]
    assert {name: spec["type"] for name, spec in parameters["properties"].items()} == {
        "a": "string", "b": "array", "c": "integer", "d": "Callable", "e": "object", "g": "boolean"}
    assert parameters["properties"]["b"]["items"] == {"type": "integer"}
    assert parameters["required"] == ["a", "d", "e"]
    gpt_oss = family_tokenizer(tiny_model_dir, "gpt_oss")
    path = tmp_path / "xlam.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [row, {**row, "tools": json.dumps([{**tools[0],
                                                                                            "parameters": {}}])}]))
    examples, (report,) = build_examples(DataArguments(dataset_mixer_list=[str(path), "1.0"]), gpt_oss, 0)
    assert "type f = (_: {\n// A.\na: string,\n// B.\nb?: number[], // default: [1],\n// C.\nc?: number, // default: " \
           "3,\n// D.\nd: any,\n// E.\ne: object,\n// G.\ng?: boolean,\n}) => any;" in gpt_oss.decode(
               examples[0].input_ids)
    assert report.tool_types_mapped == 1 and report.to_dict()["tool_types_mapped"] == 1


def test_xlam_parameters_with_a_default_or_optional_in_any_spelling_are_not_required() -> None:
    """Every xLAM parameter not ending exactly ", optional" was required: `{"type": "str", "default": "us"}` (xLAM's
    usual optional parameter), "Optional[int]" (left unmapped too) and "str,optional". A default, Optional[X] (typed
    X) and `,optional` in any spacing or case make a parameter optional now; only `a` and `f` are required."""
    properties = {"a": {"type": "str"}, "country": {"type": "str", "default": "us"},
                  "limit": {"type": "Optional[int]"}, "lang": {"type": "str,optional"},
                  "page": {"type": "int , Optional ", "default": None}, "f": {"type": "Callable"},
                  "tags": {"type": "Optional[List[str]], optional"}}
    mapped, required, changed = json_schema_types(properties)
    assert required == ["a", "f"] and changed
    assert {name: spec["type"] for name, spec in mapped.items()} == {
        "a": "string", "country": "string", "limit": "integer", "lang": "string", "page": "integer", "f": "Callable",
        "tags": "array"}
    assert mapped["tags"]["items"] == {"type": "string"} and mapped["country"]["default"] == "us"


def test_xlam_union_with_none_and_optional_with_a_default_are_typed_and_not_required() -> None:
    """`str | None`, `None | List[int]` and `str, optional, default='us'` (xLAM's) were required and left unmapped
    (gpt-oss wrote `a: any`): they are typed as X and not required now. A union with None inside a generic, or of two
    types, is not mistaken for one: `List[int | None]` is an array, required; `int | str | None` optional, unmapped."""
    properties = {"a": {"type": "str | None"}, "b": {"type": "None | List[int]"},
                  "c": {"type": "str, optional, default='us'"}, "d": {"type": "int, Optional, default = 10"},
                  "e": {"type": "List[int | None]"}, "f": {"type": "int | str | None"}, "g": {"type": "int | str"}}
    mapped, required, changed = json_schema_types(properties)
    assert required == ["e", "g"] and changed
    assert {name: spec["type"] for name, spec in mapped.items()} == {
        "a": "string", "b": "array", "c": "string", "d": "integer", "e": "array", "f": "int | str | None",
        "g": "int | str"}
    assert mapped["b"]["items"] == {"type": "integer"} and "items" not in mapped["e"]
