"""Every way users configure DeepSpeed through accelerate: an `accelerate config` YAML without a JSON,
`accelerate launch` flags alone, and a Trainer-style JSON with optimizer/scheduler sections.

The decisions are unit-tested on the environment accelerate hands its workers; real 2-rank runs through
each style must give the per-step losses of the JSON path (configs/ds/zero2.json) tested in test_e2e.

The tests of this subject that launch real processes are in tests/integration/test_accelerate_configs.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from conftest import TRAINER_JSON
from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError
from open_sft.config import launch
from open_sft.config.launch import plan_launch
from open_sft.model.precision import DtypeChoice


YAML_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_multinode_launcher,gradient_accumulation_steps,gradient_clipping,"
                                   "offload_optimizer_device,offload_param_device,zero3_init_flag,"
                                   "zero3_save_16bit_model,zero_stage,mixed_precision",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_GRADIENT_CLIPPING": "0.5",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
}


def plan(flags: list[str], env: dict[str, str], auto_dtype: torch.dtype = torch.float32):
    config = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *flags])
    explicit = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        config.model.torch_dtype)
    return plan_launch(config.train, config.model, config.explicit,
                       lambda: DtypeChoice(explicit or auto_dtype, "flag" if explicit else "auto"), env)


def write_json(tmp_path, content: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return str(path)


def test_yaml_settings_build_the_deepspeed_config() -> None:
    result = plan([], YAML_ENV)
    zero = result.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["offload_param"] == {"device": "cpu"}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert result.deepspeed_config["zero_force_ds_cpu_optimizer"] is False  # our AdamW steps the offloaded state
    # No flag given: accelerate's values are used, and said so.
    assert result.train.gradient_accumulation_steps == 1 and result.train.clip_grad_norm == 0.5
    assert result.dtype == torch.bfloat16
    assert result.dtype_choice.reason.startswith("accelerate's mixed_precision=bf16")
    assert any("clip_grad_norm = 0.5 from accelerate's gradient_clipping" in n for n in result.notes)
    assert any("loaded partitioned (deepspeed.zero.Init)" in n for n in result.notes)
    assert result.record["accelerate_deepspeed_settings"]["zero3_init_flag"] is True
    assert result.zero3_init and result.record["zero3_init"]


def test_zero3_save_gather_switched_off_is_switched_on_with_a_line(tmp_path) -> None:
    """`accelerate config` answers no to saving 16-bit weights under ZeRO-3 by default (zero3_save_16bit_model:
    false): the export at the end needs the gather (accelerator.get_state_dict refuses without it), so the plan
    switches it on and says so, rather than the run failing after training."""
    result = plan([], {**YAML_ENV, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false"})
    assert result.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ("stage3_gather_16bit_weights_on_model_save false (accelerate's zero3_save_16bit_model) is set to true: "
            "the export at the end gathers the ZeRO-3 shards into full weights, which needs it (it changes nothing "
            "else)") in result.notes
    path = write_json(tmp_path, {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}})
    result = plan([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path})
    assert result.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert [n for n in result.notes if "gather" in n] == [
        f"stage3_gather_16bit_weights_on_model_save false in {path} is set to true: the export at the end gathers "
        "the ZeRO-3 shards into full weights, which needs it (it changes nothing else)"]
    # ZeRO-2 exports without any gather: the value is left as given, nothing said.
    env = {**YAML_ENV, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false"}
    result = plan([], env)
    assert result.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert not [n for n in result.notes if "gather" in n]


def test_deepspeeds_own_launcher_is_refused_with_the_accelerate_line() -> None:
    """`deepspeed --num_gpus 8 finetune.py ... --no_local_rank` gives no accelerate settings: the run trained plain
    DDP, no ZeRO, without a word. Refused naming the accelerate command; under accelerate's own multi-node DeepSpeed
    launchers (which run DeepSpeed's with accelerate's settings) it goes on."""
    launcher = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "CROSS_RANK": "0",
                "CROSS_SIZE": "1", "LOCAL_SIZE": "8"}
    with pytest.raises(UserError) as info:
        plan([], launcher)
    assert str(info.value) == (
        "started by DeepSpeed's own launcher (`deepspeed finetune.py`: CROSS_RANK, CROSS_SIZE and LOCAL_SIZE are set, "
        "no accelerate DeepSpeed settings), which would train plain data parallelism without ZeRO; launch with "
        "accelerate: accelerate launch --num_processes 8 --use_deepspeed --deepspeed_config_file configs/ds/zero2.json "
        "finetune.py ...")
    with pytest.raises(UserError, match=r"accelerate launch --num_processes 16 --num_machines 2 --machine_rank 1 "
                                        r"--main_process_ip 10.0.0.1 --use_deepspeed "):
        plan([], {**launcher, "WORLD_SIZE": "16", "CROSS_SIZE": "2", "CROSS_RANK": "1"})
    result = plan([], {**YAML_ENV, **launcher, "CROSS_SIZE": "2", "WORLD_SIZE": "16"})  # accelerate's pdsh launch
    assert result.deepspeed_config["zero_optimization"]["stage"] == 3
    assert plan([], {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8"}).deepspeed_config is None  # torchrun: DDP


@pytest.mark.parametrize("env,expected", [
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}, False),  # accelerate's flag off: loaded whole
    ({}, True),  # stage 3 without the flag: partitioned, as accelerate and the HF Trainer default to
    ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}, False),  # ZeRO-2: n/a
])
def test_zero3_init_follows_accelerates_flag(env, expected) -> None:
    base = {k: v for k, v in YAML_ENV.items() if k != "ACCELERATE_DEEPSPEED_ZERO3_INIT"}
    assert plan([], {**base, **env}).zero3_init is expected


def test_given_flags_win_over_the_yaml_with_one_line_each() -> None:
    result = plan(["--gradient_accumulation_steps", "4", "--clip_grad_norm", "1.0", "--torch_dtype", "float32"],
                  YAML_ENV)
    assert result.train.gradient_accumulation_steps == 4 and result.train.clip_grad_norm == 1.0
    assert result.dtype == torch.float32
    wins = [n for n in result.notes if " wins over accelerate's " in n]
    assert len(wins) == 3, result.notes
    # The values live in the flags; the config takes them when it is resolved.
    assert result.deepspeed_config["gradient_accumulation_steps"] == "auto"


def test_flag_spelling_and_run_yaml_count_as_given(tmp_path) -> None:
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("model_name_or_path: m\ndataset_mixer_list: [d.jsonl, '1.0']\nclip_grad_norm: 2.0\n")
    config = parse_config([str(run_yaml), "--gradient-accumulation-steps", "3"])
    assert {"clip_grad_norm", "gradient_accumulation_steps"} <= config.explicit
    assert "learning_rate" not in config.explicit
    result = plan_launch(config.train, config.model, config.explicit, lambda: DtypeChoice(torch.float32, "x"),
                         YAML_ENV)
    assert (result.train.gradient_accumulation_steps, result.train.clip_grad_norm) == (3, 2.0)


def test_mixed_precision_no_is_only_a_request_when_the_yaml_says_it() -> None:
    base = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no"}
    assert plan([], base, auto_dtype=torch.bfloat16).dtype == torch.bfloat16  # accelerate's default: auto decides
    from_yaml = {**base, "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,mixed_precision"}
    assert plan([], from_yaml, auto_dtype=torch.bfloat16).dtype == torch.float32
    with pytest.raises(UserError, match="mixed_precision=fp8 is not supported"):
        plan([], {**base, "ACCELERATE_MIXED_PRECISION": "fp8"})
    assert plan(["--torch_dtype", "bfloat16"], {**base, "ACCELERATE_MIXED_PRECISION": "fp16"}).dtype == torch.bfloat16


def test_fp16_from_accelerate_the_json_or_the_flag(tmp_path, monkeypatch) -> None:
    """`accelerate launch --mixed_precision fp16`, a JSON with fp16.enabled true and --torch_dtype float16 all train
    fp16; outside DeepSpeed on any machine, under DeepSpeed where DeepSpeed can (else one clear error)."""
    assert plan([], {"ACCELERATE_MIXED_PRECISION": "fp16"}).dtype == torch.float16
    assert plan(["--torch_dtype", "float16"], {}).dtype == torch.float16
    ds = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "fp16"}
    monkeypatch.setattr(launch, "deepspeed_fp16_problem", lambda: None)  # a GPU, or a CPU with AVX512-FP16
    result = plan([], ds)
    assert result.dtype == torch.float16 and result.deepspeed_config["fp16"] == {"enabled": "auto"}
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "hysteresis": 2}})
    json_env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path}
    assert plan([], json_env).dtype == torch.float16
    with pytest.raises(UserError, match=r"its precision \(fp16\) conflicts with --torch_dtype float32"):
        plan(["--torch_dtype", "float32"], json_env)
    monkeypatch.setattr(launch, "deepspeed_fp16_problem", lambda: "DeepSpeed cannot train fp16 on this CPU (...)")
    with pytest.raises(UserError, match=r"DeepSpeed cannot train fp16 on this CPU .* \(compute dtype float16: "):
        plan([], ds)
    assert plan([], {"ACCELERATE_MIXED_PRECISION": "fp16"}).dtype == torch.float16  # no DeepSpeed: still fine
    both = write_json(tmp_path, {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(UserError, match="bf16.enabled and fp16.enabled are both true"):
        plan([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": both})


def test_flags_only_launch_defaults_to_zero2() -> None:
    result = plan([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no"})
    assert result.deepspeed_config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": "auto"}
    assert plan([], {"ACCELERATE_USE_DEEPSPEED": "false"}).deepspeed_config is None


def test_json_merges_accelerate_settings_and_refuses_contradictions(tmp_path) -> None:
    path = write_json(tmp_path, {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.3})
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path,
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    result = plan([], env)
    assert result.deepspeed_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert result.train.clip_grad_norm == 0.3  # the file's explicit value, no flag given
    with pytest.raises(UserError, match=r"gradient_clipping=0.3 conflicts with --clip_grad_norm 1.0"):
        plan(["--clip_grad_norm", "1.0"], env)
    with pytest.raises(UserError, match=r"zero_optimization.stage=3 conflicts with accelerate's zero_stage=2"):
        plan([], {**env, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


def test_json_bf16_and_batch_values_are_checked(tmp_path) -> None:
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    with pytest.raises(UserError, match=r"its precision \(bf16\) conflicts with --torch_dtype float32"):
        plan(["--torch_dtype", "float32"], {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": path})
    assert plan([], {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": path}).dtype == torch.bfloat16
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2}, "train_batch_size": 24})
    with pytest.raises(UserError, match=r"train_batch_size=24 is not micro-batch 8 × accumulation 1"):
        plan([], {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": path})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match=r"bad.json: not valid JSON"):
        plan([], {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "bad.json")})


def test_a_pinned_train_batch_size_names_the_accumulation_and_goes_on_with_its_checkpoint(tmp_path) -> None:
    """A Trainer-era JSON pinning micro-batch 2 × accumulation 2 and train_batch_size 8 (2 ranks), launched on 1 rank:
    the refusal names the accumulation that keeps the global batch, and that the file's own must go; resuming the
    2-rank checkpoint (global batch 8) on 1 rank goes on (the resume fits the accumulation: training.elastic)."""
    pinned = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 2, "train_batch_size": 8}
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, pinned)}
    assert plan([], {**env, "WORLD_SIZE": "2"}).train.gradient_accumulation_steps == 2
    with pytest.raises(UserError, match=r"train_batch_size=8 is not micro-batch 2 × accumulation 2 × 1 ranks = 4; "
                                        r"accumulation 4 keeps it on 1 ranks: pass --gradient_accumulation_steps 4 "
                                        r"and set gradient_accumulation_steps to \"auto\" in the file"):
        plan([], env)
    config = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0"])
    result = plan_launch(config.train, config.model, config.explicit, lambda: DtypeChoice(torch.float32, "x"), env,
                         resumed=(8, 2))
    assert result.deepspeed_config["train_batch_size"] == "auto"  # filled from the fitted accumulation
    assert any("train_batch_size=8 in" in note and "is the 2-rank checkpoint's global batch: on 1 rank(s) the "
               "accumulation is fitted to keep it" in note for note in result.notes)
    with pytest.raises(UserError, match=r"= 4; accumulation 4 keeps it"):  # another checkpoint's batch: refused
        plan_launch(config.train, config.model, config.explicit, lambda: DtypeChoice(torch.float32, "x"), env,
                    resumed=(16, 2))
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, {**pinned, "train_batch_size": 9})
    with pytest.raises(UserError, match=r"train_batch_size=9 .*it is no multiple of micro-batch 2"):
        plan([], env)
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, {**pinned, "train_batch_size": 6,
                                                                    "gradient_accumulation_steps": "auto"})
    with pytest.raises(UserError, match=r"2 ranks cannot hold it in micro-batches of 2: launch a number of processes "
                                        r"that divides 3"):
        plan([], {**env, "WORLD_SIZE": "2"})


@pytest.mark.parametrize("given, named", [
    ("configs/ds_configs/stage3_no_offloading_accelerate.conf", "for what stage3_no_offloading_accelerate.conf does "
     "in open-instruct is .*configs/ds/zero3.json"),
    ("configs/ds_configs/stage3_offloading_accelerate.conf", r"configs/ds/zero3_offload\.json"),
    ("configs/ds_configs/stage2_no_offloading_accelerate.conf", r"configs/ds/zero2\.json"),
    ("configs/ds_configs/stage0_no_offloading_accelerate.conf", "launch without --use_deepspeed"),
    ("ds/my_zero.json", r"open_sft's configs are .*configs/ds/zero2\.json, .*zero3\.json, .*zero3_offload\.json"),
])
def test_a_deepspeed_config_that_is_not_there_names_ours(given, named) -> None:
    """open-instruct's command lines name its configs/ds_configs/ files: the error names the one of ours that does
    the same (they exist), or all of ours."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": given}
    with pytest.raises(UserError, match=f"{given}: cannot read it .*check --deepspeed_config_file; .*{named}") as err:
        plan([], env)
    for path in re.findall(r"(\S*configs/ds/\S+?\.json)", str(err.value)):
        assert os.path.isfile(path), path


