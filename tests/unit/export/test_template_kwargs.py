"""generate, chat and compare render prompts with the chat template variables the run trained with (its run.json's
--chat_template_kwargs), or --chat_template_kwargs' (open_sft.export.template_kwargs). They passed none: a Qwen3 run
trained with enable_thinking false was asked with thinking on (`<|im_start|>assistant\\n`, no empty think block), a
Gemma 4 run trained with enable_thinking true without the `<|think|>` its system turn trained with."""

from __future__ import annotations

import gc
import io
import json
import shutil
import weakref

import pytest
import torch

from open_sft.export import chat, compare, generate
from open_sft.export.model_card import render_model_card
from open_sft.export.reply import parse_reply
from open_sft.export.template_kwargs import bind_template_kwargs, run_record, trained_kwargs, unbound_renderer
from open_sft.export.trace_layout import ReasoningLayout, reasoning_layout

from ..data.test_reasoning_tool_calls import build, family_tokenizer, trained_runs
from ..data.test_template_families import gemma4_tokenizer

QUESTION = [{"role": "user", "content": "Q"}]
QWEN3_NO_THINKING = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_THINKING = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
GEMMA4_THINKING = "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nQ<turn|>\n<|turn>model\n"


def run_dir(tiny_model_dir, tmp_path, tokenizer, data: dict | None, name: str = "run"):
    """A run's output directory: the tiny model, `tokenizer` saved beside it, run.json with `data` as its data
    arguments (None: no run.json, a base model's directory)."""
    out = tmp_path / name
    shutil.copytree(tiny_model_dir, out)
    tokenizer.save_pretrained(out)
    if data is not None:
        (out / "run.json").write_text(json.dumps({"args": {"data": data}}))
    return out


def recording(monkeypatch, module, reply: str = "") -> list[str]:
    """The prompts the model `module` loads is asked, as text; it writes `reply` and ends its turn (eos)."""
    prompts, real = [], module.load_or_exit

    def loading(args):
        loaded = real(args)
        answer_with_eos(loaded.model, lambda: loaded.tokenizer, prompts, reply)
        return loaded

    monkeypatch.setattr(module, "load_or_exit", loading)
    return prompts


def answer_with_eos(model, tokenizer, prompts: list[str], reply: str = "") -> None:
    """`model` made to write `reply` and eos after any prompt, each prompt kept (as text) in `prompts`."""
    def generate_eos(**kwargs):
        prompts.append(tokenizer().decode(kwargs["input_ids"][0]))
        written = tokenizer()(reply, add_special_tokens=False)["input_ids"] + [tokenizer().eos_token_id]
        return torch.cat([kwargs["input_ids"], torch.tensor([written])], dim=1)

    model.generate = generate_eos


def trained_context(tokenizer, tmp_path, kwargs: str) -> str:
    """What training rendered before the reply to QUESTION with these variables (the data side's own example)."""
    examples, _ = build(tokenizer, tmp_path, [{"messages": QUESTION + [{"role": "assistant", "content": "A"}]}],
                        chat_template_kwargs=kwargs)
    return trained_runs(tokenizer, examples)[0][0]


def test_generate_renders_the_runs_kwargs_and_the_flag_overrides_them(tiny_model_dir, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    out = run_dir(tiny_model_dir, tmp_path, tokenizer, {"chat_template_kwargs": '{"enable_thinking": false}'})
    prompts = recording(monkeypatch, generate)
    assert generate.main([str(out), "--prompt", "Q"]) == 0
    assert generate.main([str(out), "--prompt", "Q", "--chat_template_kwargs", '{"enable_thinking": true}']) == 0
    assert generate.main([str(out), "--prompt", "Q", "--chat_template_kwargs", "{}"]) == 0  # none: the default
    assert prompts == [QWEN3_NO_THINKING, QWEN3_THINKING, QWEN3_THINKING]
    assert prompts[0] == trained_context(tokenizer, tmp_path, '{"enable_thinking": false}')
    err = capsys.readouterr().err
    assert f'{out}: prompts render with the chat template variables the run trained with, {{"enable_thinking": ' \
           f'false}} ({out / "run.json"}; --chat_template_kwargs JSON overrides)' in err
    assert err.count("prompts render with") == 1  # the flag's run says nothing of the run's


@pytest.mark.parametrize("value, why", [
    ("{enable_thinking: false}", "--chat_template_kwargs '{enable_thinking: false}' is not JSON"),
    ('["enable_thinking"]', "--chat_template_kwargs '[\"enable_thinking\"]': give a JSON object"),
    ('{"tools": []}', "--chat_template_kwargs sets tools: apply_chat_template's own arguments")])
def test_a_bad_flag_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, value, why) -> None:
    monkeypatch.setattr(generate, "load_or_exit", lambda args: pytest.fail("a model was loaded"))
    monkeypatch.setattr(compare, "_load", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps({"messages": QUESTION + [
        {"role": "assistant", "content": "A"}], "answer": "A"}) + "\n")
    for main, argv in ((generate.main, [tmp_path]), (chat.main, [tmp_path]),
                       (compare.main, [tmp_path, tmp_path, "--tasks", tasks])):
        assert main([*map(str, argv), "--chat_template_kwargs", value]) == 2
        assert capsys.readouterr().err.startswith(f"error: {why}")


