"""Native engine on FSDP2-sharded models (``fully_shard``), world size 2 (gloo, CPU).

* With noise 0, two ranks holding B/2 samples each of a logical batch of B step the shards to the
  parameters one unsharded process reaches on the whole batch (float64: to 1e-6), in each of the
  six clipping modes, for an MLP (a bias of 3 rows: FSDP2 pads its shards), a CNN with GroupNorm
  and a tiny timm ViT (``cls_token`` and ``pos_embed`` clipped by the tracer on the root's
  unsharded parameters); with gradient accumulation (three physical batches per rank of
  different sizes, empty ones included); with every sample on one rank (MLP). FSDP2's own
  gradient reduction is off and no raw ``.grad`` is formed on the unsharded parameters.
* A crafted sample (inputs ×1e4) on rank 1 moves the release by at most R:
  ``B·‖Δupdate‖/R ≤ 1`` (noise 0, SGD with learning rate 1).
* The noise is added once per coordinate: with zero gradients the update's per-coordinate
  standard deviation is σR/B (not √2·σR/B), each rank noising its own rows with its own
  generator (the two halves uncorrelated); generators in the same state on both ranks are
  refused.
* Refusals: ``distributed=False``, ``check_replicas=True``, a ``MixedPrecisionPolicy``, a
  ``Shard(1)`` placement, trainable
  parameters outside ``fully_shard``, a torch.func fallback module, FSDP2's
  gradient sync switched back on (refused at the step, nothing updated), an engine state of
  another rank, ``save_checkpoint``.
* ``engine.state_dict()`` works on every rank and loads on the rank that wrote it, with the step
  ledger that rank 0 writes and no generator state; ``detach``
  gives FSDP2 its own gradient reduction back, ``attach`` takes it again.

Two spawns of two ranks (one per module fixture); each test checks what they returned.
"""
from __future__ import annotations

import math
import os
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from dist_spawn import run_ranks
from private_engine.checkpoint import use_ledger

pytestmark = pytest.mark.slow

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("no FSDP2 in this torch", allow_module_level=True)

MODES = pe.CLIPPING_MODES
MODELS = ("mlp", "cnn", "vit")
B, N, STEPS, R = 8, 64, 2, 0.1
TOL = 1e-6
CASES = [(name, mode, variant) for name in MODELS for mode in MODES
         for variant in ("split", "accumulate") + (("uneven",) if name == "mlp" else ())]
SIGMA = 1.0


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    elif name == "cnn":
        m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3))
    else:
        m = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1,
                              embed_dim=16, num_heads=2, num_classes=3)
    return m.double()


def _shard(name: str, model: nn.Module) -> nn.Module:
    """``fully_shard`` on the layers (blocks of the ViT), then on the root."""
    if name == "vit":
        for block in model.blocks:
            fsdp.fully_shard(block)
    else:
        for layer in model:
            if any(p.requires_grad for p in layer.parameters(recurse=False)):
                fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def _batches(name: str, crafted: bool = False):
    g = torch.Generator().manual_seed(1)
    shape = {"mlp": (6,), "cnn": (3, 6, 6), "vit": (3, 16, 16)}[name]
    out = []
    for _ in range(STEPS):
        x = torch.randn(B, *shape, generator=g, dtype=torch.float64)
        if crafted:
            x[B - 1] *= 1e4
        out.append((x, torch.randint(0, 3, (B,), generator=g)))
    return out


