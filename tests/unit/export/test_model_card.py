"""The model card's small rules: which base model names are Hub ids, and target modules in a line."""

from __future__ import annotations

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