def test_trainer_sections_become_our_optimizer_and_schedule(tmp_path) -> None:
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, TRAINER_JSON)}
    result = plan([], env)
    assert "optimizer" not in result.deepspeed_config and "scheduler" not in result.deepspeed_config
    assert result.train.lr_scheduler_type == "linear" and result.train.learning_rate == 2e-5
    assert sum("replaced by open_sft's AdamW" in n for n in result.notes) == 1

    explicit = json.loads(json.dumps(TRAINER_JSON))
    explicit["optimizer"]["params"].update(lr=1e-4, weight_decay=0.1)
    explicit["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_max_lr": 1e-4}}
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, explicit)
    result = plan([], env)
    assert (result.train.learning_rate, result.train.weight_decay, result.train.warmup_steps) == (1e-4, 0.1, 7)
    assert result.train.lr_scheduler_type == "constant_with_warmup"
    # DeepSpeed's WarmupLR without a warmup_type warms up log-shaped: the replacement says the shape changes
    shaped = "its WarmupLR gives no warmup_type, so DeepSpeed would warm up log-shaped (its default), and open_sft's " \
        "warmup rises linearly"
    assert [n for n in result.notes if "replaced by open_sft's AdamW" in n][0].endswith(shaped)
    explicit["scheduler"]["params"]["warmup_type"] = "linear"
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, explicit)
    assert not any(shaped in n for n in plan([], env).notes)
    del explicit["scheduler"]["params"]["warmup_type"]
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, explicit)
    with pytest.raises(UserError, match=r"optimizer.params.lr=0.0001 conflicts with --learning_rate 0.001"):
        plan(["--learning_rate", "1e-3"], env)
    assert plan(["--lr_scheduler_type", "cosine"], env).train.lr_scheduler_type == "cosine"  # a given flag wins

    for section, change, message in (
            ("optimizer", {"type": "Lamb"}, r"optimizer.type='Lamb' is not one open_sft can train with"),
            ("scheduler", {"type": "OneCycle"}, r"scheduler.type='OneCycle'")):
        broken = json.loads(json.dumps(TRAINER_JSON))
        broken[section].update(change)
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, broken)
        with pytest.raises(UserError, match=message):
            plan([], env)


