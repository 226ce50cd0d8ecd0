"""Learning-rate schedules against their formulas, decay groups, and fused AdamW against the reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from open_sft.training.optim import (build_optimizer, fused_adamw_supported, lr_multiplier, optimizer_impl, param_groups,
                             warmup_steps_for)


@pytest.mark.parametrize("kind, step, expected", [
    # total 100 steps, 10 warmup: warmup reaches the peak at step 9
    ("linear", 0, 0.1), ("linear", 9, 1.0), ("linear", 10, 1.0), ("linear", 55, 1 - 45 / 90), ("linear", 99, 1 / 90),
    ("cosine", 10, 1.0), ("cosine", 55, 0.5 * (1 + math.cos(math.pi * 0.5))), ("cosine", 99, 0.5 * (1 + math.cos(math.pi * 89 / 90))),
    ("constant", 0, 1.0), ("constant", 99, 1.0),
    ("constant_with_warmup", 4, 0.5), ("constant_with_warmup", 50, 1.0),
    ("wsd", 4, 0.5), ("wsd", 89, 1.0), ("wsd", 90, 1 - 1 / 11), ("wsd", 99, 1 - 10 / 11),
])
def test_schedules_follow_the_formula(kind, step, expected) -> None:
    assert lr_multiplier(kind, step, warmup_steps=10, total_steps=100) == pytest.approx(expected)


def test_warmup_steps_and_decay_groups() -> None:
    assert warmup_steps_for(0.03, 100) == 3 and warmup_steps_for(0.0, 100) == 0
    # the product rounded before the ceiling: 0.07 × 100 is 7.000000000000001 in floating point
    assert warmup_steps_for(0.07, 100) == 7 and warmup_steps_for(0.03, 50) == 2 and warmup_steps_for(0.1, 13) == 2
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3  # bias, norm weight, norm bias


def test_fused_adamw_matches_the_reference_loop() -> None:
    """30 steps with weight decay on matrices only: the fused kernel build_optimizer picks on CPU gives the
    weights and Adam moments of torch's single-tensor loop within float32 rounding (observed: weights and
    moments equal to < 1e-6 in relative norm). The optimizer always holds fp32 weights here (bf16 runs keep fp32 master weights)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))
    fused_model, reference_model = model(), model()
    fused = build_optimizer(fused_model, 1e-2, 0.1)
    reference = torch.optim.AdamW(param_groups(reference_model, 0.1), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                  foreach=False)
    assert optimizer_impl(fused) == {"class": "torch.optim.adamw.AdamW", "implementation": "fused", "wrapped_by": []}
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        x = torch.randn(16, 64, generator=generator)
        for net, optimizer in ((fused_model, fused), (reference_model, reference)):
            optimizer.zero_grad()
            net(x).pow(2).mean().backward()
            optimizer.step()
    start = model()
    for (name, a), b, b0 in zip(fused_model.named_parameters(), reference_model.parameters(), start.parameters()):
        assert not torch.equal(b, b0), name  # the comparison is over weights that really moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):  # moments pass through zero: compare relative norms (observed < 1e-6)
            ours, theirs = fused.state[a][key], reference.state[b][key]
            assert float((ours - theirs).norm() / theirs.norm()) < 1e-5, (name, key)


def test_foreach_where_fused_is_not_built(monkeypatch) -> None:
    """The meta device has no fused kernel: the probe says so, and where it says so AdamW falls back to foreach."""
    from open_sft.training import optim

    assert fused_adamw_supported([torch.zeros(2)]) and not fused_adamw_supported([torch.zeros(2, device="meta")])
    monkeypatch.setattr(optim, "fused_adamw_supported", lambda params: False)
    assert optimizer_impl(build_optimizer(torch.nn.Linear(4, 4), 1e-3, 0.0))["implementation"] == "foreach"


