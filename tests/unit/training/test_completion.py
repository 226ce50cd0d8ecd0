"""The completion record of a run (open_sft.training.completion), in process: which launches stop at it, what it
lists, what a damaged export says, and --overwrite_output_dir's place among the flags. A real relaunch of a
finished run (bytes compared, 2 ranks) is in tests/integration/test_completion.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from open_sft.config.parse import parse_config
from open_sft.errors import ConfigError, UserError
from open_sft.training import completion

BASE = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0"]


def finished_run(output_dir) -> None:
    """A finished run's files, its bookkeeping, and the record written last."""
    (output_dir / "checkpoints" / "step_4").mkdir(parents=True)
    (output_dir / "checkpoints" / "step_4" / "COMPLETE").write_text("{}")
    (output_dir / "report").mkdir()
    for name, text in {"config.json": "{}", "model.safetensors": "x" * 100, "metrics.jsonl": "{}\n",
                       "report/summary.md": "# r\n", ".open_sft.lock": "{}", "data_order.rank0.json": "{}"}.items():
        (output_dir / name).write_text(text)
    completion.mark_complete(output_dir, 4, 12.5)


def test_the_record_lists_the_export_not_the_bookkeeping(tmp_path) -> None:
    finished_run(tmp_path)
    record = json.loads((tmp_path / "RUN_COMPLETE").read_text())
    assert record["step"] == 4 and record["elapsed_s"] == 12.5 and re.match(r"\d{4}-\d\d-\d\dT", record["finished_at"])
    assert record["files"] == {"config.json": 2, "metrics.jsonl": 3, "model.safetensors": 100, "report/summary.md": 4}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_relaunch_with_auto_stops_at_a_finished_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # --push_to_hub is refused up front under HF_HUB_OFFLINE
    finished_run(tmp_path)
    message = completion.already_complete(parse_config(BASE + ["--output_dir", str(tmp_path)]))
    assert message.startswith(f"already complete: {tmp_path} (trained to step 4, finished at ")
    assert "pass --overwrite_output_dir" in message and "open_sft push" not in message
    pushing = parse_config(BASE + ["--output_dir", str(tmp_path), "--push_to_hub", "--hub_model_id", "o/m"])
    assert "nothing to train; its export is not on the Hub at o/m (main) yet: uploading it" in \
        completion.already_complete(pushing)
    completion.mark_pushed(tmp_path, "o/m", "main", "http://hub/o/m/commit/1")
    assert "its export was uploaded to http://hub/o/m/commit/1" in completion.already_complete(pushing)


@pytest.mark.parametrize("extra", [["--overwrite_output_dir"], ["--resume_from_checkpoint", "none"],
                                   ["--resume_from_checkpoint", "ckpt"], ["--dry_run"], ["--cache_dataset_only"]])
def test_launches_that_train_on_purpose_or_write_nothing_do_not_stop(tmp_path, extra, monkeypatch) -> None:
    finished_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    Path("ckpt").mkdir()  # a named checkpoint must exist (refused with the other settings otherwise)
    config = parse_config(BASE + ["--output_dir", str(tmp_path), *extra])
    assert completion.already_complete(config) is None
    assert completion.resume_setting(config) == ("none" if extra == ["--overwrite_output_dir"] else
                                                 config.checkpoint.resume_from_checkpoint)


def test_no_record_no_stop_and_training_removes_the_record(tmp_path) -> None:
    config = parse_config(BASE + ["--output_dir", str(tmp_path)])
    assert completion.already_complete(config) is None  # an unfinished or fresh directory
    finished_run(tmp_path)
    completion.clear_marker(tmp_path)  # what the train phase does once its resume point is settled
    assert completion.already_complete(config) is None and not (tmp_path / "RUN_COMPLETE").exists()


def test_a_finished_run_whose_export_lost_files_says_so(tmp_path) -> None:
    finished_run(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UserError, match=re.escape(
            f"--output_dir {tmp_path}: the run there completed ({tmp_path / 'RUN_COMPLETE'}) but its export lacks "
            "model.safetensors; restore the files, or pass --overwrite_output_dir to train again from scratch")):
        completion.already_complete(parse_config(BASE + ["--output_dir", str(tmp_path)]))


def test_overwrite_output_dir_is_open_sfts_flag_and_refuses_a_named_checkpoint() -> None:
    config = parse_config(BASE + ["--overwrite_output_dir"])
    assert config.checkpoint.overwrite_output_dir and not config.notes  # a flag of its own, no longer ignored
    assert parse_config(BASE + ["--overwrite_output_dir", "--resume_from_checkpoint", "none"]).checkpoint
    with pytest.raises(ConfigError, match=re.escape(
            "--overwrite_output_dir starts over from step 0 but --resume_from_checkpoint out/checkpoints/step_4 "
            "continues that checkpoint; give one of the two")):
        parse_config(BASE + ["--overwrite_output_dir", "--resume_from_checkpoint", "out/checkpoints/step_4"])


