"""open-instruct users' command lines and train configs run unchanged.

OPEN_INSTRUCT_FLAGS is every field of open-instruct's FlatArguments (open_instruct/finetune.py) and
TokenizerConfig (open_instruct/dataset_transformation.py) at commit e6c3044aa6201c8bfa4573c1b03142af599e730d,
extracted by name, plus the fields of older versions that are still pasted (add_seed_and_date_to_exp_name,
overwrite_output_dir, reduce_loss, run_name, train_file, use_flash_attn).

The tests of this subject that launch real processes are in tests/integration/test_open_instruct_compat.py.
"""

from __future__ import annotations

import re

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError


FLAT_ARGUMENTS = (
    "exp_name do_not_randomize_output_dir model_name_or_path config_name model_revision additional_model_arguments "
    "low_cpu_mem_usage dataset_name dataset_mixer dataset_mixer_list dataset_mixer_list_splits dataset_transform_fn "
    "dataset_target_columns dataset_cache_mode dataset_local_cache_dir dataset_config_hash dataset_skip_cache "
    "dataset_mix_dir dataset_config_name max_train_samples preprocessing_num_workers max_seq_length overwrite_cache "
    "clip_grad_norm gradient_accumulation_steps learning_rate logging_steps lora_rank lora_alpha lora_dropout "
    "lr_scheduler_type num_train_epochs output_dir per_device_train_batch_size use_lora use_qlora use_8bit_optimizer "
    "warmup_ratio final_lr_ratio weight_decay timeout resume_from_checkpoint report_to save_to_hub "
    "gradient_checkpointing use_liger_kernel max_train_steps seed checkpointing_steps keep_last_n_checkpoints "
    "fused_optimizer load_balancing_loss load_balancing_weight clean_checkpoints_at_end with_tracking "
    "wandb_project_name wandb_entity push_to_hub hf_entity hf_repo_id hf_repo_revision hf_repo_url "
    "try_launch_beaker_eval_jobs hf_metadata_dataset cache_dataset_only try_auto_save_to_beaker gs_bucket_path "
    "oe_eval_tasks oe_eval_max_length sync_each_batch packing verbose sequence_parallel_size").split()


TOKENIZER_CONFIG = ("tokenizer_name_or_path tokenizer_revision trust_remote_code use_fast chat_template_name add_bos "
                    "get_tokenizer_fn tokenizer_files_hash use_slow_tokenizer tokenizer_name ground_truths_key "
                    "sft_messages_key").split()


OLDER = "add_seed_and_date_to_exp_name overwrite_output_dir reduce_loss run_name train_file use_flash_attn".split()


OPEN_INSTRUCT_FLAGS = sorted(set(FLAT_ARGUMENTS + TOKENIZER_CONFIG + OLDER))