def test_the_jsons_betas_and_eps_are_the_adam_flags(tmp_path) -> None:
    """optimizer.params.betas/eps are --adam_beta1/--adam_beta2/--adam_epsilon (they were refused unless (0.9, 0.999)
    and 1e-8): "auto" takes the flags, a number sets a flag left to its default, and contradicts a given one."""
    config = json.loads(json.dumps(TRAINER_JSON))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, config)}
    auto = plan(["--adam_beta2", "0.95", "--adam_epsilon", "1e-6"], env).train
    assert (auto.adam_beta1, auto.adam_beta2, auto.adam_epsilon) == (0.9, 0.95, 1e-6)
    config["optimizer"]["params"].update(betas=[0.8, 0.95], eps=1e-6)
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, config)
    result = plan([], env)
    assert (result.train.adam_beta1, result.train.adam_beta2, result.train.adam_epsilon) == (0.8, 0.95, 1e-6)
    assert any("(from them: --adam_beta1 0.8, --adam_beta2 0.95, --adam_epsilon 1e-06)" in n for n in result.notes)
    assert plan(["--adam_beta1", "0.8", "--adam_beta2", "0.95"], env).train.adam_beta2 == 0.95  # equal: no conflict
    with pytest.raises(UserError, match=r"ds.json: optimizer.params.betas=\[0.8, 0.95\] conflicts with --adam_beta2 "
                                        r"0.98; set it to \"auto\" in the file or drop the flag"):
        plan(["--adam_beta2", "0.98"], env)
    for betas, message in (([0.9, 1.5], r"betas=\[0.9, 1.5\] cannot be --adam_beta2 \(it must be in \[0, 1\)\)"),
                           (0.9, r"betas=0.9 must be a list of 2 numbers \(adam_beta1, adam_beta2\) or \"auto\""),
                           ([0.9, "x"], r"betas=\[0.9, 'x'\] is not a number \(it sets --adam_beta2\)")):
        config["optimizer"]["params"]["betas"] = betas
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, config)
        with pytest.raises(UserError, match=message):
            plan([], env)


