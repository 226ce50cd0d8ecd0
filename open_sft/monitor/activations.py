"""The activation memory a micro-batch really holds: the bytes autograd saves for backward during its forward
(parameters excluded, views of one storage counted once). Measured, not estimated, so it can check the preflight's
model and what a layout saves (sequence parallelism: each rank holds 1/N of every sequence) without the noise of
the allocator's resident set. An audit aid: `OPEN_SFT_RECORD_ACTIVATIONS=1` writes each rank's peak to
`activations.rank<N>.json` in the output directory.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

ENV = "OPEN_SFT_RECORD_ACTIVATIONS"


class SavedActivations:
    def __init__(self) -> None:
        self.peak_bytes = 0  # the largest forward's saved bytes so far

    @classmethod
    def if_requested(cls) -> Optional["SavedActivations"]:
        return cls() if os.environ.get(ENV) else None

    @contextmanager
    def measure(self) -> Iterator[None]:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not (tensor.is_leaf and tensor.requires_grad):  # a parameter is not an activation
                try:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. sparse)
                    pass
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.peak_bytes = max(self.peak_bytes, sum(storages.values()))
