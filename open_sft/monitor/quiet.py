"""Third-party output that does not apply to a run, silenced at its source (issue: a user reads the log).

- Progress bars (transformers' "Loading weights", "Writing model shards", datasets', huggingface_hub's) are
  drawn only on a terminal: in a redirected log they are carriage-return noise between the log lines.
- bitsandbytes warns at import that it could not load its 4-bit CPU inference kernel from the Hub (with the
  exception's text, once per process: every rank); peft imports bitsandbytes on every LoRA run. open_sft stops
  that fetch (open_sft/__init__.py: LOCAL_KERNELS) and training never calls the kernel: the warning is silenced.
- transformers' FutureWarning about `is_gradient_checkpointing` is raised by peft's own call, not by anything a
  user wrote or can change; peft's warning that it saves the embedding layers of a resized vocabulary says what
  open_sft meant it to do (added tokens' rows are trained and saved; the log says which tokens).
- torchao (--fp8's; transformers imports it while loading any model when it is installed) warns at import that its
  C++ kernels for other formats failed to load against this torch build and that Triton is missing (on a CPU), and
  torch's pytree that torchao registers enums it no longer needs to: none of it touches FP8 training, whose matmul
  is torch's own. Those lines, and only those, are dropped.
- huggingface_hub's "Model weights successfully saved to" names an export's staging directory, gone after it.
- accelerate's "Removed shared tensor {'lm_head.weight'} while saving ... check by verifying that you don't receive
  any warning while reloading", at every checkpoint of a model with tied embeddings (Qwen3 0.6B, Llama 3.2 1B,
  Gemma 3, SmolLM3) under one process or DDP: safetensors stores a tied tensor once, and the resume and
  `open_sft export` that read the checkpoint tie it again (resume after a kill tested bitwise on such a model).
"""

from __future__ import annotations

import logging
import sys
import warnings


logger = logging.getLogger(__name__)

# `logger.warning(..., **SAID_ALIKE_BY_EVERY_RANK)`: a warning every rank of a launch would say alike (about the
# flags, the tokenizer, a step all ranks skip), said by rank 0 only (`RankZeroSaysIt`); a rank's own trouble is not
# marked and is said by the rank that has it
SAID_ALIKE_BY_EVERY_RANK = {"extra": {"alike_on_every_rank": True}}


class RankZeroSaysIt(logging.Filter):
    """On the other ranks: drops the warnings marked SAID_ALIKE_BY_EVERY_RANK."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "alike_on_every_rank", False)


def setup_logging(main_rank: bool) -> None:
    """open_sft logs INFO on rank 0 and warnings elsewhere (but those every rank says alike); other libraries only
    warnings."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.WARNING, stream=sys.stdout, force=True)
    logging.getLogger("open_sft").setLevel(logging.INFO if main_rank else logging.WARNING)
    if not main_rank:
        for handler in logging.getLogger().handlers:
            handler.addFilter(RankZeroSaysIt())
    # torch.distributed's own deprecation notices, emitted from inside DeepSpeed's collectives.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


class _DropLines(logging.Filter):
    """Drops a logger's records whose message contains one of `texts`."""

    def __init__(self, *texts: str):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(text in message for text in self.texts)


IMPORT_NOISE = {"torchao": _DropLines("Failed to load "),
                "torchao.kernel.intmm": _DropLines("Detected no triton"),
                "torch.utils._pytree": _DropLines("is an Enum subclass and is now natively supported")}
# huggingface_hub's save_torch_state_dict says "Model weights successfully saved to OUT/.export.tmp/merged!" of the
# staging directory an export writes through (open_sft.export.save.staged_export), which is renamed away after it:
# the export's own line names where the model is
STAGED_SAVE = _DropLines("Model weights successfully saved to ")
# accelerate's save_state drops the alias of a tied tensor (lm_head.weight of tied embeddings) and asks the user to
# check the reload: open_sft's resume and export do the reload, and tie it again
SAVE_NOISE = {"accelerate.utils.other": _DropLines("Removed shared tensor ")}


def quiet_kernel_fetch() -> None:
    """bitsandbytes' CPU backend, on a CPU with AVX512-BF16, calls kernels.get_kernel("kernels-community/
    quantization-bitsandbytes") when it is imported and warns, with the exception's text, when that fails (as it
    does under open_sft, which stops the fetch: open_sft/__init__.py; offline; `kernels` missing): the CPU falls
    back to bitsandbytes' own kernel. `kernels` (transformers 5.25's
    requirement) says offline that it skipped the publisher's trust check. Neither applies to what the user asked;
    called by open_sft/__init__.py, before any entry point imports peft."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels._internals.hf_hub").setLevel(logging.ERROR)


def quiet_third_parties(terminal: bool | None = None) -> None:
    """Silence what does not apply to this run; `terminal` defaults to whether stderr is one."""
    if not (sys.stderr.isatty() if terminal is None else terminal):
        import datasets
        import huggingface_hub.utils
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
    quiet_kernel_fetch()
    import huggingface_hub.serialization._torch as hub_torch  # it logs by its file's path (getLogger(__file__))

    for name, drop in {**IMPORT_NOISE, **SAVE_NOISE, hub_torch.__file__: STAGED_SAVE}.items():
        if drop not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(drop)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
