"""Preflight: the memory estimate per rank against the measured peak RSS (±25 %), the time estimate of
--dry_run's probe against the real run's training time (±30 %), and the activation coefficients against
the bytes transformers' Llama really saves for backward.

The memory runs use a model big enough that parameters, optimizer states and activations are a large
share of the peak (not only the interpreter and libraries): hidden 256, 4 layers, 4k vocabulary, 512-token
blocks of text.

The tests of this subject that launch real processes are in tests/integration/test_preflight.py.
"""

from __future__ import annotations

import pytest
import torch

from open_sft.preflight.memory import ModelShape, RunShape, estimate_memory, saved_activation_bytes
from open_sft.preflight.positions import micro_batch_positions, step_slots
from open_sft.preflight.timing import format_seconds


def test_time_probe_scales_the_probe_steps_by_token_positions() -> None:
    """Steps whose time is proportional to the token positions they compute are estimated exactly from
    the probe steps (after the warm-up one), whatever the other steps' sizes."""
    from open_sft.preflight.timing import TimeProbe

    slots = [900, 400, 800, 1200, 300, 2000, 1000, 600]
    probe = TimeProbe(total_steps=len(slots), step_slots=slots)
    seconds_per_slot = 0.002
    for index, size in enumerate(slots):
        probe.record(index, 5.0 if index == 0 else seconds_per_slot * size)  # a slow warm-up step
    assert probe.done and probe.seconds == pytest.approx([0.8, 1.6, 2.4])
    assert probe.estimate_seconds(1, 1) == pytest.approx(seconds_per_slot * sum(slots[1:]))
    assert probe.estimate_seconds(4, 1) == pytest.approx(seconds_per_slot * sum(slots[4:]))


def test_step_timer_estimate_is_warmup_plus_probed_rate() -> None:
    """StepTimer on step times it is given: the estimate logged after the probe steps is the warm-up step's
    time plus the probed rate × the remaining token positions; a resumed launch starts from its step."""
    from open_sft.preflight import timing as preflight

    slots = [100, 100, 200, 300, 100, 400]
    durations = iter([3.0, 0.1, 0.2, 0.3, 0.1, 0.4])  # a warm-up step, then 1 ms per position
    logged = []
    timer = preflight.StepTimer(preflight.TimeProbe(len(slots), slots), 0, log=logged.append)
    for done in range(1, len(slots) + 1):
        assert timer(done, next(durations)) is False  # a timer never stops the run
    assert timer.estimate == pytest.approx(3.0 + 0.001 * sum(slots[1:]))
    assert logged == ["time estimate: 0m04s for steps 1-6 (measured on steps 2-4)"]
    assert timer.elapsed == pytest.approx(4.1)
    resumed = preflight.StepTimer(preflight.TimeProbe(len(slots), slots), 2, log=logged.append)
    for done, seconds in zip(range(3, 7), [1.0, 0.3, 0.1, 0.4]):
        resumed(done, seconds)
    assert resumed.estimate == pytest.approx(1.0 + 0.001 * sum(slots[3:]))
    short = preflight.StepTimer(preflight.TimeProbe(4, slots[:4]), 0, log=logged.append)  # probed to its end
    for done, seconds in zip(range(1, 5), [3.0, 0.1, 0.2, 0.3]):
        short(done, seconds)
    assert short.estimate == pytest.approx(3.0 + 0.001 * sum(slots[1:4])) and len(logged) == 1  # not said after it