def test_chat_renders_gemma4_as_it_trained_with_enable_thinking(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """The helper's measurement: chat rendered `<bos><|turn>user\\nQ<turn|>\\n<|turn>model\\n<|channel>thought\\n
    <channel|>`, training `<|think|>` in a system turn and no closed thought block."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    out = run_dir(tiny_model_dir, tmp_path, tokenizer, {"chat_template_kwargs": '{"enable_thinking": true}'})
    prompts = recording(monkeypatch, chat)
    monkeypatch.setattr("sys.stdin", io.StringIO("Q\n"))
    assert chat.main([str(out)]) == 0
    assert prompts == [GEMMA4_THINKING] == [trained_context(tokenizer, tmp_path, '{"enable_thinking": true}')]


def test_a_gemma4_reply_after_its_thinking_prompt_is_split(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """The layout is read where the run's variables hide it (enable_thinking leaves out the empty block Gemma 4's
    default prompt closes): the trace the reply writes in that block is `reasoning`, not `thought\nTRACE` in the
    answer; and such a model writes reasoning first (compare's budget), Qwen3 under enable_thinking false does not."""
    tokenizer = gemma4_tokenizer(tiny_model_dir)
    out = run_dir(tiny_model_dir, tmp_path, tokenizer, {"chat_template_kwargs": '{"enable_thinking": true}'})
    recording(monkeypatch, generate, "<|channel>thought\nTRACE<channel|>ANSWER")
    assert generate.main([str(out), "--prompt", "Q"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (line["generation"], line["reasoning"], line["stop_token"]) == ("ANSWER", "TRACE", "<turn|>")
    for family, kwargs, limit in (("gemma4", {"enable_thinking": True}, 256), ("gemma4", {}, 16),
                                  ("qwen3", {"enable_thinking": False}, 16), ("qwen3", {}, 256)):
        made = gemma4_tokenizer(tiny_model_dir) if family == "gemma4" else family_tokenizer(tiny_model_dir, family)
        bind_template_kwargs(made, kwargs)
        assert compare.default_limits(out, made, made.chat_template, [{"messages": QUESTION}]) == [limit], kwargs


def test_compare_asks_both_models_with_the_runs_kwargs(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    after = run_dir(tiny_model_dir, tmp_path, tokenizer, {"chat_template_kwargs": '{"enable_thinking": false}'})
    before = run_dir(tiny_model_dir, tmp_path, tokenizer, None, "base")
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps({"messages": QUESTION + [
        {"role": "assistant", "content": "A"}], "answer": "A"}) + "\n")
    prompts, real = [], compare._load

    def loading(directory, kwargs, tokenizer_only=False):
        loaded = real(directory, kwargs, tokenizer_only)
        if not tokenizer_only:
            answer_with_eos(loaded[0], lambda: loaded[1], prompts)
        return loaded

    monkeypatch.setattr(compare, "_load", loading)
    assert compare.main([str(before), str(after), "--tasks", str(tasks)]) == 0
    assert prompts == [QWEN3_NO_THINKING] * 2
    assert f"{after}: prompts render with the chat template variables the run trained with" in capsys.readouterr().err


def test_sources_that_trained_with_other_kwargs_are_named() -> None:
    """One set for all sources is theirs; sources that differ: the run's --chat_template_kwargs, the others named."""
    def record(shared, per_source):
        return {"args": {"data": {"dataset_mixer_list": ["a.jsonl", "1.0", "b.jsonl", "1.0"],
                                  "chat_template_kwargs": shared,
                                  "dataset_mixer_list_chat_template_kwargs": per_source}}}

    assert trained_kwargs(record(None, ['{"enable_thinking": false}'])) == ({"enable_thinking": False}, [])
    assert trained_kwargs(record('{"enable_thinking": false}', ["{}", '{"enable_thinking": true}'])) == (
        {"enable_thinking": False}, ['b.jsonl {"enable_thinking": true}'])
    assert trained_kwargs({"args": {"data": {"chat_template_kwargs": None}}}) == ({}, [])


def test_a_merged_model_reads_its_runs_record(tmp_path) -> None:
    (tmp_path / "merged").mkdir()
    (tmp_path / "run.json").write_text("{}")
    assert run_record(tmp_path / "merged") == run_record(tmp_path) == tmp_path / "run.json"
    assert run_record(tmp_path / "merged" / "elsewhere") is None


def test_the_model_card_says_how_to_pass_them(tmp_path) -> None:
    run = {"args": {"data": {"chat_template_kwargs": '{"enable_thinking": false}'}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    card = render_model_card(tmp_path)
    section = card[card.index("## Chat template variables"):card.index("## Hyperparameters")]
    assert "- transformers: `tokenizer.apply_chat_template(messages, add_generation_prompt=True, " \
           "enable_thinking=False)`" in section
    assert "- vLLM: `vllm serve MODEL_DIR --default-chat-template-kwargs '{\"enable_thinking\": false}'`" in section
    (tmp_path / "run.json").write_text(json.dumps({"args": {"data": {"chat_template_kwargs": None}}}))
    assert "## Chat template variables" not in render_model_card(tmp_path)


def test_variables_bind_once_and_the_tokenizer_is_still_freed(tiny_model_dir) -> None:
    """The template's defaults stay at hand (its unbound renderer renders thinking on), a second bind is refused
    rather than stacked on the first, and nothing kept per tokenizer holds a bound one alive."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    bind_template_kwargs(tokenizer, {"enable_thinking": False})
    assert tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == QWEN3_NO_THINKING
    assert unbound_renderer(tokenizer)(QUESTION, add_generation_prompt=True, tokenize=False) == QWEN3_THINKING
    with pytest.raises(ValueError, match='variables {"enable_thinking": false} are bound to this tokenizer already'):
        bind_template_kwargs(tokenizer, {"enable_thinking": True})
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None


def test_a_layout_read_before_the_bind_is_read_again(tiny_model_dir) -> None:
    """A shape template writing the trace only under a variable: probed before the bind, it had no layout, which
    was kept for the tokenizer; the bind reads it again."""
    tokenizer = family_tokenizer(tiny_model_dir, "qwen3")
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}{%- if m.reasoning_content and show_trace %}"
        "{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}{{- m.content + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    assert reasoning_layout(tokenizer.chat_template, tokenizer) is None
    bind_template_kwargs(tokenizer, {"show_trace": True})
    assert reasoning_layout(tokenizer.chat_template, tokenizer) == ReasoningLayout("<think>", "</think>", "</think>")


def test_an_opened_default_layout_does_not_read_the_bound_prompts_replies(tiny_model_dir) -> None:
    """Apriel-1.6's template, a shape writing no trace under a variable around it: the bound prompt opens no trace,
    so its reply `4.` is the answer; read with the default (opened) layout it was a trace cut before any answer."""
    from ..data.test_worded_opening import apriel_tokenizer

    tokenizer = apriel_tokenizer(tiny_model_dir)
    tokenizer.chat_template = (
        "{%- if plain %}{%- for m in messages %}{{- '<|begin_' + m.role + '|>\\n' + m.content + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|begin_assistant|>\\n' }}{%- endif %}{%- else %}"
        + tokenizer.chat_template + "{%- endif %}")
    assert reasoning_layout(tokenizer.chat_template, tokenizer).opened is True
    bind_template_kwargs(tokenizer, {"plain": True})
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|begin_user|>\nQ\n<|begin_assistant|>\n"
    assert reasoning_layout(tokenizer.chat_template, tokenizer) is None
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("4.", prompt)]
    parts = parse_reply(tokenizer, ids[0], ids[1], None, "<|end|>")
    assert (parts.answer, parts.reasoning, parts.answered) == ("4.", None, True)


def test_the_card_passes_every_key_and_says_when_only_sources_set_them(tmp_path) -> None:
    run = {"args": {"data": {"chat_template_kwargs": '{"enable_thinking": false, "reasoning-effort": "low", '
                                                     '"class": 1}'}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert "- transformers: `tokenizer.apply_chat_template(messages, add_generation_prompt=True, " \
           "enable_thinking=False, **{'class': 1, 'reasoning-effort': 'low'})`" in render_model_card(tmp_path)
    run = {"args": {"data": {"chat_template_kwargs": None, "dataset_mixer_list": ["a.jsonl", "1", "b.jsonl", "1"],
                             "dataset_mixer_list_chat_template_kwargs": ["{}", '{"enable_thinking": true}']}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    card = render_model_card(tmp_path)
    assert card[card.index("## Chat template variables"):card.index("## Hyperparameters")] == (
        "## Chat template variables\n\nThe run set no chat template variables (--chat_template_kwargs); its sources "
        "rendered the template with their own, so no one set is the form the model trained in.\n\n"
        "Sources that trained with their own variables: `b.jsonl {\"enable_thinking\": true}`\n\n")


def test_a_merge_lora_output_renders_with_the_runs_variables(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """merge-lora wrote no run.json: generate and chat on its output rendered with the template's defaults. chat
    --raw renders no template, so it says nothing of the variables."""
    from open_sft.export.merge_adapter import merge_adapter_dir

    from .test_lora_added_tokens import _trained_run

    run = tmp_path / "run"
    _trained_run(tiny_model_dir, run)
    record = {"args": {"data": {"chat_template_kwargs": '{"enable_thinking": false}'}}}
    (run / "run.json").write_text(json.dumps(record))
    out = merge_adapter_dir(run, tmp_path / "out")
    assert json.loads((out / "run.json").read_text()) == record
    recording(monkeypatch, chat)
    monkeypatch.setattr("sys.stdin", io.StringIO("Q\n"))
    assert chat.main([str(out)]) == 0
    assert f"{out}: prompts render with the chat template variables the run trained with" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("Q\n"))
    assert chat.main([str(out), "--raw"]) == 0
    assert "prompts render with" not in capsys.readouterr().err
