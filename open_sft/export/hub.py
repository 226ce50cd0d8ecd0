"""Upload an export (or a checkpoint) to the Hugging Face Hub, with retries, never losing local work.

    python -m open_sft push OUTPUT_DIR --hub_model_id my-org/my-model [--hub_revision main] [--no_hub_private]
    python -m open_sft push OUTPUT_DIR/checkpoints/step_N --hub_model_id ...   (to checkpoints/step_N/ in the repo)

finetune.py --push_to_hub calls `push_output_dir` on the main process after every rank has finished and
been released, so no rank waits on the network. Transient failures (HTTP 429/5xx, dropped connections,
timeouts) are retried with exponential backoff, each request by one party only: creating the repo and branch
(which huggingface_hub sends once) by with_retries here, the upload's requests by huggingface_hub itself
(http_backoff: 5 retries waiting 1, 2, 4, 8, 8 s; hf_xet retries its transfers); wrapping the upload in
with_retries as well multiplied them (6 x 6 commit attempts). A final failure leaves the export untouched,
prints this module's command to retry only the upload, and exits with PUSH_FAILED_EXIT_CODE.

The token comes from --hub_token or HF_TOKEN. It is passed to huggingface_hub only: never logged, never
in an error message we print (scrubbed), never written to disk (run.json holds "<redacted>").
Environment: HF_ENDPOINT (another Hub), OPEN_SFT_HUB_RETRIES [6, attempts at creating the repo or branch],
OPEN_SFT_HUB_BACKOFF_S [2.0, doubling up to 60 s], OPEN_SFT_HUB_TIMEOUT_S [300, per request read timeout].
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from open_sft.config.whole_flags import WholeFlagParser
from open_sft.durable import write_json
from open_sft.errors import StopRun
from open_sft.redaction import scrub

logger = logging.getLogger(__name__)

PUSH_FAILED_EXIT_CODE = 3
#: In OUTPUT_DIR/checkpoints/step_N/: the uploads of that checkpoint whose commit landed (repo, revision, URL), as
#: RUN_COMPLETE's "pushed" notes the export's. Written after the commit: a checkpoint without it is not on the Hub.
CHECKPOINT_PUSHED = "PUSHED"
#: Never uploaded with the export: training state, staging leftovers, test aids, W&B's run directory (the console log,
#: the resolved config with local paths, the installed packages: open_sft.monitor's WandbTracker writes it into
#: --output_dir unless WANDB_DIR is set) and the run id a resume continues.
EXPORT_IGNORE = ["checkpoints/**", "checkpoints.previous-*/**", "tensorboard.previous-*/**", ".export.tmp/**", "*.tmp",
                 "data_order.rank*.json", ".cache/**", ".open_sft.lock", ".open_sft_export.json", "RUN_COMPLETE",
                 "wandb/**", "wandb_run_id"]
#: A directory holding one of these is an open_sft run (its lock, completion record, resolved arguments) or export
#: (open_sft.export.save.EXPORT_FILES) of its own.
RUN_MARKERS = frozenset({".open_sft.lock", "RUN_COMPLETE", "run.json", ".open_sft_export.json"})
#: What an open_sft export or run writes at the top of --output_dir (and so of the repo): a re-push deletes those that
#: this export lacks, in the upload's commit, so that the repo holds this export only (an earlier push's
#: model.safetensors beside new shards is what from_pretrained loads; a full model's config.json beside a new adapter
#: gets the adapter applied to the old model). huggingface_hub's `*` crosses `/`: each pattern starts with a literal
#: name, so none reaches into checkpoints/ (--push_checkpoints) or a user's folder. Other files (a user's own,
#: .gitattributes, which huggingface_hub never deletes) stay; README.md is the export's model card, uploaded each time.
HUB_STALE = ["model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json", "config.json", "generation_config.json",
             "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
             "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "merged/*", "run.json",
             "metrics.jsonl", "data_report.json", "export.json", "report/*", "tensorboard/*", "wandb/*",
             "wandb_run_id"]  # the last two: what pushes before they were left out uploaded
T = TypeVar("T")


class PushFailed(StopRun):
    exit_code = PUSH_FAILED_EXIT_CODE


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def resolve_token(explicit: Optional[str]) -> Optional[str]:
    return explicit or os.environ.get("HF_TOKEN") or None


def name_not_resolved(exc: BaseException) -> bool:
    """The Hub's host name did not resolve (no network or no DNS here): somewhere in the error's causes."""
    while exc is not None:
        if isinstance(exc, socket.gaierror):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def has_token(explicit: Optional[str]) -> bool:
    """A token to upload with: --hub_token, HF_TOKEN, or the one huggingface_hub stored at login."""
    from huggingface_hub import get_token

    return bool(resolve_token(explicit) or get_token())


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: the server or the network failed, not the request. A host name that does not resolve is
    not: a machine without DNS stays so, and six tries with backoff kept a push without network silent for a
    minute before it said why."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, OfflineModeIsEnabled) or name_not_resolved(exc):  # waiting changes neither
        return False
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        return status is None or status == 429 or status >= 500
    return isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError))


def refusal(exc: BaseException) -> Optional[int]:
    """The HTTP status when the Hub refused the request for its token (401, 403): the token cannot write there, which
    no retry and no later upload of the same run changes."""
    from huggingface_hub.errors import HfHubHTTPError

    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    return status if status in (401, 403) else None


def with_retries(what: str, call: Callable[[], T], token: Optional[str] = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    attempts = max(1, int(_env_number("OPEN_SFT_HUB_RETRIES", 6)))
    delay = _env_number("OPEN_SFT_HUB_BACKOFF_S", 2.0)
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            logger.warning("%s failed (%s); retry %d/%d in %.1fs", what, scrub(describe(exc), token),
                           attempt, attempts - 1, delay)
            sleep(delay)
            delay = min(delay * 2, 60.0)
    raise AssertionError("unreachable")


def describe(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"


def _use_timeouts() -> None:
    """huggingface_hub's client waits forever by default; a stalled upload must become a retryable error."""
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    read = _env_number("OPEN_SFT_HUB_TIMEOUT_S", 300.0)

    def factory() -> Any:
        client = default_client_factory()
        client.timeout = httpx2.Timeout(read, connect=min(read, 30.0))
        return client

    set_client_factory(factory)