def test_a_relaunch_with_other_settings_is_refused_naming_each(tmp_path) -> None:
    launched = parse_config(BASE + ["--output_dir", str(tmp_path), "--learning_rate", "1e-5"])
    finished_run(tmp_path)
    completion.mark_complete(tmp_path, 4, 12.5, launched)
    last = tmp_path / "checkpoints" / "step_4"  # a usable checkpoint: its manifest and trainer state
    (last / "COMPLETE").write_text(json.dumps({"files": {}}))
    (last / "trainer_state.json").write_text(json.dumps({"step": 4}))
    other = parse_config(["--model_name_or_path", "other", "--dataset_mixer_list", "d.jsonl", "1.0",
                          "--output_dir", str(tmp_path), "--learning_rate", "1e-4"])
    with pytest.raises(UserError) as refused:
        completion.already_complete(other)
    assert "--learning_rate: 1e-05 then, 0.0001 now" in str(refused.value)
    assert "--model_name_or_path: 'm' then, 'other' now" in str(refused.value)
    assert "--overwrite_output_dir" in str(refused.value) and "RUN_COMPLETE" not in str(refused.value)
    assert str(refused.value).endswith(  # the way to train on (hunt_b: more epochs were refused without it)
        f"; or, to train on from its last checkpoint with these settings (more epochs or steps, another learning "
        f"rate: the steps after it train with them, recorded), --resume_from_checkpoint {last} "
        "--allow_changed_settings")
    # what changes neither the weights nor the export may differ: the relaunch stops at the finished run
    same = parse_config(BASE + ["--output_dir", str(tmp_path), "--learning_rate", "1e-5", "--logging_steps", "1",
                                "--report_to", "none", "--checkpointing_steps", "2", "--preprocessing_num_workers",
                                "1", "--dataset_local_cache_dir", str(tmp_path / "c")])
    assert completion.already_complete(same).startswith(f"already complete: {tmp_path}")


