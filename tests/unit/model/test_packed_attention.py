"""Packed rows attended one example at a time give what transformers' block-diagonal sdpa mask gives:
the same loss and gradients (fp32: to rounding; bf16 autocast: to bf16's), the same evaluation loss, and
rows that hold one example each go to the masked path untouched."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from open_sft.model import packed_attention
from open_sft.model.loss import TokenLossModel
from tests.unit.model.varlen_stand_in import cpu_as_gpu, reference_varlen  # noqa: F401 (a fixture)


@pytest.fixture
def sdpa_entry():
    """install() changes a process-wide table: put back what was there."""
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = before


def packed_batch(lengths_per_row: list[list[int]], vocab: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    width = max(sum(row) for row in lengths_per_row)
    ids = torch.randint(3, vocab, (len(lengths_per_row), width), generator=generator)
    position_ids = torch.zeros_like(ids)
    for r, row in enumerate(lengths_per_row):
        cursor = 0
        for n in row + [width - sum(row)]:
            position_ids[r, cursor : cursor + n] = torch.arange(n)
            cursor += n
    labels = ids.clone()
    labels[:, ::4] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def loss_and_grads(model: TokenLossModel, batch: dict, bf16: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_segment_lengths_follow_position_restarts() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert packed_attention.segment_lengths(position_ids) == [3, 2, 1, 4, 2]
    # A jump that is not a restart starts an example too (transformers reads packing the same way).
    assert packed_attention.segment_lengths(torch.tensor([[0, 1, 5, 6]])) == [2, 2]
    assert packed_attention.segment_lengths(torch.arange(6).repeat(2, 1)) is None


def relative_error(got: dict, reference: dict) -> float:
    return max(float((got[n] - reference[n]).norm() / reference[n].norm()) for n in reference)


def tiny_sdpa_model(tiny_model_dir) -> TokenLossModel:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is covered
    return TokenLossModel(model)


def test_per_example_attention_equals_the_block_diagonal_mask(tiny_model_dir, sdpa_entry) -> None:
    """fp32: the same loss, gradients and evaluation loss to rounding."""
    model = tiny_sdpa_model(tiny_model_dir)
    batch = packed_batch([[7, 1, 20, 5], [33], [2, 2, 2, 10]], model.model.config.vocab_size)
    masked_loss, masked_grads = loss_and_grads(model, batch)
    with torch.no_grad():
        masked_eval = model(**batch)
    assert packed_attention.install(model.model)
    assert packed_attention.install(model.model)  # a second install does not wrap twice
    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], packed_attention.FLAG)
    assert not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"].__closure__[0].cell_contents, packed_attention.FLAG, False)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, masked_loss, rtol=1e-6, atol=0)
    assert grads.keys() == masked_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], masked_grads[name], rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation goes through it too
        torch.testing.assert_close(model(**batch), masked_eval, rtol=1e-6, atol=0)


def test_per_example_attention_in_bf16_is_as_close_to_fp32_as_the_mask(tiny_model_dir, sdpa_entry) -> None:
    """bf16 autocast: both paths round differently, so each is held to the fp32 result: per example is no
    further from it than the masked kernel is."""
    model = tiny_sdpa_model(tiny_model_dir)
    batch = packed_batch([[7, 1, 20, 5], [33], [2, 2, 2, 10]], model.model.config.vocab_size, seed=1)
    reference_loss, reference = loss_and_grads(model, batch)
    masked_loss, masked = loss_and_grads(model, batch, bf16=True)
    packed_attention.install(model.model)
    loss, grads = loss_and_grads(model, batch, bf16=True)
    masked_error, error = relative_error(masked, reference), relative_error(grads, reference)
    assert 0 < error < 2 * masked_error + 1e-3, (error, masked_error)
    assert abs(float(loss - reference_loss)) <= 2 * abs(float(masked_loss - reference_loss)) + 1e-3 * float(loss)


def test_rows_of_one_example_take_the_masked_path(sdpa_entry) -> None:
    calls = []

    def inner(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape, attention_mask))
        return query.transpose(1, 2), None

    wrapped = packed_attention._per_example(inner)
    q = torch.randn(2, 4, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    wrapped(None, q, q, q, mask, position_ids=torch.arange(6).repeat(2, 1))
    assert calls == [(q.shape, mask)]
    # Decoding with a cache (one query against longer keys) is not split either.
    calls.clear()
    wrapped(None, q[:, :, :1], q, q, None, position_ids=torch.tensor([[5], [5]]))
    assert len(calls) == 1 and calls[0][0] == (2, 4, 1, 8)
    # Packed rows with transformers' block-diagonal causal mask: one call per example, each without a mask,
    # causal, its length padded up to the bucket.
    calls.clear()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    block = packed_attention.block_causal([3, 3, 2, 4], 2, 6, torch.device("cpu"))[:, None]
    out, _ = wrapped(None, q, q, q, block, position_ids=positions)
    assert [c[0][2] for c in calls] == [packed_attention.BUCKET] * 4 and all(c[1] is None for c in calls)
    torch.testing.assert_close(out, q.transpose(1, 2))  # the padding's outputs are dropped
    # A mask that is more than that (a window only the mask holds): each example gets its own block of it, the
    # padding keys hidden from its queries
    calls.clear()
    windowed = block & ~packed_attention.block_causal([6, 6], 2, 6, torch.device("cpu")).tril(-2)[:, None]
    wrapped(None, q, q, q, windowed, position_ids=positions)
    assert len(calls) == 4 and all(c[1] is not None for c in calls)
    first = calls[3][1][0, 0]  # the second row's second example: 4 tokens, window 2
    assert first[:4, :4].tolist() == [[True, False, False, False], [True, True, False, False],
                                      [False, True, True, False], [False, False, True, True]]
    assert not first[:4, 4:].any() and first[4:].any(dim=1).all()  # no query without a key
    long = torch.randn(1, 4, packed_attention.BUCKET + 3, 8)
    calls.clear()
    out, _ = wrapped(None, long, long, long, None, position_ids=torch.cat([torch.arange(2), torch.arange(33)])[None])
    assert [c[0][2] for c in calls] == [packed_attention.BUCKET, 2 * packed_attention.BUCKET]
    torch.testing.assert_close(out, long.transpose(1, 2))


def test_the_host_finds_example_lengths_only_where_the_packed_attention_will_ask(sdpa_entry, monkeypatch) -> None:
    """The trainer hands each pass's host position ids (`known_segments`); their lengths are found on the host only
    where the "sdpa" entry is routed here, and then the layers take them instead of reading the device's copy."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward  # as a run without the packed attention has it
    found = []
    monkeypatch.setattr(packed_attention, "segment_lengths",
                        lambda ids, real=packed_attention.segment_lengths: found.append(ids) or real(ids))
    host = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    device = host.clone()
    packed_attention.known_segments(device, host)
    assert found == [] and packed_attention._known == (None, None)  # not installed: no host work
    tiny = type("Tiny", (), {"config": type("C", (), {"_attn_implementation": "sdpa"})()})()
    assert packed_attention.install(tiny) and packed_attention.installed()
    packed_attention.known_segments(device, host)
    assert found == [host] and packed_attention._known[1] == [3, 2, 4]
    assert packed_attention._Segments()(device) == [3, 2, 4] and len(found) == 1  # the device copy is not read
    assert packed_attention._Segments()(host.clone()) == [3, 2, 4] and len(found) == 2  # another tensor is


