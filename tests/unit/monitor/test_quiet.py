"""Third-party noise a run's log does not need (bitsandbytes' warning that it could not load its CPU kernel from the
Hub is silenced), and code a run does not ask for is not fetched (bitsandbytes' CPU kernel)."""

from __future__ import annotations

import logging

import pytest

from open_sft.monitor import quiet


def test_bitsandbytes_kernel_warning_is_silenced(caplog) -> None:
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.INFO):
        caplog.set_level(logging.INFO, logger="open_sft")
        quiet.quiet_third_parties(terminal=True)
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: Cannot find a build variant for "
                    "this system in /dev/null. Please make sure you already `pip install kernels` and the kernels "
                    ">= 0.11.1")
    assert [r.getMessage() for r in caplog.records] == []


def test_importing_open_sft_stops_bitsandbytes_fetching_its_cpu_kernel_from_the_hub(monkeypatch) -> None:
    """`import bitsandbytes` (peft's, in every LoRA run) on a CPU with AVX512-BF16 called
    kernels.get_kernel("kernels-community/quantization-bitsandbytes", version=1): online, a publisher check, then
    the kernel's code downloaded and imported, for a one-token inference op training never calls. open_sft's
    package (imported before any of its modules, so before peft) names that kernel in LOCAL_KERNELS with no path:
    the same call now fails in kernels' local resolver, and its Hub resolvers (made to raise here) are never
    asked, also where the user's LOCAL_KERNELS names other kernels (ours is added to it); one naming this kernel,
    or USE_HUB_KERNELS=YES, is left as it is."""
    import importlib
    import inspect
    import os

    import bitsandbytes.backends.cpu.ops as bnb_cpu
    from kernels import get_kernel
    from kernels._internals import resolver

    import open_sft

    assert f'"{open_sft.BNB_CPU_KERNEL}", version=1' in inspect.getsource(bnb_cpu)  # bitsandbytes' own call
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    importlib.reload(open_sft)
    ours = f"kernels-community/quantization-bitsandbytes={os.devnull}"
    assert os.environ["LOCAL_KERNELS"] == ours

    def asks_the_hub(self, **kwargs):
        raise AssertionError(f"{kwargs['kernel'].repo_id}: the Hub was asked")

    for hub in (resolver.HubResolver, resolver.HubCacheResolver, resolver.LatestHubResolver,
                resolver.LockedHubResolver, resolver.LockedHubCacheResolver):
        monkeypatch.setattr(hub, "resolve", asks_the_hub)
    with pytest.raises(FileNotFoundError, match=f"Cannot find a build variant for this system in {os.devnull}"):
        get_kernel(open_sft.BNB_CPU_KERNEL, version=1)
    monkeypatch.delenv("LOCAL_KERNELS")
    with pytest.raises(AssertionError, match="the Hub was asked"):  # what the call did before
        get_kernel(open_sft.BNB_CPU_KERNEL, version=1)
    # a user's own LOCAL_KERNELS keeps its kernels and gains ours (kernels splits the entries on ':'), unless it
    # names this one itself; USE_HUB_KERNELS=YES leaves the Hub's kernels to the user
    for name, value, then in (("LOCAL_KERNELS", "org/kernel=/opt/kernel", f"org/kernel=/opt/kernel:{ours}"),
                               ("LOCAL_KERNELS", *[f"{open_sft.BNB_CPU_KERNEL}=/opt/bnb"] * 2),
                               ("LOCAL_KERNELS", "", ours), ("USE_HUB_KERNELS", "yes", None)):
        monkeypatch.setenv(name, value)
        importlib.reload(open_sft)
        assert os.environ.get("LOCAL_KERNELS") == then
        monkeypatch.delenv(name)
        monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.setenv("LOCAL_KERNELS", f"org/kernel={os.devnull}")
    importlib.reload(open_sft)
    with pytest.raises(FileNotFoundError, match=f"Cannot find a build variant for this system in {os.devnull}"):
        get_kernel(open_sft.BNB_CPU_KERNEL, version=1)  # not from the Hub with the user's kernel named there


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_warning_every_rank_says_alike_is_said_by_rank_zero(rank, monkeypatch, capsys) -> None:
    """A warning about what every rank shares (the tokenizer, a step all ranks skip) is said once, by rank 0; a
    warning that is not marked is said by every rank that has it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        quiet.setup_logging(main_rank=rank == "0")
        log = logging.getLogger("open_sft.test")
        log.warning("every rank alike", **quiet.SAID_ALIKE_BY_EVERY_RANK)
        log.warning("this rank's own")
        out = capsys.readouterr().out
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
    assert ("every rank alike" in out) == (rank == "0") and "this rank's own" in out


def test_importing_open_sft_quiets_the_kernel_fetch_before_any_entry_point_imports_peft(monkeypatch) -> None:
    """`open_sft merge-lora` and `generate` of an adapter imported peft (so bitsandbytes) before anything quieted
    it: 'Failed to load CPU gemm_4bit_forward from kernels-community ...' and 'Skipping publisher trust check for
    kernels-community/quantization-bitsandbytes' came before the tool's own output. The package does it."""
    import importlib

    import open_sft

    loggers = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub")]
    for logger in loggers:
        monkeypatch.setattr(logger, "level", logging.NOTSET)
    importlib.reload(open_sft)
    assert [logger.level for logger in loggers] == [logging.ERROR, logging.ERROR]


def test_the_staging_directory_of_an_export_is_not_named_as_where_the_model_is(tmp_path, caplog) -> None:
    """huggingface_hub's save_torch_state_dict (the merged model's writer) logged 'Model weights successfully saved
    to OUT/.export.tmp/merged!' in `open_sft export` of a LoRA checkpoint: a directory renamed away after it."""
    import torch
    from huggingface_hub import save_torch_state_dict

    quiet.quiet_third_parties(terminal=True)
    (tmp_path / ".export.tmp").mkdir()
    with caplog.at_level(logging.INFO):
        save_torch_state_dict({"w": torch.zeros(2)}, tmp_path / ".export.tmp")
    assert (tmp_path / ".export.tmp" / "model.safetensors").is_file()
    assert not [r.getMessage() for r in caplog.records if ".export.tmp" in r.getMessage()]


def test_a_tied_lm_head_dropped_at_a_checkpoint_is_not_reported_and_comes_back_on_reload(tmp_path, caplog) -> None:
    """accelerate logged "Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check by
    verifying that you don't receive any warning while reloading" at every checkpoint of a model with tied embeddings
    (a SmolLM3 run, one process). The tensor is stored once and the reload ties it again, so the line goes; what is
    saved does not change."""
    import torch
    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors
    from safetensors.torch import load_model, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    quiet.quiet_third_parties(terminal=True)
    PartialState()  # accelerate's logger asks for it (one process: no process group)
    try:
        with caplog.at_level(logging.INFO):
            state = clean_state_dict_for_safetensors(model.state_dict())
    finally:
        PartialState._reset_state()
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    assert not [r.getMessage() for r in caplog.records if "shared tensor" in r.getMessage()]
    save_file(state, tmp_path / "model.safetensors")
    torch.manual_seed(1)
    reloaded = LlamaForCausalLM(config)
    load_model(reloaded, tmp_path / "model.safetensors")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