def test_a_requeue_on_other_ranks_is_complete_when_its_accumulation_keeps_the_global_batch(tmp_path,
                                                                                            monkeypatch) -> None:
    """Trained on 2 ranks × accumulation 2, resumed and finished on 1 rank with --gradient_accumulation_steps 4 (the
    same global batch of micro-batch 2 × 8): the original 2-rank command, requeued, was refused ('4 then, 2 now');
    it is the run's command (a resume compares the accumulation so too). Another global batch is still refused; the
    recorded accumulation itself stops on any ranks (a resume would fit it to them)."""
    def command(accumulation: str):
        return parse_config(BASE + ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "2",
                                    "--gradient_accumulation_steps", accumulation])

    finished_run(tmp_path)
    last_leg = command("4")
    completion.mark_complete(tmp_path, 4, 12.5, last_leg, batch=completion.trained_batch(last_leg.train, 1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert completion.already_complete(command("2")).startswith(f"already complete: {tmp_path}")
    for world, accumulation in (("2", "3"), ("1", "2")):
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(UserError, match=rf"--gradient_accumulation_steps: 4 then, {accumulation} now"):
            completion.already_complete(command(accumulation))
    assert completion.already_complete(command("4")).startswith("already complete")


def test_a_record_written_before_settings_were_kept_stops_as_before(tmp_path) -> None:
    finished_run(tmp_path)  # no settings in the record
    relaunch = parse_config(BASE + ["--output_dir", str(tmp_path), "--learning_rate", "1e-4"])
    assert completion.already_complete(relaunch).startswith("already complete")


def test_a_checkpoint_past_the_schedule_is_refused_with_the_ways_on(tmp_path) -> None:
    """Resumed from step 12 under --max_train_steps 9, the step-12 model was exported as a 9-step run."""
    from open_sft.training.checkpoint import ResumePoint

    past = ResumePoint(tmp_path / "checkpoints" / "step_12", {"step": 12})
    with pytest.raises(UserError, match=r"is at step 12, past the end of this run's schedule \(9 optimizer steps\): "
                                        r"raise --max_train_steps to 12"):
        completion.refuse_past_schedule(past, 9)
    completion.refuse_past_schedule(past, 12)  # at the end: resumed there, exported
    completion.refuse_past_schedule(None, 9)


def test_the_record_is_written_before_the_checkpoints_are_cleaned(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A stop while --clean_checkpoints_at_end deletes (minutes for a large model) left no record and no checkpoint:
    the same command trained the run again from step 0. The record comes first now (the clean-up fails here)."""
    from conftest import SAMPLE
    from open_sft import run

    def interrupted(output_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr("open_sft.export.hub_checkpoints.remove_all", interrupted)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "8",
            "--max_train_steps", "2", "--checkpointing_steps", "1", "--clean_checkpoints_at_end",
            "--torch_dtype", "float32",
            "--per_device_train_batch_size", "4", "--max_seq_length", "128", "--report_to", "none",
            "--output_dir", str(out), "--dataset_local_cache_dir", str(tmp_path / "cache")]
    assert run.main(argv) == 130
    assert json.loads((out / "RUN_COMPLETE").read_text())["step"] == 2
    assert run.main(argv) == 0 and not (out / "metrics.jsonl").read_text().count('"step": 3')


@pytest.mark.parametrize("module, function", [("open_sft.export.final", "write_model_card"),
                                              ("open_sft.monitor.run_info", "write_audit_files")])
def test_sigterm_while_exporting_finishes_the_export_first(tiny_model_dir, tmp_path, monkeypatch, capfd, module,
                                                           function) -> None:
    """SIGTERM after the last step, while the export was written, exited 75 promising a resume 'from the newest
    complete checkpoint': without --checkpointing_steps there was none, and the relaunch trained from step 1. The
    export (the trained model is only in memory) is finished first now: the run completes, and says so. So is a
    SIGTERM between the loop's end and the export (the audit files written there)."""
    import importlib
    import os
    import signal

    from conftest import SAMPLE
    from open_sft import run

    where = importlib.import_module(module)
    written = getattr(where, function)

    def signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return written(*args)

    monkeypatch.setattr(where, function, signalled)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--dataset_mixer_list", str(SAMPLE), "8",
            "--max_train_steps", "2", "--torch_dtype", "float32", "--per_device_train_batch_size", "4",
            "--max_seq_length", "128", "--report_to", "none", "--output_dir", str(out), "--dataset_local_cache_dir",
            str(tmp_path / "cache")]
    assert run.main(argv) == 0
    assert "SIGTERM received after the last step: finished the export first" in "".join(capfd.readouterr())
    assert json.loads((out / "RUN_COMPLETE").read_text())["step"] == 2 and (out / "README.md").is_file()


def test_sigterm_outside_the_training_loop_stops_with_75_and_says_what_to_do(tmp_path, monkeypatch, capsys) -> None:
    """Loading data or the model, or exporting, a SIGTERM ended the process with 143 and no word: a scheduler that
    requeues on 75 did not requeue. The handler is put back when main returns."""
    import os
    import signal

    from open_sft import run

    before = signal.getsignal(signal.SIGTERM)

    def loading(config):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal stops the run before this line")

    monkeypatch.setattr(run, "run", loading)
    monkeypatch.chdir(tmp_path)  # BASE's data file: the command line's parse names a missing one
    (tmp_path / "d.jsonl").write_text("{}\n")
    assert run.main(BASE) == 75
    assert "stopped by SIGTERM outside the training loop" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_dropped_before_the_loop_is_taken_up_by_the_loop(caplog) -> None:
    """A SIGTERM while loading whose handler ran inside a weakref callback (or a __del__): Python prints "Exception
    ignored" and goes on, so the run trained to its end and exited 0, the scheduler's stop lost (seen on 2 ranks
    under ZeRO-2: the raise landed in a WeakKeyDictionary's callback). The training loop's stop request now starts
    requested, so the run stops after its first step with a checkpoint, every rank agreeing, and exits 75."""
    import gc
    import os
    import signal
    import weakref

    from open_sft.training.preemption import StopRequest, stop_outside_training

    restore = stop_outside_training()
    try:
        class Held:
            pass

        held = Held()
        ref = weakref.ref(held, lambda _: os.kill(os.getpid(), signal.SIGTERM))  # the handler raises in here
        del held
        gc.collect()
        assert ref() is None
        stop = StopRequest().install()
        try:
            assert stop.requested and stop.signal_name == "SIGTERM"
        finally:
            stop.uninstall()
    finally:
        restore()
    assert "SIGTERM came before training and was lost where it landed" in caplog.text
    fresh = StopRequest().install()  # a later run in this process does not inherit it
    fresh.uninstall()
    assert not fresh.requested


def resume_point(tmp_path, step: int, history=None, config=None):
    from open_sft.training.checkpoint import ResumePoint

    saved = {**(config or {}), **({completion.SETTINGS_KEY: history} if history is not None else {})}
    return ResumePoint(tmp_path / "checkpoints" / f"step_{step}", {"step": step, "config": saved})


def launch(tmp_path, *flags: str):
    return parse_config(BASE + ["--output_dir", str(tmp_path), "--max_train_steps", "60", *flags])


def test_a_resume_with_changed_settings_is_refused_naming_each_and_the_ways_on(tmp_path) -> None:
    """Relaunched with another --learning_rate after a stop at step 29, a run warned one line and trained on."""
    first = launch(tmp_path, "--learning_rate", "3e-3")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), is_main=True)
    assert history == [{"from_step": 1, "settings": completion.settings(first)}]
    other = launch(tmp_path, "--learning_rate", "1e-3", "--warmup_ratio", "0.1")
    with pytest.raises(UserError) as refused:
        completion.check_resume_point(resume_point(tmp_path, 29, history), 60, other, other.to_dict(), True)
    message = str(refused.value)
    assert f"cannot resume from {tmp_path / 'checkpoints' / 'step_29'} (step 29) with settings other" in message
    assert "  - --learning_rate: 0.003 in the checkpoint, 0.001 now\n  - --warmup_ratio: 0.03 in the checkpoint, " \
           "0.1 now\n" in message
    assert "--allow_changed_settings" in message and "--resume_from_checkpoint none" in message
    # what alters neither the weights nor the export is free to change, the flag itself included
    free = launch(tmp_path, "--learning_rate", "3e-3", "--logging_steps", "1", "--checkpointing_steps", "5",
                  "--allow_changed_settings", "--max_memory_per_rank_gib", "70")  # another GPU: auto's split
    assert completion.check_resume_point(resume_point(tmp_path, 29, history), 60, free, free.to_dict(), True) \
        == history


def test_a_requeue_after_running_out_of_memory_may_add_gradient_checkpointing(tmp_path) -> None:
    """A run that ran out of memory at step 29, requeued with --gradient_checkpointing, was refused as a changed
    setting; the recomputation trains the same numbers (a run with it logs the same losses and grad norms as one
    without, LoRA dropout included), so it is free to change, both ways, and no range records it."""
    first = launch(tmp_path, "--learning_rate", "3e-3")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), is_main=True)
    assert "gradient_checkpointing" not in history[0]["settings"]
    requeued = launch(tmp_path, "--learning_rate", "3e-3", "--gradient_checkpointing")
    assert completion.check_resume_point(resume_point(tmp_path, 29, history), 60, requeued, requeued.to_dict(),
                                         True) == history
    older = [{"from_step": 1, "settings": {**history[0]["settings"], "gradient_checkpointing": True}}]
    assert completion.check_resume_point(resume_point(tmp_path, 29, older), 60, first, first.to_dict(),
                                         True) == older  # a checkpoint that recorded it


