"""Packed rows under flash_attention_2 (flash-attn's kernels stood in for on CPU by tests/unit/model/flash_stub.py,
with plain attention): a packed micro-batch of several rows gives each example the loss and gradients it has alone
once the trainer hands where each example starts; without them transformers ran causal attention over each whole
row (it finds examples from position ids only for one row) and the examples packed later attended to the earlier
ones. Every verified family that runs flash_attention_2 hands the lengths from its forward to its attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from open_sft.data.batching import collate_packed
from open_sft.data.labels import Example
from open_sft.model.flash_packing import FLASH, packed_rows, uses_flash
from open_sft.model.loss import TokenLossModel
from open_sft.model.loss_parity import VERIFIED
from tests.unit.model.flash_stub import flash_stub  # noqa: F401 (a fixture)
from tests.unit.model.test_packed_families import SMALL, build, config_of

LENGTHS = [13, 9, 4, 6]  # in rows of 20: [13, 6] and [9, 4] with 6 positions of padding, the window 5 shorter
ROW = 20


def flash_families() -> list[str]:
    return sorted(f for f in VERIFIED
                  if AutoModelForCausalLM._model_mapping[type(config_of(f, False))]._supports_flash_attn)


def flash_model(family: str) -> TokenLossModel:
    model = build(family, True, attn_implementation="eager")
    model.causal_lm().config._attn_implementation = FLASH  # what loading with flash_attention_2 sets, with flash-attn
    return model


def examples() -> list[Example]:
    g = torch.Generator().manual_seed(3)
    return [Example(ids, ids) for ids in (torch.randint(3, SMALL["vocab_size"], (n,), generator=g).tolist()
                                          for n in LENGTHS)]


def losses_and_grads(model: TokenLossModel, batches: list[dict]):
    model.zero_grad(set_to_none=True)
    loss = sum(model(**batch) for batch in batches)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_lengths_of_a_collated_packed_batch() -> None:
    batch = collate_packed(examples(), pad_token_id=0, row_capacity=ROW)
    assert batch["position_ids"].tolist() == [list(range(13)) + list(range(6)), list(range(9)) + list(range(4))
                                              + list(range(6))]
    found = packed_rows(batch["position_ids"], torch.device("cpu"))
    assert found["cu_seq_lens"].dtype == torch.int32
    assert found["cu_seq_lens"].tolist() == [0, 13, 19, 28, 32, 38] and found["max_length"] == 13  # padding: its own
    assert packed_rows(torch.arange(5).repeat(3, 1), torch.device("cpu")) == {}  # one example a row: causal is right


@pytest.mark.parametrize("family", flash_families())
def test_packed_rows_train_as_each_example_alone(family, flash_stub) -> None:
    model = flash_model(family)
    assert uses_flash(model.causal_lm())
    batch = collate_packed(examples(), pad_token_id=0, row_capacity=ROW)
    batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    alone = [{"input_ids": torch.tensor([e.input_ids]), "labels": torch.tensor([e.labels])} for e in examples()]
    reference, reference_grads = losses_and_grads(model, alone)
    flash_stub.calls.clear()
    loss, grads = losses_and_grads(model, [{**batch, **packed_rows(batch["position_ids"], torch.device("cpu"))}])
    assert flash_stub.calls == [("varlen", [0, 13, 19, 28, 32, 38], 13)] * len(flash_stub.calls) != []
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    assert grads.keys() == reference_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-4, atol=1e-5)
    _, unsplit = losses_and_grads(model, [batch])  # as before: causal attention over each whole row
    assert {kind for kind, _, _ in flash_stub.calls[-2:]} == {"rows"}
    assert not all(torch.allclose(unsplit[n], reference_grads[n], rtol=1e-4, atol=1e-5) for n in unsplit), family


def test_the_start_up_check_holds_a_family_to_handing_the_lengths_on(flash_stub, monkeypatch) -> None:
    """A family outside VERIFIED under flash_attention_2 is checked as training runs it (two rows, the lengths
    handed to the backbone): OLMo-3 keeps packed examples apart; the same model with a forward that drops the lengths
    (as a model whose forward does not hand them to its attention would) is refused by name."""
    from open_sft.errors import UserError
    from open_sft.model.packing_check import check_packing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of("olmo3", False), dtype=torch.float32,
                                             attn_implementation="eager")
    model.config._attn_implementation = FLASH
    assert "olmo3" not in VERIFIED and "keeps packed examples apart" in check_packing(model)
    assert {kind for kind, _, _ in flash_stub.calls} == {"rows", "varlen"}  # each example alone; the packed rows
    backbone = model.model
    forward = backbone.forward
    monkeypatch.setattr(backbone, "forward", lambda **kw: forward(**{k: v for k, v in kw.items()
                                                                    if not k.startswith(("cu_seq", "max_length"))}))
    with pytest.raises(UserError, match="--packing: model type 'olmo3' lets packed examples see each other"):
        check_packing(model)


def test_flash_attention_2_where_flash_attn_cannot_run_is_not_run_by_the_start_up_check(flash_stub, monkeypatch,
                                                                                        caplog) -> None:
    """Under DeepSpeed ZeRO-1/2 the start-up check runs before DeepSpeed places the model on the GPU: flash-attn's
    kernels take CUDA tensors only, so an unverified family under flash_attention_2 is not run there (it would stop
    the run with flash-attn's error) but named in a warning with the fix; a recurrent one is still refused by name."""
    from open_sft.model import packed_attention
    from open_sft.model.packing_check import check_packing

    monkeypatch.setattr(packed_attention, "KERNEL_DEVICE", "cuda")  # flash-attn's device, the model on the CPU
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of("olmo3", False), dtype=torch.float32,
                                             attn_implementation="eager")
    model.config._attn_implementation = FLASH
    with caplog.at_level("WARNING", logger="open_sft.model.packing_check"):
        assert check_packing(model) is None
    assert flash_stub.calls == []
    assert "model type 'olmo3'" in caplog.text and "--attn_implementation sdpa" in caplog.text


def test_where_the_check_would_measure_again_in_fp32_flash_attention_2_is_refused_with_the_fix(flash_stub,
                                                                                              monkeypatch) -> None:
    """flash-attn computes bf16/fp16 only, so the check's fp32 measure (a routed model or a deep dense one moved past
    half precision's tolerance; half precision overflowing) cannot run under flash_attention_2: fp32 queries stopped
    the run with flash-attn's dtype error. It is refused with the fix (sdpa, checked in fp32 there) before anything
    runs in fp32."""
    from open_sft.errors import UserError
    from open_sft.model import packing_check

    monkeypatch.setattr(packing_check, "in_fp32", None)  # neither fp32 measure may start
    monkeypatch.setattr(packing_check, "fp32_by_layer", None)
    for family in ("phimoe", "olmo3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_of(family, False), dtype=torch.float32,
                                                 attn_implementation="eager")
        model.config._attn_implementation = FLASH
        for half_move, why in ((5e-2, "half precision's rounding moved them by 5.0e-02, over its 2e-02"),
                               (float("nan"), "half precision overflowed in it")):
            monkeypatch.setattr(packing_check, "packing_leak", lambda model, move=half_move: move)
            with pytest.raises(UserError) as refused:
                packing_check.check_packing(model, torch.bfloat16)
            assert str(refused.value) == (
                f"--packing: model type '{family}' could not be checked at start for keeping packed examples apart: "
                f"{why}, and the fp32 measure that tells it cannot run under flash_attention_2 (flash-attn computes "
                "bf16/fp16 only); train with --attn_implementation sdpa (checked in fp32 there), or without --packing")