def _hub_lines_once() -> None:
    """huggingface_hub's logger writes its lines (a retry's 'HTTP Error 500 ... Retrying in 8s') through a handler of
    its own and passes them on to the root logger, which open_sft's entry points configure: each came twice, once
    bare. Where the root logger has a handler, the library's own default one (a plain StreamHandler) is dropped: its
    lines come once, formatted as open_sft's."""
    if not logging.getLogger().handlers:
        return
    library = logging.getLogger("huggingface_hub")
    for handler in [h for h in library.handlers if type(h) is logging.StreamHandler]:
        library.removeHandler(handler)


def push_folder(folder: Path, repo_id: str, revision: str = "main", private: bool = True,
                token: Optional[str] = None, path_in_repo: Optional[str] = None,
                ignore_patterns: Optional[list[str]] = None, message: str = "Upload with open_sft",
                delete_patterns: Optional[list[str]] = None) -> str:
    """Create the repo and branch if needed and upload `folder`, deleting in the same commit the repo's files that
    match `delete_patterns` and are not in it; returns the commit URL."""
    from huggingface_hub import HfApi

    _use_timeouts()
    _hub_lines_once()
    api = HfApi(token=token)
    with_retries("create repo", lambda: api.create_repo(repo_id, private=private, exist_ok=True), token)
    if revision != "main":
        with_retries("create branch", lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), token)
    # huggingface_hub 2.x has no upload_large_folder: with hf_xet, upload_folder itself commits a large folder in
    # batches and a rerun resumes it; without, it is one commit. Not in with_retries: huggingface_hub retries each
    # of its requests (module docstring)
    info = api.upload_folder(repo_id=repo_id, folder_path=folder, path_in_repo=path_in_repo, revision=revision,
                             ignore_patterns=ignore_patterns, delete_patterns=delete_patterns, commit_message=message)
    return str(info.commit_url if hasattr(info, "commit_url") else info)


def retry_command(output_dir: Path, repo_id: str, revision: str, private: bool) -> str:
    parts = ["python", "-m", "open_sft", "push", str(output_dir), "--hub_model_id", repo_id, "--hub_revision", revision]
    parts.append("--hub_private" if private else "--no_hub_private")
    return " ".join(shlex.quote(p) for p in parts)


def push_export(output_dir: Path, repo_id: str, revision: str = "main", private: bool = True,
                token: Optional[str] = None) -> str:
    """Upload the export in output_dir; raises PushFailed (with the retry command) on a final failure."""
    token = resolve_token(token)
    logger.info("uploading %s to %s (revision %s)", output_dir, repo_id, revision)
    try:
        url = push_folder(output_dir, repo_id, revision, private, token,
                          ignore_patterns=EXPORT_IGNORE + runs_inside(output_dir) + caches_inside(output_dir),
                          message=f"open_sft export of {output_dir.name}", delete_patterns=HUB_STALE)
    except StopRun:  # a signal (open_sft.training.preemption), not a failed upload
        raise
    except Exception as exc:
        command = retry_command(output_dir, repo_id, revision, private)
        raise PushFailed(
            f"upload to the Hub failed: {scrub(describe(exc), token)}\nThe local export in {output_dir} is intact. "
            f"Retry just the upload (token from HF_TOKEN or --hub_token) with:\n  {command}"
        ) from None
    logger.info("uploaded to %s", url)
    return url