@pytest.mark.parametrize("first, eval_steps, evaluates, every, expected", [
    (0, 10, True, "25", (10, 4)),  # evals at 10..100 (the one at the end is step 100's), saves at 25, 50, 75, 100
    (0, 30, True, 40, (4, 2)),  # evals at 30, 60, 90 and the end (100); saves at 40, 80 (none at the end)
    (0, None, True, None, (1, 0)),  # eval data and no --eval_steps: the one at the end
    (0, 10, False, "25", (0, 4)),  # --eval_steps without eval data evaluates nothing
    (37, 10, True, "25", (7, 3)),  # resumed after step 37: evals at 40..100, saves at 50, 75, 100
    (0, 10, True, "epoch", (10, 3)),  # epochs of 34 steps end at 34, 68, 100
])
def test_cadence_counts_the_evaluations_and_saves_of_the_launch(first, eval_steps, evaluates, every,
                                                                  expected) -> None:
    from open_sft.preflight.timing import Cadence

    cadence = Cadence.of(first, 100, eval_steps, evaluates, every, lambda step: step in (34, 68, 100))
    assert (cadence.evals, cadence.saves) == expected


def test_the_estimate_adds_evaluations_and_saves_timed_on_the_first_of_each() -> None:
    """100 steps at 0.1 s (after a 2 s warm-up), 10 evaluations and 4 saves: before either has happened the
    estimate says so; the first evaluation (3 s) and the first save (1.5 s) each refine it, once."""
    from open_sft.preflight.timing import Cadence, StepTimer, TimeProbe

    evals, saves, logged = [], [], []
    timer = StepTimer(TimeProbe(100, [10] * 100), 0, logged.append, Cadence(evals=10, saves=4), evals, saves)
    for done in range(1, 101):
        if done % 10 == 0:
            evals.append(3.0 if done == 10 else 9.0)  # only the first is read
        if done % 25 == 0:
            saves.append(1.5)
        timer(done, 2.0 if done == 1 else 0.1)
    training = 2.0 + 0.1 * 99
    assert logged == [
        "time estimate: 0m12s (training 0m12s + 10 evaluations, not yet measured + 4 checkpoint saves, not yet "
        "measured) for steps 1-100 (measured on steps 2-4)",
        "time estimate: 0m42s (training 0m12s + 10 evaluations × 3.0s + 4 checkpoint saves, not yet measured) "
        "for steps 1-100 (refined)",
        "time estimate: 0m48s (training 0m12s + 10 evaluations × 3.0s + 4 checkpoint saves × 1.5s) for steps "
        "1-100 (refined)"]
    assert timer.estimate == pytest.approx(training + 10 * 3.0 + 4 * 1.5)
    quiet = StepTimer(TimeProbe(6, [1] * 6), 0, logged.append, Cadence(evals=1))  # the eval at the end
    assert quiet.describe(4.0) == (4.0, "0m04s (training 0m04s + 1 evaluation, not yet measured)")


def _saved_bytes(model, tokens: torch.Tensor, mask: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward in the decoder, parameters excluded."""
    seen, total = set(), [0]

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += tensor.untyped_storage().nbytes()
        return tensor

    seen.update(p.untyped_storage().data_ptr() for p in model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.model(input_ids=tokens, attention_mask=mask)
    return total[0]


@pytest.mark.parametrize("hidden,intermediate,layers,bf16,padded", [
    (256, 688, 4, False, False), (384, 1024, 2, False, True), (256, 688, 4, True, False), (512, 1376, 2, True, True),
])
def test_activation_coefficients_match_saved_tensors(hidden, intermediate, layers, bf16, padded) -> None:
    """The estimate's per-token coefficients equal what autograd really keeps for backward (±15 %)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).train()
    tokens = torch.randint(0, 512, (2, 256))
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, 100:] = 0
    measured = _saved_bytes(model, tokens, mask, bf16)
    if bf16:  # autocast's bf16 copies of the layers' weights are saved too; the estimate counts them as parameters
        measured -= 2 * sum(p.numel() for p in model.model.layers.parameters() if p.ndim == 2)
    run = RunShape(1, 0, False, bf16, tokens.numel(), 0, False, attention_width=256 if padded else 0)
    estimated = saved_activation_bytes(ModelShape.of(model), run)
    assert 0.85 * measured <= estimated <= 1.15 * measured, (estimated / 2**20, measured / 2**20)


