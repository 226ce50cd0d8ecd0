"""Command lines of open-instruct's OLMo-core SFT entrypoint (open_instruct/olmo_core_finetune.py, where its
deprecated finetune.py sends users) run here with the same meaning, or stop naming the flag and what to do.

OLMO_CORE_FLAGS is every field of the dataclasses olmo_core_finetune.py parses (open_instruct/olmo_core_utils.py's
ExperimentConfig, ModelConfig, TrainingConfig, DatasetConfig, LoggingConfig, CheckpointConfig and its SFTConfig) at
open-instruct commit e6c3044aa6201c8bfa4573c1b03142af599e730d, extracted by name (its TokenizerConfig is
finetune.py's, tested in test_open_instruct_compat.py).
"""

from __future__ import annotations

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError

OLMO_CORE_FLAGS = (
    "exp_name run_name seed data_loader_seed model_name_or_path config_name attn_implementation loss_implementation "
    "model_revision low_cpu_mem_usage rope_scaling_factor rope_scaling_beta_fast rope_scaling_beta_slow "
    "rope_scaling_old_context_len num_epochs per_device_train_batch_size gradient_accumulation_steps learning_rate "
    "warmup_ratio weight_decay max_grad_norm max_seq_length lr_scheduler_type max_train_steps "
    "activation_memory_budget activation_checkpointing_mode activation_checkpointing_modules compile_model "
    "fused_optimizer cp_degree cp_strategy mixer_list mixer_list_splits transform_fn target_columns cache_mode "
    "local_cache_dir skip_cache cache_dataset_only config_hash hf_entity logging_steps with_tracking wandb_project "
    "wandb_entity report_to wandb_group_name output_dir checkpointing_steps ephemeral_save_interval "
    "keep_last_n_checkpoints resume_from_checkpoint dist_timeout_hours save_async").split()

REFUSED = {"rope_scaling_factor", "rope_scaling_beta_fast", "rope_scaling_beta_slow", "rope_scaling_old_context_len"}

VALUES = {"exp_name": "sft", "run_name": "r", "seed": "123", "data_loader_seed": "34521", "model_name_or_path": "m",
          "config_name": "org/config", "attn_implementation": "torch", "loss_implementation": "fused_linear",
          "model_revision": "main", "num_epochs": "2", "per_device_train_batch_size": "1",
          "gradient_accumulation_steps": "4", "learning_rate": "5e-06", "warmup_ratio": "0.03", "weight_decay": "0.0",
          "max_grad_norm": "1.0", "max_seq_length": "1024", "lr_scheduler_type": "linear", "max_train_steps": "10",
          "activation_memory_budget": "0.5", "activation_checkpointing_mode": "selected_modules",
          "activation_checkpointing_modules": "blocks.*.attention", "cp_degree": "1", "cp_strategy": "ulysses",
          "mixer_list": "d.jsonl 100", "mixer_list_splits": "train",
          "transform_fn": "sft_tulu_tokenize_and_truncate_v1",
          "target_columns": "input_ids labels", "cache_mode": "local", "local_cache_dir": "cache",
          "config_hash": "abc", "hf_entity": "org", "logging_steps": "1", "wandb_project": "p",
          "wandb_entity": "team", "report_to": "tensorboard", "wandb_group_name": "g", "output_dir": "out",
          "checkpointing_steps": "345", "ephemeral_save_interval": "-1", "keep_last_n_checkpoints": "-1",
          "resume_from_checkpoint": "none", "dist_timeout_hours": "2"}
BOOLEANS = {"low_cpu_mem_usage", "compile_model", "fused_optimizer", "skip_cache", "cache_dataset_only",
            "with_tracking", "save_async"}


PACKING = ("OLMo-core SFT packs examples into --max_seq_length sequences, --per_device_train_batch_size of them a "
           "micro-batch: --packing (a micro-batch of at most --max_tokens_per_batch, default "
           "per_device_train_batch_size × max_seq_length, tokens)")
BETAS = "OLMo-core SFT's AdamW has betas (0.9, 0.95): --adam_beta2 0.95"
CHECKPOINTS = ("OLMo-core SFT checkpoints every 250 steps (its --ephemeral_save_interval default): --checkpointing_steps "
               "250, the newest --keep_last_n_checkpoints kept (give --checkpointing_steps to choose)")