def _full(model):
    """The model's parameters, full tensors (a collective on sharded models), flattened."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in model.parameters()]).clone()


def _engine(model, mode="bk_mixed", lr=0.5, max_grad_norm=R, sigma=0.0, **kwargs):
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=N, max_grad_norm=max_grad_norm,
                              noise_multiplier=sigma, clipping_mode=mode, **kwargs)
    return engine, engine.attach(torch.optim.SGD(model.parameters(), lr=lr))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _pieces(rank: int, variant: str):
    """The physical batches this rank runs in one logical batch: the same number on every rank
    (each runs FSDP2's forward collectives), of any sizes."""
    if variant == "split":
        return [slice(rank * 4, rank * 4 + 4)]
    if variant == "uneven":
        return [slice(0, B)] if rank == 0 else [slice(0, 0)]
    if rank == 0:  # accumulate: rank 0 → [1, 3, empty]; rank 1 → [2, empty, 2]
        return [slice(0, 1), slice(1, 4), slice(4, 4)]
    return [slice(4, 6), slice(6, 6), slice(6, 8)]


def _run_sharded(rank, name, mode, variant):
    model = _shard(name, _model(name))
    engine, opt = _engine(model, mode)
    for x, y in _batches(name):
        pieces = _pieces(rank, variant)
        for k, sl in enumerate(pieces):
            loss = _loss(model, x[sl], y[sl])
            if k < len(pieces) - 1:
                opt.virtual_step(loss=loss)
            else:
                opt.step(loss=loss)
    groups = [g for m in engine.distributed.modules
              for g in m._get_fsdp_state()._fsdp_param_groups]
    raw = [fp._unsharded_param.grad for g in groups for fp in g.fsdp_params]
    return {"params": _full(model), "sync_off": not any(g.reduce_grads for g in groups),
            "no_raw_grad": all(t is None for t in raw)}


def _run_single(name, mode):
    model = _model(name)
    _, opt = _engine(model, mode, distributed=False)
    for x, y in _batches(name):
        opt.step(loss=_loss(model, x, y))
    return _full(model)


def _crafted_ratio(rank, name, mode):
    """B·‖update(with) − update(without)‖ / R, the crafted sample on rank 1 (noise 0, lr 1)."""
    updates = []
    for crafted_in in (True, False):
        model = _shard(name, _model(name))
        before = _full(model)
        _, opt = _engine(model, mode, lr=1.0, max_grad_norm=1.0)
        x, y = _batches(name, crafted=True)[0]
        sl = slice(rank * 4, rank * 4 + 4 if (rank == 0 or crafted_in) else B - 1)
        opt.step(loss=_loss(model, x[sl], y[sl]))
        updates.append(_full(model) - before)
    return float(B * (updates[0] - updates[1]).norm() / 1.0)


def equivalence_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    out = {}
    for name, mode, variant in CASES:
        out[(name, mode, variant)] = _run_sharded(rank, name, mode, variant)
    for name in MODELS:
        for mode in MODES:
            if rank == 0:
                out[(name, mode, "single")] = _run_single(name, mode)
            out[(name, mode, "initial")] = _full(_model(name))
    for name in ("mlp", "vit"):
        for mode in MODES:
            out[(name, mode, "crafted")] = _crafted_ratio(rank, name, mode)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(equivalence_worker, tmp_path_factory.mktemp("dist_fsdp"), timeout=300.0)


@pytest.mark.parametrize("name,mode,variant", CASES)
def test_sharded_two_ranks_equal_one_process(ranks, name, mode, variant):
    r0, r1 = ranks
    got0, got1 = r0[(name, mode, variant)], r1[(name, mode, variant)]
    assert torch.equal(got0["params"], got1["params"])  # the gathered model, seen by both
    for got in (got0, got1):
        assert got["sync_off"] and got["no_raw_grad"]
    want = r0[(name, mode, "single")]
    moved = (want - r0[(name, mode, "initial")]).abs().max()
    assert moved > 1e-3, "the reference did not move: the test would see nothing"
    assert (got0["params"] - want).abs().max() <= TOL


@pytest.mark.parametrize("name", ["mlp", "vit"])
@pytest.mark.parametrize("mode", MODES)
def test_sharded_crafted_sample_moves_release_by_at_most_R(ranks, name, mode):
    ratio0, ratio1 = ranks[0][(name, mode, "crafted")], ranks[1][(name, mode, "crafted")]
    assert ratio0 == pytest.approx(ratio1, rel=1e-12)
    assert 0.5 < ratio0 <= 1.0 + 1e-9


# -- noise, refusals, state --------------------------------------------------------------------
def _noise_once(rank):
    """Zero gradients, σ = 1, R = 1: the updates (lr 1) of two steps are pure noise / B."""
    torch.manual_seed(0)
    model = fsdp.fully_shard(nn.Sequential(nn.Linear(100, 100)).double())
    engine, opt = _engine(model, lr=1.0, max_grad_norm=1.0, sigma=SIGMA)
    g = torch.Generator().manual_seed(3)
    deltas = []
    for _ in range(2):
        x = torch.randn(B // 2, 100, generator=g, dtype=torch.float64)
        before = _full(model)
        opt.step(loss=(model(x) * 0.0).sum(1))
        deltas.append((_full(model) - before)[:100 * 100].view(100, 100))
    return {"delta": torch.stack(deltas), "has_generator": engine.noise_generator is not None,
            "eps": engine.get_epsilon(), "steps": engine.steps_taken}


def _same_generators(rank):
    out = {}
    for seeds in ((5, 5), (5, 6)):
        gen = torch.Generator().manual_seed(seeds[rank])
        try:
            _engine(fsdp.fully_shard(nn.Sequential(nn.Linear(4, 4)).double()), sigma=SIGMA,
                    noise_generator=gen)
            out[seeds] = None
        except ValueError as e:
            out[seeds] = str(e)
    return out


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _refusals(rank, out_dir):
    out = {}

    def attempt(key, build):
        try:
            build()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)

    attempt("distributed_false",
            lambda: _engine(fsdp.fully_shard(_mlp()), distributed=False))
    attempt("check_replicas", lambda: _engine(fsdp.fully_shard(_mlp()), check_replicas=True))
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.float32)
    attempt("mixed_precision", lambda: _engine(fsdp.fully_shard(_mlp(), mp_policy=policy)))

    def placement():
        from torch.distributed.tensor import Shard

        m = _mlp()
        _engine(fsdp.fully_shard(m, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2
                                 and p.shape[1] % 2 == 0 else None))
    attempt("placement", placement)

    def outside():
        m = _mlp()
        fsdp.fully_shard(m[0])  # m[2] and the root are not sharded
        _engine(m)
    attempt("outside", outside)

    def fallback():
        class Attn(nn.Module):
            def __init__(self):
                super().__init__()
                self.mha = nn.MultiheadAttention(4, 2, batch_first=True)

            def forward(self, x):
                return self.mha(x, x, x)[0].sum(1)

        _engine(fsdp.fully_shard(Attn().double()))
    attempt("fallback", fallback)

    # FSDP2's gradient sync switched back on: refused at the step, nothing updated
    model = fsdp.fully_shard(_mlp())
    engine, opt = _engine(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    model.set_requires_gradient_sync(True)
    before = _full(model)
    try:
        opt.step(loss=_loss(model, x, y))
        out["sync"] = None
    except RuntimeError as e:
        out["sync"] = str(e)
    out["sync_unchanged"] = torch.equal(before, _full(model)) and engine.steps_taken == 0
    model.set_requires_gradient_sync(False)
    opt.step(loss=_loss(model, x, y))
    out["sync_then_steps"] = engine.steps_taken

    # a step ledger opened on every rank (rank 0 writes it), one more step; the engine's state:
    # written on each rank, loaded on its own rank only, with no generator state (fresh noise)
    ledger = use_ledger(engine, os.path.join(out_dir, "run.ledger"))
    opt.step(loss=_loss(model, x, y))
    state = engine.state_dict()
    torch.save(state, os.path.join(out_dir, f"state{rank}.pt"))
    torch.distributed.barrier()
    other = torch.load(os.path.join(out_dir, f"state{1 - rank}.pt"), weights_only=False)
    engine2, _ = _engine(fsdp.fully_shard(_mlp()))
    attempt("other_rank_state", lambda: engine2.load_state_dict(other))
    engine3, _ = _engine(fsdp.fully_shard(_mlp()))
    engine3.load_state_dict(state)
    out["own_state_loaded"] = (
        engine3.steps_taken == 2 and state["noise_generator"] is None
        and state["ledger"]["path"] == ledger.path and ledger.writer == (rank == 0)
        and not torch.equal(engine3.noise_generator.get_state(),
                            engine.noise_generator.get_state()))
    out["dcp"] = _dcp_round_trip(model, opt, engine, os.path.join(out_dir, "dcp"))
    attempt("save_checkpoint", lambda: pe.save_checkpoint(
        os.path.join(out_dir, "ckpt.pt"), model=model, optimizer=opt, engine=engine))
    # detach gives FSDP2 its gradient reduction back; attach takes it again
    groups = [g for m in engine.distributed.modules
              for g in m._get_fsdp_state()._fsdp_param_groups]
    engine.detach()
    out["detached_sync"] = all(g.reduce_grads and g.reshard_after_backward for g in groups)
    engine.attach(opt)
    out["attached_sync"] = any(g.reduce_grads or g.reshard_after_backward for g in groups)
    return out


def _memory(rank, mode):
    """What is held while a physical batch is clipped and released (MLP, a unit per layer and
    the root): whether the gathered parameters' storage is freed when the clipped sums are
    formed, how many flat buffers the sums take, and how many are left after the release."""
    model = _shard("mlp", _model("mlp"))
    engine, opt = _engine(model, mode)
    gathered = engine.clipper.params
    seen = {}
    clipped_sums, release = engine.clipper.clipped_sums, engine.distributed.release

    def spy_sums(*args, **kwargs):
        seen["freed"] = [p.untyped_storage().size() == 0 for p in gathered]
        return clipped_sums(*args, **kwargs)

    def spy_release(sums, *args, **kwargs):
        seen["buffers"] = len(sums.buffers)
        out = release(sums, *args, **kwargs)
        seen["left"] = sum(b is not None for b in sums.buffers)
        seen["grads_left"] = sum(g is not None for g in sums.grads)
        return out

    engine.clipper.clipped_sums, engine.distributed.release = spy_sums, spy_release
    x, y = _batches("mlp")[0]
    opt.step(loss=_loss(model, x[rank * 4:rank * 4 + 4], y[rank * 4:rank * 4 + 4]))
    seen["units"] = len(engine.distributed.modules)
    return seen


def _dcp_round_trip(model, opt, engine, path):
    """Model, optimizer and engine saved by ``torch.distributed.checkpoint`` and loaded into a new
    sharded model and engine: what the new one holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from private_engine.checkpoint import EngineStateful

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
              "engine": EngineStateful(engine)}, checkpoint_id=path)
    torch.manual_seed(1)
    model2 = _shard("mlp", nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5)
    # model and optimizer before the engine attaches: DCP forms a fresh optimizer's state by a
    # step on zero gradients
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    engine2 = pe.PrivacyEngine(model2, batch_size=B, sample_size=N, max_grad_norm=R,
                               noise_multiplier=0.0, clipping_mode="bk_mixed")
    engine2.attach(opt2)
    dcp.load({"engine": EngineStateful(engine2)}, checkpoint_id=path)
    return {"same_model": torch.equal(_full(model), _full(model2)),
            "steps": (engine.steps_taken, engine2.steps_taken),
            "history": ([tuple(h) for h in engine.accountant.history],
                        [tuple(h) for h in engine2.accountant.history])}


def noise_worker(rank, out_dir):
    warnings.simplefilter("ignore")
    return {"noise": _noise_once(rank), "generators": _same_generators(rank),
            "refusals": _refusals(rank, out_dir),
            "memory": {mode: _memory(rank, mode) for mode in ("bk_mixed", "mixed")}}


@pytest.fixture(scope="module")
def noise_ranks(tmp_path_factory):
    return run_ranks(noise_worker, tmp_path_factory.mktemp("dist_fsdp_noise"))


def test_sharded_noise_is_added_once_per_coordinate(noise_ranks):
    r0, r1 = noise_ranks[0]["noise"], noise_ranks[1]["noise"]
    assert torch.equal(r0["delta"], r1["delta"])
    assert r0["has_generator"] and r1["has_generator"]  # each rank noises its own rows
    delta = r0["delta"]
    d = delta.numel()
    std = SIGMA * 1.0 / B
    ratio = float(delta.square().mean() / std ** 2)  # ~ χ²_d / d: mean 1, sd (2/d)^½ = 0.01
    assert abs(ratio - 1.0) < 6 * math.sqrt(2 / d)
    assert abs(float(delta.mean())) < 6 * std / math.sqrt(d)
    # rank 0's rows (0..49) and rank 1's (50..99): independent draws, not one draw repeated
    a, b = delta[:, :50].flatten(), delta[:, 50:].flatten()
    corr = float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))
    assert abs(corr) < 6 / math.sqrt(a.numel())
    assert r0["steps"] == r1["steps"] == 2 and r0["eps"] == r1["eps"] > 0


def test_sharded_generators_in_the_same_state_are_refused(noise_ranks):
    for r in noise_ranks:
        assert r["generators"][(5, 5)] is not None and "same state" in r["generators"][(5, 5)]
        assert r["generators"][(5, 6)] is None


@pytest.mark.parametrize("key,words", [
    ("distributed_false", "distributed=False"),
    ("check_replicas", "check_replicas"),
    ("mixed_precision", "MixedPrecisionPolicy"),
    ("placement", "the placement of 0.weight"),
    ("outside", "outside fully_shard"),
    ("fallback", "torch.func fallback"),
    ("other_rank_state", "loads only the state its own rank wrote"),
    ("save_checkpoint", "FSDP2"),
])
def test_sharded_refusals(noise_ranks, key, words):
    for r in noise_ranks:
        assert r["refusals"][key] is not None and words in r["refusals"][key]


def test_sharded_gradient_sync_switched_on_is_refused(noise_ranks):
    for r in noise_ranks:
        f = r["refusals"]
        assert f["sync"] is not None and "set_requires_gradient_sync" in f["sync"]
        assert f["sync_unchanged"] and f["sync_then_steps"] == 1


def test_sharded_engine_state_loads_on_its_rank(noise_ranks):
    for r in noise_ranks:
        assert r["refusals"]["own_state_loaded"]


def test_sharded_detach_gives_fsdp2_its_reduction_back(noise_ranks):
    for r in noise_ranks:
        assert r["refusals"]["detached_sync"] and not r["refusals"]["attached_sync"]


def test_sharded_memory_gathered_parameters_and_sums_are_freed(noise_ranks):
    """The whole-model path (a first step: the separability probe's). Book-keeping: the gathered
    parameters are freed before the clipped sums are formed (they need only the kept activations
    and output gradients); two-pass modes keep them for their second backward. The sums take
    one slot per FSDP2 unit (2 Linear units; the root's unit holds no parameter of its own),
    each dropped once released."""
    for r in noise_ranks:
        bk, two_pass = r["memory"]["bk_mixed"], r["memory"]["mixed"]
        assert len(bk["freed"]) == 4 and all(bk["freed"])
        assert not any(two_pass["freed"])
        for seen in (bk, two_pass):
            assert seen["units"] == 3 and seen["buffers"] == 2
            assert seen["left"] == 0 and seen["grads_left"] == 0


def test_sharded_engine_checkpoint_through_torch_distributed_checkpoint(noise_ranks):
    """``dcp.save`` / ``dcp.load`` of the sharded model, its optimizer and
    ``EngineStateful(engine)``: each rank restores its own engine state (steps, accountant
    history) with the model's shards."""
    for r in noise_ranks:
        got = r["refusals"]["dcp"]
        assert got["same_model"]
        assert got["steps"][0] == got["steps"][1] == 2
        assert got["history"][0] == got["history"][1] and len(got["history"][0]) > 0