def test_a_requeue_on_a_node_mounting_the_data_elsewhere_resumes(tmp_path) -> None:
    """The data's cache key holds the sources, the tokenizer's files and the template by content, so a requeue on a
    node that mounts them at another path tokenizes to the same key (a cache hit) and passes the identity check;
    the settings rule then refused it as changed --dataset_mixer_list and --tokenizer_name_or_path. The paths are no
    changed setting where the key is the checkpoint's; another amount, or another key, still is."""
    from open_sft.training.checkpoint import ResumePoint

    def mounted(root, *flags):
        (tmp_path / root / "tok").mkdir(parents=True, exist_ok=True)
        (tmp_path / root / "d.jsonl").write_text("{}\n")
        return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", str(tmp_path / root / "d.jsonl"),
                             "1.0", "--tokenizer_name_or_path", str(tmp_path / root / "tok"), "--output_dir",
                             str(tmp_path / "out"), "--max_train_steps", "60", *flags])

    first = mounted("mnt")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    state = {"step": 29, "config": {completion.SETTINGS_KEY: history}, "identity": {"dataset_cache_key": "k1"}}
    at = ResumePoint(tmp_path / "checkpoints" / "step_29", state)
    elsewhere = mounted("data")
    assert completion.check_resume_point(at, 60, elsewhere, elsewhere.to_dict(), True,
                                         {"dataset_cache_key": "k1"}) == history
    with pytest.raises(UserError, match="--dataset_mixer_list: .* in the checkpoint"):
        completion.check_resume_point(at, 60, elsewhere, elsewhere.to_dict(), True, {"dataset_cache_key": "k2"})
    with pytest.raises(UserError, match="--learning_rate"):  # the rest is still compared
        other = mounted("data", "--learning_rate", "1e-3")
        completion.check_resume_point(at, 60, other, other.to_dict(), True, {"dataset_cache_key": "k1"})


def test_text_documents_free_their_sources_path_but_not_the_template_their_key_does_not_hold(tmp_path) -> None:
    """A mixture of text documents alone has a cache key without the chat template (no template renders them), so an
    equal key says nothing of --chat_template_path or the tokenizer's template, which the export writes: another
    template (or tokenizer) on a resume was waved through as 'moved'. The sources' path is still free."""
    from open_sft.training.checkpoint import ResumePoint

    def mounted(root, template):
        (tmp_path / root / "tok").mkdir(parents=True, exist_ok=True)
        (tmp_path / root / "d.jsonl").write_text('{"text": "a document"}\n')
        (tmp_path / root / "t.jinja").write_text(template)
        return parse_config(["--model_name_or_path", "m", "--dataset_mixer_list", str(tmp_path / root / "d.jsonl"),
                             "1.0", "--tokenizer_name_or_path", str(tmp_path / root / "tok"), "--chat_template_path",
                             str(tmp_path / root / "t.jinja"), "--output_dir", str(tmp_path / "out"),
                             "--max_train_steps", "60"])

    from conftest import ROOT

    templates = ROOT / "tests" / "data" / "chat_templates"
    first = mounted("a", (templates / "qwen3.jinja").read_text())
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    state = {"step": 29, "config": {completion.SETTINGS_KEY: history}, "identity": {"dataset_cache_key": "k1"}}
    at = ResumePoint(tmp_path / "checkpoints" / "step_29", state)
    other = mounted("b", (templates / "gpt_oss.jinja").read_text())
    with pytest.raises(UserError) as refused:
        completion.check_resume_point(at, 60, other, other.to_dict(), True, {"dataset_cache_key": "k1"})
    named = str(refused.value)
    assert "--chat_template_path" in named and "--tokenizer_name_or_path" in named
    assert "--dataset_mixer_list" not in named


def test_a_checkpoint_of_auto_under_mean_resumes_with_the_batch_flags_and_allow_changed_settings(tmp_path) -> None:
    """--auto_micro_batch_size with --loss_normalization mean is refused up front now; a run checkpointed with
    both before resumes as the refusal says: the batch flags set, --auto_micro_batch_size dropped (a changed
    setting, refused unless --allow_changed_settings)."""
    batch = ["--loss_normalization", "mean", "--per_device_train_batch_size", "8"]
    with pytest.raises(ConfigError, match=r"a resume of a checkpoint trained with --auto_micro_batch_size also "
                                          r"needs --allow_changed_settings"):
        launch(tmp_path, *batch, "--auto_micro_batch_size")
    before = [{"from_step": 1, "settings": {**completion.settings(launch(tmp_path, *batch)),
                                            "auto_micro_batch_size": True}}]
    with pytest.raises(UserError, match=r"  - --auto_micro_batch_size: True in the checkpoint, False now"):
        completion.check_resume_point(resume_point(tmp_path, 29, before), 60, launch(tmp_path, *batch),
                                      launch(tmp_path, *batch).to_dict(), True)
    allowed = launch(tmp_path, *batch, "--allow_changed_settings")
    history = completion.check_resume_point(resume_point(tmp_path, 29, before), 60, allowed, allowed.to_dict(), True)
    assert [h["from_step"] for h in history] == [1, 30]
    assert history[1]["settings"]["auto_micro_batch_size"] is False


