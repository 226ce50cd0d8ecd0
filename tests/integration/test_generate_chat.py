"""`open_sft generate` and `open_sft chat` on what runs really leave: a full export, a LoRA run's directory
(adapter on its base, with chatml's added tokens) and its merged/ model; each reply says why it stopped; the chat
keeps the conversation, resets it and quits, from a pipe and on a pseudo-terminal; a directory without a model
is a clear error."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, SAMPLE, child_env, run_finetune

PROMPTS = ["What is 7 plus 5?", "How many letters are in the word cookie?", "Convert banana to capital letters.",
           "What is the product of 4 and 10?", "Add 3 to 9."]
STOP_LINE = re.compile(r"^\[(?P<why>end of turn \((?P<token>[^)]+)\)|cut off at --max_new_tokens \d+|stopped: [^(]+)"
                       r".*?(?P<new>\d+) tokens?; conversation (?P<conversation>\d+) of \d+ tokens.*\]$")


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A full fine-tune long enough to end its turns (the template's eos) after short answers."""
    out = tmp_path_factory.mktemp("generate_full")
    run_finetune(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "1.0",
                  "--output_dir", str(out), "--max_train_steps", "40", "--learning_rate", "5e-3",
                  "--warmup_ratio", "0.1", "--logging_steps", "10", "--max_seq_length", "128",
                  "--per_device_train_batch_size", "8", "--torch_dtype", "float32"])
    return out


@pytest.fixture(scope="module")
def lora_run(full_run, tmp_path_factory) -> Path:
    """A LoRA run on the full run's export, with chatml (tokens added: the base's embeddings must grow to load
    the adapter) and --merge_lora_on_save."""
    out = tmp_path_factory.mktemp("generate_lora")
    run_finetune(["--model_name_or_path", str(full_run), "--dataset_mixer_list", str(SAMPLE), "200",
                  "--output_dir", str(out), "--max_train_steps", "6", "--learning_rate", "3e-2",
                  "--logging_steps", "3", "--max_seq_length", "128", "--per_device_train_batch_size", "4",
                  "--torch_dtype", "float32", "--use_lora", "--lora_rank", "4", "--lora_alpha", "8",
                  "--lora_dropout", "0.0", "--chat_template_name", "chatml", "--merge_lora_on_save"])
    return out


@pytest.fixture(scope="module")
def qlora_run(full_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("generate_qlora")
    run_finetune(["--model_name_or_path", str(full_run), "--dataset_mixer_list", str(SAMPLE), "200",
                  "--output_dir", str(out), "--max_train_steps", "4", "--learning_rate", "1e-2",
                  "--logging_steps", "2", "--max_seq_length", "128", "--per_device_train_batch_size", "8",
                  "--use_qlora", "--lora_rank", "8", "--lora_alpha", "16", "--merge_lora_on_save"])
    return out


def open_sft(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "open_sft", *args], cwd=ROOT, env=child_env(), input=stdin,
                          capture_output=True, text=True, timeout=300)