def runs_inside(output_dir: Path) -> list[str]:
    """Upload patterns of the open_sft runs and exports inside output_dir (RUN_MARKERS), such as a day-two run
    `--model_name_or_path out --output_dir out/day2`, which README allows: another model, with its checkpoints
    (optimizer states, many times the model's size) and its lock, which EXPORT_IGNORE's top-level patterns do not
    reach. Never uploaded with the export (said in the log); push it on its own."""
    skipped = [pattern[:-len("/**")] for pattern in EXPORT_IGNORE if pattern.endswith("/**")]
    found = []
    for root, dirs, files in os.walk(output_dir):
        if Path(root) == output_dir:  # the export's own training state is left out by EXPORT_IGNORE already
            dirs[:] = [name for name in dirs if not any(fnmatch.fnmatchcase(name, skip) for skip in skipped)]
        elif not RUN_MARKERS.isdisjoint(files):
            found.append(Path(root))
            dirs[:] = []  # all of it is left out
    for run in found:
        logger.info("%s holds another open_sft run or export (%s): it is not uploaded; push it on its own",
                    output_dir, run.relative_to(output_dir))
    return [f"{glob.escape(run.relative_to(output_dir).as_posix())}/**" for run in found]


def caches_inside(output_dir: Path) -> list[str]:
    """Upload patterns of the tokenization caches inside output_dir (a --dataset_local_cache_dir placed there): a
    folder holding a build's lock, <64 hex digits>.lock, or a build's partial rows, <64 hex digits>.partial (a failed
    build leaves no lock: data.cache). The tokenized training data is no part of the model, may be private, and can
    be many times its size: never uploaded with the export (said in the log)."""
    from open_sft.data.cache import is_key
    from open_sft.data.partials import SUFFIX as PARTIAL

    found = sorted({path.parent for path in output_dir.rglob("*.*") if path.suffix in (".lock", PARTIAL)
                    and is_key(path.stem) and path.parent != output_dir})
    for cache in found:
        logger.info("%s holds a tokenization cache (%s): it is not uploaded", output_dir, cache.relative_to(output_dir))
    return [f"{cache.relative_to(output_dir).as_posix()}/**" for cache in found]


