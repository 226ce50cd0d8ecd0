"""Resuming a checkpoint under another engine: DeepSpeed ZeRO-1/2/3 ↔ FSDP2 ↔ one process or DDP.

What a resume needs of the model and optimizer is the same whatever engine wrote it: for each trained parameter its
fp32 master weight, Adam's two moments and its step count (AdamW everywhere: open_sft.training.optim; the learning
rate is a function of the step, and the run's own counters ride in trainer_state.json). Only the files differ:
accelerate's model.safetensors and the torch optimizer's optimizer.bin (states by index in the optimizer's order,
which is optim.param_group_names's), FSDP2's torch distributed checkpoint (states by parameter name), DeepSpeed's
flat per-rank partitions (made whole per parameter by DeepSpeed's own `ds_to_universal`: open_sft.training.universal).

So a checkpoint of another engine is read per parameter by name (`open_states`) and put into this run's engine by
that engine's own loader: DeepSpeed's universal-checkpoint load (we write the universal layout: one file per
parameter and state, and the two small files of global state it reads), or torch's
`set_model_state_dict` / `set_optimizer_state_dict` (full, name-keyed state dicts, sent from the main rank; FSDP2
shards them as it loads). The conversion runs once, on the main process, into a scratch directory beside the
checkpoint that is removed once loaded; the checkpoint is left as it was. Memory: the main process holds the whole
model's fp32 weights and both moments once (12 bytes per trained parameter) when the target is FSDP2, one process or
DDP; towards DeepSpeed one parameter at a time.

Refused, with the reason: LoRA and QLoRA (their frozen base is stored differently by each engine, and a QLoRA base
is 4-bit), fp16 (each engine keeps its own loss scale), bitsandbytes' 8-bit optimizer (its quantized moments are
not Adam's), pipeline, tensor and sequence parallelism (open_sft.training.elastic).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from open_sft.distributed.collectives import broadcast_object
from open_sft.errors import UserError
from open_sft.export.checkpoint_weights import FSDP_DIR, FSDP_OPTIMIZER_DIR, WRAPPER, distributed_checkpoint
from open_sft.training.checkpoint import ResumePoint
from open_sft.training.optim import param_group_names
from open_sft.training.trained_state import TrainedWeightsState
from open_sft.training.universal import (MODEL_STATES, PARTITIONED_MODEL_STATES, TAG, UniversalResume, convert,
                                         load_universal, partitioned)

logger = logging.getLogger(__name__)

ENGINE_WORDS = {"torch": "one process or DDP", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed ZeRO"}
STATES = ("exp_avg", "exp_avg_sq")


@dataclass
class Trained:
    """One trained parameter as every engine's AdamW needs it."""

    weight: torch.Tensor  # fp32 master
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # float32 scalar: Adam's bias correction


@dataclass
class CheckpointStates:
    """The trained parameters of a checkpoint: `names` (the run's parameter names, TokenLossModel's `model.`
    included) and `load(names)`."""

    names: list[str]
    load: Callable[[list[str]], dict[str, Trained]]


