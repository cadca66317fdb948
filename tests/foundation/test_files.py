"""The atomic writes: a file holds its old content or the whole new one, an exclusive create never
replaces an existing file, and no temporary file is left behind."""
import os
import stat

import pytest
import torch

from private_engine.foundation.files import atomic_create, atomic_save


def test_atomic_create_writes_a_new_file_with_its_mode_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "ledger"
    atomic_create(b"header\n", path, mode=0o640)
    assert path.read_bytes() == b"header\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger"]


def test_atomic_create_never_replaces_an_existing_file(tmp_path):
    path = tmp_path / "ledger"
    path.write_bytes(b"another run\n")
    with pytest.raises(FileExistsError):
        atomic_create(b"header\n", path)
    assert path.read_bytes() == b"another run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger"]


def test_atomic_save_keeps_the_old_content_when_the_write_fails(tmp_path):
    path = tmp_path / "state.pt"
    atomic_save({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    atomic_save({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
