"""The audit sees every clipping path: each canary head is clipped by the engine path it stands for,
its canaries are clipped to exactly R there, and the audit flags an engine that leaves any one
path unclipped (a positive control per path, through both doors and in every clipping mode)
while it does not flag the engine as it is.

The broken engines come from ``broken_engine.unclipped(path)`` (clip factor 1 on one path; tests
only). Sizes: 900 canaries (100 per path), 100 examples, 12 steps, q = 1/2, claimed ε = 1 at
δ = 1e-5. A broken path separates all of its canaries: its own rules (each at (β/2)/18) then give
ε_lower ≈ 2.43, the most 80 right guesses out of 80 can certify; the engine as it is gave
ε_lower ≤ 0.27 in 30 runs (usually 0). The noise is the engine's own (OS entropy), so the runs
differ; the margins (≈ 1.4 and ≥ 0.7) keep the verdicts reliable.
"""
import math
import warnings

import pytest
import torch
from broken_engine import PATHS, unclipped
from torch import nn

from private_engine.audit import VERDICT_OK, VERDICT_VIOLATION, run_audit

#: the audit of the positive controls and of the engine as it is (old-style arguments only)
CONTROL = dict(canaries=900, data_size=100, steps=12, epsilon=1.0)
#: a broken path's own rules certify this much at CONTROL (80/80 right, δ = 1e-5, (β/2)/18)
REACH = 2.432


def _observe(door, mode="bk_mixed", scale=1000.0):
    """The audit's model and canaries (90, 10 per path) trained 4 steps at σ = 1e-9 and R = 0.5:
    each canary's per-step observations, by path."""
    from private_engine.audit import AuditConfig, build_audit
    from private_engine.audit.training import observe_training

    config = AuditConfig(canaries=90, data_size=10, door=door, clipping_mode=mode,
                         max_grad_norm=0.5, canary_scale=scale, seed=3)
    setup = build_audit(config)
    with warnings.catch_warnings():  # 10 canaries a path: a batch may hold fewer than 2 of them
        warnings.filterwarnings("ignore", message="the separability probe could not compare")
        obs = observe_training(setup.model, setup.dataset, setup.linear, batch_size=50, steps=4,
                               noise_multiplier=1e-9, max_grad_norm=0.5, unit=0.5, delta=1e-5,
                               accountant="rdp", lr=0.1, paths=setup.others, door=door,
                               clipping_mode=mode)
    included = torch.cat([setup.linear.included] + [p.included for p in setup.others])
    blocks, at = {}, 0
    for name, m in setup.split.items():
        blocks[name] = (obs.y[:, at:at + m], included[at:at + m])
        at += m
    return blocks


def _zero_or_one(y, included):
    """Every observation is 0 or 1 (in units of R) within 1e-6, 0 for an excluded canary."""
    rounded = y.round()
    return bool(torch.allclose(y, rounded, atol=1e-6)) and \
        set(rounded.unique().tolist()) <= {0.0, 1.0} and rounded[:, ~included].abs().max() == 0


@pytest.mark.parametrize("door,mode", [("native", m) for m in
                                       ("bk_mixed", "bk", "bk_mixopt", "mixed", "ghost",
                                        "per_sample")] + [("opacus", "bk_mixed")])
def test_every_path_clips_its_canaries_to_exactly_R(door, mode):
    # nearly no noise: an included canary the Poisson batch sampled moves its head by exactly R
    # along its direction (1), any other canary by nothing (0), on every path
    blocks = _observe(door, mode)
    assert set(blocks) == set(PATHS)
    for name, (y, included) in blocks.items():
        assert _zero_or_one(y, included), name
        assert y.round()[:, included].sum() > 0, name  # something was observed


@pytest.mark.parametrize("door", ["native", "opacus"])
@pytest.mark.parametrize("path", PATHS)
def test_each_path_s_canaries_see_that_path_unclipped(door, path):
    # the broken engine releases the raw gradient (norm 1000·R) of the canaries of its path,
    # and only of those: the observation is the canary's own unclipped size
    with unclipped(path):
        blocks = _observe(door)
    broken = {path, "sequence"} if path == "linear_bias" else {path}  # a biased Linear too
    for name, (y, included) in blocks.items():
        if name in broken:
            assert set(y.round()[:, included].unique().tolist()) == {0.0, 1000.0}, name
            assert y[:, ~included].abs().max() < 1e-6, name
        else:
            assert _zero_or_one(y, included), name