def test_allowed_changes_are_recorded_per_step_range(tmp_path, caplog) -> None:
    import logging

    from open_sft.training.run_settings import by_steps

    first = launch(tmp_path, "--learning_rate", "3e-3")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    second = launch(tmp_path, "--learning_rate", "1e-3", "--allow_changed_settings")
    with caplog.at_level(logging.WARNING, logger="open_sft.training.run_settings"):
        history = completion.check_resume_point(resume_point(tmp_path, 29, history), 60, second, second.to_dict(),
                                                True)
    assert "resuming at step 29 with changed settings (--allow_changed_settings)" in caplog.text
    assert "--learning_rate: 0.003 in the checkpoint, 0.001 now" in caplog.text
    assert [h["from_step"] for h in history] == [1, 30]
    third = launch(tmp_path, "--learning_rate", "1e-3", "--weight_decay", "0.1", "--allow_changed_settings")
    history = completion.check_resume_point(resume_point(tmp_path, 45, history), 60, third, third.to_dict(), True)
    assert by_steps(history, 60) == [
        {"steps": [1, 29], "changed": {"learning_rate": 0.003, "weight_decay": 0.0}},
        {"steps": [30, 45], "changed": {"learning_rate": 0.001, "weight_decay": 0.0}},
        {"steps": [46, 60], "changed": {"learning_rate": 0.001, "weight_decay": 0.1}}]
    # resumed from an earlier checkpoint (by name): the ranges after it are dropped
    again = completion.check_resume_point(resume_point(tmp_path, 20, history), 60, first, first.to_dict(), True)
    assert again == history[:1] and by_steps(again, 60) == []


def test_a_checkpoint_written_before_histories_compares_its_resolved_config(tmp_path) -> None:
    old = launch(tmp_path, "--learning_rate", "3e-3")
    now = launch(tmp_path, "--learning_rate", "1e-3")
    point = resume_point(tmp_path, 29, config=old.to_dict())
    with pytest.raises(UserError, match="--learning_rate: 0.003 in the checkpoint, 0.001 now"):
        completion.check_resume_point(point, 60, now, now.to_dict(), True)
    allowed = launch(tmp_path, "--learning_rate", "1e-3", "--allow_changed_settings")
    history = completion.check_resume_point(point, 60, allowed, allowed.to_dict(), False)
    assert [(h["from_step"], h["settings"]["learning_rate"]) for h in history] == [(1, 0.003), (30, 0.001)]


def test_changed_adam_betas_are_a_changed_setting_and_a_checkpoint_before_the_flags_had_torchs(tmp_path) -> None:
    """--adam_beta2 is refused on a resume as --learning_rate is. A checkpoint written before the flags existed
    (its settings without them) trained with (0.9, 0.999): an OLMo-core command line, which now means --adam_beta2
    0.95, is refused on it instead of stepping its moments with other betas unsaid."""
    first = launch(tmp_path)
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    other = launch(tmp_path, "--adam_beta2", "0.95")
    with pytest.raises(UserError, match=r"  - --adam_beta2: 0.999 in the checkpoint, 0.95 now\n"):
        completion.check_resume_point(resume_point(tmp_path, 29, history), 60, other, other.to_dict(), True)
    before = [{**h, "settings": {k: v for k, v in h["settings"].items() if not k.startswith("adam_")}}
              for h in history]
    olmo_core = launch(tmp_path, "--num_epochs", "1")
    with pytest.raises(UserError, match=r"  - --adam_beta2: 0.999 in the checkpoint, 0.95 now\n"):
        completion.check_resume_point(resume_point(tmp_path, 29, before), 60, olmo_core, olmo_core.to_dict(), True)
    assert completion.check_resume_point(resume_point(tmp_path, 29, before), 60, first, first.to_dict(), True) \
        == history  # the same run, relaunched by the same command: its history read with the betas it trained with


def test_a_record_from_before_the_flags_is_read_with_what_it_trained_with_by_every_reader(tmp_path) -> None:
    """The betas' old values were filled in by `differences` alone, into whatever it was given (a false blame came
    of it: a record cut to the data's flags got betas this launch's side lacked). They are filled where a record is
    read: a checkpoint's settings and history, a completion record; so the history a resume under
    --allow_changed_settings writes says steps 1-29 trained with beta2 0.999 (it said null)."""
    from open_sft.training.run_settings import by_steps, checkpoint_settings, differences, recorded_settings

    first = launch(tmp_path, "--learning_rate", "3e-3")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    old_betas = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
    unrecorded = {k: v for k, v in history[0]["settings"].items() if k not in old_betas}  # before the flags
    assert differences(unrecorded, completion.settings(launch(tmp_path, "--learning_rate", "3e-3", "--adam_beta2",
                                                             "0.95"))) == []
    before = [{"from_step": 1, "settings": unrecorded}]
    assert checkpoint_settings({"step": 29, "config": {completion.SETTINGS_KEY: before}}) == history[0]["settings"]
    old_config = first.to_dict()
    old_config["train"] = {k: v for k, v in old_config["train"].items() if k not in old_betas}
    assert {k: checkpoint_settings({"step": 29, "config": old_config})[k] for k in old_betas} == old_betas
    olmo_core = launch(tmp_path, "--learning_rate", "3e-3", "--num_epochs", "1", "--allow_changed_settings")
    resumed = completion.check_resume_point(resume_point(tmp_path, 29, before), 60, olmo_core, olmo_core.to_dict(),
                                            False)
    assert by_steps(resumed, 60) == [
        {"steps": [1, 29], "changed": {"adam_beta2": 0.999, "num_train_epochs": 2, "packing": False}},
        {"steps": [30, 60], "changed": {"adam_beta2": 0.95, "num_train_epochs": 1, "packing": True}}]
    # a completion record without them, or whose ranges hold null for them (a history extended before this)
    record = {"settings": {"learning_rate": 0.001, "adam_beta2": 0.95},
              completion.SETTINGS_KEY: [{"steps": [1, 29], "changed": {"learning_rate": 0.003, "adam_beta2": None}},
                                        {"steps": [30, 60], "changed": {"learning_rate": 0.001, "adam_beta2": 0.95}}]}
    assert recorded_settings(record) == [{"learning_rate": 0.003, **old_betas},
                                         {"learning_rate": 0.001, **old_betas, "adam_beta2": 0.95}]
    assert recorded_settings({"settings": {"learning_rate": 0.001}}) == [{"learning_rate": 0.001, **old_betas}]


