"""A deep dense family outside the verified list (OLMo-3, EXAONE-4, Gemma-4's unified text model) was refused for
--packing under bf16 on AVX-512 BF16 CPUs: rounding adds up over its layers (tiny 32-layer bf16 OLMo-3: 3.3e-2, over
half precision's 2e-2, with no dependence on the example before; 1.2e-2 on AVX2), and the check said its mask was not
built from position_ids. Such a move is measured again in fp32, as a routed model's is; the packed attention (torch's
varlen kernel on a GPU, its CPU stand-in here) is held to per-example attention at the first layer of each kind of
attention in the run's dtype, so a kernel faulty at sliding layers only is still refused, and so is a leak."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from open_sft.errors import UserError
from open_sft.model import packed_attention, packing_check
from open_sft.model.packing_check import RTOL, RTOL_HALF, check_packing, packing_dependence, packing_leak
from open_sft.model.packing_precision import attention_moves
from tests.unit.model.varlen_stand_in import cpu_as_gpu, own_sdpa_entry, reference_varlen  # noqa: F401 (fixtures)

FIGURE = r"(\d\.\de[+-]\d\d)"


def deep(layers: int = 32, **config) -> torch.nn.Module:
    """Tiny OLMo-3 (not verified: checked at start), bf16 weights: three sliding layers, then a full one, by default;
    its 4096-token window longer than the probes' examples."""
    config = transformers.Olmo3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, **config)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)


def through(model: torch.nn.Module, kernel, monkeypatch) -> list[tuple[int, ...]]:
    """Packed rows of `model` through `kernel` as on a GPU (`cpu_as_gpu`), the window of each call recorded."""
    windows: list[tuple[int, ...]] = []

    def recording(*args, **kwargs):
        windows.append(tuple(kwargs["window_size"]))
        return kernel(*args, **kwargs)

    recording.__signature__ = inspect.signature(kernel)  # the keywords the packed attention reads off the kernel
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: recording)
    assert packed_attention.install(model, varlen=True)
    return windows


def windowless(*args, window_size=(-1, -1), **kwargs):
    """A faulty kernel: causal, but a sliding layer's window dropped (its queries see keys past it)."""
    return reference_varlen(*args, window_size=(-1, 0) if window_size[0] >= 0 else window_size, **kwargs)


def test_a_deep_dense_model_past_half_precisions_tolerance_is_measured_again_in_fp32(monkeypatch) -> None:
    """32 layers of bf16 OLMo-3 that keep packed examples apart (dependence 0, 1e-6 in fp32), trained on a CPU under
    bf16: where bf16 moved them past 2e-2 (AVX-512 BF16: 3.3e-2) the check refused them; over it they are measured
    again in fp32, the log line says so with its figures, and the packed attention is held to per-example at layer 0
    (sliding) and layer 3 (full) in bf16. On a CPU whose rounding stays under 2e-2 (AVX2: 1.2e-2) the half-precision
    figure is logged, and the move stood in for by 5e-2 under autocast takes the fp32 path on a 4-layer model."""
    model = deep()
    packed_attention.install(model)
    note = check_packing(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # back from fp32, layer by layer
    plain = re.search(rf"checked at start: {FIGURE}, dependence 0\.0e\+00\)$", note)
    if plain:  # this CPU's bf16 rounding stays under the tolerance
        assert float(plain[1]) <= RTOL_HALF, note
        real = packing_check.packing_leak
        monkeypatch.setattr(packing_check, "packing_leak",
                            lambda m: 5e-2 if torch.is_autocast_enabled("cpu") else real(m))
        model = deep(4)
        packed_attention.install(model)
        note = check_packing(model, torch.bfloat16)
    found = re.search(rf"'olmo3' keeps packed examples apart \(checked at start in fp32: half precision's rounding "
                      rf"moved them by {FIGURE}, over its 2e-02: {FIGURE}, dependence 0\.0e\+00; the packed attention "
                      rf"at the first layer of each kind \(layer 0 \(sliding_attention, window 4096 not reached\), "
                      rf"layer 3 \(full_attention\)\), in the run's dtype: at most {FIGURE} from per-example\)$",
                      note)
    assert found, note
    assert float(found[1]) > RTOL_HALF and float(found[2]) < RTOL[torch.float32], note
    assert 0.0 <= float(found[3]) < RTOL_HALF / 2, note


def test_a_kernel_faulty_at_sliding_layers_only_is_refused_there(cpu_as_gpu, monkeypatch) -> None:
    """A full layer first, then sliding ones with a 4-token window (the probes' 7- and 9-token examples, and the
    attention probe's 11 and 13, are longer): a kernel that drops the window moves the hidden states far past bf16's
    tolerance with no dependence and nothing in fp32 (which takes the per-example attention). Held to per-example
    attention at the first layer alone (full: the window not in it), it passed; at each kind's first, layer 1 refuses
    it. The sound stand-in passes, the window handed to it where the layer has one."""
    kinds = {"layer_types": ["full_attention"] + ["sliding_attention"] * 3, "sliding_window": 4}
    model = deep(4, **kinds)
    windows = through(model, windowless, monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half, dependence = packing_leak(model), packing_dependence(model)
        moves = attention_moves(model, torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2)),
                                [11, 13])
    assert half > 5 * RTOL_HALF and dependence == 0.0 and (3, 0) in windows, (half, dependence, windows)
    assert list(moves) == ["layer 0 (full_attention)", "layer 1 (sliding_attention, window 4)"], moves
    assert moves["layer 0 (full_attention)"] < RTOL_HALF / 4 < 10 * RTOL_HALF < moves[
        "layer 1 (sliding_attention, window 4)"], moves
    with pytest.raises(UserError, match=r"'olmo3': the attention of packed rows \(torch's variable-length kernel on a "
                                        r"GPU\) gave the first attention layer of its kind, layer 1 \(sliding_"
                                        r"attention, window 4\), outputs [1-9]\.\d\de-0[12] \(relative\) from the "
                                        r"same examples"):
        check_packing(model, torch.bfloat16)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward  # install wraps once: the sound stand-in in its place
    model = deep(4, **kinds)
    windows = through(model, reference_varlen, monkeypatch)
    note = check_packing(model, torch.bfloat16)
    assert "keeps packed examples apart" in note and (3, 0) in windows and (-1, 0) in windows, (note, windows)


def test_a_deep_dense_model_that_leaks_is_still_refused(monkeypatch) -> None:
    """The mask planted to ignore position_ids (one causal mask over the whole row, as gpt-oss's eager attention):
    the second example depends on the first, refused whatever its half-precision move; and a move fp32 finds too
    (1e-3 under a half-precision 5e-2: positions taken from the row, say, which no gradient shows) is refused with
    the fp32 figure."""

    def row_causal(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": True})

    ALL_ATTENTION_FUNCTIONS["sdpa"] = row_causal
    with pytest.raises(UserError, match=rf"'olmo3' lets packed examples see each other \(an example's hidden states "
                                        rf"moved by .* and depend on its tokens \({FIGURE}, relative\)") as refused:
        check_packing(deep(), torch.bfloat16)
    assert float(re.search(rf"its tokens \({FIGURE}", str(refused.value))[1]) > 1e-3
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    model = deep(4)
    packed_attention.install(model)
    monkeypatch.setattr(packing_check, "packing_leak", lambda m: 5e-2 if torch.is_autocast_enabled("cpu") else 1e-3)
    with pytest.raises(UserError, match=r"'olmo3' lets packed examples see each other \(an example's hidden states "
                                        r"moved by 1\.00e-03 \(relative\)"):
        check_packing(model, torch.bfloat16)