VALUES = {
    "exp_name": ["tulu3_8b_sft"], "model_name_or_path": ["org/model"], "push_to_hub": ["true", "--hub_model_id", "o/m"],
    "config_name": ["org/model"], "model_revision": ["main"],
    "additional_model_arguments": ['{"rope_theta": 500000}'], "dataset_name": ["data.jsonl"],
    "dataset_mixer": ['{"data.jsonl": 1.0}'], "dataset_mixer_list": ["data.jsonl", "1.0"],
    "dataset_mixer_list_splits": ["train"], "dataset_transform_fn": ["sft_tulu_tokenize_and_truncate_v1",
                                                                      "sft_tulu_filter_v1"],
    "dataset_target_columns": ["input_ids", "attention_mask", "labels"], "dataset_cache_mode": ["local"],
    "dataset_local_cache_dir": ["cache"], "dataset_config_hash": ["abc"], "dataset_mix_dir": ["out"],
    "dataset_config_name": ["default"], "max_train_samples": ["100"], "preprocessing_num_workers": ["4"],
    "max_seq_length": ["4096"], "clip_grad_norm": ["-1"], "gradient_accumulation_steps": ["2"],
    "learning_rate": ["5e-06"], "logging_steps": ["1"], "lora_rank": ["8"], "lora_alpha": ["16"],
    "lora_dropout": ["0.05"], "lr_scheduler_type": ["linear"], "num_train_epochs": ["2"], "output_dir": ["out"],
    "per_device_train_batch_size": ["1"], "warmup_ratio": ["0.03"], "final_lr_ratio": ["0.1"],
    "weight_decay": ["0.0"], "timeout": ["3600"], "resume_from_checkpoint": ["none"], "report_to": ["wandb"],
    "save_to_hub": ["org/model"], "max_train_steps": ["10"], "seed": ["123"], "checkpointing_steps": ["epoch"],
    "keep_last_n_checkpoints": ["-1"], "load_balancing_weight": ["0.5"], "wandb_project_name": ["proj"],
    "wandb_entity": ["team"], "hf_entity": ["org"], "hf_repo_id": ["model"], "hf_repo_revision": ["rev"],
    "hf_repo_url": ["https://example.invalid/org/model"], "hf_metadata_dataset": ["allenai/tulu-3-evals"],
    "gs_bucket_path": ["gs://bucket"], "oe_eval_tasks": ["mmlu:mc::tulu", "gsm8k::tulu"],
    "oe_eval_max_length": ["4096"], "sequence_parallel_size": ["1"], "tokenizer_name_or_path": ["org/model"],
    "tokenizer_revision": ["main"], "chat_template_name": ["tulu"], "get_tokenizer_fn": ["get_tokenizer_tulu_v2_2"],
    "tokenizer_files_hash": ["abc"], "tokenizer_name": ["org/model"], "ground_truths_key": ["ground_truth"],
    "sft_messages_key": ["conversation"], "reduce_loss": ["sum"], "run_name": ["tulu"], "train_file": ["data.jsonl"],
}


DATA_FLAGS = {"dataset_name", "dataset_mixer", "dataset_mixer_list", "train_file"}


def flag_args(name: str) -> list[str]:
    base = ["--model_name_or_path", "org/model"]
    if name not in DATA_FLAGS:
        base += ["--dataset_mixer_list", "data.jsonl", "1.0"]
    return base + [f"--{name}", *VALUES.get(name, [])]


def test_the_flag_list_is_open_instructs() -> None:
    assert len(FLAT_ARGUMENTS) == 73 and len(TOKENIZER_CONFIG) == 12 and len(OPEN_INSTRUCT_FLAGS) == 91