def push_checkpoint(checkpoint: Path, repo_id: str, revision: str = "main", private: bool = True,
                    token: Optional[str] = None) -> str:
    """Upload a complete checkpoint directory (COMPLETE included) to checkpoints/step_N/ in one commit;
    retried like the export; raises the final error (callers add the retry command). Once the commit landed it is
    noted in the checkpoint's CHECKPOINT_PUSHED record (never uploaded), which pruning and a relaunch read."""
    url = push_folder(checkpoint, repo_id, revision, private, resolve_token(token),
                      path_in_repo=f"checkpoints/{checkpoint.name}", message=f"open_sft checkpoint {checkpoint.name}",
                      ignore_patterns=[CHECKPOINT_PUSHED])
    record = _pushed_record(checkpoint)
    uploads = [u for u in record.get("pushed") or [] if (u.get("hub_model_id"), u.get("hub_revision"))
               != (repo_id, revision)]
    record["pushed"] = uploads + [{"hub_model_id": repo_id, "hub_revision": revision, "url": url,
                                   "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
    write_json(checkpoint / CHECKPOINT_PUSHED, record)
    return url


def checkpoint_pushed(checkpoint: Path, repo_id: str, revision: str) -> Optional[str]:
    """The URL of the checkpoint's upload to `repo_id` at `revision` whose commit landed, or None (never uploaded
    there, its upload failed or was cut off, or it predates the record: all uploaded again, which the Hub makes
    cheap for files it holds already)."""
    from open_sft.training.completion import pushed

    return pushed(_pushed_record(checkpoint), repo_id, revision)


def _pushed_record(checkpoint: Path) -> dict[str, Any]:
    try:
        record = json.loads((checkpoint / CHECKPOINT_PUSHED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def push_output_dir(output_dir: Path, hub: Any) -> str:
    """finetune.py --push_to_hub (`hub`: the HubArguments), after the run's completion record: the upload is noted
    in it, so that a relaunch of the same command uploads an export whose upload failed or was stopped (a requeued
    job), and only such a one. A signal during the upload stops the process with the preemption's exit code."""
    from open_sft.training.completion import mark_pushed
    from open_sft.training.preemption import Preempted

    try:
        url = push_export(output_dir, hub.hub_model_id, hub.hub_revision, hub.hub_private, hub.hub_token)
    except Preempted as stop:
        command = retry_command(output_dir, hub.hub_model_id, hub.hub_revision, hub.hub_private)
        raise Preempted(f"stopped by {stop.signal_name} during the upload to the Hub; the export in {output_dir} is "
                        "complete: the same command uploads it (it does not train again), or upload just it "
                        f"with:\n  {command}") from None
    mark_pushed(output_dir, hub.hub_model_id, hub.hub_revision, url)
    return url


def upload_pending(config: Any) -> None:
    """A relaunch stopped at a completed run (open_sft.training.completion.already_complete) whose --push_to_hub
    upload never succeeded (it failed, or the job was stopped during it) uploads it (after the checkpoints:
    hub_checkpoints.upload_pending)."""
    from open_sft.training.completion import pushed, read_marker

    output_dir, hub = Path(config.train.output_dir), config.hub
    record = read_marker(output_dir)
    if hub.push_to_hub and record is not None and not pushed(record, hub.hub_model_id, hub.hub_revision):
        push_output_dir(output_dir, hub)


def repo_id_problem(repo_id: str) -> Optional[str]:
    """Why `repo_id` cannot name a Hub repository (huggingface_hub's own rule), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return f"--hub_model_id {repo_id!r} is not a Hub repository id ({exc}); give NAME or ORG/NAME"
    return None


def _push_input_problems(output_dir: Path, repo_id: str) -> list[str]:
    """The directory and the id, checked before the token and any network wait (a missing directory and a bad id
    were said as 'no Hugging Face token')."""
    problems = []
    if not output_dir.is_dir():
        problems.append(f"{output_dir}: no such directory; pass the --output_dir of a finished run or "
                        "OUTPUT_DIR/checkpoints/step_N")
    elif not (output_dir / "COMPLETE").is_file() and not any((output_dir / name).is_file()
                                                              for name in ("config.json", "adapter_config.json")):
        problems.append(f"{output_dir} has no exported model (config.json) and is not a complete checkpoint "
                        "(COMPLETE); pass the --output_dir of a finished run or OUTPUT_DIR/checkpoints/step_N")
    return problems + [p for p in [repo_id_problem(repo_id)] if p]


def main(argv: Optional[list[str]] = None, prog: str = "open_sft push") -> int:
    parser = WholeFlagParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="the --output_dir of a finished run, or a complete checkpoint")
    parser.add_argument("--hub_model_id", required=True)
    parser.add_argument("--hub_revision", default="main")
    parser.add_argument("--hub_private", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no_hub_private", dest="hub_private", action="store_false")
    parser.add_argument("--hub_token", default=None, help="default: HF_TOKEN")
    args = parser.parse_args(argv)
    problems = _push_input_problems(args.output_dir, args.hub_model_id)  # what the user can fix here, first
    if not has_token(args.hub_token):  # before any network wait: without a token nothing can be uploaded
        problems.append("no Hugging Face token: pass --hub_token, set HF_TOKEN, or log in once with `hf auth login`")
    from open_sft.model.source import hub_offline

    if hub_offline():  # the upload would fail (exit 3) and print this same command as the retry
        problems.append("HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it for this command "
                        f"(HF_HUB_OFFLINE= {prog} ...)")
    if problems:
        print("error: " + "\n  ".join(problems), file=sys.stderr)
        return 2
    from open_sft.training.completion import mark_pushed

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if (args.output_dir / "COMPLETE").is_file():  # a checkpoint (checkpoint.COMPLETE)
        try:
            print(push_checkpoint(args.output_dir, args.hub_model_id, args.hub_revision, args.hub_private,
                                  args.hub_token))
        except Exception as exc:
            print(f"open_sft: checkpoint upload failed: {scrub(describe(exc), resolve_token(args.hub_token))}",
                  file=sys.stderr)
            return PUSH_FAILED_EXIT_CODE
        return 0
    try:
        url = push_export(args.output_dir, args.hub_model_id, args.hub_revision, args.hub_private, args.hub_token)
    except PushFailed as exc:
        print(f"open_sft: {exc}", file=sys.stderr)
        return exc.exit_code
    # noted in a run's completion record as the run's own push notes it: this is the retry the failed push prints,
    # and a relaunch (a requeue) of the training command must then upload nothing
    mark_pushed(args.output_dir, args.hub_model_id, args.hub_revision, url)
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
