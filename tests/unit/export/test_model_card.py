"""The model card's small rules: which base model names are Hub ids, and target modules in a line."""

from __future__ import annotations

import json

import pytest

from open_sft.export.model_card import hub_id, target_modules


@pytest.mark.parametrize(("name", "expected"), [
    ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"),
    ("gpt2", "gpt2"),
    ("/data/hub/models--allenai--OLMo-2-0425-1B/snapshots/0123abcd", "allenai/OLMo-2-0425-1B"),
    ("/data/hub/models--gpt2/snapshots/0123abcd/", "gpt2"),
    ("/data/models/llama", None),
    ("./base", None),
])
def test_hub_id_of_a_base_model_name(name, expected) -> None:
    assert hub_id(name) == expected


def test_target_modules_in_a_line() -> None:
    paths = [f"model.layers.{i}.{m}" for i in range(3) for m in ("self_attn.q_proj", "mlp.up_proj")]
    assert target_modules({"target_modules": paths}) == "q_proj, up_proj (6 modules)"
    assert target_modules({"target_modules": ["v_proj", "q_proj"]}) == "q_proj, v_proj"
    assert target_modules({"target_modules": ".*proj"}) == ".*proj"
    assert target_modules({}) == "none"


def test_a_local_base_is_recorded_by_its_absolute_path_and_the_card_does_not_ask_the_cwd(tmp_path,
                                                                                          monkeypatch) -> None:
    """A base given as a relative directory is recorded (run.json's base_model, the adapter config) by its absolute
    path where the run loaded it; a Hub id as given. The card rendered from any directory says the same."""
    from open_sft.export.model_card import render_model_card
    from open_sft.model.base_record import base_model_record

    (tmp_path / "r" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert base_model_record("r/base") == str(tmp_path.resolve() / "r" / "base")
    assert base_model_record("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": {"model": {"model_name_or_path": "r/base"}},
                                              "base_model": base_model_record("r/base")}))
    here = render_model_card(run)
    monkeypatch.chdir(tmp_path / "r")
    assert render_model_card(run) == here and "\nbase_model:" not in here and str(tmp_path / "r" / "base") in here


def test_the_front_matter_names_the_hub_datasets_the_run_read(tmp_path) -> None:
    """TRL's cards list the Hub datasets in `datasets:` (the Hub links the model to them); local files stay in
    the card's text only. A source is a Hub dataset where its name is not a local file or directory."""
    from open_sft.data.sources import SourceSpec
    from open_sft.data.summary import SourceReport
    from open_sft.export.model_card import render_model_card

    local = tmp_path / "mine.jsonl"
    local.write_text("{}\n")
    names = ["allenai/tulu-3-sft-mixture", str(local), "allenai/tulu-3-sft-mixture", "HuggingFaceH4/no_robots"]
    sources = [SourceReport(name=n, format="messages", rows_in=1,
                            hub_dataset=not SourceSpec(n, 1.0, True, "train").is_local).to_dict() for n in names]
    assert [s["hub_dataset"] for s in sources] == [True, False, True, True]
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": {"model": {"model_name_or_path": "Qwen/Qwen2.5-0.5B"}}}))
    (run / "data_report.json").write_text(json.dumps({"sources": sources}))
    card = render_model_card(run)
    front = card.split("---\n")[1]
    assert front.endswith("base_model: Qwen/Qwen2.5-0.5B\ndatasets:\n- allenai/tulu-3-sft-mixture\n"
                          "- HuggingFaceH4/no_robots\n")
    assert str(local) in card  # the data section names it
    (run / "data_report.json").write_text(json.dumps({"sources": sources[1:2]}))
    assert "datasets:" not in render_model_card(run)


def test_final_metrics_hold_the_last_evaluation_and_the_layout_is_in_words(tmp_path) -> None:
    """The card's Final metrics list the last training step's numbers and, when the run evaluated, its last
    eval_loss, eval_tokens and eval_loss/<source> (the held-out loss a reader wants; only report/summary.md had
    it), with the evaluation's step where it is another; the layout reads as the run's log line, not accelerate's
    DistributedType name ("1 process(es), NO")."""
    from open_sft.export.model_card import render_model_card

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 9, "loss": 7.25, "train_tokens": 90}, {"step": 10, "loss": 7.0, "train_tokens": 100},
             {"step": 10, "eval_loss": 6.65691234, "eval_tokens": 60, "eval_loss/chat": 6.5, "eval_loss/math": 7.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "run.json").write_text(json.dumps({"world_size": 1, "distributed_type": "NO", "launch": {"parallelism": {
        "engine": "single", "world_size": 1, "zero_stage": 0, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "sp": 1,
        "pp": 1, "virtual_stages": 1, "dp_replicas": 1}}}))
    card = render_model_card(run)
    metrics = card.split("## Final metrics\n\n")[1].split("\n\n")[0]
    assert metrics.splitlines()[2:] == ["| step | 10 |", "| loss | 7 |", "| train_tokens | 100 |",
                                        "| eval_loss | 6.65691 |", "| eval_tokens | 60 |", "| eval_loss/chat | 6.5 |",
                                        "| eval_loss/math | 7 |"]
    assert "- 1 process: plain torch, dp_replicate 1 × dp_shard 1; compute dtype" in card and ", NO" not in card
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:1] + lines[2:]))
    card = render_model_card(run)  # an evaluation after the last logged step: its step named
    assert "| step | 9 |\n| loss | 7.25 |\n| train_tokens | 90 |\n| eval step | 10 |\n| eval_loss |" in card


