"""Files written whole or not at all: the library's one atomic write (checkpoints, engine states
in framework checkpoints, the feature heads' cache)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch


def atomic_save(obj: Any, path) -> None:
    """``torch.save(obj, path)`` so that ``path`` holds either its old content or the whole new
    one: written to a temporary file of mode 0600 in the same directory, flushed and ``fsync``-ed,
    renamed over ``path`` (``os.replace``, atomic on POSIX and Windows), then the directory
    ``fsync``-ed where the OS allows. The temporary file is removed if anything raises."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError, AttributeError):  # directories cannot be opened on Windows
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
