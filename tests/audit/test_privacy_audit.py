"""The one-run audit of the real engine: below the claimed ε as it is, flagged far above it by
the positive controls (100× less private than claimed), canaries clipped to exactly R.

The engine's noise and Poisson sampling are its own (OS entropy), so every run differs; the sizes
leave wide margins: the engine's bound stays near 1 for a claim of 4 (the one-run audit with 1,000
canaries cannot come close), the controls separate every canary (noise σ/100) and reach the
bound's ceiling."""
import pytest
import torch

from private_engine.audit import VERDICT_OK, VERDICT_VIOLATION, AuditConfig, run_audit
from private_engine.audit.canaries import (
    CLASSES,
    FEATURES,
    build_dataset,
    draw_canaries,
    synthetic_data,
)
from private_engine.audit.model import AuditModel
from private_engine.audit.training import observe_training


def test_engine_is_consistent_with_its_claim():
    r = run_audit(AuditConfig(canaries=1000, steps=20, epsilon=4.0, delta=1e-5))
    assert r.epsilon_claimed == pytest.approx(4.0, abs=0.02)
    assert r.epsilon_lower < r.epsilon_claimed
    assert r.verdict == VERDICT_OK and not r.violation
    assert (r.run_noise_multiplier, r.run_max_grad_norm) == (r.noise_multiplier, 1.0)
    assert r.last_loss < r.first_loss  # a real training run: the examples are learnt


def test_noise_scaled_control_is_flagged_far_above_the_claim():
    r = run_audit(AuditConfig(canaries=2000, steps=20, epsilon=4.0, delta=1e-5,
                              control="noise_scaled", control_factor=100))
    assert r.run_noise_multiplier == pytest.approx(r.noise_multiplier / 100)
    assert r.correct == r.guesses == 1600  # every canary separated
    assert r.epsilon_lower > r.epsilon_claimed + 1.0
    assert r.verdict == VERDICT_VIOLATION and r.violation


def test_clip_scaled_control_is_flagged():
    # clipped at 100·R with noise σR: the noise is as claimed, the sensitivity is not
    r = run_audit(AuditConfig(canaries=1000, steps=20, epsilon=2.0, delta=1e-5,
                              control="clip_scaled", score="sum"))
    assert r.run_max_grad_norm == 100.0
    assert r.run_noise_multiplier * r.run_max_grad_norm == pytest.approx(r.noise_multiplier)
    assert r.epsilon_lower > r.epsilon_claimed + 2.0 and r.violation


def test_random_directions_audit_both_ways():
    real = run_audit(canaries=500, steps=20, epsilon=2.0, directions="random")
    control = run_audit(canaries=500, steps=20, epsilon=2.0, directions="random",
                        control="noise_scaled")
    assert real.epsilon_lower < real.epsilon_claimed
    assert control.epsilon_lower > control.epsilon_claimed + 1.0


def test_engine_clips_each_canary_to_exactly_R():
    # nearly no noise: each step's observation is 1 (in units of R) for an included canary the
    # Poisson batch sampled, 0 otherwise — the canary's gradient of norm 1000·R clipped to R
    gen = torch.Generator().manual_seed(3)
    canaries = draw_canaries(64, "dirac", gen)
    x, y = synthetic_data(32, gen)
    dataset = build_dataset(x, y, canaries, canary_weight=1000 * 0.5)
    model = AuditModel(FEATURES, CLASSES, canaries.c.shape[1], canaries.v.shape[1]).double()
    obs = observe_training(model, dataset, canaries, batch_size=48, steps=6,
                           noise_multiplier=1e-9, max_grad_norm=0.5, unit=0.5, delta=1e-5,
                           accountant="rdp", lr=0.1)
    rounded = obs.y.round()
    assert torch.allclose(obs.y, rounded, atol=1e-6)
    assert set(rounded.unique().tolist()) == {0.0, 1.0}
    assert rounded[:, ~canaries.included].abs().max() == 0
    share = rounded[:, canaries.included].mean()  # ≈ q = 48/96
    assert 0.3 < share < 0.7


def test_config_is_checked():
    with pytest.raises(ValueError, match="not both"):
        run_audit(epsilon=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="control"):
        run_audit(control="broken")
    with pytest.raises(ValueError, match="batch_size"):
        AuditConfig(canaries=10, data_size=0, batch_size=11).validate()
    assert AuditConfig().target_epsilon == AuditConfig.DEFAULT_EPSILON
    assert AuditConfig(noise_multiplier=2.0).target_epsilon is None