@pytest.fixture(autouse=True)
def online_services(monkeypatch) -> None:
    """--push_to_hub and --report_to wandb parse as on a machine with the Hub in reach and a W&B login (without
    them they are refused up front, which tests/unit/config/test_up_front_checks.py checks)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("WANDB_API_KEY", "test-key")


@pytest.fixture
def gpu_machine(monkeypatch) -> None:
    """A CUDA machine (an H100: flash-attn 2 needs Ampere or later) with flash-attn and liger-kernel installed (what
    --use_flash_attn and --use_liger_kernel need; on a CPU they are refused up front, which test_model_options
    checks)."""
    from open_sft.config import checks

    monkeypatch.setattr(checks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checks.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(checks, "_installed", lambda package: True)


@pytest.mark.parametrize("name", OPEN_INSTRUCT_FLAGS)
def test_every_open_instruct_flag_parses(name, gpu_machine) -> None:
    config = parse_config(flag_args(name))
    assert name in config.explicit or name in {"tokenizer_name", "use_flash_attn", "reduce_loss", "run_name",
                                                "train_file", "dataset_name", "dataset_mixer", "hf_entity",
                                                "hf_repo_id", "hf_repo_revision", "dataset_transform_fn",
                                                "dataset_target_columns"} | DATA_FLAGS


@pytest.mark.parametrize("args, check", [
    (["--tokenizer_name", "tok"], lambda c: c.model.tokenizer_name_or_path == "tok"),
    (["--chat_template", "tulu"], lambda c: c.data.chat_template_name == "tulu"),
    (["--report_to", "wandb", "tensorboard"], lambda c: c.train.report_to == ["wandb", "tensorboard"]),
    (["--report_to", "all"], lambda c: c.train.report_to == ["all"]),
    (["--use_flash_attn"], lambda c: c.model.attn_implementation == "flash_attention_2"),
    (["--reduce_loss", "mean"], lambda c: c.train.loss_normalization == "mean"),
    (["--reduce_loss", "sum"], lambda c: c.train.loss_normalization == "sum"),
    (["--run_name", "r"], lambda c: c.train.exp_name == "r"),
    (["--hf_entity", "org", "--hf_repo_id", "m", "--hf_repo_revision", "v1", "--push_to_hub"],
     lambda c: (c.hub.hub_model_id, c.hub.hub_revision, c.hub.push_to_hub) == ("org/m", "v1", True)),
    (["--exp_name", "run7", "--push_to_hub", "--hub_model_id", "o/m"], lambda c: c.hub.hub_revision == "run7"),
    (["--exp_name", "run7"], lambda c: c.hub.hub_revision == "main" and c.train.output_dir == "output/"),
    (["--no_push_to_hub"], lambda c: c.hub.push_to_hub is False),
    # HfArgumentParser's --no_X of open-instruct's flags that are on by default there (off here)
    (["--clean_checkpoints_at_end", "--no_clean_checkpoints_at_end"],
     lambda c: c.checkpoint.clean_checkpoints_at_end is False and "clean_checkpoints_at_end" in c.explicit),
    (["--no_gradient_checkpointing"], lambda c: c.model.gradient_checkpointing is False),
    (["--no_verbose", "--no_add_seed_and_date_to_exp_name"], lambda c: "--verbose" in c.notes[0]),
    # false was open-instruct's eager attention: sdpa computes it; an explicit choice stays
    (["--use_flash_attn", "false"], lambda c: c.model.attn_implementation == "sdpa"),
    (["--no_use_flash_attn"], lambda c: c.model.attn_implementation == "sdpa"),
    (["--use_flash_attn", "False", "--attn_implementation", "eager"], lambda c: c.model.attn_implementation == "eager"),
    ([], lambda c: c.model.attn_implementation == "auto"),
    (["--dataset_transform_fn", "last_turn_tulu_tokenize_and_truncate_v1", "sft_tulu_filter_v1"],
     lambda c: c.data.train_on == "last_assistant"),
    (["--dataset_transform_fn", "sft_tokenize_v1"], lambda c: c.data.train_on == "all"),
    (["--keep_last_n_checkpoints", "-1"], lambda c: c.checkpoint.keep_last_n_checkpoints == -1),
    (["--lr_scheduler_type", "cosine_with_restarts"], lambda c: c.train.lr_scheduler_type == "cosine_with_restarts"),
    (["--tokenizer_revision", "v2"], lambda c: c.model.tokenizer_revision == "v2"),
    (["--no_try_launch_beaker_eval_jobs", "--use_slow_tokenizer", "--max_train_samples", "5"],
     lambda c: c.notes == ("open-instruct flags accepted and ignored: --max_train_samples (as open-instruct does "
                           "(use an amount in --dataset_mixer_list)); --try_launch_beaker_eval_jobs (AI2's Beaker); "
                           "--use_slow_tokenizer (as open-instruct does)",) and c.warnings == ()),
    (["--load_balancing_loss", "--load_balancing_weight", "0.5"],  # the router loss trains; the weight, as in
     lambda c: c.train.load_balancing_loss and c.warnings == ()  # open-instruct, is the model's coefficient
     and "--load_balancing_weight (as open-instruct does (its loss weighs the router loss" in c.notes[0]),
])
def test_open_instruct_flags_mean_what_they_mean(args, check, gpu_machine) -> None:
    assert check(parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *args]))


def test_flash_attention_off_and_on_at_once_is_refused() -> None:
    with pytest.raises(UserError, match="--use_flash_attn false contradicts --attn_implementation flash_attention_2"):
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--use_flash_attn",
                      "false", "--attn_implementation", "flash_attention_2"])


def test_data_flags_of_open_instruct() -> None:
    assert parse_config(["--model_name_or_path", "m", "--dataset_name", "org/data"]).data.dataset_mixer_list == \
        ["org/data", "1.0"]
    assert parse_config(["--model_name_or_path", "m", "--train_file", "a.jsonl"]).data.dataset_mixer_list == \
        ["a.jsonl", "1.0"]
    mixed = parse_config(["--model_name_or_path", "m", "--dataset_mixer", '{"a.jsonl": 0.5, "b.jsonl": 300}'])
    assert mixed.data.dataset_mixer_list == ["a.jsonl", "0.5", "b.jsonl", "300"]
    # as open-instruct read the mapping: up to 1 a fraction (an integer 1 is every row), above 1 int() rows
    mixed = parse_config(["--model_name_or_path", "m", "--dataset_mixer", '{"a.jsonl": 1, "b.jsonl": 2.5, "c": 1e3}'])
    assert mixed.data.dataset_mixer_list == ["a.jsonl", "1.0", "b.jsonl", "2", "c", "1000"]
    with pytest.raises(UserError, match="--dataset_mixer: the amount of a.jsonl is 'all'"):
        parse_config(["--model_name_or_path", "m", "--dataset_mixer", '{"a.jsonl": "all"}'])
    with pytest.raises(UserError, match="--dataset_name and --dataset_mixer_list both name the training data"):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "x", "--dataset_mixer_list", "a.jsonl", "1.0"])


@pytest.mark.parametrize("args, message", [
    (["--sequence_parallel_size", "0"], "--sequence_parallel_size must be at least 1, got 0"),
    (["--final_lr_ratio", "0.1", "--lr_scheduler_type", "cosine"], "--final_lr_ratio applies to --lr_scheduler_type "
                                                                   "linear, not cosine"),
    (["--report_to", "wandb", "none"], "'all' and 'none' stand alone"),
    (["--report_to", "comet_ml"], "--report_to comet_ml: give one or more of tensorboard, wandb"),
    (["--additional_model_arguments", "[1, 2]"], "--additional_model_arguments '[1, 2]': give a JSON object"),
    (["--keep_last_n_checkpoints", "0"], "--keep_last_n_checkpoints must be at least 1, or -1 to keep all"),
    # open-instruct silently trains with the tokenizer's own template for a name it lacks (olmo123 in its OLMo 3
    # scripts, on purpose); here the name is refused, and the message says how to get that template
    (["--chat_template_name", "olmo123"], "or leave the flag out for the tokenizer's own template (which "
                                          "open-instruct trains with for a name it does not know"),
])
def test_open_instruct_values_open_sft_cannot_honour_are_errors(args, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", *args])


def test_a_train_config_of_open_instruct_loads(tmp_path) -> None:
    """The shape of open-instruct's configs/train_configs/tulu3/tulu3_sft.yaml, model and data swapped."""
    path = tmp_path / "tulu3_sft.yaml"
    path.write_text(
        "model_name_or_path: org/model\nmodel_revision: main\ntokenizer_name: org/model\nuse_slow_tokenizer: true\n"
        "dataset_mixer:\n    data.jsonl: 1.0\n    more.jsonl: 500\npreprocessing_num_workers: 128\n"
        "per_device_train_batch_size: 1 # note, this is set up for 8 GPUs\ngradient_accumulation_steps: 2\n"
        "learning_rate: 5.0e-06 # best LR so far\nmax_seq_length: 4096\nlr_scheduler_type: linear\nwarmup_ratio: 0.03\n"
        "weight_decay: 0.0\nnum_train_epochs: 2\noutput_dir: output/sft_8b\nwith_tracking: true\nreport_to:\n"
        "  - wandb\nlogging_steps: 1\ncheckpointing_steps: epoch\ndataset_mix_dir: output/sft_8b\nadd_bos: true\n"
        "keep_last_n_checkpoints: 1\nreduce_loss: sum\n")
    config = parse_config([str(path), "--learning_rate", "1e-5"])
    assert config.data.dataset_mixer_list == ["data.jsonl", "1.0", "more.jsonl", "500"]
    assert config.model.tokenizer_name_or_path == "org/model" and config.train.report_to == ["wandb"]
    assert config.train.learning_rate == 1e-5 and config.data.add_bos and config.train.loss_normalization == "sum"
    assert "--dataset_mix_dir" in config.notes[0] and "--use_slow_tokenizer" in config.notes[0]