def test_the_same_command_of_a_completed_run_that_means_other_settings_now_is_complete_saying_so(tmp_path) -> None:
    """A completed OLMo-core run from before the betas change (its record: --adam_beta2 0.999; the same command line
    now means 0.95) was refused on relaunch as a run 'launched with other settings', with --overwrite_output_dir
    to train again: a requeue of the very command that completed failed. A relaunch trains nothing either way; what
    a user must not be told is that a command they changed is complete. So the run's own command (the settings it
    gave the same; an older record: test_an_older_record_is_complete_only_for_...) is `already complete`, naming what it means
    now and the way to train that; a command that gives other settings is refused as before."""
    olmo_core = launch(tmp_path, "--num_epochs", "1")
    finished_run(tmp_path)
    completion.mark_complete(tmp_path, 4, 1.0, olmo_core)
    record = json.loads((tmp_path / "RUN_COMPLETE").read_text())
    assert record["given"]["num_train_epochs"] == 1 and "adam_beta2" not in record["given"]  # implied, not given
    for old_settings in ({**record["settings"], "adam_beta2": 0.999},  # before the change, and before the flags
                         {k: v for k, v in record["settings"].items() if not k.startswith("adam_")}):
        (tmp_path / "RUN_COMPLETE").write_text(json.dumps(
            {k: v for k, v in {**record, "settings": old_settings}.items() if k != "given"}))
        message = completion.already_complete(olmo_core)
        assert message.startswith(f"already complete: {tmp_path} (trained to step 4, ") and message.endswith(
            "; nothing to train. This command line now means settings the run did not train with (what it implies "
            "or defaults to changed since; the export is what the run trained):\n  - --adam_beta2: 0.999 then, 0.95 "
            "now\nTo train again with these settings pass --overwrite_output_dir (the earlier checkpoints are moved "
            "aside), or choose another --output_dir")
        for changed in (["--adam_beta2", "0.95"], ["--learning_rate", "1e-3"]):  # given: another command
            with pytest.raises(UserError, match="holds a completed run launched with other settings"):
                completion.already_complete(launch(tmp_path, "--num_epochs", "1", *changed))
    # a record with the settings its command gave: a default changed since is the same command; a flag left out
    typed = launch(tmp_path, "--learning_rate", "1e-5")
    completion.mark_complete(tmp_path, 4, 1.0, typed)
    record = json.loads((tmp_path / "RUN_COMPLETE").read_text())
    (tmp_path / "RUN_COMPLETE").write_text(json.dumps({**record, "settings": {**record["settings"],
                                                                               "warmup_ratio": 0.05}}))
    assert "  - --warmup_ratio: 0.05 then, 0.03 now\n" in completion.already_complete(typed)
    with pytest.raises(UserError, match=r"--learning_rate: 1e-05 then, 2e-05 now"):  # the flag left out
        completion.already_complete(launch(tmp_path))


def older_record(output_dir, config, **trained) -> None:
    """The record a run of `config` wrote before records said what its command gave (no GIVEN_KEY), its settings
    with `trained` in place."""
    completion.mark_complete(output_dir, 4, 1.0, config)
    record = json.loads((output_dir / "RUN_COMPLETE").read_text())
    (output_dir / "RUN_COMPLETE").write_text(json.dumps(
        {**{k: v for k, v in record.items() if k != completion.GIVEN_KEY},
         "settings": {**record["settings"], **trained}}))


def test_an_older_record_is_complete_only_for_settings_whose_meaning_changed_not_for_a_flag_left_out(tmp_path):
    """A record without the settings its command gave was answered "already complete ... what it implies or
    defaults to changed" for any differing setting not given now, so a relaunch that left out the run's
    --learning_rate 1e-4 (now its default) was told it was the same command. Only a setting whose meaning is known
    to have changed passes: one a command line implies now, or one that was no flag then, the record holding what
    it meant when left out; a flag the run's command gave, left out now, is refused as before."""
    finished_run(tmp_path)
    older_record(tmp_path, launch(tmp_path, "--learning_rate", "1e-4"))
    with pytest.raises(UserError, match=r"launched with other settings:\n  - --learning_rate: 0.0001 then, 2e-05 now"):
        completion.already_complete(launch(tmp_path))
    older_record(tmp_path, launch(tmp_path, "--adam_beta2", "0.98"))  # given then, no flag's default now
    with pytest.raises(UserError, match=r"other settings:\n  - --adam_beta2: 0.98 then, 0.999 now\n"):
        completion.already_complete(launch(tmp_path))
    olmo_core = ["--num_epochs", "1"]
    older_record(tmp_path, launch(tmp_path, *olmo_core, "--adam_beta2", "0.98"))  # now implied: 0.95
    with pytest.raises(UserError, match=r"other settings:\n  - --adam_beta2: 0.98 then, 0.95 now\n"):
        completion.already_complete(launch(tmp_path, *olmo_core))
    # an OLMo-core line from before it implied --packing and --adam_beta2: both changed meaning
    older_record(tmp_path, launch(tmp_path, *olmo_core), packing=False, adam_beta2=0.999)
    assert "the run did not train with (what it implies or defaults to changed since; the export is what the run " \
           "trained):\n  - --adam_beta2: 0.999 then, 0.95 now\n  - --packing: False then, True now\nTo train " \
           "again" in completion.already_complete(launch(tmp_path, *olmo_core))