def _shape(params: int, trainable: int, param_bytes: int) -> ModelShape:
    return ModelShape(params=params, trainable=trainable, param_bytes=param_bytes, largest_param=params // 10,
                      matmul_params=trainable, hidden=1024, layers=8, intermediate=2816, vocab=32000)


def test_model_states_follow_zero_stage_lora_and_dtype() -> None:
    full = _shape(100_000_000, 100_000_000, 400_000_000)

    def states(model, **run):
        fields = dict(world_size=1, zero_stage=0, offload=False, bf16=False, micro_batch_tokens=0,
                      trained_tokens=0, gradient_checkpointing=False)
        estimate = estimate_memory(model, RunShape(**{**fields, **run}), runtime=0)
        return estimate.parameters, estimate.gradients, estimate.optimizer

    params, grads, optimizer = states(full)
    assert (params, grads) == (400_000_000, 400_000_000)
    assert optimizer == 1_200_000_000  # Adam's two fp32 moments + one step temporary
    _, _, zero2_optimizer = states(full, world_size=4, zero_stage=2)
    assert zero2_optimizer == 200_000_000  # 8 bytes × N / 4 ranks
    zero2_params = states(full, world_size=4, zero_stage=2, bf16=True)[0]
    zero3_params = states(full, world_size=4, zero_stage=3, bf16=True)[0]
    assert zero2_params == 200_000_000 + 100_000_000  # bf16 module copy + fp32 master partition
    assert zero3_params < zero2_params  # ZeRO-3 partitions the module's parameters too
    lora = _shape(100_000_000, 1_000_000, 400_000_000)
    lora_params, lora_grads, lora_optimizer = states(lora)
    assert lora_params == 400_000_000 and lora_grads == 4_000_000 and lora_optimizer == 12_000_000
    qlora = _shape(100_000_000, 1_000_000, 56_000_000)  # 4-bit base: packed bytes as loaded
    assert states(qlora)[0] == 56_000_000


def test_packed_micro_batch_positions_count_the_rows_as_collated() -> None:
    assert micro_batch_positions([100, 30, 7], packing=False, row_capacity=512) == 300
    # 300 + 300 + 200 do not fit one 512 row: rows [300, 200] and [300] → 2 rows of width 500
    assert micro_batch_positions([300, 300, 200], packing=True, row_capacity=512) == 1000


def test_step_positions_count_the_fillers_computed() -> None:
    """The time estimate scales with the positions computed: the last step of an epoch of 10 examples at 1 × 8
    computes its 2 examples and, in each of its 6 empty micro-batch slots, a filler (example 0)."""
    from types import SimpleNamespace

    from open_sft.data.batching import BatchLayout, UnpackedPlan

    lengths = [5, 9, 3, 7, 4, 6, 8, 2, 11, 10]
    plan = UnpackedPlan(len(lengths), BatchLayout(1, 8, 1), seed=0)
    slots, _, _ = step_slots(SimpleNamespace(plan=plan, layout=plan.layout, total_steps=2, max_seq_length=0), lengths, False)
    last = [i for indices in plan.micro_batches(0, 1, 0) for i in indices]
    assert slots == [sum(lengths) - sum(lengths[i] for i in last), sum(lengths[i] for i in last) + 6 * lengths[0]]


def test_format_seconds() -> None:
    assert format_seconds(59.6) == "1m00s"
    assert format_seconds(3725) == "1h02m05s"


