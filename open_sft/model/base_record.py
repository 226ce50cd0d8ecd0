"""How a run names its base model in what it writes (run.json, adapter_config.json), for loaders and the model
card to read from any directory later."""

from __future__ import annotations

import os


def base_model_record(name: str) -> str:
    """What a run records as its base (run.json's base_model, adapter_config.json's base_model_name_or_path):
    a local directory as its absolute path, decided where the run loaded it (a relative path named from another
    directory loads nothing, and would read as a Hub id), a Hub id as given."""
    path = os.path.expanduser(name)
    return os.path.abspath(path) if name and os.path.isdir(path) else name  # symlinks kept as given