def test_a_flag_that_sets_no_setting_but_implies_some_is_another_command(tmp_path) -> None:
    """A completed plain run relaunched with an OLMo-core flag that sets no setting (--wandb_project: a tracker's,
    --local_cache_dir: a cache's) gave the same settings, while that line implies --packing and --adam_beta2 0.95:
    "already complete" for a changed command. RUN_COMPLETE records the names of the settings a command implied
    (`implied`), which must be the same."""
    finished_run(tmp_path)
    completion.mark_complete(tmp_path, 4, 1.0, launch(tmp_path))
    assert json.loads((tmp_path / "RUN_COMPLETE").read_text())["implied"] == []
    for olmo_core in (["--wandb_project", "p"], ["--local_cache_dir", str(tmp_path / "cache")]):
        with pytest.raises(UserError, match=r"launched with other settings:\n  - --adam_beta2: 0.999 then, 0.95 now\n"
                                            r"  - --packing: False then, True now\n"):
            completion.already_complete(launch(tmp_path, *olmo_core))
    olmo_core = launch(tmp_path, "--wandb_project", "p")
    completion.mark_complete(tmp_path, 4, 1.0, olmo_core)
    assert json.loads((tmp_path / "RUN_COMPLETE").read_text())["implied"] == ["adam_beta2", "checkpointing_steps",
                                                                            "packing"]
    assert completion.already_complete(olmo_core).endswith("nothing to train. To train again from scratch pass "
                                                           "--overwrite_output_dir (the earlier checkpoints are "
                                                           "moved aside), or choose another --output_dir")


def test_an_accumulation_the_identity_check_accepted_is_no_changed_setting(tmp_path) -> None:
    """A checkpoint of 2 ranks resumed on 1 with --gradient_accumulation_steps doubled keeps the global batch
    (open_sft.training.elastic; check_compatible accepts it): no refusal, as for the same command relaunched, which
    the fit gives the doubled accumulation in its resolved config."""
    first = launch(tmp_path, "--gradient_accumulation_steps", "2")
    history = completion.check_resume_point(None, 60, first, first.to_dict(), True)
    doubled = launch(tmp_path, "--gradient_accumulation_steps", "4")
    assert completion.check_resume_point(resume_point(tmp_path, 29, history), 60, doubled, doubled.to_dict(),
                                         True) == history
    older = resume_point(tmp_path, 29, config=first.to_dict())  # written before histories: resolved configs
    assert len(completion.check_resume_point(older, 60, first, doubled.to_dict(), True)) == 1
    with pytest.raises(UserError, match="--learning_rate"):  # what else changed is still named
        other = launch(tmp_path, "--gradient_accumulation_steps", "4", "--learning_rate", "1e-3")
        completion.check_resume_point(resume_point(tmp_path, 29, history), 60, other, other.to_dict(), True)


def test_a_completed_run_with_step_ranges_accepts_the_command_of_any_range(tmp_path) -> None:
    """The original command of a run resumed at step 29 with another learning rate was refused as 'a completed run
    launched with other settings: --learning_rate: 0.001 then, 0.003 now', though steps 1-29 used 0.003."""
    from open_sft.training.run_settings import by_steps

    original = launch(tmp_path, "--learning_rate", "3e-3")
    history = completion.check_resume_point(None, 60, original, original.to_dict(), True)
    resumed = launch(tmp_path, "--learning_rate", "1e-3", "--allow_changed_settings")
    history = completion.check_resume_point(resume_point(tmp_path, 29, history), 60, resumed, resumed.to_dict(), True)
    finished_run(tmp_path)
    completion.mark_complete(tmp_path, 60, 1.0, resumed, by_steps(history, 60))
    record = json.loads((tmp_path / "RUN_COMPLETE").read_text())
    assert record["settings_by_steps"] == [{"steps": [1, 29], "changed": {"learning_rate": 0.003}},
                                           {"steps": [30, 60], "changed": {"learning_rate": 0.001}}]
    assert completion.already_complete(original).startswith(f"already complete: {tmp_path}")
    assert completion.already_complete(launch(tmp_path, "--learning_rate", "1e-3")).startswith("already complete")
    with pytest.raises(UserError) as refused:
        completion.already_complete(launch(tmp_path, "--learning_rate", "2e-3"))
    assert "--learning_rate: 0.001 then, 0.002 now" in str(refused.value)  # against the last range
    mixed = launch(tmp_path, "--learning_rate", "3e-3", "--seed", "5")  # matches no range as a whole
    with pytest.raises(UserError, match="--seed: 42 then, 5 now"):
        completion.already_complete(mixed)