def test_scheduler_steps_in_the_json_conflict_with_the_epochs_or_warmup_ratio_given(tmp_path) -> None:
    """total_num_steps and warmup_num_steps set --max_train_steps and --warmup_steps, which override --num_train_epochs
    and --warmup_ratio: given (command line or run YAML), those are refused beside them, not silently overridden."""
    pinned = json.loads(json.dumps(TRAINER_JSON))
    pinned["scheduler"]["params"].update(total_num_steps=8, warmup_num_steps=2)
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, pinned)}
    result = plan([], env)  # neither flag given: the file's values, said in the one line
    assert (result.train.max_train_steps, result.train.warmup_steps) == (8, 2)
    assert any("--max_train_steps 8, --warmup_steps 2" in note for note in result.notes)
    with pytest.raises(UserError, match=r"ds.json: scheduler.params.total_num_steps=8 would override --num_train_epochs"
                                        r" 3 \(it sets --max_train_steps\); set it to \"auto\" in the file, or drop "
                                        r"--num_train_epochs \(or give --max_train_steps 8 instead\)"):
        plan(["--num_train_epochs", "3"], env)
    with pytest.raises(UserError, match=r"scheduler.params.warmup_num_steps=2 would override --warmup_ratio 0.5"):
        plan(["--warmup_ratio", "0.5", "--max_train_steps", "8"], env)
    (tmp_path / "run.yaml").write_text("warmup_ratio: 0.1\nmax_train_steps: 8\n")
    config = parse_config([str(tmp_path / "run.yaml"), "--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl",
                           "1.0"])
    with pytest.raises(UserError, match=r"warmup_num_steps=2 would override --warmup_ratio 0.1"):
        plan_launch(config.train, config.model, config.explicit, lambda: DtypeChoice(torch.float32, "x"), env)
    # the flag that the value sets, given equal, says the same thing: nothing is overridden
    assert plan(["--num_train_epochs", "3", "--max_train_steps", "8", "--warmup_ratio", "0.5", "--warmup_steps", "2"],
                env).train.max_train_steps == 8


