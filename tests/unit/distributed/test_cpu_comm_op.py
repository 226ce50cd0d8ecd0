"""DeepSpeed's CPU communication op: one line before it compiles (main process only), nothing once a machine has
it cached, and DeepSpeed's per-rank 'built successfully' print gone."""

from __future__ import annotations

import logging

import pytest

from open_sft.distributed import cpu_comm_op


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_a_machine_without_the_op_is_told_it_compiles_and_where(extensions, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=cpu_comm_op.__name__):
        line = cpu_comm_op.announce(is_main=True)
    assert line is not None and "about a minute, once per machine" in line
    assert str(extensions / "deepspeed_shm_comm") in line
    assert [r.getMessage() for r in caplog.records] == [line]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=cpu_comm_op.__name__):
        assert cpu_comm_op.announce(is_main=False) == line
    assert not caplog.records  # the other ranks say nothing


def test_a_cached_op_is_not_announced_unless_another_environment_built_it(extensions) -> None:
    """torch's loader rewrites build.ninja with this environment's paths and ninja compiles again when another
    venv's torch built the cached library (the silent minute a second checkout's run met)."""
    from torch.utils.cpp_extension import include_paths

    built = extensions / "deepspeed_shm_comm"
    built.mkdir()
    (built / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    (built / "build.ninja").write_text(f"cflags = -isystem {include_paths()[0]} -fPIC\n")
    assert cpu_comm_op.announce(is_main=True) is None
    (built / "build.ninja").write_text("cflags = -isystem /elsewhere/.venv/lib/python3.11/site-packages/torch/include\n")
    line = cpu_comm_op.announce(is_main=True)
    assert line is not None and "the build there is another Python environment’s" in line


def test_deepspeeds_per_rank_print_is_dropped(extensions, capsys) -> None:
    import importlib

    import torch

    cpu_comm_op.announce(is_main=True)
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    assert ds_comm is not torch and ds_comm.build_shm_op  # the module that prints it
    ds_comm.print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert capsys.readouterr().out == ""