def test_the_model_card_lists_the_step_ranges_and_their_settings(tmp_path) -> None:
    from open_sft.export.model_card import render_model_card

    ranges = [{"steps": [1, 29], "changed": {"learning_rate": 0.003}},
              {"steps": [30, 60], "changed": {"learning_rate": 0.001}}]
    (tmp_path / "run.json").write_text(json.dumps({"args": {"train": {"learning_rate": 0.001}},
                                                   "settings_by_steps": ranges}))
    card = render_model_card(tmp_path)
    assert "## Settings by steps" in card
    assert "| steps | learning_rate |\n| --- | --- |\n| 1-29 | 0.003 |\n| 30-60 | 0.001 |" in card
    (tmp_path / "run.json").write_text(json.dumps({"args": {"train": {"learning_rate": 0.001}}}))
    assert "Settings by steps" not in render_model_card(tmp_path)


def _sleep(started) -> None:
    import time

    started.set()
    time.sleep(30)


def test_a_forked_process_takes_sigterm_as_its_default(tmp_path) -> None:
    """The handlers of the launch's process are inherited by what it forks (the cache build's render workers):
    there SIGTERM ends the process as by default, which multiprocessing's Pool.terminate expects (the inherited
    handler raised in idle workers: a traceback each, or a queue lock held)."""
    import multiprocessing
    import signal

    from open_sft.training.preemption import StopRequest, stop_outside_training

    for install in (stop_outside_training, lambda: StopRequest().install().uninstall):
        restore = install()
        try:
            fork = multiprocessing.get_context("fork")
            started = fork.Event()
            child = fork.Process(target=_sleep, args=(started,))
            child.start()
            assert started.wait(timeout=20)  # running (a signal before Python's fork hooks is dropped by CPython)
            child.terminate()
            child.join(timeout=20)
        finally:
            restore()
        assert child.exitcode == -signal.SIGTERM


def test_the_same_paths_spelled_otherwise_are_the_same_settings(tmp_path, monkeypatch) -> None:
    """A trailing slash on the model directory, a data file relative from another working directory: neither a
    changed setting of a resume nor of a finished run's relaunch. A Hub id stays as written."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "d.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    first = parse_config(["--model_name_or_path", str(tmp_path / "model"), "--dataset_mixer_list",
                          str(tmp_path / "data" / "d.jsonl"), "1.0", "--output_dir", str(out)])
    history = completion.check_resume_point(None, 60, first, first.to_dict(), is_main=True)
    monkeypatch.chdir(tmp_path / "data")
    again = parse_config(["--model_name_or_path", f"{tmp_path / 'model'}/", "--dataset_mixer_list", "d.jsonl", "1.0",
                          "--output_dir", str(out)])
    assert completion.check_resume_point(resume_point(tmp_path, 29, history), 60, again, again.to_dict(),
                                         True) == history
    out.mkdir()
    finished_run(out)
    completion.mark_complete(out, 4, 12.5, first)
    assert completion.already_complete(again).startswith("already complete")
    hub = parse_config(["--model_name_or_path", "org/model", "--dataset_mixer_list", "d.jsonl", "1.0"])
    assert completion.settings(hub)["model_name_or_path"] == "org/model"


def test_torch_dtype_is_compared_by_the_dtype_the_run_trained_in(tmp_path) -> None:
    """A run launched with auto (which resolved to bfloat16) resumes with `--torch_dtype bf16` or `bfloat16`
    spelled out, and stops at its finished record, as the same setting; an explicit other dtype is a change."""
    import torch

    from open_sft.model.precision import COMPUTE_DTYPE_KEY

    first = launch(tmp_path)
    history = completion.check_resume_point(None, 60, first, first.to_dict(), is_main=True)
    point = resume_point(tmp_path, 29, history, config={COMPUTE_DTYPE_KEY: "bfloat16"})
    for spelled in ("bf16", "bfloat16", "auto"):
        now = launch(tmp_path, "--torch_dtype", spelled)
        assert completion.check_resume_point(point, 60, now, now.to_dict(), True) == history
    fp32 = launch(tmp_path, "--torch_dtype", "fp32")
    with pytest.raises(UserError, match="--torch_dtype: 'auto' in the checkpoint, 'fp32' now"):
        completion.check_resume_point(point, 60, fp32, fp32.to_dict(), True)
    # the other way: an explicit dtype then, auto now (which keeps the checkpoint's dtype)
    explicit = launch(tmp_path, "--torch_dtype", "fp32")
    history = completion.check_resume_point(None, 60, explicit, explicit.to_dict(), is_main=True)
    point = resume_point(tmp_path, 29, history, config={COMPUTE_DTYPE_KEY: "float32"})
    assert completion.check_resume_point(point, 60, first, first.to_dict(), True) == history
    # a finished run's relaunch: its record keeps the dtype it trained in
    out = tmp_path / "out"
    out.mkdir()
    finished_run(out)
    completion.mark_complete(out, 4, 12.5, parse_config(BASE + ["--output_dir", str(out)]),
                             computed=torch.bfloat16)
    again = parse_config(BASE + ["--output_dir", str(out), "--torch_dtype", "bf16"])
    assert completion.already_complete(again).startswith("already complete")
    with pytest.raises(UserError, match="--torch_dtype: 'auto' then, 'float16' now"):
        completion.already_complete(parse_config(BASE + ["--output_dir", str(out), "--torch_dtype", "float16"]))
