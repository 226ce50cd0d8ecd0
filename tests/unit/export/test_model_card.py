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
