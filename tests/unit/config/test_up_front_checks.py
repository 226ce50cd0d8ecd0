"""Problems found with the flags, before any data is tokenized or a model loaded: an --output_dir that cannot be
a directory, W&B without credentials where nobody can be asked for them, a Hub push while HF_HUB_OFFLINE is set."""

from __future__ import annotations

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError
from open_sft.monitor.tracking import wandb_login_problem

BASE = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0"]


def test_an_output_dir_that_is_a_file_or_lies_under_one_is_refused(tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"--output_dir .*afile: it is a file, not a directory; give a directory"):
        parse_config(BASE + ["--output_dir", str(tmp_path / "afile")])
    with pytest.raises(ConfigError, match=r"--output_dir .*afile/sub/run: it lies under .*afile, which is a file"):
        parse_config(BASE + ["--output_dir", str(tmp_path / "afile" / "sub" / "run")])
    assert parse_config(BASE + ["--output_dir", str(tmp_path / "new" / "run")])  # created when the run starts
    assert not (tmp_path / "new").exists()
    # --cache_dataset_only and --dry_run write nothing there
    assert parse_config(BASE + ["--output_dir", str(tmp_path / "afile"), "--cache_dataset_only"])


def test_wandb_without_credentials_and_no_terminal_is_refused_with_the_ways_out(tmp_path) -> None:
    problem = wandb_login_problem({}, interactive=False, home=tmp_path)
    assert "no W&B API key for api.wandb.ai" in problem
    assert "wandb login" in problem and "WANDB_MODE=offline" in problem and "--report_to tensorboard" in problem
    # each place W&B finds a key, an offline mode, or a terminal to prompt on lets it start
    assert wandb_login_problem({"WANDB_API_KEY": "k"}, interactive=False, home=tmp_path) is None
    assert wandb_login_problem({"WANDB_MODE": "offline"}, interactive=False, home=tmp_path) is None
    assert wandb_login_problem({"WANDB_MODE": "disabled"}, interactive=False, home=tmp_path) is None
    assert wandb_login_problem({}, interactive=True, home=tmp_path) is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_login_problem({}, interactive=False, home=tmp_path) is None
    # a key for another W&B server is not one for this server
    assert "no W&B API key for wandb.example.org" in wandb_login_problem(
        {"WANDB_BASE_URL": "https://wandb.example.org"}, interactive=False, home=tmp_path)
    settings = tmp_path / "cfg" / "settings"
    settings.parent.mkdir()
    settings.write_text("[default]\napi_key = k\n")
    assert wandb_login_problem({"WANDB_BASE_URL": "https://wandb.example.org", "WANDB_CONFIG_DIR": str(settings.parent)},
                               interactive=False, home=tmp_path) is None