OPTIMIZER = ("OLMo-core SFT's AdamW skips a step whose loss or gradient norm spikes (SkipStepAdamW); open_sft's takes "
             "every step (--clip_grad_norm bounds a spike)")


def parse(*args: str):
    return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *args])


def test_the_flag_list_is_olmo_cores() -> None:
    assert len(OLMO_CORE_FLAGS) == len(set(OLMO_CORE_FLAGS)) == 54
    assert set(VALUES) | BOOLEANS | REFUSED == set(OLMO_CORE_FLAGS)


@pytest.mark.parametrize("name", sorted(set(OLMO_CORE_FLAGS) - REFUSED))
def test_every_olmo_core_flag_parses(name) -> None:
    base = ["--model_name_or_path", "m"] + ([] if name == "mixer_list" else ["--dataset_mixer_list", "d.jsonl", "1.0"])
    value = [] if name in BOOLEANS else VALUES[name].split()
    config = parse_config([*base, f"--{name}", *value])
    assert name in config.explicit


def test_the_olmo_core_debug_script_means_the_same() -> None:
    """open-instruct's scripts/train/debug/oc_sft.sh (torchrun ... olmo_core_finetune.py), flags as written."""
    config = parse_config(
        "--model_name_or_path m --max_seq_length 1024 --per_device_train_batch_size 1 --gradient_accumulation_steps 4 "
        "--learning_rate 5e-06 --warmup_ratio 0.03 --num_epochs 2 --ephemeral_save_interval 100 --logging_steps 1 "
        "--mixer_list d.jsonl 100 --seed 123 --compile_model true --with_tracking".split())
    assert (config.train.num_train_epochs, config.data.dataset_mixer_list, config.model.torch_compile) == \
        (2, ["d.jsonl", "100"], True)
    assert {"num_train_epochs", "dataset_mixer_list", "torch_compile"} <= config.explicit
    # its per_device_train_batch_size 1 is one packed 1024-token sequence, not one example
    assert (config.train.packing, config.train.max_tokens_per_batch, config.train.per_device_train_batch_size) == \
        (True, None, 1)  # None: per_device_train_batch_size × max_seq_length = 1024 tokens
    # it checkpoints every 100 steps there (--ephemeral_save_interval 100): so does the same command line here
    assert config.notes == (PACKING, BETAS, "OLMo-core SFT checkpoints every 100 steps (its --ephemeral_save_interval"
                                            "): --checkpointing_steps 100, the newest --keep_last_n_checkpoints kept "
                                            "(give --checkpointing_steps to choose)")
    assert (config.checkpoint.checkpointing_steps, config.checkpoint.keep_last_n_checkpoints) == ("100", 3)
    assert "checkpointing_steps" in config.explicit and "checkpointing_steps" in config.implied
    assert (config.train.adam_beta1, config.train.adam_beta2, config.train.adam_epsilon) == (0.9, 0.95, 1e-8)
    # olmo_core_finetune.py does not clip unless told; open_sft clips at 1.0: said, as the one default left out
    assert config.warnings == (
        OPTIMIZER,
        "OLMo-core SFT flags (--num_epochs, --mixer_list, --compile_model, --ephemeral_save_interval) given, but not "
        "--max_grad_norm: olmo_core_finetune.py's defaults for those are none (no clipping); open_sft's are "
        "--clip_grad_norm 1.0. Give them to train as that command line did there",)


