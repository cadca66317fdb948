"""The batch flow's tags, op by op: what stays per sample, what mixes, and the tracker's own
bookkeeping (regions, the dispatch stack)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

import private_engine as pe
from private_engine import opacus_compat
from private_engine.guards.batch_flow import BatchFlow, Iota, Mixed, Rows, join, reshape_rows
from private_engine.guards.batch_flow.tags import Summed


def tags_of(model, make, *inputs):
    """The tag of ``make(model(*inputs))`` under a fresh tracker (the region closed after)."""
    flow = BatchFlow(model).install()
    try:
        return flow.tag(make(model(*inputs)))
    finally:
        flow.remove()


class Identity(nn.Module):
    def forward(self, x):
        return x * 1


B = 4


def test_reshape_keeps_the_sample_digit():
    r = Rows(0, 1, 0, B)
    assert reshape_rows((B, 6, 5), r, (B * 6, 5)) == Rows(0, 6, 0, B)  # merged: per = 6
    assert reshape_rows((B * 6, 5), Rows(0, 6, 0, B), (B, 6, 5)) == Rows(0, 1, 0, B)
    assert reshape_rows((2 * B, 3), Rows(0, 1, 0, 2 * B), (2, B, 3)) == Rows(1, 1, 0, B)
    assert reshape_rows((B, 6), r, (6, B)) is None  # the digit spreads over two dims


def test_join_lowers_the_modulus_to_what_stays_one_sample():
    assert join(Rows(0, 1, 0, 8), Rows(0, 1, 4, 8)) == Rows(0, 1, 0, 4)
    with pytest.raises(Exception):
        join(Rows(0, 1, 0, 8), Rows(0, 1, 1, 8))  # rows r and r+1: different samples
    with pytest.raises(Exception):
        join(Rows(0, 1, 0, B), Rows(1, 1, 0, B))


@pytest.mark.parametrize("make,expected", [
    (lambda y: y.sum(1), Rows),
    (lambda y: y.softmax(1).log().mean(1), Rows),
    (lambda y: y - y.mean(0), Mixed),
    (lambda y: y.flip(0).sum(1), Mixed),
    (lambda y: y.softmax(0).sum(1), Mixed),
    (lambda y: y.sum(), Summed),
    (lambda y: y.mean(0), Summed),
    (lambda y: y.sum(1) / y.sum(), Mixed),
    (lambda y: y.sum(1) * torch.clamp(10 / y.abs().amax(), max=1), Mixed),
    (lambda y: y[torch.arange(B), torch.zeros(B, dtype=torch.long)], Rows),
    (lambda y: y[torch.arange(B) + 0, torch.zeros(B, dtype=torch.long)], Mixed),
    (lambda y: y[torch.arange(1, B + 1) % B, 0], Mixed),
    (lambda y: y.t().sum(0), Rows),
    (lambda y: (y.t() @ y).sum(1), Summed),
])
def test_ops_on_the_batch(make, expected):
    torch.manual_seed(0)
    tag = tags_of(Identity(), make, torch.randn(B, 5, requires_grad=True))
    assert isinstance(tag, expected), tag


@pytest.mark.parametrize("make", [lambda y: torch.cat([y[2:], y[:2]]).sum(1),
                                  lambda y: y.roll(2, 0).sum(1) + y.sum(1)])
def test_rows_moved_or_paired_across_samples_are_refused_as_a_loss(make):
    """A rotation of the batch keeps rows separable but out of order (``off`` 2); adding rows r
    and r + 2 leaves only pairs of rows that could be one sample (``mod`` 2): as a loss vector of
    B entries both are refused."""
    model = Identity()
    flow = BatchFlow(model).install()
    try:
        loss = make(model(torch.randn(B, 5, requires_grad=True)))
        assert isinstance(flow.tag(loss), Rows)
        with pytest.raises(pe.BatchMixingError, match="not one per sample in batch order"):
            flow.check_loss(loss)
    finally:
        flow.remove()


def test_two_views_of_a_batch_are_one_sample_per_pair_of_rows():
    """``cat([x, aug(x)], 0)`` through a model, then the views compared row by row: entry j
    depends on rows j and j + B, sample j under the two-view convention (``mod`` B)."""
    model = nn.Linear(5, 3)
    x = torch.randn(B, 5)
    tag = tags_of(model, lambda z: (z[:B] - z[B:]).pow(2).sum(1), torch.cat([x, x + 1]))
    assert tag == Rows(0, 1, 0, B)


def test_arange_is_an_index_only_when_it_is_all_of_them():
    flow = BatchFlow(Identity()).install()
    try:
        flow.begin(B)
        assert flow.tag(torch.arange(B)) == Iota(0, True)
        assert flow.tag(torch.arange(1, B)) == Iota(0, False)  # positions, not an index
        assert flow.tag(torch.arange(B) + 1) == Iota(0, False)
    finally:
        flow.remove()


def test_position_weights_on_the_batch_mix():
    """``loss · (1 + arange(B))`` weighs each sample by how many come before it."""
    tag = tags_of(nn.Linear(5, 3), lambda y: y.pow(2).sum(1) * (1 + torch.arange(B)),
                  torch.randn(B, 5))
    assert isinstance(tag, Mixed) and "position" in tag.why


def test_a_tensor_of_the_batch_size_from_outside_is_data_along_any_dim():
    """Labels broadcast along another dim than the batch's and summed there couple samples (a
    constant that happens to have the batch's size is taken for data too: register such constants
    as buffers of the model)."""
    t = torch.randn(B, 3)
    tag = tags_of(nn.Linear(5, 3), lambda y: (y[:, None, :] * t).sum((1, 2)), torch.randn(B, 5))
    assert isinstance(tag, Mixed)


def test_values_kept_from_an_earlier_batch_mix():
    class Memory(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)
            self.prev = None

        def forward(self, x):
            h = self.fc(x)
            out = h if self.prev is None else h + self.prev
            self.prev = h.detach()
            return out

    model = Memory()
    flow = BatchFlow(model).install()
    try:
        flow.check_loss(model(torch.randn(B, 5)).sum(1))
        loss = model(torch.randn(B, 5)).sum(1)
        assert isinstance(flow.tag(loss), Mixed) and "earlier batch" in flow.tag(loss).why
    finally:
        flow.remove()


def test_the_opacus_door_leaves_one_tracker_on_the_dispatch_stack_at_most():
    """The door closes its region inside the backward, where a pop would not last: repeated steps
    must not pile trackers onto the stack (each op would go through all of them)."""
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(16, 1)),
                                         batch_size=B)
    module, opt, _ = opacus_compat.PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=1.0, poisson_sampling=False)
    for _ in range(5):
        F.cross_entropy(module(torch.randn(B, 5)), torch.randint(0, 2, (B,))).backward()
        opt.step()
        opt.zero_grad()
        stack = _get_current_dispatch_mode_stack()
        assert sum(isinstance(m, BatchFlow) for m in stack) <= 1
    module.remove_hooks()
    assert not any(isinstance(m, BatchFlow) for m in _get_current_dispatch_mode_stack())


def test_submodules_called_by_the_loop_open_the_region():
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 2))
    flow = BatchFlow(model).install()
    try:
        h = model[0](torch.randn(B, 5))
        out = model[1](h - h.mean(0))
        assert isinstance(flow.tag(out.sum(1)), Mixed)
    finally:
        flow.remove()



class RewritesAFreedTemporary(nn.Module):
    """Writes a batch-wide mean into a temporary in place and frees it; then takes a tensor of
    the batch's size made where the tracker does not see it (as the engine's own code and
    ``torch.from_numpy`` make them). ``external``: the temporary is a NumPy buffer's memory, and
    the fresh tensor reads that memory again."""

    def __init__(self, external: bool):
        super().__init__()
        self.external = external
        self.buffer = torch.zeros(B, 1000).numpy()
        self.written, self.fresh = 0, -1  # the two storages' addresses

    def forward(self, x):
        z = torch.from_numpy(self.buffer) if self.external else torch.zeros(B, 1000)
        z.add_(x.mean(0).sum())  # every row now holds a value of the whole batch
        self.written = z.untyped_storage().data_ptr()
        del z
        with _disable_current_modes():  # made outside the tracker
            fresh = torch.from_numpy(self.buffer) if self.external else torch.ones(B, 1000)
        self.fresh = fresh.untyped_storage().data_ptr()
        return x * fresh[:, :5]


def test_a_freed_storage_written_in_place_does_not_taint_a_tensor_later_at_its_address(
        monkeypatch):
    """A write in place is remembered by its storage's address. Once torch's allocator has that
    storage back, a tensor it hands out at the same address holds none of the written values:
    its rows stay its own (the allocator's reuse of the address is made certain by reading the
    fresh tensor's address as the freed one's). Memory torch does not own (a NumPy buffer) still
    holds the write after the tensor over it is gone, and a tensor over it again reads the mixed
    values."""
    from private_engine.guards.batch_flow import mode

    model = RewritesAFreedTemporary(external=False)
    address = mode._storage
    monkeypatch.setattr(mode, "_storage", lambda t: (
        model.written if address(t) == model.fresh else address(t)))
    tag = tags_of(model, lambda y: y.sum(1), torch.randn(B, 5, requires_grad=True))
    assert isinstance(tag, Rows), tag
    model = RewritesAFreedTemporary(external=True)
    tag = tags_of(model, lambda y: y.sum(1), torch.randn(B, 5, requires_grad=True))
    assert model.fresh == model.written and isinstance(tag, Mixed), tag
