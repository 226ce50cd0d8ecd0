"""Files a run writes get the permissions the user's umask gives, like any file made with `open()`.

Written by hand because safetensors' `save_file` (behind transformers' save_pretrained and accelerate's
save_state) creates its file with mode 0600 whatever the umask: a model exported by a container job (uid
1000) or on a shared filesystem was unreadable by the host user and by teammates. Nothing in the field's
libraries restores the umask's modes, so the writers here pass what they wrote through `share_as_umask`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where Linux tells (/proc/self/status, kernel >= 4.7)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not atomic, but only this process's own files race)
    os.umask(mask)
    return mask


def umask_mode(is_dir: bool, umask: int) -> int:
    """The permission bits `open()` (rw for all) or `mkdir()` (rwx for all) give under `umask`."""
    return (0o777 if is_dir else 0o666) & ~umask


def share_as_umask(root: Path, umask: int | None = None) -> int:
    """Add to `root` and everything under it the permission bits the umask gives and they lack (bits are never
    taken away); returns how many entries changed. Entries owned by another user (a mounted input, another
    node's files on a shared filesystem) and symlinks are left alone."""
    umask = current_umask() if umask is None else umask
    root = Path(root)
    if not root.exists():
        return 0
    changed = 0
    paths = [root]
    if root.is_dir():
        paths += [Path(d) / name for d, dirs, files in os.walk(root) for name in dirs + files]
    for path in paths:
        try:
            info = path.lstat()
        except FileNotFoundError:  # removed meanwhile (a pruned checkpoint)
            continue
        if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid():
            continue
        mode = stat.S_IMODE(info.st_mode)
        want = mode | umask_mode(stat.S_ISDIR(info.st_mode), umask)
        if mode != want:
            try:
                os.chmod(path, want)
                changed += 1
            except OSError:
                continue
    return changed


def unreadable(path: Path, recursive: bool = True) -> str | None:
    """Why this process cannot read `path` (a file, or a directory with the files a load of it reads), or None.

    Checked up front because the libraries report it badly: transformers says "No such file or directory" for a
    weights file it may not open, and a data file fails deep inside tokenization with a traceback.

    What is checked is what a load reads: with `recursive` (a dataset directory: its load and its cache key read
    every file under it) everything under the directory; without (a model or tokenizer directory: from_pretrained
    reads the files in it, not its subdirectories, which may hold anything: old checkpoints, a .git) the directory
    and the files in it. A symlink to a file counts as its target (a Hub snapshot's files are such links); a
    symlinked directory below `path` is not entered (pathlib's rglob, the data load's walk, does not either, and a
    link to `.` or `/` would walk forever or the whole filesystem), nor a broken link (no load reads it). A
    directory that cannot be listed is named, not a traceback."""
    path = Path(path).expanduser()
    if not path.exists():
        return None  # a missing path has its own message
    todo = [path]
    while todo:
        item = todo.pop()
        below = item != path
        try:
            is_dir = item.is_dir()
            if below and is_dir and item.is_symlink():
                continue
        except OSError:  # gone meanwhile, or a link loop: nothing a load reads
            continue
        if below and is_dir and not recursive:
            continue
        if not permitted(item, os.R_OK | (os.X_OK if is_dir else 0)):
            try:
                info = item.stat()
            except OSError:  # a broken link (not read by a load) or removed meanwhile
                continue
            return (f"{item} cannot be read by this user (uid {os.geteuid()}): it is mode "
                    f"{stat.filemode(info.st_mode)} owned by uid {info.st_uid}; make it readable (chmod -R a+rX) "
                    "or run as its owner")
        if is_dir and (recursive or not below):
            try:
                todo.extend(sorted(item.iterdir(), reverse=True))
            except OSError as exc:
                return f"{item} cannot be listed ({exc.strerror or exc}); check the directory"
    return None


def writable_dir_problem(path: Path) -> str | None:
    """Why `path` is not, and cannot be made, a directory this process writes into (None when it can): a file
    there or above it, no permission, a read-only filesystem. For a message "PATH: <this>; give ..."."""
    path = Path(path).expanduser().absolute()
    for existing in (path, *path.parents):
        try:
            existing.stat()
            break
        except (FileNotFoundError, NotADirectoryError):  # not there yet, or under a file (said below)
            continue
        except OSError as exc:  # a parent this user may not enter (EACCES), a link loop
            return f"it cannot be reached ({exc.strerror or exc}: {existing})"
    if not existing.is_dir():
        return f"{'it is' if existing == path else f'it lies under {existing}, which is'} a file, not a directory"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:  # first: access() says no there too, as for a permission
        return f"{existing} is on a read-only filesystem"
    if not permitted(existing, os.W_OK | os.X_OK):
        what = "" if existing == path else f" (its nearest existing parent {existing} is not writable)"
        return f"no permission to write there{what}"
    return None


def output_file_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path` (None when it can): it is a directory, or its directory cannot be
    made or written (writable_dir_problem)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return "it is a directory; give the path of a file"
    why = writable_dir_problem(path.parent)
    return f"its directory {path.parent}: {why}" if why else None


def permitted(path: Path, mode: int) -> bool:
    """os.access for this process as it runs (its effective ids: a setuid launcher, a test acting as another user)."""
    return os.access(path, mode, effective_ids=_EFFECTIVE_IDS)


_EFFECTIVE_IDS = os.access in os.supports_effective_ids