def test_gpu_estimate_is_within_15_percent_of_the_h200_measurement() -> None:
    """scripts/gpu_check.py's speed part on an NVIDIA H200 (torch 2.11): a Llama-3.2-1B-shaped model (untied
    50,304-token head), 4 × 4,096 packed bf16 tokens per micro-batch, fp32 AdamW, peaked (torch.cuda.
    max_memory_allocated) at 52.16 GiB; at 44.04 with --use_liger_kernel when the loss was still ours (commit
    a78cc67: what a run of several sources still gets), at 41.33 with Liger's fused loss and at 40.17 with
    --torch_compile (commit d7433b0). The estimate, built the way estimate_run builds it on a GPU, lands within
    15 % of each (the issue's figure), and above each."""
    from open_sft.preflight.memory import ModelShape, RunShape, estimate_memory

    hidden, layers, intermediate, vocab = 2048, 16, 8192, 50304
    per_layer = 2 * hidden * hidden + 2 * hidden * 512 + 3 * hidden * intermediate + 2 * hidden
    matmul = 2 * vocab * hidden + layers * (per_layer - 2 * hidden)
    params = 2 * vocab * hidden + layers * per_layer + hidden
    model = ModelShape(params=params, trainable=params, param_bytes=4 * params, largest_param=vocab * hidden,
                       matmul_params=matmul, hidden=hidden, layers=layers, intermediate=intermediate, vocab=vocab,
                       heads=32)
    measured = [({}, 52.16), ({"liger": True}, 44.04), ({"liger": True, "liger_loss": True}, 41.33),
                ({"compiled": True}, 40.17)]
    for flags, peak in measured:
        run = RunShape(world_size=1, zero_stage=0, offload=False, bf16=True, micro_batch_tokens=4 * 4096,
                       trained_tokens=4 * 4096, gradient_checkpointing=False, on_gpu=True, **flags)
        total = estimate_memory(model, run, runtime=0).total / 2**30
        assert peak <= total <= 1.15 * peak, (flags, total)
    cpu = RunShape(world_size=1, zero_stage=0, offload=False, bf16=True, micro_batch_tokens=4 * 4096,
                   trained_tokens=4 * 4096, gradient_checkpointing=False)
    assert estimate_memory(model, cpu, runtime=0).total / 2**30 > 80  # the CPU allocator's factor stays


def test_the_global_batch_line_of_a_packed_run_counts_tokens_not_examples() -> None:
    """Under --packing a micro-batch is a budget of tokens: the line said "8 per micro-batch × 2 × 1 = 16 examples
    per step" where 188 examples ran in 6 steps."""
    from types import SimpleNamespace

    from open_sft.preflight.estimate import Preflight
    from open_sft.preflight.memory import MemoryEstimate

    layout = SimpleNamespace(micro_batch_size=8, gradient_accumulation_steps=2, world_size=1, global_batch_size=16)
    preflight = Preflight(MemoryEstimate(0, 1, 1, 1, 1), 2**30, "cpu", [1])
    packed = SimpleNamespace(steps_per_epoch=6, total_steps=6, num_epochs=1, layout=layout,
                             plan=SimpleNamespace(max_tokens=512))
    assert ("global batch: up to 512 packed tokens per micro-batch × 2 accumulation × 1 rank(s) = up to 1024 tokens "
            "per step, ~31 examples on average (open-instruct's --packing: 16 examples per step, 12 steps per "
            "epoch; --max_tokens_per_batch sets the budget)") in preflight.describe(packed, [0] * 188)
    padded = SimpleNamespace(steps_per_epoch=12, total_steps=12, num_epochs=1, layout=layout, plan=SimpleNamespace())
    assert "global batch: 8 per micro-batch × 2 accumulation × 1 rank(s) = 16 examples per step" in preflight.describe(
        padded, [0] * 188)


@pytest.mark.parametrize("step, width", [(1, 64), (2, 128)])
def test_llama4_dense_layers_mlp_width_is_intermediate_size_mlp(step, width) -> None:
    """Llama 4's dense layers (every other one in Maverick: interleave_moe_layer_step 2) run an MLP
    intermediate_size_mlp wide, twice its experts'; the estimate read the experts' intermediate_size and so counted
    half the activations those layers keep. A model of experts only (Scout: step 1) has no such layer."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=128,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_local_experts=2, interleave_moe_layer_step=step)
    model = Llama4ForCausalLM(config)
    assert ModelShape.of(model).intermediate == width
    dense = [m for name, m in model.named_modules() if name.endswith("feed_forward") and hasattr(m, "up_proj")]
    assert len(dense) == (step - 1) and all(m.up_proj.out_features == 128 for m in dense)