def test_the_flags_only_ask_for_w_and_b_credentials_when_w_and_b_tracks(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_CONFIG_DIR", "WANDB_BASE_URL", "WANDB_DISABLED",
                 "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    out = ["--output_dir", str(tmp_path / "o")]
    for report_to in (["wandb"], ["all"], ["tensorboard", "wandb"]):
        with pytest.raises(ConfigError, match="--report_to wandb: no W&B API key"):
            parse_config(BASE + out + ["--with_tracking", "--report_to", *report_to])
    assert parse_config(BASE + out + ["--with_tracking", "--report_to", "tensorboard"])
    assert parse_config(BASE + out + ["--report_to", "wandb"])  # no --with_tracking: no tracker starts
    with pytest.raises(ConfigError, match="--report_to wandb: no W&B API key"):  # a dry run shows the refusal
        parse_config(BASE + out + ["--with_tracking", "--report_to", "wandb", "--dry_run"])
    assert parse_config(BASE + out + ["--with_tracking", "--report_to", "wandb", "--cache_dataset_only"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert parse_config(BASE + out + ["--with_tracking", "--report_to", "wandb"])


def test_a_push_with_hf_hub_offline_set_is_refused_before_training(tmp_path, monkeypatch) -> None:
    push = BASE + ["--output_dir", str(tmp_path / "o"), "--push_to_hub", "--hub_model_id", "me/m"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="--push_to_hub cannot upload with HF_HUB_OFFLINE set: unset it"):
        parse_config(push)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert parse_config(push).hub.push_to_hub


def test_a_chat_template_file_that_is_not_valid_jinja_is_refused_with_its_line(tmp_path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"--chat_template_path .*bad.jinja line 2: unexpected '}'; fix the template"):
        parse_config(BASE + ["--output_dir", str(tmp_path / "o"), "--chat_template_path", str(bad)])
    good = tmp_path / "good.jinja"  # transformers' own filters and globals are not needed to parse it
    good.write_text("{% for m in messages %}{{ m | tojson }}{% if m.role == 'x' %}{{ raise_exception('no') }}"
                    "{% endif %}{% endfor %}")
    assert parse_config(BASE + ["--output_dir", str(tmp_path / "o"), "--chat_template_path", str(good)])


def test_a_chat_template_file_that_renders_no_conversation_is_refused_up_front(tmp_path) -> None:
    """A data file given as --chat_template_path parses as Jinja (no tags) and rendered as itself: the error came
    from the first conversation, as a template that is 'not prefix-stable'."""
    from open_sft.data.chat.templates import BUILTIN_TEMPLATES, conversation_render_problem

    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE + ["--output_dir", str(tmp_path / "o"), "--chat_template_path", str(data)])
    assert refused.value.problems == [
        f"--chat_template_path {data}: not a chat template: it does not write a conversation's assistant reply (the "
        "file begins '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'); give a Jinja chat template file"]
    failing = tmp_path / "failing.jinja"
    failing.write_text("{{ raise_exception('only system messages') }}")
    with pytest.raises(ConfigError, match=r"failing.jinja: cannot render a conversation of a user message and an "
                                          r"assistant reply \(TemplateError: only system messages\)"):
        parse_config(BASE + ["--output_dir", str(tmp_path / "o"), "--chat_template_path", str(failing)])
    assert not [name for name, template in BUILTIN_TEMPLATES.items() if conversation_render_problem(template.source)]


@pytest.mark.parametrize("amount, expected", [
    ("0", "--dataset_mixer_list: amount 0 for a.jsonl must be a finite number above 0 (a fraction like 1.0 or a row "
          "count like 500); leave out a source you want none of"),
    ("-1", "--dataset_mixer_list: amount -1 for a.jsonl must be a finite number above 0"),
    ("0.0", "--dataset_mixer_list: amount 0.0 for a.jsonl must be a finite number above 0"),
    ("1.0e999", "--dataset_mixer_list: amount 1.0e999 for a.jsonl must be a finite number above 0"),
    ("50%", "--dataset_mixer_list: amount '50%' for a.jsonl is not a number; a percentage is written as a fraction: "
            "0.5"),
    ("200%", "--dataset_mixer_list: amount '200%' for a.jsonl is not a number; a percentage is written as a "
             "fraction: 2.0"),
    ("1e3", "--dataset_mixer_list: amount '1e3' for a.jsonl is not a number; a row count is a whole number written "
            "out, 1000 (an amount with a '.' is a fraction)"),
    ("all", "--dataset_mixer_list: amount 'all' for a.jsonl is not a number; use a fraction like 1.0 or a row count "
            "like 500"),
])
def test_a_mixer_amount_that_is_no_positive_number_is_said_with_the_other_flags_problems(amount, expected) -> None:
    """Said with the flags' problems (before, the data phase said it alone, after the model's dtype probe)."""
    with pytest.raises(ConfigError) as raised:
        parse_config(["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", amount,
                      "--learning_rate", "inf"])
    assert any(problem.startswith(expected) for problem in raised.value.problems), raised.value.problems
    assert any(problem.startswith("--learning_rate") for problem in raised.value.problems)


def test_an_evaluation_amount_is_named_by_its_own_flag_and_shares_keep_their_own_check() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(BASE + ["--eval_dataset_mixer_list", "b.jsonl", "-5"])
    assert raised.value.problems == ["--eval_dataset_mixer_list: amount -5 for b.jsonl must be a finite number above "
                                     "0 (a fraction like 1.0 or a row count like 500); leave out a source you want "
                                     "none of"]
    with pytest.raises(ConfigError) as raised:  # one problem for a share of 0, the share check's
        parse_config(["--model_name_or_path", "org/model", "--dataset_mixer_unit", "share", "--dataset_mixer_list",
                      "a.jsonl", "0"])
    assert [p.split(" must")[0] for p in raised.value.problems] == ["--dataset_mixer_list: share 0 for a.jsonl"]
    assert parse_config(BASE + ["--eval_dataset_mixer_list", "b.jsonl", "20"]).data.eval_dataset_mixer_list == [
        "b.jsonl", "20"]


def test_auto_micro_batch_size_is_refused_where_the_micro_batch_split_changes_the_loss() -> None:
    """Under --loss_normalization mean (open-instruct's --reduce_loss mean) each micro-batch's mean counts, and the
    router's load-balancing loss is computed per micro-batch: another split is another run
    (tests/unit/training/test_loss_normalization.py measures it), so the flag that chooses the split is refused."""
    auto = ["--auto_micro_batch_size", "--per_device_train_batch_size", "8"]
    with pytest.raises(ConfigError) as error:
        parse_config(BASE + auto + ["--reduce_loss", "mean"])
    assert ("--auto_micro_batch_size with --loss_normalization mean: under mean each micro-batch's own mean counts"
            in str(error.value))
    assert "set --per_device_train_batch_size and --gradient_accumulation_steps yourself" in str(error.value)
    assert "or use --loss_normalization token" in str(error.value)
    with pytest.raises(ConfigError, match=r"--auto_micro_batch_size with --load_balancing_loss: the router's "
                                          r"load-balancing loss is computed over each micro-batch's routing.*drop "
                                          r"--load_balancing_loss"):
        parse_config(BASE + auto + ["--load_balancing_loss"])
    for fine in (["--loss_normalization", "token"], ["--loss_normalization", "sum"], ["--no_load_balancing_loss"]):
        assert parse_config(BASE + auto + fine).train.auto_micro_batch_size
    assert parse_config(BASE + ["--loss_normalization", "mean", "--load_balancing_loss"]).train.load_balancing_loss