@pytest.mark.parametrize("flags, every, because", [
    ("", "250", "its --ephemeral_save_interval default"),
    ("--ephemeral_save_interval 40", "40", "its --ephemeral_save_interval"),
    ("--ephemeral_save_interval -1", "500", "its --checkpointing_steps default"),  # non-positive: no ephemeral ones
    ("--ephemeral_save_interval 0", "500", "its --checkpointing_steps default"),
    ("--ephemeral_save_interval 800", "500", "its --checkpointing_steps default"),  # the kept ones come first
])
def test_an_olmo_core_command_line_checkpoints_as_it_did_there(flags, every, because) -> None:
    """olmo_core_finetune.py keeps a checkpoint every 500 steps and writes an ephemeral one every 250 (unless told):
    its command line killed after step 250 resumed there. Here the same command line had no checkpoints (ours only
    when preempted), so a kill -9 restarted it from step 0; it checkpoints at the shorter interval now."""
    config = parse_config(f"--model_name_or_path m --mixer_list d.jsonl 1.0 {flags}".split())
    assert config.checkpoint.checkpointing_steps == every
    assert f"OLMo-core SFT checkpoints every {every} steps ({because}): --checkpointing_steps {every}" in "".join(
        config.notes)
    given = parse_config(f"--model_name_or_path m --mixer_list d.jsonl 1.0 {flags} --checkpointing_steps 7".split())
    assert given.checkpoint.checkpointing_steps == "7"  # given and the shorter: it holds
    assert not any("checkpoints every" in note for note in given.notes)
    epoch = parse_config(f"--model_name_or_path m --mixer_list d.jsonl 1.0 {flags} --checkpointing_steps epoch".split())
    assert epoch.checkpoint.checkpointing_steps == "epoch"  # ours, kept
    assert any("--ephemeral_save_interval" in note and "--checkpointing_steps epoch chooses" in note
               for note in epoch.notes) == bool(flags)
    plain = parse_config("--model_name_or_path m --dataset_mixer_list d.jsonl 1.0".split())
    assert plain.checkpoint.checkpointing_steps is None  # finetune.py's command lines: as before


def test_an_ephemeral_interval_under_the_checkpointing_steps_given_checkpoints_between_them() -> None:
    """`--ephemeral_save_interval 100 --checkpointing_steps 1000` checkpoints every 100 steps there; here the given
    --checkpointing_steps 1000 held and the interval was dropped unsaid (a kill at step 900 lost 900 steps, not 100)."""
    for flags, every in (("--ephemeral_save_interval 100 ", "100"), ("", "250")):  # 250: its default interval
        config = parse_config(f"--model_name_or_path m --mixer_list d.jsonl 1.0 {flags}--checkpointing_steps 1000"
                              .split())
        assert config.checkpoint.checkpointing_steps == every
        assert any(note.startswith(f"OLMo-core SFT checkpoints every {every} steps (its --ephemeral_save_interval")
                   and "between those of --checkpointing_steps 1000" in note for note in config.notes), config.notes


def test_the_olmo3_training_script_means_the_same(monkeypatch) -> None:
    """scripts/train/debug/oc_sft_olmo3_7b_1node.sh's train job, less --rope_scaling_factor (refused, below) and
    --config_name olmo3_7B (OLMo-core's name for the architecture)."""
    from open_sft.config import checks

    monkeypatch.setattr(checks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checks.torch.cuda, "get_device_capability", lambda *a: (9, 0))  # an H100
    monkeypatch.setattr(checks, "_installed", lambda package: True)
    config = parse_config(
        "--model_name_or_path m --tokenizer_name_or_path tok --max_seq_length 32768 --per_device_train_batch_size 1 "
        "--gradient_accumulation_steps 4 --learning_rate 8e-5 --warmup_ratio 0.03 --weight_decay 0.0 "
        "--max_grad_norm 1.0 --num_epochs 1 --activation_checkpointing_mode selected_modules --attn_implementation "
        "flash_2 --compile_model true --checkpointing_steps 345 --ephemeral_save_interval -1 --keep_last_n_checkpoints "
        "-1 --with_tracking --logging_steps 1 --mixer_list d.jsonl 1.0 --local_cache_dir /cache --seed 33333 "
        "--data_loader_seed 34521 --output_dir out".split())
    assert (config.train.clip_grad_norm, config.train.num_train_epochs, config.model.gradient_checkpointing,
            config.model.attn_implementation, config.model.torch_compile, config.data.dataset_local_cache_dir,
            config.checkpoint.checkpointing_steps, config.checkpoint.keep_last_n_checkpoints) == \
        (1.0, 1, True, "flash_attention_2", True, "/cache", "345", -1)
    assert config.warnings == (OPTIMIZER,)  # every default that differs was given
    assert config.train.packing and config.notes[:2] == (PACKING, BETAS) and config.train.adam_beta2 == 0.95
    assert "--data_loader_seed (the data order follows --seed)" in config.notes[-1]


