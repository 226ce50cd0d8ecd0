"""Where half precision cannot tell whether a model keeps packed examples apart, the packing check measures again in
fp32: there, on a GPU, packed rows take the per-example attention, not torch's variable-length kernel that bf16
trains them with, so the kernel is held to the per-example attention at the first layer of each kind of attention in
the run's dtype (here the kernel's CPU stand-in, tests/gpu_check/stand_in.py, and a faulty one planted); and the
fp32 measure upcasts one decoder layer at a time, not the whole model (an 8B in bf16 did not fit twice)."""

from __future__ import annotations

import pytest
import torch
import transformers

from open_sft.errors import UserError
from open_sft.model import packed_attention, packing_check
from open_sft.model.packing_check import RTOL_HALF, check_packing, packing_dependence, packing_leak
from open_sft.model.packing_precision import attention_moves, fp32_by_layer, in_fp32
from tests.gpu_check.stand_in import acausal, varlen_stand_in
from tests.unit.model.test_packing_leaks import tiny, tiny_phimoe


@pytest.fixture(autouse=True)
def sdpa_entry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = before


def through(model: torch.nn.Module, kernel, monkeypatch) -> list[list[int]]:
    """Packed rows of `model` through `kernel` as on a GPU (install with varlen), the cumulative lengths of each call
    recorded."""
    calls: list[list[int]] = []

    def recording(*args, **kwargs):
        calls.append(args[3].tolist())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: recording)
    monkeypatch.setattr(packed_attention, "KERNEL_DEVICE", "cpu")  # the CPU stands in for the kernel's GPU
    assert not packed_attention.installed() and packed_attention.install(model, varlen=True)
    return calls


