"""The launch judged as a whole before anything loads: every problem that depends on how the run is spread, the
flags and the model's config.json, in one error (each engine's own list is tested beside it: tests/unit/distributed/,
tests/unit/model/test_compile.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import LlamaConfig

from open_sft.config.launch import LaunchPlan
from open_sft.config.launch_check import check_launch, launch_problems
from open_sft.config.parse import parse_config
from open_sft.distributed.parallelism import Parallelism
from open_sft.errors import UserError


def config(model: str, *flags: str):
    return parse_config(["--model_name_or_path", model, "--dataset_mixer_list", "d.jsonl", "1.0",
                         "--output_dir", "unused", *flags])


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a tokenizer, data or weights fails the test: the launch check comes before all of them."""
    import transformers

    from open_sft import run
    from open_sft.model import load, tokenizer

    def loaded(*args, **kwargs):
        raise AssertionError("something was loaded before the launch was checked")

    for owner, name in ((load, "load_model"), (tokenizer, "load_tokenizer"), (run, "prepare_data"), (run, "build_model"),
                        (transformers.AutoModelForCausalLM, "from_pretrained")):
        monkeypatch.setattr(owner, name, loaded)
    return monkeypatch


def test_every_problem_of_a_deepspeed_launch_is_named_at_once(tiny_model_dir, tmp_path, nothing_loads) -> None:
    from open_sft.run import plan_launch

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"check_grad_overflow": False}}))
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_json),
                        "WORLD_SIZE": "3"}.items():
        nothing_loads.setenv(name, value)
    given = config(str(tiny_model_dir), "--pipeline_parallel_size", "2", "--torch_compile", "--use_qlora",
                   "--torch_dtype", "bfloat16")
    with pytest.raises(UserError) as caught:
        plan_launch(given)
    message = str(caught.value)
    assert message.startswith("the launch cannot run as asked (3 processes: DeepSpeed ZeRO-2, "), message
    for expected in (
            "--use_qlora does not work under DeepSpeed",  # once config.checks', now the launch's
            "the DeepSpeed config would apply steps with a non-finite gradient instead of skipping them: "
            "bf16.check_grad_overflow is false",  # once found by the Trainer, after the weights had loaded
            "--torch_compile does not run with --pipeline_parallel_size",
            "--torch_compile does not run with --use_qlora",
            "--pipeline_parallel_size 2 must divide the number of processes (3)",
            "--pipeline_parallel_size 2 runs on torch's pipelining, not under DeepSpeed",
            "--pipeline_parallel_size 2 with --use_qlora"):
        assert expected in message, (expected, message)
    assert len(message.splitlines()) == 8  # the heading and seven problems, one a line


def test_every_problem_of_an_fsdp2_launch_is_named_at_once(tiny_model_dir, nothing_loads) -> None:
    from open_sft.run import plan_launch

    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "4"}.items():
        nothing_loads.setenv(name, value)
    # 2 stages × 2 virtual stages: more stages than the tiny model's 2 layers (known from its config.json alone)
    given = config(str(tiny_model_dir), "--pipeline_parallel_size", "2", "--pipeline_virtual_stages", "2",
                   "--pipeline_schedule", "interleaved_1f1b", "--torch_compile", "--torch_dtype", "float16")
    with pytest.raises(UserError) as caught:
        plan_launch(given)
    problems = str(caught.value).splitlines()[1:]
    assert [problem.split(":")[0].strip() for problem in problems] == [
        "FSDP2", "--torch_compile does not run with FSDP (its per-layer gathering would have to be traced with the "
        "layer)", "--torch_compile does not run with --pipeline_parallel_size (each stage swaps the backbone's "
        "layers)", "--pipeline_parallel_size 2"], problems
    assert "fp16 under FSDP2 is not supported" in problems[0]
    assert "4 pipeline stages need at least one of the model's 2 decoder layers each" in problems[-1]


def plan(parallelism: Parallelism, dtype: torch.dtype = torch.float32, deepspeed_config=None, **train) -> LaunchPlan:
    return LaunchPlan(train=dataclasses.replace(config("m").train, **train), dtype=dtype,
                      deepspeed_config=deepspeed_config, parallelism=parallelism)


LLAMA = LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, vocab_size=128, num_hidden_layers=2)