def test_only_sdpa_models_are_routed(tiny_model_dir, sdpa_entry) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert not packed_attention.install(model)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_call_equals_the_block_diagonal_mask(kv_heads, cpu_as_gpu) -> None:
    """The one variable-length call GPUs take: flattened rows, cumulative lengths and grouped kv heads give what
    the block-diagonal mask gives, in bf16 (the dtypes the kernel takes); fp32 keeps the per-example calls."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    q = torch.randn(2, 4, 10, 8, dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, 10, 8, dtype=torch.bfloat16) for _ in range(2))
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    segment = starts.cumsum(1)
    mask = (segment[:, :, None] == segment[:, None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 4 // kv_heads
    expected, _ = sdpa_attention_forward(module, q, k, v, mask[:, None], scaling=0.3)
    calls = []

    cumulative = []

    def kernel(*args, **kwargs):
        calls.append(args[3].tolist())
        cumulative.append(args[3])
        return reference_varlen(*args, **kwargs)

    wrapped = packed_attention._per_example(sdpa_attention_forward, kernel)
    out, _ = wrapped(module, q, k, v, mask[:, None], position_ids=position_ids, scaling=0.3)
    assert calls == [[0, 3, 5, 10, 16, 20]]  # one call for the whole micro-batch
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    # the layers of one forward pass share the position ids: their lengths are read once
    wrapped(module, q, k, v, mask[:, None], position_ids=position_ids, scaling=0.3)
    assert calls[-1] == calls[0] and cumulative[-1] is cumulative[0]  # and their cumulative lengths copied once
    out32, _ = wrapped(module, q.float(), k.float(), v.float(), mask[:, None], position_ids=position_ids,
                       scaling=0.3)
    assert len(calls) == 2  # fp32 is not the kernel's: per-example sdpa
    torch.testing.assert_close(out32, expected.float(), rtol=2e-2, atol=2e-2)
    # under bf16 autocast fp32 queries (rotary times the fp32 residual stream's cos/sin) go to the kernel in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_autocast, _ = wrapped(module, q.float(), k.float(), v.float(), mask[:, None], position_ids=position_ids,
                                  scaling=0.3)
    assert len(calls) == 3 and out_autocast.dtype == torch.bfloat16
    torch.testing.assert_close(out_autocast, expected, rtol=1e-2, atol=1e-2)


def test_latent_attentions_narrower_values_take_the_varlen_kernel_padded_with_zeros(cpu_as_gpu) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi): values 16 wide beside queries and keys 24 wide (128 and
    192 in DeepSeek-V3), which the kernel does not take (one head_dim for all three), so such layers never reached it
    on a GPU. The values go to it padded with zero columns, which attend to exactly zero, cut off again: what the
    block-diagonal mask gives."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    q, k = (torch.randn(2, 4, 10, 24, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(2, 4, 10, 16, dtype=torch.bfloat16)
    segment = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    mask = (segment[:, :, None] == segment[:, None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    expected, _ = sdpa_attention_forward(module, q, k, v, mask[:, None], scaling=24 ** -0.5)
    seen = []

    def kernel(*args, **kwargs):
        seen.append(args[2])
        out = reference_varlen(*args, **kwargs)
        assert out.shape[-1] == 24 and torch.equal(out[..., 16:], torch.zeros_like(out[..., 16:]))
        return out

    wrapped = packed_attention._per_example(sdpa_attention_forward, kernel)
    out, _ = wrapped(module, q, k, v, mask[:, None], position_ids=position_ids, scaling=24 ** -0.5)
    assert len(seen) == 1 and seen[0].shape == (20, 4, 24) and not seen[0][..., 16:].any()
    assert out.shape == expected.shape == (2, 10, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_a_query_the_mask_gives_no_key_sees_itself() -> None:
    """sdpa gives NaN for a query with no key, and NaN times a zero gradient is NaN in the keys' gradients: such a
    query (none in causal or windowed masks) gets its own key in an example's block."""
    allowed = packed_attention.block_causal([4], 1, 4, torch.device("cpu"))[:, None].clone()
    allowed[0, 0, 2] = False
    block = packed_attention._example_mask(allowed, 0, 0, 4, packed_attention.BUCKET)[0, 0]
    assert block[2].tolist()[:4] == [False, False, True, False] and block.any(dim=-1).all()