@pytest.mark.parametrize("args, check", [
    (["--attn_implementation", "torch"], lambda c: c.model.attn_implementation == "sdpa"),
    (["--attn_implementation", "flash_3"], lambda c: c.model.attn_implementation == "auto"),
    (["--attn_implementation", "flash-3"], lambda c: c.model.attn_implementation == "auto"),  # open-instruct's docs
    (["--attn_implementation", "te"], lambda c: c.model.attn_implementation == "sdpa"),
    (["--dist_timeout_hours", "0.5"], lambda c: c.train.timeout == 1800),
    (["--max_grad_norm", "0.5"], lambda c: c.train.clip_grad_norm == 0.5),
    (["--compile_model", "false"], lambda c: c.model.torch_compile is False),
    (["--wandb_project", "p"], lambda c: c.train.wandb_project_name == "p"),
    (["--mixer_list_splits", "test"], lambda c: c.data.dataset_mixer_list_splits == ["test"]),
    (["--skip_cache"], lambda c: c.data.dataset_skip_cache),
    (["--transform_fn", "last_turn_tulu_tokenize_and_truncate_v1", "sft_tulu_filter_v1"],
     lambda c: c.data.train_on == "last_assistant"),
    (["--activation_memory_budget", "1.0"], lambda c: c.model.gradient_checkpointing is False),
    (["--activation_memory_budget", "0.5"], lambda c: c.model.gradient_checkpointing is True),
    (["--num_epochs", "3", "--learning_rate", "8e-5", "--max_seq_length", "4096", "--max_grad_norm", "1"],
     lambda c: c.warnings == (OPTIMIZER,) and c.notes == (PACKING, BETAS, CHECKPOINTS)),
    (["--num_epochs", "1", "--packing", "false", "--adam_beta2", "0.98"],
     lambda c: (c.train.packing, c.train.adam_beta2, c.notes) == (False, 0.98, (CHECKPOINTS,))),  # given flags win
    (["--num_epochs", "1", "--adam_beta2", "0.999"], lambda c: c.train.adam_beta2 == 0.999 and BETAS not in c.notes),
    (["--num_epochs", "1"], lambda c: c.train.adam_beta2 == 0.95 and "adam_beta2" in c.explicit),
    (["--cache_mode", "local"], lambda c: c.warnings[1:] == (
        "OLMo-core SFT flags (--cache_mode) given, but not --num_epochs, --learning_rate, --max_seq_length, "
        "--max_grad_norm: olmo_core_finetune.py's defaults for those are 3, 8e-05, 4096, none (no clipping); "
        "open_sft's are --num_train_epochs 2, --learning_rate 2e-05, --max_seq_length 2048, --clip_grad_norm 1.0. "
        "Give them to train as that command line did there",)),
])
def test_olmo_core_flags_mean_what_they_mean(args, check) -> None:
    assert check(parse(*args))


@pytest.mark.parametrize("args, message", [
    (["--rope_scaling_factor", "8"], "--rope_scaling_factor: open_sft does not apply OLMo-core's YaRN RoPE scaling"),
    (["--rope_scaling_old_context_len", "8192"], "--rope_scaling_old_context_len: open_sft does not apply"),
    (["--num_epochs", "2", "--num_train_epochs", "3"], "--num_epochs 2 contradicts --num_train_epochs 3"),
    (["--max_grad_norm", "1.0", "--clip_grad_norm", "-1"], "--max_grad_norm 1.0 contradicts --clip_grad_norm -1"),
    (["--transform_fn", "sft_tokenize_v1", "--dataset_transform_fn", "sft_tulu_tokenize_and_truncate_v1"],
     "--transform_fn sft_tokenize_v1 contradicts --dataset_transform_fn sft_tulu_tokenize_and_truncate_v1"),
    (["--activation_checkpointing_mode", "full"], "--activation_checkpointing_mode 'full': expected budget or "
                                                  "selected_modules"),
    (["--config_name", "olmo3_7B", "--num_epochs", "1"], "--config_name olmo3_7B: in olmo_core_finetune.py's "
                                                         "command line this is OLMo-core's name for the architecture"),
    (["--cp_degree", "0"], "--cp_degree 0: give the number of ranks that share a sequence"),
])
def test_olmo_core_values_open_sft_cannot_honour_are_errors(args, message) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        parse(*args)