def test_nulls_of_open_instructs_dumped_arguments_are_the_defaults(tmp_path) -> None:
    """open-instruct writes its unset settings as null in a dump of its arguments: each is left to our default (it
    was a traceback: '<' not supported between NoneType and int)."""
    path = tmp_path / "dumped.yaml"
    path.write_text("model_name_or_path: m\ndataset_mixer_list: [a.jsonl, 1.0]\nmax_seq_length: null\n"
                    "logging_steps: null\nresume_from_checkpoint: null\nreport_to: null\nhf_entity: null\n"
                    "dataset_mixer: null\nlearning_rate: 2.0e-05\n")
    config = parse_config([str(path)])
    defaults = parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0"])
    assert (config.data.max_seq_length, config.train.logging_steps, config.checkpoint.resume_from_checkpoint,
            config.train.report_to) == (defaults.data.max_seq_length, defaults.train.logging_steps,
                                        defaults.checkpoint.resume_from_checkpoint, defaults.train.report_to)
    assert "max_seq_length" not in config.explicit and "learning_rate" in config.explicit


def test_after_a_yaml_config_a_list_flags_comma_value_is_the_list_as_open_instruct_reads_it(tmp_path) -> None:
    """open-instruct's parser reads `--name=a,b` after a YAML config as [a, b] for list flags (one value "a,b" to
    argparse); other flags' commas and the spaced form stay as written."""
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: m\ndataset_mixer_list: [a.jsonl, 1.0, b.jsonl, 1.0]\nuse_lora: true\n")
    config = parse_config([str(path), "--dataset_mixer_list_splits=train,test", "--report_to=tensorboard,wandb",
                           "--exp_name=a,b", "--lora_target_modules", "q_proj,v_proj"])
    assert config.data.dataset_mixer_list_splits == ["train", "test"]
    assert config.train.report_to == ["tensorboard", "wandb"]
    assert config.train.exp_name == "a,b" and config.lora.lora_target_modules == ["q_proj,v_proj"]