def generations(*args: str) -> list[dict]:
    result = open_sft("generate", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def greedy(directory: Path, messages: list[dict], max_new_tokens: int) -> list[int]:
    """The new token ids plain transformers generates (greedy) from a full model directory."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, encoded["input_ids"].shape[1]:].tolist()


def test_full_export_replies_say_why_they_stopped(full_run) -> None:
    tokenizer = AutoTokenizer.from_pretrained(full_run)
    rows = generations(str(full_run), *[a for p in PROMPTS for a in ("--prompt", p)], "--max_new_tokens", "40")
    assert [row["prompt"] for row in rows] == PROMPTS
    for row in rows:  # each reply is what plain transformers generates, and says why it ended
        ids = greedy(full_run, [{"role": "user", "content": row["prompt"]}], 40)
        assert row["generation"] == tokenizer.decode(ids, skip_special_tokens=True)  # as generated, not stripped
        assert row["new_tokens"] == len(ids)
        if ids[-1] == tokenizer.eos_token_id:
            assert (row["stop_reason"], row["stop_token"]) == ("end_of_turn", tokenizer.eos_token)
        else:
            assert (row["stop_reason"], len(ids)) == ("max_new_tokens", 40)
    ended = [row for row in rows if row["stop_reason"] == "end_of_turn" and row["new_tokens"] >= 2]
    assert ended, rows  # the trained model ends some turns itself, after a reply of a token or more
    # the same prompt under a limit one token short of its reply: cut off, and says so
    row = ended[0]
    limit = row["new_tokens"] - 1
    [cut] = generations(str(full_run), "--prompt", row["prompt"], "--max_new_tokens", str(limit))
    assert (cut["stop_reason"], cut["new_tokens"], cut["stop_token"]) == ("max_new_tokens", limit, None)
    ids = greedy(full_run, [{"role": "user", "content": row["prompt"]}], limit)
    assert cut["generation"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_lora_run_directory_and_its_merged_model_generate_alike(lora_run, full_run) -> None:
    """The LoRA run's own directory (no config.json: the adapter on the base adapter_config.json names) and its
    merged/ give the same replies; the CLI's loader applies the adapter (logits of the merged model, not the
    base's)."""
    from open_sft.export.run_dir import ADAPTER_DIR, FULL, load_run_model

    assert not (lora_run / "config.json").exists()
    args = [a for p in PROMPTS[:3] for a in ("--prompt", p)] + ["--max_new_tokens", "12"]
    adapter_rows, merged_rows = generations(str(lora_run), *args), generations(str(lora_run / "merged"), *args)
    assert adapter_rows == merged_rows
    assert all(row["stop_reason"] in ("end_of_turn", "max_new_tokens") for row in adapter_rows)

    adapter, merged = load_run_model(lora_run), load_run_model(lora_run / "merged")
    assert (adapter.kind, merged.kind) == (ADAPTER_DIR, FULL) and "LoRA adapter on" in adapter.description
    assert "<|im_end|>" in adapter.tokenizer.chat_template  # the run's template, not the base's
    ids = adapter.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
    with torch.no_grad():
        adapter_logits, merged_logits = adapter.model(input_ids=ids).logits, merged.model(input_ids=ids).logits
        with adapter.model.disable_adapter():
            base_logits = adapter.model(input_ids=ids).logits
    torch.testing.assert_close(adapter_logits, merged_logits, rtol=1e-5, atol=1e-5)
    assert float((adapter_logits - base_logits).abs().max()) > 1e-2
    im_end = adapter.tokenizer.convert_tokens_to_ids("<|im_end|>")  # the run's end of turn ends a reply
    assert im_end in adapter.model.generation_config.eos_token_id


def test_qlora_run_directory_loads_on_the_4bit_base_it_trained_against(qlora_run) -> None:
    """A QLoRA adapter is applied to its base quantized as in training (NF4, bitsandbytes' CPU backend here):
    its logits are the merged/ model's (the dequantized base plus the update, stored in bf16) up to a small
    fraction of what the adapter changes."""
    import bitsandbytes as bnb

    from open_sft.export.run_dir import load_run_model

    rows = generations(str(qlora_run), "--prompt", PROMPTS[0], "--max_new_tokens", "8")
    assert rows[0]["stop_reason"] in ("end_of_turn", "max_new_tokens")
    adapter, merged = load_run_model(qlora_run), load_run_model(qlora_run / "merged")
    assert sum(isinstance(module, bnb.nn.Linear4bit) for module in adapter.model.modules()) == 2 * 7
    assert "(QLoRA adapter on 4-bit" in adapter.description
    ids = adapter.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
    with torch.no_grad():
        adapter_logits = adapter.model(input_ids=ids).logits.float()
        merged_logits = merged.model(input_ids=ids).logits.float()
        with adapter.model.disable_adapter():
            base_logits = adapter.model(input_ids=ids).logits.float()
    effect = float((adapter_logits - base_logits).abs().max())
    assert effect > 0.1 and float((adapter_logits - merged_logits).abs().max()) < 0.1 * effect


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`open_sft ARGS` run in this process: (exit code, stdout, stderr)."""
    from open_sft.__main__ import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_directory_without_a_model_is_a_clear_error(lora_run, full_run, tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = open_sft("generate", str(empty), "--prompt", "hi")  # the real command line, once
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {empty} holds no model") and "a LoRA/QLoRA adapter" in result.stderr
    (empty / "checkpoints").mkdir()
    code, out, err = in_process(capsys, "chat", str(empty))
    assert (code, out) == (2, "") and "has checkpoints/ but no export" in err and "relaunch the same command" in err
    code, _, err = in_process(capsys, "generate", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert code == 2 and err.startswith(f"error: {tmp_path / 'nowhere'} does not exist")

    moved = tmp_path / "moved_adapter"  # an adapter whose base is not where adapter_config.json says
    shutil.copytree(lora_run, moved, ignore=shutil.ignore_patterns("merged", "checkpoints"))
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone_base")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    code, _, err = in_process(capsys, "generate", str(moved), "--prompt", PROMPTS[0])
    assert code == 2 and f"is a LoRA adapter on {tmp_path / 'gone_base'}" in err and "pass --base_model" in err
    code, _, err = in_process(capsys, "generate", str(full_run), "--prompt", PROMPTS[0], "--base_model", str(full_run))
    assert code == 2 and "--base_model is for a LoRA/QLoRA adapter directory" in err
    code, _, err = in_process(capsys, "chat", str(full_run), "--max_new_tokens", "0")
    assert code == 2 and "--max_new_tokens 0 must be at least 1" in err
    args = ["--prompt", PROMPTS[0], "--max_new_tokens", "12"]
    code, out, _ = in_process(capsys, "generate", str(moved), *args, "--base_model", str(full_run))
    assert code == 0 and out == in_process(capsys, "generate", str(lora_run), *args)[1]


def parse_chat(stdout: str) -> list[dict]:
    """The chat's stdout as events: {"reply", "why", "token", "new", "conversation"} per reply, {"reset"},
    {"unknown"}."""
    events, text = [], []
    for line in stdout.splitlines():
        match = STOP_LINE.match(line)
        if line == "[conversation reset]":
            events.append({"reset": True})
        elif line.startswith("[unknown command "):
            events.append({"unknown": line})
        elif match:
            events.append({"reply": "\n".join(text).strip(), "why": match["why"], "token": match["token"],
                           "new": int(match["new"]), "conversation": int(match["conversation"])})
            text = []
        else:
            text.append(line)
    return events


def test_chat_from_a_pipe_keeps_the_conversation_and_resets(full_run) -> None:
    first, second = PROMPTS[0], PROMPTS[1]
    result = open_sft("chat", str(full_run), "--max_new_tokens", "24", stdin=f"{first}\n\n{second}\n/reset\n{second}\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"chatting with {full_run} (full model)" in result.stderr and "/reset" in result.stderr
    events = parse_chat(result.stdout)
    assert [("reset" if "reset" in e else "reply") for e in events] == ["reply", "reply", "reset", "reply"]
    one, two, _, three = events
    tokenizer = AutoTokenizer.from_pretrained(full_run)
    said = tokenizer.decode(greedy(full_run, [{"role": "user", "content": first}], 24), skip_special_tokens=True)
    conversations = [[{"role": "user", "content": first}],
                     [{"role": "user", "content": first}, {"role": "assistant", "content": said},
                      {"role": "user", "content": second}],
                     [{"role": "user", "content": second}]]
    for event, messages in zip((one, two, three), conversations):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert event["conversation"] == len(prompt) + event["new"]  # the history it answered, and no more
        ids = greedy(full_run, messages, 24)
        assert (event["reply"], event["new"]) == (tokenizer.decode(ids, skip_special_tokens=True).strip(), len(ids))
        ended = ids[-1] == tokenizer.eos_token_id
        assert event["why"].startswith("end of turn" if ended else "cut off at --max_new_tokens 24")
    assert two["conversation"] > one["conversation"] > 0 and three["conversation"] < two["conversation"]


def test_a_model_without_a_chat_template_continues_plain_text(full_run, tmp_path) -> None:
    """Continual pretraining leaves a model without a chat template: generate and chat continue the text as it is
    (they refused it, saying to export again), and --raw asks the same of any model."""
    plain = tmp_path / "plain"
    shutil.copytree(full_run, plain, ignore=shutil.ignore_patterns("checkpoints", "chat_template.jinja"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(plain)
    assert not tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(plain).eval()

    def continued(text: str, limit: int) -> str:
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=limit, do_sample=False)
        return tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)

    result = open_sft("generate", str(plain), "--prompt", "Add 3 to", "--max_new_tokens", "12")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "its tokenizer has no chat template (a model trained on plain text)" in result.stderr
    [row] = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["generation"] == continued("Add 3 to", 12) and row["new_tokens"] > 0
    assert generations(str(full_run), "--raw", "--prompt", "Add 3 to", "--max_new_tokens", "12") == [row]
    chatted = open_sft("chat", str(plain), "--max_new_tokens", "8", stdin="Add 3 to\n")
    assert chatted.returncode == 0, chatted.stderr[-3000:]
    [event] = parse_chat(chatted.stdout)
    assert event["reply"] == continued("Add 3 to\n", 8).strip()  # each line continued with its newline
    refused = open_sft("generate", str(plain), "--system", "Be brief.", "--prompt", "Hi")
    assert refused.returncode == 2 and "--system needs a chat template" in refused.stderr


def test_chat_system_message_starts_every_conversation(full_run) -> None:
    system = "Answer with a number."
    result = open_sft("chat", str(full_run), "--system", system, "--max_new_tokens", "8",
                      stdin=f"{PROMPTS[0]}\n/reset\n{PROMPTS[0]}\n/exit\n{PROMPTS[1]}\n")
    assert result.returncode == 0, result.stderr[-3000:]
    events = [event for event in parse_chat(result.stdout) if "reset" not in event]
    assert len(events) == 2 and events[0] == events[1]  # after /reset the system message is there again
    tokenizer = AutoTokenizer.from_pretrained(full_run)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPTS[0]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert events[0]["conversation"] == len(prompt) + events[0]["new"]
    ids = greedy(full_run, messages, 8)
    assert events[0]["reply"] == tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_a_full_context_is_said_and_its_turn_dropped(full_run, tmp_path) -> None:
    """The model's context (max_position_embeddings, cut to 24 positions in a copy) ends a reply with
    max_length; a turn that no longer fits is answered by a line saying so, not kept, and /reset recovers."""
    short = tmp_path / "short_context"
    shutil.copytree(full_run, short, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    tokenizer = AutoTokenizer.from_pretrained(short)
    prompt = PROMPTS[2]  # the trained model answers it at length
    length = len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
    [row] = generations(str(short), "--prompt", prompt, "--max_new_tokens", "100")
    if row["stop_reason"] != "end_of_turn":
        assert (row["stop_reason"], row["new_tokens"]) == ("max_length", 24 - length)
    result = open_sft("chat", str(short), "--max_new_tokens", "100",
                      stdin=f"{prompt}\n{prompt}\n/foo\n/reset\n{prompt}\n")
    assert result.returncode == 0, result.stderr[-3000:]
    first, full, unknown, reset, again = parse_chat(result.stdout)
    assert first["why"].startswith("end of turn" if row["stop_reason"] == "end_of_turn" else "stopped: the model's")
    assert full["why"].startswith("stopped: the model's context is full") and (full["new"], full["reply"]) == (0, "")
    assert unknown == {"unknown": "[unknown command /foo: /reset clears the conversation, /tool TEXT answers a tool "
                                  "call, /exit quits]"}
    assert "reset" in reset and again == first  # the turn that did not fit was not kept


def _read_until(controller: int, marker: bytes, seen: bytearray, timeout: float = 120, times: int = 1) -> None:
    """Read the terminal until `marker` has been shown `times` times in all."""
    deadline = time.monotonic() + timeout
    while seen.count(marker) < times:
        ready, _, _ = select.select([controller], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {marker!r} within {timeout}s; the terminal shows: {bytes(seen)[-2000:]!r}"
        seen += os.read(controller, 65536)


@pytest.mark.parametrize("quit_with", ["/exit\r", "\x04"])
def test_chat_on_a_terminal_with_the_lora_run(lora_run, quit_with) -> None:
    """On a pseudo-terminal: the prompt, a reply and its stop line, /reset, and /exit or Ctrl-D quit (exit 0)."""
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "open_sft", "chat", str(lora_run), "--max_new_tokens", "8"],
                            cwd=ROOT, env=child_env(), stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    seen = bytearray()
    try:
        _read_until(controller, b"you> ", seen)
        assert b"LoRA adapter on" in seen
        os.write(controller, f"{PROMPTS[0]}\r".encode())
        _read_until(controller, b"tokens]", seen)
        _read_until(controller, b"you> ", seen, times=2)
        os.write(controller, b"/reset\r")
        _read_until(controller, b"[conversation reset]", seen)
        # the third prompt: the chat reads the terminal again (a Ctrl-D typed before it asks, while the terminal
        # is still in cooked mode, is the line discipline's, not readline's, and was sometimes lost)
        _read_until(controller, b"you> ", seen, times=3)
        os.write(controller, quit_with.encode())
        assert proc.wait(timeout=60) == 0, bytes(seen)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)
    shown = bytes(seen).decode("utf-8", "replace").replace("\r\n", "\n")
    stops = [match for match in map(STOP_LINE.match, shown.splitlines()) if match]
    assert len(stops) == 1 and stops[0]["why"].startswith(("end of turn", "cut off at --max_new_tokens 8"))