def test_parameters_on_the_meta_device_are_not_stepped() -> None:
    """Another pipeline stage's parameters (open_sft.distributed.pipeline) are not this rank's to step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.device("meta"):
        model[1] = torch.nn.Linear(4, 4)
    stepped = [p for group in build_optimizer(model, 1e-3, 0.1).param_groups for p in group["params"]]
    assert len(stepped) == 2 and all(not p.is_meta for p in stepped)


FLAGS = ["--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--weight_decay", "0.1"]


@pytest.mark.parametrize("eight_bit", [False, True])
def test_the_adam_flags_reach_every_parameter_group(eight_bit) -> None:
    """--adam_beta1/--adam_beta2/--adam_epsilon (TrainingArguments' names) are what AdamW steps with, torch's and
    bitsandbytes' 8-bit one alike; left out, torch's defaults (0.9, 0.999) and 1e-8."""
    from open_sft.config.parse import parse_config
    from open_sft.training.optim import optimizer_for

    if eight_bit:
        pytest.importorskip("bitsandbytes")
    extra = ["--use_8bit_optimizer"] if eight_bit else []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    given = parse_config(FLAGS + extra + ["--adam_beta1", "0.8", "--adam_beta2", "0.95", "--adam_epsilon", "1e-6"])
    groups = optimizer_for(model, given.train).param_groups
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in groups] == [((0.8, 0.95), 1e-6, 0.1),
                                                                           ((0.8, 0.95), 1e-6, 0.0)]
    default = optimizer_for(model, parse_config(FLAGS + extra).train)
    assert [(g["betas"], g["eps"]) for g in default.param_groups] == [((0.9, 0.999), 1e-8)] * 2
    assert type(default).__name__ == ("AdamW8bit" if eight_bit else "AdamW")


def test_a_resume_steps_with_the_flags_hyperparameters_not_the_checkpoints() -> None:
    """torch's load_state_dict puts the checkpoint's betas, eps and weight decay back: after it, set_hyperparameters
    (Trainer.load_state_dict) makes them the flags' again, as --allow_changed_settings lets a new --learning_rate
    take from the resumed step; the moments stay the checkpoint's."""
    from open_sft.training.optim import set_hyperparameters

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    saved = build_optimizer(model, 1e-3, 0.0)
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    resumed = build_optimizer(model, 1e-3, 0.1, betas=(0.9, 0.95), eps=1e-6)
    resumed.load_state_dict(saved.state_dict())
    assert [g["betas"] for g in resumed.param_groups] == [(0.9, 0.999)] * 2  # what the flags alone would lose
    set_hyperparameters(resumed, 0.1, (0.9, 0.95), 1e-6)
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in resumed.param_groups] == [((0.9, 0.95), 1e-6, 0.1),
                                                                                          ((0.9, 0.95), 1e-6, 0.0)]
    weight = model[0].weight
    assert torch.equal(resumed.state[weight]["exp_avg"], saved.state[weight]["exp_avg"])


def test_a_wsd_warmup_running_into_its_decay_is_refused_naming_both_flags() -> None:
    """--max_train_steps 20 --warmup_ratio 0.5 --wsd_decay_ratio 0.6: 10 warmup steps, decay over the last 12 (from
    step 8), so the rate climbed to the peak at step 9 inside the decay and fell to 0.77 at step 10. Refused with
    the flags; the most warmup that fits (8 steps) gives a schedule that rises to the peak, then falls."""
    from open_sft.config.parse import parse_config
    from open_sft.errors import ConfigError
    from open_sft.training.optim import wsd_overlap_problem

    assert [round(lr_multiplier("wsd", s, 10, 20, 0.6), 3) for s in (8, 9, 10)] == [0.9, 1.0, 0.769]  # the bug
    expected = ("--lr_scheduler_type wsd: --warmup_ratio 0.5 makes 10 warmup steps, which run into the decay over "
                "the last 12 of the 20 steps (--wsd_decay_ratio 0.6): the learning rate would rise to its peak inside "
                "the decay, then drop; lower --warmup_ratio 0.5 or --wsd_decay_ratio so that warmup and decay fit in "
                "20 steps")
    assert wsd_overlap_problem("wsd", 10, 20, 0.6, "--warmup_ratio 0.5") == expected
    base = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0", "--lr_scheduler_type",
            "wsd", "--max_train_steps", "20", "--wsd_decay_ratio", "0.6"]
    with pytest.raises(ConfigError) as error:
        parse_config(base + ["--warmup_ratio", "0.5"])
    assert expected in str(error.value)
    with pytest.raises(ConfigError, match=r"--warmup_steps 10 makes 10 warmup steps, which run into the decay"):
        parse_config(base + ["--warmup_steps", "10"])
    assert parse_config(base + ["--warmup_steps", "9"]).train.warmup_steps == 9
    # 9 warmup steps: the last (step 8) is the decay's first, at the peak; the decay goes on from it
    fits = [lr_multiplier("wsd", s, 9, 20, 0.6) for s in range(20)]
    assert fits[:9] == sorted(fits[:9]) and fits[8] == 1.0 and fits[8:] == sorted(fits[8:], reverse=True)
    assert fits[9] == pytest.approx(1 - 2 / 13)
    for other in ("linear", "cosine"):  # only wsd has a decay of its own to run into
        assert wsd_overlap_problem(other, 10, 20, 0.6, "--warmup_ratio 0.5") is None
    assert wsd_overlap_problem("wsd", 1, 1, 0.1, "--warmup_ratio 0.03") is None  # one step: no shape to break