def test_what_the_olmo3_script_asks_and_open_sft_cannot_do_is_said_at_once() -> None:
    """oc_sft_olmo3_7b_1node.sh's --config_name olmo3_7B, --rope_scaling_factor 8 and --chat_template_name olmo123:
    three problems in one error, each with what to do."""
    with pytest.raises(ConfigError) as refused:
        parse("--config_name", "olmo3_7B", "--rope_scaling_factor", "8", "--chat_template_name", "olmo123",
              "--num_epochs", "1")
    assert [p.split(":")[0].split(";")[0] for p in refused.value.problems] == \
        ["--config_name olmo3_7B", "--rope_scaling_factor", "--chat_template_name 'olmo123' is not a built-in template"]


def test_a_command_line_without_olmo_core_flags_is_as_before() -> None:
    config = parse("--num_train_epochs", "3", "--config_name", "gpt2")  # a Hub id without an org is still one
    assert config.notes == () and config.warnings == () and config.train.num_train_epochs == 3
    assert (config.train.adam_beta1, config.train.adam_beta2) == (0.9, 0.999)  # finetune.py's: torch's defaults
    assert parse("--attn_implementation", "torch").train.adam_beta2 == 0.999  # a name both read: no OLMo-core line


def test_olmo_core_keys_in_a_yaml_config(tmp_path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: m\nmixer_list: [d.jsonl, '1.0']\nnum_epochs: 1\nmax_grad_norm: -1\n"
                    "transform_fn: [sft_tulu_tokenize_and_truncate_v1, sft_tulu_filter_v1]\n")
    config = parse_config([str(path), "--learning_rate", "8e-5", "--max_seq_length", "4096"])
    assert (config.data.dataset_mixer_list, config.train.num_train_epochs, config.train.clip_grad_norm,
            config.data.train_on, config.train.packing) == (["d.jsonl", "1.0"], 1, -1.0, "all_assistant", True)
    assert config.warnings == (OPTIMIZER,)


def test_a_deepspeed_jsons_betas_against_the_olmo_core_lines_beta2_say_where_it_came_from(tiny_model_dir, tmp_path,
                                                                                       monkeypatch) -> None:
    """An OLMo-core command line sets --adam_beta2 0.95 (its AdamW's), as it sets --packing; a Trainer-style
    DeepSpeed JSON with betas [0.9, 0.999] is refused beside it, as beside a typed --adam_beta2 0.95, but the
    error said "drop the flag" of a flag the user never gave. It now says where 0.95 came from and the two ways
    on, each of which plans; a typed flag keeps its own message."""
    import json

    from open_sft.run import plan_launch

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {
        "type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999], "eps": "auto", "weight_decay": "auto"}}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_json))

    def planned(*flags: str):
        return plan_launch(parse_config(["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list",
                                         "d.jsonl", "1.0", "--output_dir", str(tmp_path / "out"), *flags]))

    with pytest.raises(UserError) as refused:
        planned("--num_epochs", "1")
    assert str(refused.value) == (
        f"DeepSpeed config {ds_json}: optimizer.params.betas=[0.9, 0.999] conflicts with --adam_beta2 0.95, which "
        "the OLMo-core command line sets (olmo_core_finetune.py's AdamW has betas (0.9, 0.95)), no --adam_beta2 "
        "given; pass --adam_beta2 0.999 to train with the file's value, or set it to \"auto\" in the file")
    assert planned("--num_epochs", "1", "--adam_beta2", "0.999").launch.train.adam_beta2 == 0.999
    with pytest.raises(UserError, match=r"conflicts with --adam_beta2 0.95; set it to \"auto\" in the file or drop "
                                        r"the flag$"):
        planned("--adam_beta2", "0.95")
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {
        "type": "AdamW", "params": {"betas": "auto"}}}))
    assert planned("--num_epochs", "1").launch.train.adam_beta2 == 0.95