@pytest.mark.parametrize("path", PATHS)
def test_audit_flags_an_engine_that_leaves_one_path_unclipped(path):
    with unclipped(path):
        r = run_audit(**CONTROL)
    assert r.verdict == VERDICT_VIOLATION and r.violation, r.summary()
    assert r.epsilon_lower > r.epsilon_claimed + 1.0, r.summary()
    assert path in r.flagged_paths and r.rule in r.flagged_paths
    mine = next(p for p in r.path_results if p.path == path)
    # every guess on the broken path's canaries right, but one: an included canary the Poisson
    # batches never sampled in 12 steps (2⁻¹² each, ≈ 1 % of runs over its ≈ 50) looks excluded
    assert mine.correct >= mine.guesses - 1
    assert mine.epsilon_reach == pytest.approx(REACH, abs=0.01)
    assert REACH - 0.35 < mine.epsilon_lower <= mine.epsilon_reach


@pytest.mark.parametrize("path", PATHS)
def test_audit_flags_an_engine_unclipped_on_one_path_through_the_opacus_door(path):
    with unclipped(path):
        r = run_audit(door="opacus", **CONTROL)
    assert r.violation and r.epsilon_lower > r.epsilon_claimed + 1.0, r.summary()
    assert path in r.flagged_paths and r.door == "opacus"


@pytest.mark.parametrize("mode,path", [("bk", "linear_bias"), ("bk_mixopt", "embedding"),
                                       ("mixed", "sequence"), ("ghost", "conv"),
                                       ("per_sample", "groupnorm")])
def test_audit_flags_an_unclipped_path_in_every_clipping_mode(mode, path):
    # the default mode (bk_mixed) above; traced parameters and fallback modules are released
    # from kept per-sample gradients alike in every mode
    with unclipped(path):
        r = run_audit(clipping_mode=mode, **CONTROL)
    assert r.violation and path in r.flagged_paths, r.summary()
    assert r.clipping_mode == mode


@pytest.mark.parametrize("door,mode", [("native", "bk_mixed"), ("opacus", "bk_mixed"),
                                       ("native", "bk"), ("native", "bk_mixopt"),
                                       ("native", "mixed"), ("native", "ghost"),
                                       ("native", "per_sample")])
def test_engine_as_it_is_is_not_flagged_on_any_path(door, mode):
    r = run_audit(door=door, clipping_mode=mode, **CONTROL)
    assert r.verdict == VERDICT_OK and not r.violation, r.summary()
    assert r.flagged_paths == () and len(r.path_results) == len(PATHS)
    assert all(p.epsilon_lower <= r.epsilon_lower for p in r.path_results)
    assert r.path_reach > r.epsilon_claimed + 1  # a broken path would have been flagged


@pytest.mark.parametrize("door", ["native", "opacus"])
def test_each_canary_head_is_clipped_by_the_path_it_stands_for(door):
    from private_engine.audit import AuditConfig, build_audit, paths_of
    from private_engine.audit.model import head_inputs, per_sample_loss
    from private_engine.guards.model_check import scan_model
    from private_engine.layers.conv import ConvRule
    from private_engine.layers.embedding import EmbeddingRule
    from private_engine.layers.linear import LinearRule
    from private_engine.layers.normalization import GroupNormRule, LayerNormRule

    setup = build_audit(AuditConfig(canaries=90, data_size=10, door=door))
    model = setup.model
    scan = scan_model(model)
    rules = {name: type(rule) for name, _, rule in scan.layers}
    assert rules["canary_head"] is LinearRule and model.canary_head.bias is None
    for name, rule in (("linear_bias", LinearRule), ("conv", ConvRule),
                       ("embedding", EmbeddingRule), ("layernorm", LayerNormRule),
                       ("groupnorm", GroupNormRule), ("sequence", LinearRule)):
        assert rules[f"heads.{name}"] is rule, name
    assert model.heads.linear_bias.bias.requires_grad
    assert {n for n, _ in scan.traced} == {"heads.traced.proj", "heads.traced.shift"}
    fallback = "heads.fallback" + (".mha" if door == "native" else "")
    assert [n for n, _ in scan.fallbacks] == [fallback]

    # the model's own paths are all the audit's, sequences included
    rows = setup.dataset[list(range(len(setup.dataset)))]
    extra, _ = head_inputs(rows[5], setup.others)
    assert paths_of(model, rows[0], *extra) == (PATHS, [])

    # a canary row's plain gradient: on its own head only, norm canary_scale·R, along u_i,
    # whose coordinates are its own (orthonormal directions)
    params = [p for p in model.parameters() if p.requires_grad]
    start = 10 + setup.linear.m
    for path in setup.others:
        assert path.directions.to_dense() @ path.directions.to_dense().T == \
            pytest.approx(torch.eye(path.m, dtype=torch.float64), abs=1e-12)
        own = {id(p) for p in path.params()}
        for i in (0, path.m - 1):
            row = [t[start + i:start + i + 1] for t in rows]
            w = float(row[2])
            if w == 0:  # excluded: no gradient at all
                continue
            loss = per_sample_loss(model, *row, paths=setup.others)
            grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
            rest = [g for p, g in zip(params, grads) if id(p) not in own and g is not None]
            assert all(float(g.abs().max()) == 0 for g in rest), path.name
            g = torch.cat([gr.reshape(-1) for p, gr in zip(params, grads) if id(p) in own])
            assert float(g.norm()) == pytest.approx(1000.0, rel=1e-12), path.name
            assert torch.allclose(g / 1000.0, path.directions.to_dense()[i], atol=1e-12)
        start += path.m


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.cls = nn.Parameter(torch.zeros(1, 1, 8))
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        x = self.norm(x)
        return self.head(self.attn(x, x, x, need_weights=False)[0][:, 0])


