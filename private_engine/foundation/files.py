"""Files written whole or not at all: the library's atomic writes (checkpoints, engine states in
framework checkpoints, the feature heads' cache, the step ledger's header)."""
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
    fsync_directory(directory)


def atomic_create(data: bytes, path, mode: int = 0o644) -> None:
    """Write ``data`` to a new file ``path`` whole or not at all, and never over an existing one:
    written to a temporary file in the same directory, ``fsync``-ed, given ``mode``, hard-linked
    to ``path`` (``os.link`` fails with ``FileExistsError`` if ``path`` exists), then the directory
    ``fsync``-ed where the OS allows. The temporary file is removed in every case."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.chmod(tmp, mode)
        os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_directory(directory)


def fsync_directory(directory) -> None:
    """``fsync`` a directory (so a new entry in it survives a crash) where the OS allows
    (directories cannot be opened on Windows)."""
    with contextlib.suppress(OSError, AttributeError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
