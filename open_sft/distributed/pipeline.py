"""Pipeline parallelism (PP): the decoder layers split into stages on different ranks, run by torch's own engine
(`torch.distributed.pipelining`: PipelineStage and its 1F1B, GPipe and interleaved 1F1B schedules). This module
builds and runs the stages; what the flags ask, the stages' layer ranges and the process groups are planned in
open_sft.distributed.pipeline_plan.

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

The math (open_sft.training.pipeline_engine): the schedule's micro-batches are the replica's micro-batches of the
plan; the loss of each is its token-loss sum × the scale --loss_normalization gives it (torch's own division
by the micro-batch count is off: scale_grads=False); gradients are summed over the replicas and, for tied
embeddings, between the first and the last stage. A PP run's step therefore equals one process's on the same
global batch.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from open_sft.distributed.pipeline_plan import PipelineLayout
from open_sft.model.flash_packing import backbone_kwargs, packed_rows, uses_flash

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
        self.routed = loss_model.router is not None  # --load_balancing_loss: router logits travel to the last stage
        self.sums: list[torch.Tensor] = []  # last stage: each micro-batch's loss sum, detached, in order
        self.aux: list[Optional[torch.Tensor]] = []  # and its router loss × trained tokens (None: no router loss)
        self.kept: list[Optional[torch.Tensor]] = []  # and its trained positions' losses (per-source losses)

    def forward(self, x: torch.Tensor, routed: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, router_mask: Optional[torch.Tensor] = None) -> Any:
        """`routed`: the router logits of the earlier stages' layers (training with --load_balancing_loss), handed
        on with this stage's appended; the last stage adds the router loss of them all, as the unsplit model's
        forward does (open_sft.model.loss.TokenLossModel), counting the positions of `router_mask`."""
        loss_model = self.loss_model[0]
        backbone = _backbone(loss_model)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        routing = self.routed and loss_model.training
        if attention_mask is None and position_ids is not None and uses_flash(loss_model.causal_lm()):
            # packed rows under flash_attention_2: where each example starts (open_sft.model.flash_packing), read
            # off this micro-batch's position ids (once per stage pass, not per layer)
            rows = packed_rows(position_ids.cpu(), position_ids.device)
            inputs.update(backbone_kwargs(rows.get("cu_seq_lens"), rows.get("max_length")))
        with self.autocast(), self.as_backbone(backbone):
            out = backbone(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                           **({"output_router_logits": routing} if loss_model.router_switch or routing else {}))
            hidden = out.last_hidden_state
            if routing:
                routed = torch.cat([*([routed] if routed is not None else []), *out.router_logits])
            if not self.last:
                return (hidden, routed) if routing else hidden
            loss, trained = loss_model.head_loss(hidden, labels)
            if not trained:  # an empty slot: its loss must still reach the hidden states (zero gradients)
                loss = loss + hidden.sum() * 0.0
            aux = None
            if routing:
                router = loss_model.router
                layers = routed.split(hidden.shape[0] * hidden.shape[1])  # each layer's, as the unsplit model hands them
                aux = router.function(layers, router.experts, router.top_k, router_mask).float() * trained
        self.sums.append(loss.detach())
        self.aux.append(aux.detach() if aux is not None else None)
        self.kept.append(loss_model.token_losses)
        return (loss + router.coefficient * aux if aux is not None else loss).reshape(1)

    def clear(self) -> None:
        for records in (self.sums, self.aux, self.kept):
            records.clear()

    def keep_last(self, count: int) -> None:
        """Keep the last `count` micro-batches' records (a new schedule first runs on placeholder inputs)."""
        for records in (self.sums, self.aux, self.kept):
            del records[:-count]

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


@dataclass
class Pipeline:
    layout: PipelineLayout
    stages: list[StageModule]  # this rank's, in stage order
    pipeline_stages: list[Any]  # torch's PipelineStage of each
    schedule: str
    tied: bool  # the unsplit model ties its input embeddings and LM head
    sharded: bool = False  # FSDP2 shards each stage over its replicas (else every replica holds it whole)
    routed: bool = False  # --load_balancing_loss: the router logits travel with the hidden states

    def last(self) -> Optional[StageModule]:
        return next((stage for stage in self.stages if stage.last), None)

    def first(self) -> Optional[StageModule]:
        return next((stage for stage in self.stages if stage.first), None)


def start_pipeline(loss_model: torch.nn.Module, train: Any, device: torch.device, shard: bool = False) -> Pipeline:
    """Split the TokenLossModel into this rank's stages (collective: the process groups). `shard` (an FSDP2
    launch): each stage's layers, and the rest of it, are FSDP2 units sharded over the stage's replicas, as
    torchtitan composes them; kept gathered through a step's micro-batches (reshard_after_forward=False)."""
    from torch.distributed.pipelining import PipelineStage

    from open_sft.distributed.pipeline_plan import build_layout, plan_stages
    from open_sft.errors import UserError
    from open_sft.model.anatomy import backbone_of

    backbone = backbone_of(loss_model.causal_lm())
    problem = check_stage_entry(loss_model)
    if problem is not None:
        raise UserError(f"--pipeline_parallel_size {train.pipeline_parallel_size}: {problem}; train this model "
                        "without pipeline parallelism")
    head = loss_model.causal_lm().get_output_embeddings()
    tied = head is not None and head.weight is backbone.embed_tokens.weight
    size, virtual = train.pipeline_parallel_size, train.pipeline_virtual_stages
    ranges, _ = plan_stages(loss_model.causal_lm(), train)
    layout = build_layout(size, virtual, tied)
    stages = split_model(loss_model, layout, ranges, device)
    sharded = shard and layout.replicas > 1
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (layout.replicas, size), mesh_dim_names=("replica", "stage"))["replica"]
        for stage in stages:
            for layer in stage.owned:
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(stage, mesh=mesh, reshard_after_forward=False)
    pipeline_stages = [PipelineStage(stage, index, layout.stages, device, group=layout.pipe_group)
                       for stage, index in zip(stages, layout.stage_ids())]
    return Pipeline(layout, stages, pipeline_stages, train.pipeline_schedule, tied, sharded,
                    routed=loss_model.router is not None)


def describe(pipeline: Pipeline) -> str:
    ranges = ", ".join(f"stage {i}: layers {r.start}-{r.stop - 1}" for i, r in
                       ((s.stage_index, m.layer_range) for s, m in zip(pipeline.pipeline_stages, pipeline.stages)))
    layout = pipeline.layout
    sharded = ", each stage FSDP2-sharded over them" if pipeline.sharded else ""
    return (f"pipeline parallel {layout.size} × {layout.replicas} data-parallel replica(s){sharded}, schedule "
            f"{pipeline.schedule}, {layout.stages} stages; this rank: {ranges}")