def test_the_card_and_run_json_args_give_the_adam_settings(tmp_path) -> None:
    """An OLMo-core command line's betas (0.9, 0.95) are in the config dump run.json holds (FinetuneConfig.to_dict)
    and in the card's hyperparameter table."""
    from open_sft.config.parse import parse_config
    from open_sft.export.model_card import render_model_card

    config = parse_config(["--model_name_or_path", "m", "--mixer_list", "d.jsonl", "1.0", "--adam_epsilon", "1e-6"])
    args = config.to_dict()
    assert {k: args["train"][k] for k in ("adam_beta1", "adam_beta2", "adam_epsilon")} == \
        {"adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6}
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": args}))
    card = render_model_card(run)
    assert "| weight_decay | 0.0 |\n| adam_beta1 | 0.9 |\n| adam_beta2 | 0.95 |\n| adam_epsilon | 1e-06 |\n" in card


def test_a_packed_run_s_card_gives_its_batch_in_packed_tokens_not_per_device_examples(tmp_path) -> None:
    """Under --packing a step is micro-batches of up to --max_tokens_per_batch tokens (the log says so); the card
    said "global batch 16 examples" there (per_device_train_batch_size × accumulation × ranks), a count the packed
    steps do not hold. A run.json written before the schedule named the budget gives it by the flags."""
    from open_sft.data.batching import BatchLayout, PackedPlan, UnpackedPlan
    from open_sft.export.model_card import render_model_card
    from open_sft.training.steps import StepPlan

    layout = BatchLayout(8, 2, 1)
    packed = PackedPlan([64] * 40 + [20] * 10, layout, seed=0, max_tokens=512)
    unpacked = UnpackedPlan(50, layout, seed=0)
    for inner, batch in ((packed, "up to 1024 packed tokens (512 per micro-batch × 2 accumulation × 1 rank(s))"),
                         (unpacked, "16 examples")):
        plan = StepPlan(layout, inner.steps_in_epoch(0), inner.steps_in_epoch(0), 1, 1, inner, 64)
        schedule = plan.to_dict()
        assert ("packed_tokens_per_micro_batch" in schedule) is (inner is packed)
        run = tmp_path / ("packed" if inner is packed else "padded")
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"schedule": schedule, "args": {"train": {
            "packing": inner is packed, "per_device_train_batch_size": 8}}}))
        card = render_model_card(run)
        assert f"- global batch {batch}, {plan.total_steps} optimizer steps (1 warmup)\n" in card
        assert f"| packing | {inner is packed} |\n" in card
    older = json.loads((tmp_path / "packed" / "run.json").read_text())
    del older["schedule"]["packed_tokens_per_micro_batch"]
    older["args"]["data"] = {"max_seq_length": 64}
    (tmp_path / "packed" / "run.json").write_text(json.dumps(older))
    assert "- global batch up to 1024 packed tokens (512 per micro-batch" in render_model_card(tmp_path / "packed")
    older["args"]["train"]["max_tokens_per_batch"] = 300
    (tmp_path / "packed" / "run.json").write_text(json.dumps(older))
    assert "- global batch up to 600 packed tokens (300 per micro-batch" in render_model_card(tmp_path / "packed")


@pytest.mark.parametrize(("formats", "tags", "what", "how"), [
    (["text"], ["open_sft", "continual-pretraining"], "A continual pretraining of `gpt2` on text documents.",
     "Trained with open_sft (Accelerate/DeepSpeed continual pretraining on text documents, every token trained)."),
    (["messages", "text"], ["open_sft", "sft", "continual-pretraining"],
     "A fine-tune of `gpt2` on chat/instruction data, with continual pretraining on text documents in the same "
     "mixture.", "supervised fine-tuning on the chat/instruction sources and continual pretraining on the text"),
    (["messages", "alpaca"], ["open_sft", "sft"], "A fine-tune of `gpt2`.",
     "Fine-tuned with open_sft (Accelerate/DeepSpeed supervised fine-tuning)."),
])
def test_the_card_says_what_the_sources_trained_continual_pretraining_on_text(tmp_path, formats, tags, what,
                                                                               how) -> None:
    """A run on text documents (README "Continual pretraining on text") is continual pretraining, not supervised
    fine-tuning: its card said "supervised fine-tuning" and tagged it `sft`. The kinds come from data_report.json's
    source formats; a mix of text and chat sources says both."""
    import yaml

    from open_sft.data.summary import SourceReport
    from open_sft.export.model_card import render_model_card

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": {"model": {"model_name_or_path": "gpt2"}}}))
    sources = [SourceReport(name=f"s{i}.jsonl", format=f, rows_in=1).to_dict() for i, f in enumerate(formats)]
    (run / "data_report.json").write_text(json.dumps({"sources": sources}))
    card = render_model_card(run)
    front, body = card[4:].split("\n---\n", 1)
    assert yaml.safe_load(front)["tags"] == tags
    assert f"\n{what}\n" in body and how in body
    assert ("supervised fine-tuning" in card) == ("sft" in tags)


@pytest.mark.parametrize(("epoch", "step", "line"), [
    (1.0, 1, "Trained for 1 epoch (1 optimizer step)."),
    (2.0, 8, "Trained for 2 epochs (8 optimizer steps)."),
    (0.5, 3, "Trained for 0.5 epochs (3 optimizer steps)."),
])
def test_the_card_counts_epochs_and_steps_in_words_a_reader_reads(tmp_path, epoch, step, line) -> None:
    """A one-epoch run's card read "Trained for 1 epochs"; one and only one is singular."""
    from open_sft.export.model_card import render_model_card

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": {"model": {"model_name_or_path": "gpt2"}}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": step, "epoch": epoch, "loss": 2.5}) + "\n")
    body = render_model_card(run)
    assert f"\n{line}\n" in body and f"| epochs trained | {epoch:g} |" in body
