"""Argument parsing: flags, a YAML file with flag overrides, and up-front validation."""

from __future__ import annotations

import re

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError

BASE = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]


def test_flags_and_defaults() -> None:
    config = parse_config(BASE + ["--per_device_train_batch_size", "2", "--gradient_checkpointing"])
    assert config.model.model_name_or_path == "org/model"
    assert config.data.dataset_mixer_list == ["a.jsonl", "1.0"]
    assert config.train.per_device_train_batch_size == 2
    assert config.model.gradient_checkpointing is True
    # Contract defaults.
    assert config.train.learning_rate == 2e-5
    assert config.train.num_train_epochs == 2
    assert config.train.warmup_ratio == 0.03
    assert config.train.loss_normalization == "token"
    assert config.data.max_seq_length == 2048
    assert config.train.seed == 42
    assert config.train.clip_grad_norm == 1.0
    assert config.data.preprocessing_num_workers is None  # one per usable core
    assert parse_config(BASE + ["--preprocessing_num_workers", "3"]).data.preprocessing_num_workers == 3


def test_yaml_then_flags_override(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model_name_or_path: org/model\n"
        "dataset_mixer_list: [a.jsonl, '0.5', b.jsonl, '100']\n"
        "learning_rate: 1.0e-4\n"
        "per_device_train_batch_size: 4\n"
    )
    config = parse_config([str(path), "--learning_rate", "3e-4"])
    assert config.train.learning_rate == 3e-4  # flag wins
    assert config.train.per_device_train_batch_size == 4  # from YAML
    assert config.data.dataset_mixer_list == ["a.jsonl", "0.5", "b.jsonl", "100"]


def test_yaml_unknown_key_is_named(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: x\nlearning_rat: 1.0\n")
    with pytest.raises(UserError, match="unknown setting\\(s\\) learning_rat"):
        parse_config([str(path)])


def test_all_problems_reported_at_once(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", str(tmp_path / "missing"), "--dataset_mixer_list", "a.jsonl",
                      "--learning_rate", "-1", "--truncation", "cut", "--per_device_train_batch_size", "0",
                      "--preprocessing_num_workers", "0"])
    text = str(info.value)
    assert "missing: no such directory; check the path" in text
    assert "NAME AMOUNT pairs" in text
    assert "--learning_rate must be positive" in text
    assert "--truncation 'cut' is not one of truncate, drop" in text
    assert "--per_device_train_batch_size must be at least 1" in text
    assert "--preprocessing_num_workers 0: give 1 or more processes, or leave it unset" in text
    assert len(info.value.problems) == 6


@pytest.mark.parametrize(("flag", "values", "named"), [
    ("--dataset_mixer_list", ["a.jsonl"], "a.jsonl"),
    ("--dataset_mixer_list", ["a.jsonl", "0.5", "b.json"], "b.json"),
    ("--dataset_mixer_list", ["a.jsonl", "b.json", "300"], "a.jsonl"),
    ("--eval_dataset_mixer_list", ["dev.jsonl"], "dev.jsonl"),
])
def test_a_name_without_its_amount_is_named_with_the_fix(flag, values, named) -> None:
    """A mixer list of an odd number of values names the source that no amount follows and how to write one."""
    args = ["--model_name_or_path", "m", "--output_dir", "out"] + (
        [] if flag == "--dataset_mixer_list" else ["--dataset_mixer_list", "a.jsonl", "1.0"])
    with pytest.raises(ConfigError) as info:
        parse_config(args + [flag, *values])
    expected = (f"{flag} takes NAME AMOUNT pairs; got {len(values)} value(s) ({' '.join(values)}): {named} has no "
                f"AMOUNT after it; give one, e.g. {flag} {named} 1.0 for all its rows")
    assert expected in info.value.problems