def test_yaml_values_are_read_as_the_flags_types(tmp_path) -> None:
    """YAML reads `checkpointing_steps: 1000` as an int and `learning_rate: 5e-06` (no dot) as a string."""
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: m\ndataset_mixer_list: [a.jsonl, 1.0, b.jsonl, 100]\ncheckpointing_steps: 1000\n"
                    "learning_rate: 5e-06\nuse_slow_tokenizer: 'False'\nreport_to: tensorboard\n")
    config = parse_config([str(path)])
    assert config.checkpoint.checkpointing_steps == "1000" and config.train.learning_rate == 5e-06
    assert config.data.dataset_mixer_list == ["a.jsonl", "1.0", "b.jsonl", "100"]
    assert config.train.report_to == ["tensorboard"]
    path.write_text("model_name_or_path: m\nlearning_rate: fast\n")
    with pytest.raises(UserError, match=r"run.yaml: learning_rate: 'fast' is not a valid value"):
        parse_config([str(path)])


def test_schedules_of_open_instruct() -> None:
    from open_sft.training.optim import lr_multiplier, schedule_floor

    total, warmup = 100, 10
    for step in range(total):  # one cycle of "cosine_with_restarts" is cosine, as open-instruct runs it
        assert lr_multiplier("cosine_with_restarts", step, warmup, total) == lr_multiplier("cosine", step, warmup, total)
    floor = schedule_floor("linear", 2e-5, 0.1)
    ends = [lr_multiplier("linear", s, warmup, total, floor=floor) for s in (warmup, total - 1)]
    assert ends[0] == pytest.approx(1.0) and ends[1] == pytest.approx(0.1 + 0.9 / 90)
    poly = schedule_floor("polynomial", 2e-5, None)
    assert poly == pytest.approx(1e-7 / 2e-5)
    assert lr_multiplier("polynomial", total, warmup, total, floor=poly) == pytest.approx(poly)