def test_tensor_and_sequence_parallel_problems_come_from_the_models_config() -> None:
    c = config("m", "--sequence_parallel_size", "2")
    launch = plan(Parallelism("ddp", 4, dp_replicate=1, tp=2, sp=2), sequence_parallel_size=2)
    problems = launch_problems(c, launch, LLAMA)
    assert "tensor parallelism: --parallelism_config_tp_size 2 runs combined with FSDP2" in problems[0]
    assert any("tensor parallelism: --parallelism_config_tp_size 2 must divide the model's num_attention_heads (3)"
               in problem for problem in problems), problems
    assert any("--sequence_parallel_size 2 runs on DeepSpeed Ulysses" in problem for problem in problems), problems
    assert any("--sequence_parallel_size 2 must divide the model's attention heads (3)" in problem
               for problem in problems), problems


def test_deepspeed_precision_is_judged_as_the_compute_dtype_fills_it() -> None:
    stage0 = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": "auto"}}
    fp32 = plan(Parallelism("deepspeed", 2, dp_shard=2), torch.float32, stage0)
    assert launch_problems(config("m"), fp32, None) == [
        "the DeepSpeed config would apply steps with a non-finite gradient instead of skipping them: "
        "zero_optimization.stage 0 in fp32 has no overflow check; use stage 1, 2 or 3"]
    assert launch_problems(config("m"), plan(Parallelism("deepspeed", 2, dp_shard=2), torch.bfloat16, stage0),
                           None) == []


def test_a_launch_that_can_run_reads_no_model_config(monkeypatch) -> None:
    from open_sft.model import load

    monkeypatch.setattr(load, "load_model_config", lambda *a: pytest.fail("config.json read for a plain launch"))
    check_launch(config("m", "--torch_compile"), plan(Parallelism("ddp", 2, dp_replicate=2)))
    check_launch(config("m"), plan(Parallelism("fsdp2", 2, dp_shard=2), torch.bfloat16))


def test_an_additional_model_argument_the_config_lacks_is_refused_before_the_data(tiny_model_dir,
                                                                                   nothing_loads) -> None:
    """A misspelled --additional_model_arguments key was refused when the model loaded: after the tokenization
    (hours on a large mixture). The launch check reads config.json for it, before anything loads."""
    from open_sft.run import plan_launch

    given = config(str(tiny_model_dir), "--additional_model_arguments", '{"rope_thetta": 20000.0}')
    with pytest.raises(UserError, match=r"--additional_model_arguments: 'rope_thetta' is not a \w+Config setting"):
        plan_launch(given)
    assert plan_launch(config(str(tiny_model_dir), "--additional_model_arguments", '{"attention_dropout": 0.1}'))


def test_two_processes_asked_of_accelerate_but_one_started_is_refused_with_the_fix(tiny_model_dir, nothing_loads):
    """On a machine without GPUs, `accelerate launch --num_processes 2 finetune.py` (no --multi_gpu) started one
    process, which trained alone at half the global batch, saying only "parallelism: 1 process"."""
    from open_sft.distributed import env
    from open_sft.run import plan_launch

    for name in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        nothing_loads.delenv(name, raising=False)
    nothing_loads.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    nothing_loads.setattr(env, "launcher_argv", lambda: ["python", "/venv/bin/accelerate", "launch", "--num_processes",
                                                         "2", "finetune.py"])
    with pytest.raises(UserError) as caught:
        plan_launch(config(str(tiny_model_dir), "--torch_dtype", "float32"))
    assert str(caught.value) == (
        "the launch cannot run as asked (1 process: plain torch, dp_replicate 1 × dp_shard 1):\n  accelerate launch "
        "was given --num_processes 2 but started this one process: on a machine with fewer than two GPUs it starts "
        "one unless --multi_gpu, --use_deepspeed or --use_fsdp (or an accelerate config file naming one) asks for "
        "more; add --multi_gpu for plain DDP over 2 processes (CPUs too), or give --num_processes 1")
    # with --cpu, accelerate starts one process whatever else it is given (--multi_gpu too): the fix is without it
    nothing_loads.setattr(env, "launcher_argv", lambda: ["python", "/venv/bin/accelerate", "launch", "--cpu",
                                                         "--multi_gpu", "--num_processes=2", "finetune.py"])
    with pytest.raises(UserError) as caught:
        plan_launch(config(str(tiny_model_dir), "--torch_dtype", "float32"))
    assert str(caught.value).splitlines()[1] == (
        "  accelerate launch was given --num_processes 2 and --cpu, with which it starts this one process whatever "
        "else it is given; drop --cpu (on a machine without GPUs, --multi_gpu runs plain DDP over 2 processes on the "
        "CPUs), or give --num_processes 1")
    nothing_loads.setattr(env, "launcher_argv", lambda: ["python", "/venv/bin/accelerate", "launch", "finetune.py"])
    assert plan_launch(config(str(tiny_model_dir), "--torch_dtype", "float32")).launch.parallelism.world_size == 1