def test_a_plain_familys_packed_mask_is_judged_plain(tiny_model_dir, sdpa_entry, monkeypatch) -> None:
    """Llama's mask for packed rows (padding block included) is the block-diagonal causal one: judged plain, so the
    examples keep the unmasked calls here and torch's variable-length flash attention on a GPU."""
    verdicts = []
    judge = packed_attention._MaskKinds.plain

    def recording(self, mask, allowed, lengths, window=None):
        verdicts.append(judge(self, mask, allowed, lengths, window))
        return verdicts[-1]

    monkeypatch.setattr(packed_attention._MaskKinds, "plain", recording)
    model = tiny_sdpa_model(tiny_model_dir)
    packed_attention.install(model.model)
    batch = packed_batch([[7, 1, 20, 5], [33], [2, 2, 2, 10]], model.model.config.vocab_size)
    model(**batch)
    assert verdicts and all(verdicts)


def test_each_mask_is_judged_once_per_forward_not_at_every_layer(monkeypatch) -> None:
    """Judging a mask builds the rows' block-diagonal mask and reads the comparison off the device (a
    synchronisation on a GPU): once per mask transformers passes in a forward, not once per layer (keyed by the
    booleans made at each call, a windowed Mistral judged its mask at all 4 layers)."""
    import transformers

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    calls, build = [], packed_attention._causal_within_examples

    def counting(*args, **kwargs):
        calls.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "_causal_within_examples", counting)
    ids = torch.randint(0, 64, (2, 20))
    positions = torch.cat([torch.arange(8), torch.arange(12)])[None].repeat(2, 1)
    assert packed_attention.install(model)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        model(input_ids=ids, position_ids=positions)
        assert len(calls) == 2  # one judgement per forward, 4 layers each
        alone = [model(input_ids=ids[:, :8]).logits, model(input_ids=ids[:, 8:]).logits]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)

