"""Files and folders fastwan writes for a user (videos, FP8 checkpoints, the tiny checkpoints, profiles).

Rules:

- Each is created with the mode any program's files get: 0o666 for a file and 0o777 for a folder, less the umask
  (the kernel applies it), never the owner-only 0o600 / 0o700 of :mod:`tempfile`'s ``mkstemp`` / ``mkdtemp``.
- Each is written under a new hidden temporary name beside its destination (created exclusively, so no other
  file is ever reused) and moved into place only when complete
  (:func:`fastwan.checkpoint.safetensors.write_atomically` for a file).
- A writer that makes its file owner-only itself (safetensors writes a private temporary file and renames it) has
  the file's mode set back to a new file's (:func:`new_file_mode`) before the file is moved into place.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

FILE_MODE = 0o666  # less the umask
FOLDER_MODE = 0o777  # less the umask


def _new_temp(folder: str | Path, prefix: str, suffix: str, create) -> Path:
    """``create(path)`` at a new ``<prefix><random><suffix>`` in ``folder`` until it does not exist yet -> the
    path. ``create`` raises FileExistsError for a taken name (another random name is tried) and OSError when
    ``folder`` is not writable (raised)."""
    while True:
        path = Path(folder) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            create(path)
        except FileExistsError:
            continue
        return path


def new_temp_file(folder: str | Path, prefix: str, suffix: str) -> Path:
    """Create a new empty file ``<prefix><random><suffix>`` in ``folder`` (exclusive create, mode 0o666 less the
    umask) -> its path. Raises OSError when ``folder`` is not writable."""
    return _new_temp(folder, prefix, suffix,
                     lambda path: os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)))


def new_temp_folder(folder: str | Path, prefix: str, suffix: str) -> Path:
    """Create a new empty folder ``<prefix><random><suffix>`` in ``folder`` (mode 0o777 less the umask) -> its
    path. Raises OSError when ``folder`` is not writable."""
    return _new_temp(folder, prefix, suffix, lambda path: os.mkdir(path, FOLDER_MODE))


def new_file_mode(folder: str | Path) -> int:
    """The permission bits a new file in ``folder`` gets (0o666 less the umask), read off a probe file created and
    removed there (``os.umask`` would change the umask of every thread to read it)."""
    probe = new_temp_file(folder, ".fastwan-mode-", ".tmp")
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink(missing_ok=True)


def set_file_modes(root: str | Path, mode: int) -> None:
    """Give every regular file under the folder ``root`` the permission bits ``mode`` (links are left alone)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            if not path.is_symlink() and path.is_file() and stat.S_IMODE(path.stat().st_mode) != mode:
                path.chmod(mode)
