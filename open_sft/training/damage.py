"""Whether a checkpoint's tensor files read: the check behind checkpoint.problem_with for a checkpoint whose files
have the sizes its COMPLETE manifest lists (a torn write, zeroed blocks after a crash, a disk's damage): such a one
is moved aside (resume.newest_complete), never resumed from."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Collection, Optional

DAMAGED = "is damaged"  # in what problem_with says of a checkpoint whose files have the right sizes but not contents
_TORCH_FILES = (".bin", ".pt", ".pth", ".pkl")  # torch.save zip archives (accelerate's random_states_N.pkl too)
READ_WHOLE = 16 << 20  # a torch archive up to this size is read whole: zipfile checks each member's CRC-32


def damage_in(path: Path, files: Collection[str]) -> Optional[str]:
    """A tensor file of the checkpoint that does not read (a safetensors header; a torch.save archive that is no
    zip, a zeroed or cut tail losing its directory, or whose member headers do not read: reading them costs a few
    bytes each, where hashing every byte would take minutes; small archives, the RNG states among them, are read
    whole against their CRC-32s), or None. Damage inside a large file's tensor data is not seen."""
    from safetensors import safe_open

    for name in files:
        file = path / name
        try:
            if name.endswith(".safetensors"):
                with safe_open(str(file), "pt"):
                    pass
            elif name.endswith(_TORCH_FILES):
                if not zipfile.is_zipfile(file):  # the manifest listed a torch.save archive: its end is gone
                    raise zipfile.BadZipFile("not a zip archive, as torch.save writes (zeroed, or its end lost)")
                whole = file.stat().st_size <= READ_WHOLE
                with zipfile.ZipFile(file) as archive:
                    for member in archive.infolist():
                        with archive.open(member) as handle:
                            while whole and handle.read(1 << 20):
                                pass
        except Exception as exc:  # safetensors' own error, zipfile's, OSError: each says the file does not read
            return f"{name} {DAMAGED} ({type(exc).__name__}: {exc})"
    return None