def test_every_conflict_of_the_json_with_the_flags_is_named_at_once(tmp_path) -> None:
    """A DeepSpeed JSON at odds with the command line in several places is refused once, naming each place (it named
    the first only: a user fixed one, relaunched and met the next); one conflict stays one line."""
    config = json.loads(json.dumps(TRAINER_JSON))
    config["optimizer"]["params"].update(lr=1e-4, betas=[0.9, 0.95])
    config["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "cos_min_ratio": 0.1}}
    config.update(gradient_accumulation_steps=4, gradient_clipping=0.3)
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, config)}
    with pytest.raises(ConfigError) as refused:
        plan(["--learning_rate", "1e-3", "--num_train_epochs", "2", "--gradient_accumulation_steps", "2",
              "--clip_grad_norm", "1.0", "--adam_beta2", "0.98"], env)
    where = [problem.split(": ", 1)[1].split(" ", 1)[0] for problem in refused.value.problems]
    assert where == ["optimizer.params.lr=0.0001", "optimizer.params.betas=[0.9,", "scheduler.params.total_num_steps=8",
                     "scheduler.params.cos_min_ratio=0.1", "gradient_accumulation_steps=4", "gradient_clipping=0.3"]
    assert all(problem.startswith("DeepSpeed config ") and "ds.json" in problem for problem in refused.value.problems)
    del config["optimizer"], config["scheduler"], config["gradient_clipping"]
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, config)
    with pytest.raises(UserError) as one:
        plan(["--gradient_accumulation_steps", "2"], env)
    assert not isinstance(one.value, ConfigError)
    assert str(one.value).startswith("DeepSpeed config ") and "gradient_accumulation_steps=4 conflicts with" in str(
        one.value)


