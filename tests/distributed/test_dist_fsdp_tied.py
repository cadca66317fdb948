"""Tied (shared) parameters on an FSDP2-sharded model, world size 2 (gloo, CPU).

A tiny language model whose output head shares the embedding's weight (``lm_head.weight is
wte.weight``), both under the root's ``fully_shard`` and a hidden block in a unit of its own:

* with noise 0 and SGD at learning rate 1, two ranks holding half of a logical batch each (and,
  accumulated, physical batches of different sizes with an empty one) step the shards by the
  float64 clipped mean computed sample by sample (one backward per sample, the tied weight's
  gradient the sum of its two uses), on a first step (the separability probe's, whole model
  gathered) and after one (book-keeping modes: the backward unit by unit);
* a crafted sample (embedding rows ×1e4 through its token) moves the release by at most R:
  ``B·‖Δupdate‖/R ≤ 1``;
* a weight tied after ``fully_shard`` (the head holding the embedding's ``DTensor``, which
  FSDP2 does not swap for the unsharded tensor there) is refused, naming both.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from dist_spawn import run_ranks
from private_engine.clipping.functions import abadi_clip
from reference import reference_clipped_sum

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("no FSDP2 in this torch", allow_module_level=True)

V, D, T, B, R = 11, 6, 4, 6, 0.5
MODES = ("bk_mixed", "bk", "mixed", "per_sample")
VARIANTS = ("split", "accumulate", "split_warm", "accumulate_warm")


class TinyLM(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.block(self.wte(ids))))


def _model(tie_after: bool = False) -> nn.Module:
    m = TinyLM(tie=not tie_after).double()
    fsdp.fully_shard(m.block)
    fsdp.fully_shard(m)
    if tie_after:  # the head holds the embedding's DTensor, which FSDP2 does not swap there
        m.lm_head.weight = m.wte.weight
    return m


def _loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], T).sum(1)


def _ids(crafted_token: bool = False):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    if crafted_token:
        ids[B - 1] = V - 1  # the only sample that reads token V-1
        ids[:B - 1][ids[:B - 1] == V - 1] = 0
    return ids


def _full(model):
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in model.parameters()]).clone()


def _engine(model, mode):
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))


def _pieces(rank, variant):
    if variant == "split":
        return [slice(rank * 3, rank * 3 + 3)]
    if rank == 0:  # accumulate: rank 0 → [1, 2, empty], rank 1 → [3, empty, empty]
        return [slice(0, 1), slice(1, 3), slice(3, 3)]
    return [slice(3, 6), slice(6, 6), slice(6, 6)]


def _warm_up(rank, model, opt):
    """A first step on other ids: the separability probe runs there (whole model gathered), so
    that the measured step's backward runs unit by unit in the book-keeping modes."""
    ids = _ids().flip(1)
    opt.step(loss=_loss(model, ids[rank * 3:rank * 3 + 3]))


def _train(rank, mode, variant, ids):
    """``(parameters before, update)`` of one logical batch (after a warm-up step for the
    variants ending in "_warm")."""
    model = _model()
    _, opt = _engine(model, mode)
    if variant.endswith("_warm"):
        _warm_up(rank, model, opt)
        variant = variant[:-len("_warm")]
    before = _full(model)
    pieces = _pieces(rank, variant)
    for k, sl in enumerate(pieces):
        loss = _loss(model, ids[sl])
        (opt.step if k == len(pieces) - 1 else opt.virtual_step)(loss=loss)
    return before, _full(model) - before


def _crafted(rank, mode):
    """B·‖update(with) − update(without)‖ / R, the crafted sample on rank 1: the only one that
    reads token V−1, whose embedding row (tied with the head's row V−1) is set to 1e4."""
    ids = _ids(crafted_token=True)
    updates = []
    for with_it in (True, False):
        model = _model()
        if rank == 1:  # row V−1 lies in rank 1's shard (rows 6..10)
            with torch.no_grad():
                model.wte.weight.to_local()[-1] = 1e4
        _, opt = _engine(model, mode)
        _warm_up(rank, model, opt)
        before = _full(model)
        sl = slice(rank * 3, rank * 3 + 3 if (rank == 0 or with_it) else B - 1)
        opt.step(loss=_loss(model, ids[sl]))
        updates.append(_full(model) - before)
    return float(B * (updates[0] - updates[1]).norm() / R)


def tied_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    out = {}
    ids = _ids()
    for mode in MODES:
        for variant in VARIANTS:
            out[(mode, variant)] = _train(rank, mode, variant, ids)
        out[(mode, "crafted")] = _crafted(rank, mode)
    try:
        _engine(_model(tie_after=True), "bk_mixed")
        out["tied_after"] = None
    except ValueError as e:
        out["tied_after"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tied_worker, tmp_path_factory.mktemp("dist_fsdp_tied"), timeout=300.0)


def _reference_update(start):
    """``−(Σ_i C_i g_i)/B`` in float64 at the parameters ``start``, one backward per sample
    (SGD, lr 1, noise 0)."""
    model = TinyLM().double()
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(start[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    sums, _ = reference_clipped_sum(model, [_ids()], _loss, R, abadi_clip)
    return -torch.cat([s.flatten() for s in sums]) / B


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_tied_weight_update_is_the_clipped_mean(ranks, mode, variant):
    start, _ = ranks[0][(mode, variant)]
    want = _reference_update(start)
    assert want.abs().max() > 1e-3
    for r in ranks:
        got_start, got = r[(mode, variant)]
        assert torch.equal(got_start, start) and got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-9


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_tied_weight_crafted_sample_moves_release_by_at_most_R(ranks, mode):
    for r in ranks:
        assert 0.0 < r[(mode, "crafted")] <= 1.0 + 1e-9


def test_fsdp2_weight_tied_after_fully_shard_is_refused(ranks):
    for r in ranks:
        msg = r["tied_after"]
        assert msg is not None and "wte.weight" in msg and "lm_head.weight" in msg, msg
        assert "tied after fully_shard" in msg, msg