@pytest.mark.parametrize("warmup_ratio, decay_ratio, steps, warmup, decay", [
    (0.93, 0.07, 100, 93, 7), (0.1, 0.9, 15, 2, 14), (0.1, 0.9, 25, 3, 23), (0.1, 0.9, 33, 4, 30),
    (0.1, 0.9, 1001, 101, 901)])
def test_wsd_ratios_adding_to_one_are_accepted(warmup_ratio, decay_ratio, steps, warmup, decay) -> None:
    """The decay is rounded as the warmup is (0.07 × 100 was 8 decay steps), and the warmup's last step may be the
    decay's first: each of these was refused as an overlap. The rate rises to the peak, then only falls."""
    from open_sft.config.parse import parse_config
    from open_sft.training.optim import wsd_decay_steps

    assert (warmup_steps_for(warmup_ratio, steps), wsd_decay_steps(decay_ratio, steps)) == (warmup, decay)
    flags = ["--model_name_or_path", "org/model", "--dataset_mixer_list", "a.jsonl", "1.0", "--lr_scheduler_type",
             "wsd", "--max_train_steps", str(steps), "--warmup_ratio", str(warmup_ratio), "--wsd_decay_ratio",
             str(decay_ratio)]
    assert parse_config(flags).train.wsd_decay_ratio == decay_ratio
    rates = [lr_multiplier("wsd", s, warmup, steps, decay_ratio) for s in range(steps)]
    assert rates[warmup - 1] == 1.0 and rates[:warmup] == sorted(rates[:warmup])
    assert rates[warmup - 1:] == sorted(rates[warmup - 1:], reverse=True) and rates[-1] == pytest.approx(1 / (decay + 1))


def test_a_wsd_warmup_one_step_further_into_the_decay_is_refused() -> None:
    """0.1 and 0.9 of 15 steps share one step (2 warmup, decay from step 1); a third warmup step would climb to
    the peak at step 2, above the decay's line at step 1."""
    from open_sft.training.optim import wsd_overlap_problem

    assert wsd_overlap_problem("wsd", 2, 15, 0.9, "--warmup_steps 2") is None
    assert "3 warmup steps, which run into the decay over the last 14 of the 15 steps" in \
        wsd_overlap_problem("wsd", 3, 15, 0.9, "--warmup_steps 3")
    assert "95 warmup steps, which run into the decay over the last 7 of the 100 steps" in \
        wsd_overlap_problem("wsd", 95, 100, 0.07, "--warmup_ratio 0.95")


def test_the_step_plan_refuses_a_wsd_overlap_the_flags_could_not_see() -> None:
    """Without --max_train_steps the steps are known only from the data: the step plan refuses it there."""
    from open_sft.config.args import TrainingArguments
    from open_sft.errors import UserError
    from open_sft.training.steps import plan_steps

    data = type("Data", (), {"lengths": lambda self: [8] * 20, "__len__": lambda self: 20})()  # 2 epochs of 10 steps
    args = TrainingArguments(per_device_train_batch_size=2, lr_scheduler_type="wsd", warmup_ratio=0.5,
                             wsd_decay_ratio=0.6, balance_micro_batches=False)
    with pytest.raises(UserError, match=r"--warmup_ratio 0.5 makes 10 warmup steps, which run into the decay over the "
                                        r"last 12 of the 20 steps"):
        plan_steps(args, data, 1, 64)
    assert plan_steps(TrainingArguments(per_device_train_batch_size=2, lr_scheduler_type="wsd", warmup_ratio=0.4,
                                        wsd_decay_ratio=0.6, balance_micro_batches=False), data, 1, 64).warmup_steps == 8