def refusal(state: dict[str, Any], now_config: dict[str, Any], dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why the checkpoint (its trainer `state`) cannot go on under another engine, given this run's resolved config
    and compute dtype; None if it can."""
    saved_config = state.get("config") or {}
    if (state.get("identity") or {}).get("adapters", "full model") != "full model":
        return ("LoRA and QLoRA checkpoints resume under the engine that wrote them (each stores the frozen base its "
                "own way): relaunch with that engine, or export the adapter (`open_sft export`) and start a new run")
    if any((c.get("train") or {}).get("use_8bit_optimizer") for c in (saved_config, now_config)):
        return ("--use_8bit_optimizer keeps quantized moments that only bitsandbytes' optimizer reads: relaunch with "
                "the engine that wrote it")
    if dtype == torch.float16 or "grad_scaler" in state or (saved_config.get("model") or {}).get("torch_dtype") in (
            "float16", "fp16"):
        return "fp16 keeps its loss scale in each engine's own state: relaunch with the engine that wrote it"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Reading: a checkpoint's trained parameters by name
# ----------------------------------------------------------------------------------------------------------------
def _step_tensor(value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).detach().clone().reshape(())


def tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each tied parameter's other names (an untied model: {}): its first name is the optimizer's, and a file that
    stores the tensor once may keep another."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _torch_states(directory: Path, order: list[str], aliases: Optional[dict[str, list[str]]] = None
                  ) -> CheckpointStates:
    """accelerate's model.safetensors (by name; a tied tensor under one of its `aliases`) and optimizer.bin (by
    index in the optimizer's order)."""
    from safetensors import safe_open

    optimizer = torch.load(directory / "optimizer.bin", map_location="cpu", mmap=True, weights_only=False)
    ids = [i for group in optimizer["param_groups"] for i in group["params"]]
    if len(ids) != len(order):
        raise UserError(f"{directory}: its optimizer steps {len(ids)} parameters, this run's model trains "
                        f"{len(order)}; resume it with the model it was trained from")
    index = dict(zip(order, ids))
    steps = [s["step"] for s in optimizer["state"].values() if "step" in s]
    latest = max((float(s) for s in steps), default=0.0)

    def load(names: list[str]) -> dict[str, Trained]:
        out = {}
        with safe_open(str(directory / "model.safetensors"), "pt") as file:
            stored = set(file.keys())
            for name in names:
                key = next((k for k in (name, *(aliases or {}).get(name, ())) if k in stored), name)
                weight = file.get_tensor(key).float()
                state = optimizer["state"].get(index[name])
                if state is None:  # never had a gradient: torch made no state for it
                    state = {"exp_avg": torch.zeros_like(weight), "exp_avg_sq": torch.zeros_like(weight),
                             "step": latest}
                out[name] = Trained(weight, *(state[k].float() for k in STATES), _step_tensor(state["step"]))
        return out

    return CheckpointStates(list(order), load)


def _fsdp2_states(directory: Path) -> CheckpointStates:
    """FSDP2's torch distributed checkpoint, read without a process group by the export's reader: the model's
    weights and the optimizer's states (under `optimizer.state.<name>.`), each assembled whole from the ranks'
    shards. That reader names tensors without TokenLossModel's `model.`; these names keep it."""
    weights = distributed_checkpoint(directory / FSDP_DIR)
    states = distributed_checkpoint(directory / FSDP_OPTIMIZER_DIR, prefix="optimizer.state.")
    names = [WRAPPER + key.removesuffix(".exp_avg") for key in states.weights if key.endswith(".exp_avg")]

    def load(wanted: list[str]) -> dict[str, Trained]:
        bare = [n.removeprefix(WRAPPER) for n in wanted]
        weight = weights.load(bare)
        state = states.load(f"{n}.{k}" for n in bare for k in (*STATES, "step"))
        return {name: Trained(weight[n].float(), *(state[f"{n}.{k}"].float() for k in STATES),
                              _step_tensor(state[f"{n}.step"])) for name, n in zip(wanted, bare)}

    return CheckpointStates(names, load)


def universal_states(folder: Path) -> CheckpointStates:
    """A universal checkpoint's zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt; the step per parameter (ZeRO-1/2's
    step.pt) or of the whole optimizer (ZeRO-3's, in zero/optimizer_state.pt)."""
    zero = folder / TAG / "zero"
    names = sorted(p.name for p in zero.iterdir() if p.is_dir())
    shared: Optional[torch.Tensor] = None
    if names and not (zero / names[0] / "step.pt").is_file():
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", mmap=True, weights_only=False)
        shared = _step_tensor(common["optimizer_state_dict"]["state"][0]["step"])

    def read(path: Path) -> torch.Tensor:
        value = torch.load(path, map_location="cpu", weights_only=False)
        return value["param"] if isinstance(value, dict) else value

    def load(wanted: list[str]) -> dict[str, Trained]:
        return {n: Trained(read(zero / n / "fp32.pt").float(), *(read(zero / n / f"{k}.pt").float() for k in STATES),
                           _step_tensor(shared if shared is not None else read(zero / n / "step.pt")))
                for n in wanted}

    return CheckpointStates(names, load)


def open_states(checkpoint: Path, engine: str, order: list[str], scratch: Path,
                aliases: Optional[dict[str, list[str]]] = None) -> CheckpointStates:
    """The trained parameters of `checkpoint` (written by `engine`); `order`: this run's trained parameter names in
    its optimizer's order (`aliases`: tied_names); `scratch`: where a ZeRO checkpoint is made whole per parameter."""
    if engine == "deepspeed":
        convert(checkpoint, scratch)
        return universal_states(scratch)
    if engine == "fsdp2":
        return _fsdp2_states(checkpoint)
    return _torch_states(checkpoint, order, aliases)


# ----------------------------------------------------------------------------------------------------------------
# Writing: into this run's engine
# ----------------------------------------------------------------------------------------------------------------
def _universal_file(tensor: torch.Tensor) -> dict[str, Any]:
    return {"param": tensor.contiguous(), "cat_dim": 0}


def write_universal(states: CheckpointStates, target: Path, engine: Any, world: int, step: int,
                    chunk: int = 16) -> None:
    """`states` in DeepSpeed's universal layout under `target`/pytorch_model for the live DeepSpeed `engine`: each
    parameter's fp32.pt, exp_avg.pt, exp_avg_sq.pt and step.pt, and what its loader reads besides (zero/
    optimizer_state.pt: the optimizer's hyperparameters and, for ZeRO-3, its step; the model states file: the
    step counters). Written a few parameters at a time."""
    import deepspeed

    zero = target / TAG / "zero"
    zero.mkdir(parents=True)
    steps = []
    for start in range(0, len(states.names), chunk):
        for name, trained in states.load(states.names[start:start + chunk]).items():
            folder = zero / name
            folder.mkdir()
            torch.save(_universal_file(trained.weight), folder / "fp32.pt")
            for key in STATES:
                torch.save(_universal_file(getattr(trained, key)), folder / f"{key}.pt")
            torch.save(trained.step, folder / "step.pt")
            steps.append(float(trained.step))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [i]}
              for i, group in enumerate(inner.param_groups)]
    step_tensor = _step_tensor(max(steps, default=0.0))
    torch.save({"ds_version": deepspeed.__version__, "param_groups": groups,
                "optimizer_state_dict": {"state": {0: {"step": step_tensor}}, "param_groups": groups}},
               zero / "optimizer_state.pt")
    model_states = PARTITIONED_MODEL_STATES if engine.zero_optimization_partition_weights() else MODEL_STATES
    torch.save({"module": {}, "buffer_names": [], "optimizer": None, "lr_scheduler": None, "skipped_steps": 0,
                "global_steps": step, "global_samples": step * engine.train_batch_size(), "dp_world_size": world,
                "mp_world_size": 1, "ds_version": deepspeed.__version__}, target / TAG / model_states)


