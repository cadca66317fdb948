"""Fixtures shared by the test modules (pytest finds them here; plain helpers such as
``reference.py`` and ``engine_checks.py`` are imported as modules).

``one_thread``: the engine tests run tiny tensors, where intra-op threads only add
synchronisation (20–90 ms per conv on a busy 2-core box). A module asks for it with
``pytestmark = pytest.mark.usefixtures("one_thread")``; the thread count is restored afterwards.
"""
import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test; the previous thread count is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def kept_group_shapes(monkeypatch):
    """The ``(B, width)`` shapes of the groups the clipper forms of kept per-sample gradients
    during the test (``group_kept_grads`` spied on)."""
    import private_engine.clipping.clipper as clipper_module

    shapes = []
    own = clipper_module.group_kept_grads

    def spy(items, batch_size, key=None):
        groups, terms = own(items, batch_size, key)
        shapes.extend(tuple(mat.shape) for _, mat in groups)
        return groups, terms

    monkeypatch.setattr(clipper_module, "group_kept_grads", spy)
    return shapes


@pytest.fixture
def together_rows(monkeypatch):
    """The number of rows (samples of all the layers) of each second try the ghost stack takes
    over layers of one shape together during the test (``second_try_rows`` spied on)."""
    import private_engine.layers.ghost_retry as ghost_retry

    rows = []
    own = ghost_retry.second_try_rows

    def spy(a, *rest):
        rows.append(a.shape[0])
        return own(a, *rest)

    monkeypatch.setattr(ghost_retry, "second_try_rows", spy)
    return rows
