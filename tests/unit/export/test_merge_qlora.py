"""`open_sft merge-lora` of a QLoRA run's adapter writes what the run's merged/ holds: the adapter merged into the
4-bit NF4 base training saw, dequantized, in bf16 (it merged into the unquantized base, in the base's fp32: another
model, 5x farther from the logits training saw)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file


def test_merge_lora_of_a_qlora_adapter_is_the_runs_merged_model(tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_sft.config.args import LoraArguments
    from open_sft.export.merge_adapter import main as merge_main
    from open_sft.export.save import save_lora
    from open_sft.model.load import load_model
    from unit.model.test_model_options import model_args

    model = load_model(model_args(tiny_model_dir), lora=LoraArguments(use_qlora=True, lora_rank=4, lora_dropout=0.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for param in (p for p in model.parameters() if p.requires_grad):
            param.add_(torch.randn_like(param) * 0.1)
    run = tmp_path / "run"
    save_lora(model, model.state_dict(), AutoTokenizer.from_pretrained(tiny_model_dir), run, merge=True)  # as a run
    (run / "run.json").write_text(json.dumps({"args": {"lora": {"use_qlora": True}},
                                              "compute_dtype": str(torch.bfloat16)}))
    assert merge_main([str(run), str(tmp_path / "offline")]) == 0
    ours = load_file(tmp_path / "offline" / "model.safetensors")
    theirs = load_file(run / "merged" / "model.safetensors")
    ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    {t.dtype for t in ours.values()} == {torch.bfloat16}

    ids = torch.randint(6, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits.float()  # the adapter on the 4-bit base: what training saw
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "offline").eval()(input_ids=ids).logits.float()
        with model.disable_adapter():
            adapter_moves = float((trained - model(input_ids=ids).logits.float()).abs().max())
    error = float((merged - trained).abs().max())
    assert error < 0.03 * adapter_moves, (error, adapter_moves)  # 0.019: bf16 rounding (the fp32 merge into the
    # unquantized base, before: 0.09)