def test_a_missing_deepspeed_config_is_said_with_the_flags_problems(tmp_path, monkeypatch) -> None:
    """open-instruct's command line, its DeepSpeed config path and all: the missing file is one of the problems
    said at once (it was said alone, after the flags' were fixed), naming our config that does the same."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/ds_configs/stage3_no_offloading_accelerate.conf")
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", str(tmp_path / "missing"), "--dataset_mixer_list", "a.jsonl", "1.0",
                      "--learning_rate", "-1"])
    assert len(info.value.problems) == 3 and "--learning_rate must be positive" in str(info.value)
    assert ("--deepspeed_config_file configs/ds_configs/stage3_no_offloading_accelerate.conf: no such file; "
            "open_sft's config for what stage3_no_offloading_accelerate.conf does in open-instruct is ") in str(info.value)
    assert str(info.value).split("does in open-instruct is ")[1].split()[0].endswith("configs/ds/zero3.json")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # the variable left from another launch: not read
    with pytest.raises(ConfigError) as info:
        parse_config(["--model_name_or_path", str(tmp_path / "missing"), "--dataset_mixer_list", "a.jsonl", "1.0"])
    assert len(info.value.problems) == 1


def test_cache_dataset_only_with_dataset_skip_cache_is_refused(tmp_path) -> None:
    """The pair tokenized, kept nothing, printed "None" as the cache path (the contract's last line) and exited 0."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="--cache_dataset_only builds the cache, which --dataset_skip_cache skips"):
        parse_config(["--model_name_or_path", str(tmp_path), "--dataset_mixer_list", str(data), "1.0",
                      "--cache_dataset_only", "--dataset_skip_cache"])


def test_example_configs_parse(tmp_path) -> None:
    """Every shipped example YAML is valid (paths overridden, since they point at built artefacts)."""
    from conftest import ROOT

    examples = sorted((ROOT / "configs" / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        config = parse_config([str(path), "--model_name_or_path", "org/model"])
        assert config.data.dataset_mixer_list and config.train.output_dir


def test_help_lists_the_choices_written_once_on_the_fields() -> None:
    """Each choice flag's values come from its field's Literal type: --help shows them, the checks use them."""
    from open_sft.config.checks import CHOICES
    from open_sft.config.parse import _make_parser

    text = " ".join(_make_parser().format_help().split())
    assert len(CHOICES) >= 9
    for name, values in CHOICES.items():
        assert f"--{name} {{{','.join(values)}}}" in text, name


def test_a_negated_flag_says_what_it_does_and_still_turns_its_flag_off() -> None:
    """--no_hub_private's help read "Create the Hub repository as private. (default: False)"."""
    from open_sft.config.parse import _make_parser

    text = " ".join(_make_parser().format_help().split())
    for flag, says in (("hub_private", "Create the Hub repository as private."),
                       ("fused_optimizer", "Use the fused AdamW kernel")):
        spelled = f"--no_{flag}, --no-{flag.replace('_', '-')} "
        after = text[text.index(spelled) + len(spelled):]
        assert after.startswith(f"Turn --{flag} off (it is on by default): --{flag} means: {says}"), after[:200]
        assert "(default: False)" not in after[:after.index(" --")]
    base = ["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0"]
    assert parse_config(base).hub.hub_private is True and parse_config(base).train.fused_optimizer is True
    assert parse_config(base + ["--no_hub_private", "--no_fused_optimizer"]).hub.hub_private is False
    assert parse_config(base + ["--no_fused_optimizer"]).train.fused_optimizer is False


def test_eval_sources_have_their_own_splits_checked_up_front(tmp_path) -> None:
    """Three eval sources beside two training ones with a split each once ended in an IndexError mid-run."""
    from open_sft.data.sources import parse_mixer_list

    base = ["--model_name_or_path", str(tmp_path), "--dataset_mixer_list", "a.jsonl", "1.0", "b.jsonl", "1.0",
            "--dataset_mixer_list_splits", "train", "train",
            "--eval_dataset_mixer_list", "a.jsonl", "10", "b.jsonl", "10", "org/c", "10"]
    data = parse_config(base).data
    assert [s.split for s in parse_mixer_list(data.eval_dataset_mixer_list, data.eval_dataset_mixer_list_splits)] \
        == ["train"] * 3
    data = parse_config(base + ["--eval_dataset_mixer_list_splits", "train", "train", "test"]).data
    assert [s.split for s in parse_mixer_list(data.eval_dataset_mixer_list, data.eval_dataset_mixer_list_splits)] \
        == ["train", "train", "test"]
    with pytest.raises(ConfigError) as info:
        parse_config(base + ["--eval_dataset_mixer_list_splits", "train", "test", "--per_device_eval_batch_size", "0"])
    assert info.value.problems == [
        "--eval_dataset_mixer_list_splits has 2 values; give one for all evaluation sources or one per source (3)",
        "--per_device_eval_batch_size must be at least 1, got 0"]


@pytest.mark.parametrize("flag, hint", [
    ("--deepspeed", "DeepSpeed is the launcher's: accelerate launch --use_deepspeed --deepspeed_config_file"),
    ("--save_steps", "use --checkpointing_steps N"), ("--save_total_limit", "use --keep_last_n_checkpoints"),
    ("--bf16", "use --torch_dtype bfloat16"), ("--mixed-precision", "use --torch_dtype"),
    ("--sequence_len", "use --max_seq_length"), ("--micro_batch_size", "use --per_device_train_batch_size"),
    ("--dataset_train_split", "use --dataset_mixer_list_splits"),
    ("--dataset_test_split", "use --eval_dataset_mixer_list NAME AMOUNT with --eval_dataset_mixer_list_splits"),
    # `deepspeed finetune.py` and torch.distributed.launch add it to every rank's command line
    # a plain multi-GPU launch needs no DeepSpeed; ZeRO is the addition, not the way to launch
    ("--local_rank", "passed by the `deepspeed` launcher or torch.distributed.launch; launch with accelerate: "
                     "accelerate launch --num_processes N finetune.py ... (for DeepSpeed ZeRO add --use_deepspeed "
                     "--deepspeed_config_file configs/ds/zero2.json))"),
    ("--local-rank", "passed by the `deepspeed` launcher or torch.distributed.launch; launch with accelerate:")])
def test_flags_of_other_trainers_name_open_sfts_own(flag, hint, tmp_path) -> None:
    """HF Trainer / TRL / axolotl flags get open_sft's way to say the same, not difflib's nearest name (--save_steps
    used to suggest --save_dtype, --deepspeed --seed, TRL's --dataset_train_split --dataset_mixer_list), as flags
    and as run-YAML keys."""
    with pytest.raises(UserError, match=f"unknown flag {flag} \\({re.escape(hint)}"):
        parse_config(BASE + [flag, "1"])
    key = flag.lstrip("-").replace("-", "_")
    (tmp_path / "run.yaml").write_text(f"{key}: 1\n")
    with pytest.raises(UserError, match=f"unknown setting\\(s\\) {key} \\({re.escape(hint)}"):
        parse_config([str(tmp_path / "run.yaml")] + BASE)


@pytest.mark.parametrize("given, said", [
    ("--learn", "--learn (flags are not shortened: did you mean --learning_rate?)"),  # either spelling: one flag
    ("--learning-r", "--learning-r (flags are not shortened: did you mean --learning_rate?)"),
    ("--loss", "--loss (flags are not shortened: did you mean --loss_normalization or --loss_implementation?)"),
    ("--config", "--config (a run config is a YAML file given first: python finetune.py run.yaml --flag value ...; "
                 "flags are not shortened: did you mean --config_name or --config_hash?)"),
    ("--lr", "--lr (for the learning rate, use --learning_rate; flags are not shortened: did you mean "
             "--lr_scheduler_type?)"),
    ("--learning_rat3", "--learning_rat3 (did you mean --learning_rate?)"),
])
def test_a_flag_given_shortened_is_unknown_naming_the_flags_it_begins(given, said) -> None:
    """Flags are read whole: a prefix named one flag until a flag was added (the OLMo-core flags made --config and
    --loss ambiguous: argparse's "could match" error), or named another than meant (`--lr 1e-4` was read as
    --lr_scheduler_type). Now one unknown-flag error naming the flags it begins; whole flags read as before."""
    with pytest.raises(UserError) as refused:
        parse_config(BASE + [given, "1"])
    assert str(refused.value) == f"unknown flag {said}; see python finetune.py --help"
    config = parse_config(BASE + ["--learning_rate", "3e-4", "--learning-rate=4e-4", "--config_name", "c"])
    assert config.train.learning_rate == 4e-4 and config.model.config_name == "c"


@pytest.mark.parametrize("args, said", [
    (["--add_tokens", "def", "self", "return"], "self return (after --add_tokens, which takes one value)"),
    (["--gradient_checkpointing", "true", "false"], "false (after --gradient_checkpointing, which takes at most one"),
])
def test_stray_values_name_the_flag_they_followed(args, said) -> None:
    """`--add_tokens def self return` (the flag takes a file) said only that values must follow a flag."""
    with pytest.raises(UserError, match=re.escape(f"unexpected argument(s) {said}")):
        parse_config(BASE + args)


def test_chat_template_kwargs_from_a_flag_or_a_yaml_mapping_and_bad_ones_named(tmp_path) -> None:
    """--chat_template_kwargs is a JSON object on the command line and a mapping in YAML; it reaches the render
    step as sorted JSON with --reasoning_loss, and anything else is an error that says what to give."""
    from open_sft.data.chat.render import DEFAULT_OPTIONS, ChatOptions, chat_options

    config = parse_config(BASE + ["--chat_template_kwargs", '{"enable_thinking": false, "a": 1}',
                                  "--reasoning_loss", "mask"])
    assert chat_options(config.data) == ChatOptions('{"a": 1, "enable_thinking": false}', "mask")
    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: org/model\ndataset_mixer_list: [a.jsonl, '1.0']\n"
                    "chat_template_kwargs:\n  enable_thinking: false\n")
    assert chat_options(parse_config([str(path)]).data) == ChatOptions('{"enable_thinking": false}', "train")
    assert chat_options(parse_config(BASE).data) == DEFAULT_OPTIONS
    for value, message in [("{enable_thinking: false}", "--chat_template_kwargs '{enable_thinking: false}' is not JSON"),
                           ("[1]", "--chat_template_kwargs '[1]': give a JSON object of template variables"),
                           ('{"tools": []}', "--chat_template_kwargs sets tools: apply_chat_template's own arguments"),
                           # transformers 5.25's own argument: taken as the argument, every row refused at render
                           ('{"sanitize_control_tokens": true}',
                            "--chat_template_kwargs sets sanitize_control_tokens: apply_chat_template's own")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(BASE + ["--chat_template_kwargs", value])
    with pytest.raises(ConfigError, match="reasoning_loss"):
        parse_config(BASE + ["--reasoning_loss", "skip"])


def test_per_source_chat_template_kwargs_are_counted_and_checked(tmp_path) -> None:
    """--dataset_mixer_list_chat_template_kwargs: one for all sources or one per source, each a JSON object; the
    YAML mixer's mapping entries fill it, and a malformed entry is named."""
    two = ["--model_name_or_path", "m", "--dataset_mixer_list", "a.jsonl", "1.0", "b.jsonl", "1.0"]
    assert parse_config(two + ["--dataset_mixer_list_chat_template_kwargs", "{}", '{"enable_thinking": false}']
                        ).data.dataset_mixer_list_chat_template_kwargs == ["{}", '{"enable_thinking": false}']
    with pytest.raises(ConfigError, match=re.escape("--dataset_mixer_list_chat_template_kwargs has 3 values; give one "
                                                    "for all sources or one per source (2)")):
        parse_config(two + ["--dataset_mixer_list_chat_template_kwargs", "{}", "{}", "{}"])
    with pytest.raises(ConfigError, match=re.escape("--dataset_mixer_list_chat_template_kwargs '[]': give a JSON")):
        parse_config(two + ["--dataset_mixer_list_chat_template_kwargs", "[]"])
    path = tmp_path / "mix.yaml"
    path.write_text("model_name_or_path: m\ndataset_mixer_list:\n  - a.jsonl\n  - 0.5\n"
                    "  - {name: b.jsonl, amount: 100, chat_template_kwargs: {enable_thinking: false}}\n")
    data = parse_config([str(path)]).data
    assert (data.dataset_mixer_list, data.dataset_mixer_list_chat_template_kwargs) == (
        ["a.jsonl", "0.5", "b.jsonl", "100"], ["{}", '{"enable_thinking": false}'])
    path.write_text("model_name_or_path: m\ndataset_mixer_list:\n  - {name: b.jsonl, weight: 1}\n")
    with pytest.raises(UserError, match="dataset_mixer_list entry .*: give a mapping of name, amount and"):
        parse_config([str(path)])