def test_paths_of_names_the_paths_a_model_uses():
    from opacus.layers.dp_multihead_attention import SequenceBias

    from private_engine.audit import paths_of

    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert paths_of(mlp, torch.zeros(3, 4)) == (("linear_bias",), [])
    assert paths_of(mlp) == (("linear_bias", "sequence"), [])  # T unknown without an input
    assert paths_of(mlp, torch.zeros(3, 5, 4)) == (("linear_bias", "sequence"), [])
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(),
                        nn.Linear(4, 2))
    assert paths_of(cnn, torch.zeros(2, 3, 3, 3)) == (("linear_bias", "conv", "groupnorm"), [])
    tokens = _Tokens()
    assert paths_of(tokens, torch.zeros(2, 5, dtype=torch.long)) == (
        ("linear", "embedding", "layernorm", "traced", "fallback", "sequence"), [])
    tokens.head.weight.requires_grad_(False)
    assert "linear" not in paths_of(tokens, torch.zeros(2, 5, dtype=torch.long)).paths
    biased = nn.Sequential(nn.Linear(4, 4), SequenceBias(4))
    found = paths_of(biased, torch.zeros(2, 3, 4))
    assert found == (("linear_bias", "sequence"), ["1 (SequenceBias)"])
    assert (found.paths, found.uncovered) == (("linear_bias", "sequence"), ["1 (SequenceBias)"])


def test_an_audit_of_some_paths_splits_its_canaries_over_them():
    r = run_audit(canaries=60, data_size=20, steps=3, epsilon=4.0, paths=("traced", "conv"),
                  door="opacus")
    assert r.paths == ("conv", "traced") and [p.path for p in r.path_results] == list(r.paths)
    assert [p.canaries for p in r.path_results] == [30, 30] and r.canaries == 60
    assert not r.violation
    # one path: the rules on all canaries alone, at β/8 each (the audit of a single head)
    one = run_audit(canaries=1000, data_size=20, steps=3, epsilon=4.0, paths="linear")
    assert one.paths == ("linear",) and one.path_results == [] and one.rules == 8
    assert one.path_reach is None and "paths" not in one.summary()


def test_new_options_are_checked():
    from private_engine.audit import AuditConfig

    with pytest.raises(ValueError, match="paths"):
        AuditConfig(paths=("linear", "attention")).validate()
    with pytest.raises(ValueError, match="door"):
        AuditConfig(door="jax").validate()
    with pytest.raises(ValueError, match="bk_mixed"):
        AuditConfig(door="opacus", clipping_mode="ghost").validate()
    with pytest.raises(ValueError, match="must divide"):
        AuditConfig(door="opacus", canaries=100, data_size=1, batch_size=50).validate()
    with pytest.raises(ValueError, match="2 per path"):
        AuditConfig(canaries=17).validate()
    assert AuditConfig(canaries=4, paths="conv").validate().path_names == ("conv",)
    assert math.isclose(AuditConfig(canaries=18).sample_size, 1018)


def test_broken_engine_paths_are_the_audit_s():
    from private_engine.audit import PATHS as AUDITED

    assert PATHS == AUDITED
