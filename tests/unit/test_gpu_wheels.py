"""scripts/gpu_wheels.py: what a GPU machine without network is carried — the requirements walked from each wheel's
own metadata for the machine (CPython 3.12, Linux x86-64), the image's packages left out but for those named."""

from __future__ import annotations

import zipfile

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def wheels():
    return load_script("gpu_wheels")


def make_wheel(directory, name: str, version: str, requires: list[str]):
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        metadata = [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
    return path


def test_a_wheels_requirements_are_those_that_apply_on_the_machine(wheels, tmp_path) -> None:
    wheel = make_wheel(tmp_path, "pkg", "1.0", [
        "huggingface-hub<3.0,>=1.31", "tomli>=1.1; python_version < '3.11'", "hf-xet<2; platform_machine == 'x86_64'",
        "pytest; extra == 'test'", "pywin32; sys_platform == 'win32'"])
    assert [str(r) for r in wheels.requirements_of(wheel)] == ["huggingface-hub<3.0,>=1.31",
                                                               'hf-xet<2; platform_machine == "x86_64"']


def test_what_is_carried_is_the_closure_less_what_the_image_has(wheels, tmp_path, monkeypatch) -> None:
    """A named package is carried even where the image has one (its version is open_sft's); a requirement the image
    meets is not, nor what only it requires; one it lacks is, with what it requires; each package once."""
    graph = {"transformers": ["huggingface-hub>=1.31", "numpy>=1.17", "tokenizers<0.24"],
             "huggingface-hub": ["httpx2>=2", "filelock"], "httpx2": ["httpcore2", "anyio"], "httpcore2": ["h11"],
             "deepspeed": ["torch", "hjson", "pydantic>=2"], "hjson": [], "pydantic": ["pydantic-core==2.5"],
             "pydantic-core": ["typing-extensions"]}
    fetched = []

    def fetch(spec, out):
        name = wheels.Requirement(spec).name
        fetched.append(spec)
        return make_wheel(out, name, "9.9", graph[name])

    monkeypatch.setattr(wheels, "fetch", fetch)
    monkeypatch.setattr(wheels, "tested_version", lambda name: {"hjson": "3.1.0"}.get(name))
    seen = wheels.gather(["transformers", "huggingface-hub", "deepspeed"], tmp_path / "core", skip=set())
    names = sorted(wheels.Requirement(s).name for s in fetched)
    assert names == ["deepspeed", "hjson", "httpcore2", "httpx2", "huggingface-hub", "pydantic", "pydantic-core",
                     "transformers"]
    assert "hjson==3.1.0" in fetched and "pydantic>=2" in fetched  # the tested version where there is one
    fetched.clear()
    graph["bitsandbytes"] = ["torch", "numpy", "packaging"]
    wheels.gather(["bitsandbytes"], tmp_path / "qlora", skip=seen)
    assert fetched == ["bitsandbytes"]  # the second carry: nothing the first one has
