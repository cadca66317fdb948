"""The batch flow's fast paths against its general path: every op's output tags the same, the
mixed ones' messages included.

The tracker reads the commonest rules (identity, view, pointwise, addmm) inline on the tags it
read already, reads an input's entry and stores an output's inline, and gives the other rules a
memo of the inputs' tags. Each program below runs twice on fresh trackers: as shipped, and with
all of these switched off (no ``OpInfo.fast``; ``tag`` through ``_entry``; every entry through
``_entry``, forced by an in-place write record that matches no storage; every output through
``_assign``); the tags of every op's outputs, and the entries stored for them (tag, region,
clock, source), must agree.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from private_engine.guards.batch_flow import mode as flow_mode
from private_engine.guards.batch_flow import rules
from private_engine.guards.batch_flow.mode import BatchFlow, _Write

B = 4


class Recording(BatchFlow):
    """A tracker that logs each op of an open region with the tags of its outputs and what it
    stored for them."""

    def __init__(self, model):
        super().__init__(model)
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        active = self.active
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if active:
            self.log.append((str(func), [(self.tag(t), self._stored(t))
                                         for t in rules.flat_tensors(out)]))
        return out

    def _stored(self, t):
        """What the tracker stored for ``t``: its tag, epoch, clock and source."""
        entry = self._tags.get(id(t))
        return None if entry is None or entry.ref() is not t else tuple(entry)[1:]


@contextlib.contextmanager
def general_path(monkeypatch):
    """The tracker without its fast paths: every rule by ``OpInfo.rule`` (or ``pointwise``),
    every tag and entry through ``_entry``, every output tagged by ``_assign``'s loop."""
    with monkeypatch.context() as m:
        def slow_info(func):
            info = rules.OpInfo(func)
            info.fast = 0
            # every op's outputs through _assign's loop for ops that write: the schema's write
            # targets (none for a pure op) take nothing, every output its tag
            info.mutable = True
            return info

        m.setattr(flow_mode, "_OPS", {})
        m.setattr(flow_mode, "op_info", slow_info)
        m.setattr(BatchFlow, "tag", lambda self, t: self._entry(t)[0])
        begin = BatchFlow.begin

        def begin_with_a_write(self, n):
            begin(self, n)
            self._writes[-7] = _Write(0, None, None)  # no storage has this pointer

        m.setattr(BatchFlow, "begin", begin_with_a_write)
        yield


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(F.gelu(self.lin(x)) + x)


