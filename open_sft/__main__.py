"""`open_sft <command>` (also `python -m open_sft <command>`): the side tools of a run, behind one command.

Training itself is `finetune.py` (the open-instruct command line). Each command is a module's `main`;
the modules are imported only when their command runs, so `open_sft --help` starts without torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

# command -> (module whose main(argv) runs it, one-line help)
COMMANDS = {
    "generate": ("open_sft.export.generate", "generate from a run's model (full, LoRA adapter, merged/); score sample tasks"),
    "chat": ("open_sft.export.chat", "talk with a run's model, turn by turn, with its chat template"),
    "compare": ("open_sft.export.compare", "score two models (before/after) on held-out tasks, side by side"),
    "export": ("open_sft.export.from_checkpoint", "write a step checkpoint (any engine) as a Hugging Face model"),
    "push": ("open_sft.export.hub", "upload an export or a checkpoint to the Hugging Face Hub"),
    "merge-lora": ("open_sft.export.merge_adapter", "merge a saved LoRA adapter into its base model"),
    "report": ("open_sft.monitor.report", "(re)draw the report/ plots and summary from a run's metrics.jsonl"),
    "model-card": ("open_sft.export.model_card", "(re)write the model card README.md of an export"),
    "embedded": ("open_sft.embedded.factory", "build the offline embedded tokenizer and tiny model"),
    "sample-data": ("open_sft.embedded.sample_data", "write deterministic, checkable instruction data"),
}
LOADS_A_MODEL = {"generate", "chat", "compare", "export", "merge-lora"}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return ("usage: open_sft <command> [options]   (open_sft <command> --help for its options)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\nTraining: python finetune.py --help")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    if command in LOADS_A_MODEL and not {"-h", "--help"} & set(rest):
        from open_sft.monitor.quiet import quiet_third_parties

        quiet_third_parties()  # as a run does: no progress bars in a redirected log, no peft notices
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=f"open_sft {command}")


def forward(command: str, drop: Optional[str] = None) -> None:
    """An old `python -m open_sft.<module>` path: run `command` with this process's arguments (after the
    old sub-command `drop`, when the old path had one) and exit with its code."""
    argv = sys.argv[1:]
    if drop is not None and argv[:1] == [drop]:
        argv = argv[1:]
    sys.exit(main([command, *argv]))


if __name__ == "__main__":
    sys.exit(main())