@pytest.mark.parametrize("key, ours, value, why", [
    ("cos_min_ratio", 0, 0.5, "open_sft's cosine decays to 0"), ("warmup_type", "linear", "log", "rises linearly"),
    ("warmup_min_ratio", 0.0, 0.1, "warm up from 0")])
def test_scheduler_params_that_change_the_rates_are_refused_not_dropped(tmp_path, key, ours, value, why) -> None:
    """DeepSpeed's WarmupCosineLR floor, log warmup and warmup start have no open_sft flag: another value than ours is
    refused (it used to be dropped, training other rates than the file asks); ours, "auto" or none pass."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true"}
    for accepted in (ours, "auto"):
        config = json.loads(json.dumps(TRAINER_JSON))
        config["scheduler"] = {"type": "WarmupCosineLR", "params": {key: accepted, "warmup_num_steps": 2}}
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, config)
        assert plan([], env).train.lr_scheduler_type == "cosine"
    config["scheduler"]["params"][key] = value
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = write_json(tmp_path, config)
    with pytest.raises(UserError, match=rf"ds.json: scheduler.params.{key}={value!r} cannot be honoured \(.*{why}\); "
                                        r"set it to .* or \"auto\", or remove it"):
        plan([], env)


def test_zero_section_spellings_and_bad_keys(tmp_path) -> None:
    """axolotl's configs write ZeRO-3 settings without the stage3_ prefix (DeepSpeed accepts both): one
    spelling is kept, so the gather-on-save setting open_sft fills is not written twice (DeepSpeed
    then rejects the file); a key DeepSpeed does not know, or both spellings disagreeing, is an error
    naming the file."""
    from open_sft.config.deepspeed_request import load_json

    def write(zero: dict):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
        return str(path)

    zero = load_json(write({"gather_16bit_weights_on_model_save": True, "max_live_parameters": 0,
                            "reduce_bucket_size": "auto"}))["zero_optimization"]
    assert zero == {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, "stage3_max_live_parameters": 0,
                    "reduce_bucket_size": "auto"}
    with pytest.raises(UserError, match=r"ds.json: zero_optimization is not valid for DeepSpeed \(stage3_bogus: "
                                        r"Extra inputs are not permitted\)"):
        load_json(write({"stage3_bogus": 1}))
    with pytest.raises(UserError, match="ds.json: zero_optimization sets both max_reuse_distance=0 and "
                                        "stage3_max_reuse_distance=5; keep one"):
        load_json(write({"max_reuse_distance": 0, "stage3_max_reuse_distance": 5}))


def test_an_auto_that_nothing_fills_is_named_with_the_file(tmp_path) -> None:
    """`"steps_per_print": "auto"` (HF's integration fills no such key either): refused with the file and the key
    when the launch is planned, not as a ValueError when the accelerator starts."""
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": "auto"},
                                 "steps_per_print": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"}})
    with pytest.raises(UserError) as info:
        plan([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path})
    assert str(info.value).startswith(f'DeepSpeed config {path}: "auto" is not a value open_sft fills for '
                                      "zero_optimization.stage3_gather_16bit_weights_on_model_save, steps_per_print; "
                                      "give each a value, or remove the key")
    stage3 = write_json(tmp_path, {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save":
                                                         "auto", "reduce_bucket_size": "auto"}})
    plan([], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": stage3})  # all filled