def fresh_phimoe() -> torch.nn.Module:
    """tiny_phimoe with transformers' own "sdpa" entry (tiny_phimoe installs the per-example attention, no kernel)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_phimoe()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    return model


def test_a_routed_model_with_an_acausal_kernel_is_refused_at_its_first_attention_layer(monkeypatch) -> None:
    """A kernel that drops the causal mask within each example leaks nothing across examples (the dependence is
    exactly 0) but moves a tiny Phi-3.5-MoE's hidden states far past half precision's tolerance. The check measured a
    routed model's move again in fp32, where packed rows take the per-example attention, found 1e-7 and passed: the
    run would have trained with that kernel. It is refused by the first attention layer, compared in bf16."""
    model = fresh_phimoe()
    calls = through(model, acausal(varlen_stand_in), monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half, dependence = packing_leak(model), packing_dependence(model)
    assert half > 10 * RTOL_HALF and dependence == 0.0 and calls  # the path that was measured again in fp32
    with in_fp32(model):
        assert packing_leak(model) < 1e-6  # what the fp32 measure alone found
    with pytest.raises(UserError, match=r"'phimoe': the attention of packed rows \(torch's variable-length kernel on "
                                        r"a GPU\) gave the first attention layer of its kind, layer 0, outputs "
                                        r"[1-9]\.\d\de-01 \(relative\)"):
        check_packing(model, torch.bfloat16)


def test_a_routed_model_with_a_sound_kernel_passes_and_its_first_layer_figure_is_logged(monkeypatch) -> None:
    """The half-precision move stood in for (5e-2, a router's flip) so the fp32 path is taken with the stand-in kernel
    (per-example sdpa in the kernel's contract): the first layer's packed row goes through it in one call (7 + 9
    tokens), the run goes on, and the log line names the figure."""
    model = fresh_phimoe()
    calls = through(model, varlen_stand_in, monkeypatch)
    real = packing_check.packing_leak
    monkeypatch.setattr(packing_check, "packing_leak", lambda m: 5e-2 if torch.is_autocast_enabled("cpu") else real(m))
    note = check_packing(model, torch.bfloat16)
    assert "in fp32: half precision's rounding moved them by 5.0e-02, over its 2e-02: " in note, note
    assert "the packed attention at the first layer of each kind (layer 0), in the run's dtype: at most " in note, note
    move = float(note.split("at most ")[1].split(" ")[0])
    assert move < RTOL_HALF and note.endswith(" from per-example)"), note
    assert [0, 7, 16] in calls


def layers_reached(model: torch.nn.Module) -> list[int]:
    """The indices of the decoder layers that ran to their end, appended as they end."""
    reached = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: reached.append(i))
    return reached


IDS = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))


def bf16_moves(model: torch.nn.Module, lengths: list[int]) -> dict:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return attention_moves(model, IDS, lengths)


def test_the_attention_comparison_stops_once_each_kind_of_layer_is_compared(monkeypatch) -> None:
    """Phi-3.5-MoE has one kind of attention layer: one kernel call (the packed row's first layer; each example alone
    takes plain sdpa on the same queries, keys and values), no layer after it, whatever the model's depth; None
    where packed rows do not go through open_sft's packed attention (eager attention)."""
    model = fresh_phimoe().eval()
    calls, reached = through(model, varlen_stand_in, monkeypatch), layers_reached(model)
    moves = bf16_moves(model, [7, 9])
    assert calls == [[0, 7, 16]] and reached == [] and list(moves) == ["layer 0"] and 0 <= moves["layer 0"] < RTOL_HALF
    assert bf16_moves(model, [10, 6])["layer 0"] < RTOL_HALF and calls[-1] == [0, 10, 16]
    # two kinds: the pass goes on to the first sliding layer (the 4-token window in its label), and stops in it
    config = transformers.Olmo3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                      sliding_window=4, layer_types=[
                                          "full_attention", "full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    olmo3 = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    reached = layers_reached(olmo3)
    moves = bf16_moves(olmo3, [7, 9])
    assert list(moves) == ["layer 0 (full_attention)", "layer 2 (sliding_attention, window 4)"] and reached == [0, 1]
    assert max(moves.values()) < RTOL_HALF, moves
    faulty = fresh_phimoe().eval()
    through(faulty, acausal(varlen_stand_in), monkeypatch)
    assert bf16_moves(faulty, [7, 9])["layer 0"] > 10 * RTOL_HALF
    assert attention_moves(faulty, IDS, [7, 9])["layer 0"] < 1e-6  # fp32 takes the per-example attention
    eager = tiny("olmo3")
    eager.config._attn_implementation = "eager"
    assert attention_moves(eager, IDS, [7, 9]) is None


@pytest.mark.parametrize("family, other", [("lfm2", "conv"), ("qwen3_5_text", "linear_attention")])
def test_the_attention_comparison_does_not_wait_for_layers_without_attention(family, other, monkeypatch) -> None:
    """Layers of a kind that calls no attention function (LFM2's convolutions, Qwen3.5's gated delta nets) were
    waited for as a kind still to compare, so the probe ran every layer: with attention in layer 1 of 4 it stops
    there, layer 0 alone run to its end, the attention compared once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from open_sft.model.packing_precision import _kinds
    from tests.unit.model.test_packing_leaks import SMALL, TINY

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    known = transformers.AutoConfig.for_model(family).to_dict().keys()
    config = transformers.AutoConfig.for_model(family, **{**{k: v for k, v in SMALL.items() if k in known}, **TINY[family],
                                                          "num_hidden_layers": 4,
                                                          "layer_types": [other, "full_attention", other, other]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    calls, reached = through(model, varlen_stand_in, monkeypatch), layers_reached(model)
    moves = bf16_moves(model, [7, 9])
    assert reached == [0] and calls == [[0, 7, 16]] and list(moves) == ["layer 1 (full_attention)"]
    assert moves["layer 1 (full_attention)"] < RTOL_HALF and _kinds(config) == {"full_attention"}


def test_the_fp32_measure_upcasts_one_layer_at_a_time_and_gives_the_whole_models_figure() -> None:
    """A bf16 Phi-3.5-MoE: while each decoder layer runs, it alone of the layers is in fp32 (with what lies outside
    the layers: embeddings, final norm); the leak measured is bit for bit the one measured with the whole model in
    fp32; after, and after a layer that raised, every weight is back in bf16, bit for bit."""
    model = tiny_phimoe().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers, seen = model.model.layers, []

    def dtypes(running: int) -> None:  # inside the layer's forward (its attention's pre-hook)
        seen.append([{p.dtype for p in layer.parameters()} == {torch.float32 if i == running else torch.bfloat16}
                     for i, layer in enumerate(layers)] + [model.model.embed_tokens.weight.dtype == torch.float32])

    hooks = [layer.self_attn.register_forward_pre_hook(lambda *_, i=i: dtypes(i)) for i, layer in enumerate(layers)]
    with in_fp32(model):
        whole = packing_leak(model)
    seen.clear()
    with fp32_by_layer(model):
        by_layer = packing_leak(model)
    assert by_layer == whole and len(seen) == 2 * len(layers)  # alone and packed
    assert all(all(flags) for flags in seen), seen
    for hook in hooks:
        hook.remove()
    layers[1].self_attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError), fp32_by_layer(model):
        packing_leak(model)
    assert all(torch.equal(p, before[n]) and p.dtype == torch.bfloat16 for n, p in model.named_parameters())
