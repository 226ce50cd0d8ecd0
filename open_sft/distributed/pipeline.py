"""Pipeline parallelism (PP): the decoder layers split into stages on different ranks, run by torch's own engine
(`torch.distributed.pipelining`: PipelineStage and its 1F1B, GPipe and interleaved 1F1B schedules).

Layout. `--pipeline_parallel_size N` cuts the W processes into W/N data-parallel replicas of N stages (rank =
replica × N + stage position). Stage s holds the decoder layers of its range (`stage_ranges`), the first also
the token embeddings, the last also the final norm, the LM head and open_sft's token loss
(`TokenLossModel.head_loss`). Only hidden states cross a stage boundary; the attention mask, position ids and
labels are known to every rank of the replica (the step plan is a pure function, as under TP), so each stage
gets them as per-micro-batch keyword arguments and the backbone rebuilds its mask and rotary embedding itself.

Why the stages run the model's own backbone forward (with `inputs_embeds` after the first stage) instead of a
re-implementation of it: the families differ in what that forward does between the layers (sliding-window
masks per layer type, scaled embeddings, rotary variants); each stage's backbone sees only its own layers (and
a config whose `num_hidden_layers` and `layer_types` are its slice) while it runs, and `check_stage_entry`
refuses a model whose forward changes the hidden states before the first layer.

The model object stays whole on every rank: the layers, embeddings and head a rank does not own are moved to
the meta device (no memory), so parameter names, the optimizer's and the checkpoint's keys are the unsplit
model's, and the export saves the gathered weights through the ordinary path.

The math (open_sft.training.pipeline_step): the schedule's micro-batches are the replica's micro-batches of the
plan; the loss of each is its token-loss sum × the scale --loss_normalization gives it (torch's own division
by the micro-batch count is off: scale_grads=False); gradients are summed over the replicas and, for tied
embeddings, between the first and the last stage. A PP run's step therefore equals one process's on the same
global batch.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

# --------------------------------------------------------------------------------------------------------------
# What the flags ask, checked up front
# --------------------------------------------------------------------------------------------------------------
def parse_layers(text: Optional[str]) -> Optional[list[int]]:
    """--pipeline_layers '10,20,30' → [10, 20, 30]; ValueError names what is wrong."""
    if text is None:
        return None
    try:
        starts = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--pipeline_layers {text!r}: give comma-separated layer indices, e.g. '10,20,30'")
    if not starts or any(b <= a for a, b in zip(starts, starts[1:])) or starts[0] < 1:
        raise ValueError(f"--pipeline_layers {text!r}: the indices must increase and start at 1 or more (each is "
                         "the first layer of a stage after the first)")
    return starts


def pipeline_flag_problems(t: Any) -> list[str]:
    """The pipeline flags on their own (numbers, schedule and virtual stages agreeing)."""
    problems = []
    if t.pipeline_parallel_size < 1:
        problems.append(f"--pipeline_parallel_size must be at least 1, got {t.pipeline_parallel_size}")
    if t.pipeline_virtual_stages < 1:
        problems.append(f"--pipeline_virtual_stages must be at least 1, got {t.pipeline_virtual_stages}")
    elif t.pipeline_schedule == "interleaved_1f1b" and t.pipeline_virtual_stages < 2:
        problems.append("--pipeline_schedule interleaved_1f1b needs --pipeline_virtual_stages 2 or more")
    elif t.pipeline_schedule != "interleaved_1f1b" and t.pipeline_virtual_stages > 1:
        problems.append(f"--pipeline_virtual_stages {t.pipeline_virtual_stages} needs --pipeline_schedule "
                        "interleaved_1f1b")
    try:
        starts = parse_layers(t.pipeline_layers)
    except ValueError as exc:
        return problems + [str(exc)]
    stages = t.pipeline_parallel_size * t.pipeline_virtual_stages
    if starts is not None and len(starts) != stages - 1:
        problems.append(f"--pipeline_layers gives {len(starts) + 1} stages, the pipeline has {stages} "
                        "(--pipeline_parallel_size × --pipeline_virtual_stages)")
    if starts is not None and t.pipeline_parallel_size == 1:
        problems.append("--pipeline_layers needs --pipeline_parallel_size 2 or more")
    return problems


def pipeline_problems(config: Any, world: int, deepspeed: bool, tp: int) -> list[str]:
    """What --pipeline_parallel_size N cannot run with, each with its fix (checked before any model is loaded).
    FSDP2 composes: it shards each stage over its replicas."""
    t, n = config.train, config.train.pipeline_parallel_size
    if n == 1:
        return []
    flag = f"--pipeline_parallel_size {n}"
    problems = []
    if world % n:
        problems.append(f"{flag} must divide the number of processes ({world}): launch a multiple of {n}")
    if deepspeed:
        problems.append(f"{flag} runs on torch's pipelining, not under DeepSpeed: launch without --use_deepspeed "
                        "(the stages' replicas are data parallel among themselves)")
    if tp > 1:
        problems.append(f"{flag} with tensor parallelism: pick one")
    if t.sequence_parallel_size > 1:
        problems.append(f"{flag} with --sequence_parallel_size: Ulysses SP runs on DeepSpeed; pick one")
    if config.lora.use_qlora:
        problems.append(f"{flag} with --use_qlora: 4-bit weights cannot move between devices by stage; use "
                        "--use_lora")
    if t.load_balancing_loss:
        problems.append(f"{flag} with --load_balancing_loss: the router losses of every stage would have to reach "
                        "the last; drop the flag")
    if t.auto_micro_batch_size:
        problems.append(f"{flag} with --auto_micro_batch_size: it measures the whole model on one rank; give "
                        "--per_device_train_batch_size")
    if config.model.torch_dtype == "float16":
        problems.append(f"{flag} with --torch_dtype float16: fp16 loss scaling is not wired into the pipeline's "
                        "backward; use bfloat16")
    return problems


def stage_ranges(layer_params: list[int], stages: int, starts: Optional[list[int]] = None, first_extra: int = 0,
                 last_extra: int = 0) -> list[range]:
    """The decoder layers of each stage: from --pipeline_layers, else balanced by parameter count — contiguous
    ranges of at least one layer whose largest stage, counting the embeddings on the first and the final norm
    and LM head on the last (`first_extra`, `last_extra`), is as small as it can be (the earliest such split on
    ties, so equal layers spread evenly with the extra layers on the earlier stages)."""
    count = len(layer_params)
    if stages > count:
        raise ValueError(f"{stages} pipeline stages need at least one of the model's {count} decoder layers "
                         "each: use fewer stages")
    if starts is None:
        starts = _balanced_starts(layer_params, stages, first_extra, last_extra)
    bounds = [0, *starts, count]
    if len(bounds) != stages + 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{stages} pipeline stages need at least one of the model's {count} decoder layers "
                         f"each (stage starts {starts}): use fewer stages or other --pipeline_layers")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _balanced_starts(layer_params: list[int], stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Two dynamic programmes over (stages used, layers covered): the smallest possible largest stage, then among
    the splits within it the most even one (least sum of squares)."""
    count = len(layer_params)
    prefix = [0]
    for value in layer_params:
        prefix.append(prefix[-1] + value)

    def cost(a: int, b: int, stage: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)

    def solve(combine: Callable[[float, int], float], limit: float) -> tuple[float, list[int]]:
        best = [[math.inf] * (count + 1) for _ in range(stages + 1)]  # best[s][i]: layers [0, i) in s stages
        cut = [[0] * (count + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for s in range(1, stages + 1):
            for i in range(s, count - (stages - s) + 1):
                for j in range(i - 1, s - 2, -1):  # later cuts first: on ties the earlier stages keep more
                    c = cost(j, i, s - 1)
                    value = combine(best[s - 1][j], c) if c <= limit else math.inf
                    if value < best[s][i]:
                        best[s][i], cut[s][i] = value, j
        starts, i = [], count
        for s in range(stages, 1, -1):
            i = cut[s][i]
            starts.append(i)
        return best[stages][count], starts[::-1]

    largest, _ = solve(max, math.inf)
    return solve(lambda before, c: before + c * c, largest)[1]


@dataclass(frozen=True)
class StageSizes:
    """Parameter counts the split balances: each decoder layer's, and what the end stages hold besides."""

    layers: list[int]
    first: int  # the input embeddings (first stage)
    last: int  # the final norm and the LM head (last stage)


def plan_stages(model: nn.Module, train: Any) -> tuple[list[range], StageSizes]:
    """The split the run makes of `model` (a transformers causal LM, or a peft model around one): each stage's
    decoder layers, from --pipeline_layers or balanced by parameter count, and the sizes it balanced; a
    UserError naming the flag when the model cannot be split so."""
    from open_sft.errors import UserError
    from open_sft.model.anatomy import backbone_of, causal_lm_of, param_numel

    causal_lm = causal_lm_of(model)
    backbone = backbone_of(causal_lm)

    def params(module: Optional[nn.Module]) -> int:
        return sum(param_numel(p) for p in module.parameters()) if module is not None else 0

    sizes = StageSizes([params(layer) for layer in backbone.layers], params(backbone.embed_tokens),
                       params(backbone.norm) + params(causal_lm.get_output_embeddings()))
    try:
        ranges = stage_ranges(sizes.layers, train.pipeline_parallel_size * train.pipeline_virtual_stages,
                              parse_layers(train.pipeline_layers), sizes.first, sizes.last)
    except ValueError as exc:
        raise UserError(f"--pipeline_parallel_size {train.pipeline_parallel_size}: {exc}")
    return ranges, sizes


# --------------------------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PipelineLayout:
    size: int  # N stage positions (ranks) per replica
    virtual: int  # stages per rank
    replicas: int
    position: int  # this rank's position in its replica's pipeline
    replica: int
    pipe_group: Any  # this replica's N ranks
    replica_group: Any  # the ranks holding this position in every replica (their gradients are summed)
    tied_group: Any  # this replica's first and last rank (tied embeddings), or None

    @property
    def stages(self) -> int:
        return self.size * self.virtual

    def stage_ids(self) -> list[int]:
        """The stages this rank runs: its position, and under interleaving position + N, + 2N, ..."""
        return [self.position + k * self.size for k in range(self.virtual)]

    def replica_ranks(self) -> list[int]:
        return [self.replica * self.size + p for p in range(self.size)]


def build_layout(size: int, virtual: int, tied: bool) -> PipelineLayout:
    """The groups of a launched run (collective: every rank creates every group, in the same order)."""
    dist = torch.distributed
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = world // size
    pipes = [dist.new_group(list(range(r * size, (r + 1) * size))) for r in range(replicas)]
    by_position = [dist.new_group(list(range(p, world, size))) for p in range(size)]
    ties = [dist.new_group([r * size, r * size + size - 1]) for r in range(replicas)] if tied else []
    replica, position = divmod(rank, size)
    return PipelineLayout(size, virtual, replicas, position, replica, pipes[replica], by_position[position],
                          ties[replica] if tied else None)


# --------------------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------------------
class StageLayers(nn.ModuleList):
    """The decoder layers a stage owns, iterated in order; their module names stay their index in the whole
    model (`layers.12`), so the stage's parameter names are the unsplit model's."""

    def __init__(self, layers: dict[int, nn.Module]):
        nn.Module.__init__(self)
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, idx):  # the backbone slices `self.layers[: num_hidden_layers]`
        return list(self._modules.values())[idx]


class StageModule(nn.Module):
    """One pipeline stage of a TokenLossModel. forward(x, attention_mask=None, position_ids=None, labels=None):
    x is input_ids on the first stage, the previous stage's hidden states after it; the last stage returns the
    micro-batch's token-loss sum (shape [1]) and keeps it (and each position's loss) for the step's records."""

    def __init__(self, loss_model: nn.Module, layers: range, first: bool, last: bool,
                 autocast: Callable[[], Any] = contextlib.nullcontext):
        super().__init__()
        backbone = _backbone(loss_model)
        self.loss_model = [loss_model]  # not a submodule: its other stages' parameters are on the meta device
        self.first, self.last, self.layer_range = first, last, layers
        self.owned = StageLayers({i: backbone.layers[i] for i in layers})  # registered: parameters() is the stage's
        self.embed = backbone.embed_tokens if first else None
        self.final_norm = backbone.norm if last else None
        self.head = loss_model.causal_lm().get_output_embeddings() if last else None
        self.config = copy.copy(backbone.config)  # the backbone's view while this stage runs: its layers only
        self.config.num_hidden_layers = len(layers)
        if getattr(self.config, "layer_types", None) is not None:
            self.config.layer_types = [backbone.config.layer_types[i] for i in layers]
        self.autocast = autocast
        self.sums: list[torch.Tensor] = []  # last stage: each micro-batch's loss sum, detached, in order
        self.kept: list[Optional[torch.Tensor]] = []  # and its trained positions' losses (per-source losses)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        loss_model = self.loss_model[0]
        backbone = _backbone(loss_model)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with self.autocast(), self.as_backbone(backbone):
            hidden = backbone(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
            if not self.last:
                return hidden
            loss, trained = loss_model.head_loss(hidden, labels)
            if not trained:  # an empty slot: its loss must still reach the hidden states (zero gradients)
                loss = loss + hidden.sum() * 0.0
        self.sums.append(loss.detach())
        self.kept.append(loss_model.token_losses)
        return loss.reshape(1)

    @contextlib.contextmanager
    def as_backbone(self, backbone: nn.Module) -> Iterator[None]:
        """The backbone with this stage's layers, config and (before the last stage) no final norm."""
        saved = backbone.layers, backbone.norm, backbone.config
        backbone.layers, backbone.config = self.owned, self.config
        backbone.norm = self.final_norm if self.last else nn.Identity()
        try:
            yield
        finally:
            backbone.layers, backbone.norm, backbone.config = saved


def _backbone(loss_model: nn.Module) -> nn.Module:
    from open_sft.model.anatomy import backbone_of

    return backbone_of(loss_model.causal_lm())


def _drop(module: nn.Module) -> None:
    """Free a module this rank does not own: each parameter and buffer replaced, in this module only, by a meta
    tensor of its shape (a weight tied to a module that is kept stays real there)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not param.is_meta:
                sub._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                     requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device="meta")


def split_model(loss_model: nn.Module, layout: PipelineLayout, ranges: list[range], device: torch.device,
                autocast: Callable[[], Any] = contextlib.nullcontext) -> list[StageModule]:
    """This rank's stage modules; whatever the rank does not own is dropped to the meta device and what it
    owns moved to `device`."""
    backbone = _backbone(loss_model)
    ids = layout.stage_ids()
    stages = [StageModule(loss_model, ranges[s], s == 0, s == layout.stages - 1, autocast) for s in ids]
    owned = {i for s in ids for i in ranges[s]}
    for index, layer in enumerate(backbone.layers):
        if index not in owned:
            _drop(layer)
    if not any(stage.first for stage in stages):
        _drop(backbone.embed_tokens)
    if not any(stage.last for stage in stages):
        _drop(backbone.norm)
        _drop(loss_model.causal_lm().get_output_embeddings())
    for stage in stages:
        stage.to(device)
    if hasattr(backbone, "rotary_emb"):
        backbone.rotary_emb.to(device)
    return stages


def owned_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters this rank holds (the others are on the meta device)."""
    return [(name, p) for name, p in model.named_parameters() if not p.is_meta]


def owned_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in model.state_dict().items() if not t.is_meta}


def check_stage_entry(loss_model: nn.Module) -> Optional[str]:
    """Why this model family cannot be split (its backbone changes `inputs_embeds` before the first decoder
    layer, which a later stage's hidden states must not undergo), or None. Runs the backbone on 2 positions and
    stops it at the first layer's input (cheap)."""
    backbone = _backbone(loss_model)
    first_layer = backbone.layers[0]
    hidden = getattr(backbone.config, "hidden_size", None)
    if hidden is None:
        return f"model type {backbone.config.model_type!r} has no hidden_size"
    probe = torch.randn(1, 2, hidden, dtype=next(first_layer.parameters()).dtype,
                        device=next(first_layer.parameters()).device)
    seen: list[torch.Tensor] = []

    class _Stop(Exception):
        pass

    def capture(_module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach())
        raise _Stop

    handle = first_layer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            backbone(inputs_embeds=probe, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen or not torch.equal(seen[0], probe):
        return (f"model type {backbone.config.model_type!r} changes the embeddings inside its forward before the "
                "first decoder layer, which a later pipeline stage would apply again")
    return None


def make_schedule(stages: list[StageModule], pipeline_stages: list[Any], microbatches: int, kind: str,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """torch's schedule over this rank's stages; scale_grads=False: the loss of each micro-batch is already
    scaled for the global batch (torch would also divide by the micro-batch count)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipeline_stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(pipeline_stages) > 1:  # several stages a rank, all forwards first (evaluation)
        return ScheduleLoopedBFS(pipeline_stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[kind]
    return schedule(pipeline_stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