def _full_state_dicts(states: CheckpointStates, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      groups: tuple[list[str], list[str]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The name-keyed full state dicts torch's set_state_dict takes: the model's (its own buffers kept) and the
    optimizer's (its own hyperparameters kept, `groups`: its groups' parameter names), filled from `states`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    loaded = states.load([name for names in groups for name in names])
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, trained in loaded.items():  # ZeRO-3's universal files hold each parameter flat
        shape = model_sd[name].shape
        trained.weight, trained.exp_avg, trained.exp_avg_sq = (t.reshape(shape) for t in (
            trained.weight, trained.exp_avg, trained.exp_avg_sq))
        model_sd[name] = trained.weight.to(model_sd[name].dtype)
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                    for group, names in zip(optimizer.param_groups, groups)]
    # a step tensor per parameter: torch's load keeps the tensor it is given, and Adam advances each one in place
    optim_sd = {"state": {n: {"step": t.step.clone(), "exp_avg": t.exp_avg, "exp_avg_sq": t.exp_avg_sq}
                          for n, t in loaded.items()}, "param_groups": param_groups}
    return model_sd, optim_sd


def load_torch(states: Optional[CheckpointStates], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               groups: tuple[list[str], list[str]]) -> None:
    """Collective: `states` (read on the main process; None elsewhere) into a one-process, DDP or FSDP2 model
    and its torch optimizer (`groups`: optim.param_group_names of the model), through torch's state-dict API (the
    main process's full state dicts sent to the other ranks, which keep their part)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and (
        torch.distributed.get_world_size() > 1)
    if states is not None:
        model_sd, optim_sd = _full_state_dicts(states, model, optimizer, groups)
    else:  # the template's gather is collective under FSDP2; what other ranks pass is ignored
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model_sd, optim_sd = {}, {}
    # apart: set_state_dict takes a rank's empty model state dict for "the optimizer only", so it would not
    # receive the main process's weights
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)


class CrossEngineResume:
    """What the Checkpointer saves and loads with (its `state_io`) when the checkpoint was written by another
    engine: saves as accelerate does (this run's own format from now on); loads by converting (above)."""

    def __init__(self, accelerator: Any, trainer: Any, resume: ResumePoint, now_engine: str):
        self.accelerator, self.trainer, self.resume, self.now_engine = accelerator, trainer, resume, now_engine

    def save(self, directory: str) -> None:
        self.accelerator.save_state(directory)

    def load(self, directory: str) -> None:
        from accelerate.checkpointing import load_accelerator_state

        acc, checkpoint = self.accelerator, Path(directory)
        identity = self.resume.state.get("identity", {})
        engine, world = identity.get("engine", "torch"), int(identity.get("world_size", 1))
        scratch = checkpoint.with_name(checkpoint.name + ".portable.tmp")
        module = acc.unwrap_model(self.trainer.model)
        groups = param_group_names(module)
        order = groups[0] + groups[1]
        states, error = None, None
        if acc.is_main_process:
            try:
                shutil.rmtree(scratch, ignore_errors=True)
                states = open_states(checkpoint, engine, order, scratch / "source", tied_names(module))
                _check_names(states, order, checkpoint)
                logger.info("resuming a %s checkpoint of %d rank(s) under %s: its fp32 weights and Adam moments "
                            "(%d trained tensors) read by name", _words(engine, checkpoint), world,
                            _words(self.now_engine, engine=self.trainer.model), len(order))
                if self.now_engine == "deepspeed":
                    write_universal(states, scratch / "target", self.trainer.model, acc.num_processes,
                                    self.resume.step)
                    for rng in checkpoint.glob("random_states_*.pkl"):
                        shutil.copy2(rng, scratch / "target" / rng.name)
            except UserError as exc:
                error = str(exc)
        error = broadcast_object(error)  # every rank raises, none waits in a collective
        if error:
            raise UserError(error)
        if self.now_engine == "deepspeed":
            load_universal(acc, self.trainer.model, scratch / "target")
        else:
            load_torch(states, self.trainer.model, getattr(self.trainer.optimizer, "optimizer",
                                                           self.trainer.optimizer), groups)
            load_accelerator_state(str(checkpoint), [], [], [], [], acc.process_index)  # the random states
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(scratch, ignore_errors=True)


def checkpoint_io(resume: Optional[ResumePoint], trainer: Any, identity: dict[str, Any],
                  quantized_base: bool = False) -> Any:
    """What the run's Checkpointer saves and loads with: CrossEngineResume when `resume` was written by another
    engine than this run's (`identity['engine']`), UniversalResume when it is a ZeRO checkpoint of another number of
    ranks, TrainedWeightsState for a run on a frozen 4-bit base (`quantized_base`: QLoRA, one process or DDP), else
    the engine's own (None: accelerate's save_state and load_state)."""
    saved = resume.state.get("identity", {}) if resume is not None else {}
    world = trainer.accelerator.num_processes
    if resume is not None and (saved.get("engine", "torch") != identity["engine"] or (
            saved.get("engine") == "deepspeed" and _other_zero_stage(resume.path, trainer.model))):
        return CrossEngineResume(trainer.accelerator, trainer, resume, identity["engine"])
    if quantized_base:
        return TrainedWeightsState(trainer.accelerator)
    if saved.get("engine") != "deepspeed" or saved.get("world_size", world) == world:
        return trainer.engine.checkpoint_io()
    return UniversalResume(trainer.accelerator, trainer.model, int(saved["world_size"]))


def _other_zero_stage(checkpoint: Path, engine: Any) -> bool:
    """Whether a ZeRO checkpoint's weights are partitioned (stage 3) and this run's are not, or the other way round:
    DeepSpeed's own load reads only its own stage's files, and the two universal layouts keep the step and the
    global state in other places, so the checkpoint is converted as another engine's is."""
    live = getattr(engine, "zero_optimization_partition_weights", None)
    return live is not None and partitioned(checkpoint) != bool(live())


def _words(name: str, checkpoint: Optional[Path] = None, engine: Any = None) -> str:
    """An engine in a log line; DeepSpeed's with its stage (a checkpoint's: partitioned weights or not)."""
    if name != "deepspeed":
        return ENGINE_WORDS.get(name, name)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        return f"DeepSpeed ZeRO-{engine.zero_optimization_stage()}"
    if checkpoint is not None:
        return "DeepSpeed ZeRO-3" if partitioned(checkpoint) else "DeepSpeed ZeRO-1/2"
    return ENGINE_WORDS[name]


def _check_names(states: CheckpointStates, order: list[str], checkpoint: Path) -> None:
    missing = sorted(set(order) - set(states.names))
    extra = sorted(set(states.names) - set(order))
    if missing or extra:
        raise UserError(f"{checkpoint} trains other parameters than this run's model (missing "
                        f"{', '.join(missing[:3]) or 'none'}; not in this model {', '.join(extra[:3]) or 'none'}); "
                        "resume it with the model and adapters it was trained with")