def _attention(y):
    q = y.view(B, 3, 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(B, 3, 8)


def _in_place(y):
    z = y.clone()
    z[:, 0].add_(1.0)
    z.mul_(2)
    return z.sum((1, 2))


def _in_place_across(y):
    z = y.clone()
    z[1:].add_(z[:-1].clone())
    return z


def _view_then_write(y):
    z = y.clone()
    v = z.view(B * 3, 8)
    z.add_(z.roll(1, 0))
    return v + 1


#: per-sample data made before the step (labels): rows of the batch from outside the forward
LABELS = torch.randn(B, 8)

PROGRAMS = {
    "views": lambda y: y.view(B * 3, 8).view(B, 24).reshape(B, 3, 8).flatten(1).unflatten(
        1, (3, 8)),
    "batch split": lambda y: y.reshape(2, B // 2, 3, 8).sum(0),
    "batch merge": lambda y: y.reshape(B * 3, 8)[: 3 * B // 2].view(B // 2, 3, 8),
    "reshape across": lambda y: y.transpose(0, 1).reshape(B, 3, 8),
    "identity ops": lambda y: torch.ops.aten.alias(y.detach().clone().contiguous()) * 1,
    "pointwise": lambda y: F.gelu(y) * torch.sigmoid(y) - y.exp().neg() / 3,
    "broadcast": lambda y: y + y[:, :1] + torch.ones(8) + torch.randn(1, 3, 1),
    "broadcast one row": lambda y: y + y[:1],
    "unaligned rows": lambda y: y.sum((1, 2)) + y.sum((1, 2)).unsqueeze(1),
    "positions": lambda y: y * torch.arange(B).view(B, 1, 1),
    "positions along": lambda y: y * torch.arange(8),
    "linear": lambda y: F.linear(y, torch.randn(5, 8), torch.randn(5)),
    "linear 2-d": lambda y: F.linear(y.reshape(B * 3, 8), torch.randn(5, 8), torch.randn(5)),
    "per-sample weight": lambda y: F.linear(torch.randn(3, 8), y[:, 0]),
    "matmul over batch": lambda y: y.reshape(B, 24).t() @ y.reshape(B, 24),
    "addmm over batch": lambda y: torch.addmm(torch.randn(24, 24), y.reshape(B, 24).t(),
                                              y.reshape(B, 24)),
    "addmm rows bias": lambda y: torch.addmm(y.reshape(B, 24)[:, :5], y.reshape(B, 24),
                                             torch.randn(24, 5)),
    "baddbmm": lambda y: torch.baddbmm(torch.randn(3, 3), y, y.transpose(1, 2)),
    "bmm": lambda y: torch.bmm(y, y.transpose(1, 2)),
    "layer norm": lambda y: F.layer_norm(y, (8,)) + F.layer_norm(y, (3, 8)),
    "layer norm affine": lambda y: F.layer_norm(y, (3, 8), torch.ones(3, 8), torch.zeros(3, 8)),
    "layer norm across": lambda y: F.layer_norm(y.transpose(0, 2), (3, B), torch.ones(3, B),
                                                torch.zeros(3, B)),
    "layer norm over the batch": lambda y: F.layer_norm(y.permute(1, 0, 2), (B, 8),
                                                        torch.ones(B, 8), torch.zeros(B, 8)),
    "layer norm per-sample weight": lambda y: F.layer_norm(torch.randn(3, B), (B,), y[:, 0, 0],
                                                           torch.zeros(B)),
    "outside rows": lambda y: ((LABELS * nn.Parameter(torch.ones(8))).sum(1) + y.sum((1, 2))),
    "batch norm": lambda y: F.batch_norm(y, None, None, training=True),
    "attention": _attention,
    "softmax": lambda y: y.softmax(-1) + y.log_softmax(0),
    "cat stack": lambda y: torch.cat([y, y], 1).sum(1) + torch.stack([y, y]).sum(0).sum(1),
    "cat batch": lambda y: torch.cat([y, y.roll(1, 0)], 0).view(2, B, 3, 8).sum(0),
    "split unbind": lambda y: sum(y.unbind(1)).sum(-1) + sum(y.split(4, -1)).sum((1, 2)),
    "permute": lambda y: y.permute(2, 0, 1).permute(1, 2, 0),
    "index": lambda y: y[torch.arange(B), torch.zeros(B, dtype=torch.long)] + y[:, 0],
    "gather": lambda y: y.gather(2, torch.zeros(B, 3, 1, dtype=torch.long)),
    "sums": lambda y: (y.sum() * 2 + y.mean(0).sum()) / 3,
    "sum divides": lambda y: y.sum((1, 2)) / y.sum(),
    "mixed then more": lambda y: (y - y.mean(0)).view(B, 24).t().detach() + 1,
    "in place": _in_place,
    "in place across": _in_place_across,
    "view then write": _view_then_write,
    "where": lambda y: torch.where(y > 0, y, torch.zeros(())) + y.clamp(min=0),
    "loss": lambda y: F.cross_entropy(y.sum(1), torch.arange(B) % 8, reduction="none"),
    "loss mean": lambda y: F.cross_entropy(y.sum(1), torch.arange(B) % 8),
    "flip": lambda y: y.flip(0).sum((1, 2)),
    "prelu": lambda y: F.prelu(y, torch.full((3,), 0.1)),
    "prelu per-sample weight": lambda y: F.prelu(torch.randn(3, B, 8), y[:, 0, 0]),
    "expand": lambda y: y[:, :1].expand(B, 3, 8) + y.sum(0, keepdim=True).expand(B, 3, 8),
}


def run(program, state_from_before=False):
    """The log of ``program`` on a net's output for a batch of B (after a first region when
    ``state_from_before``: a value of an earlier step used again) and the tag of its result."""
    net = Net()
    flow = Recording(net).install()
    torch.manual_seed(1)
    x = torch.randn(B, 3, 8)
    kept = None
    if state_from_before:
        kept = net(x).sum(1)
        flow.end()  # the step's end: the next forward opens the next region
    flow.log.clear()
    try:
        torch.manual_seed(2)
        y = net(x) if kept is None else net(x) + kept.unsqueeze(1)
        final = flow.tag(program(y))
    finally:
        flow.remove()
    return flow.log, final


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_fast_paths_give_the_general_paths_tags(name, stale, monkeypatch):
    fast = run(PROGRAMS[name], stale)
    with general_path(monkeypatch):
        general = run(PROGRAMS[name], stale)
    assert fast[0], "the region saw no op"
    assert fast == general


def test_the_fast_paths_run_in_these_programs():
    """The programs reach every fast path (the comparison above is not between two general
    paths)."""
    fast = {rules.op_info(f).fast for f in (torch.ops.aten.view.default,
                                          torch.ops.aten.detach.default,
                                          torch.ops.aten.add.Tensor,
                                          torch.ops.aten.addmm.default)}
    assert fast == {rules.VIEW, rules.IDENTITY, rules.POINTWISE, rules.ADDMM}
    seen = set()
    for program in PROGRAMS.values():
        for func, _ in run(program)[0]:
            seen.add(func)
    assert {"aten.view.default", "aten.detach.default", "aten.add.Tensor",
            "aten.addmm.default", "aten.gelu.default"} <= seen
