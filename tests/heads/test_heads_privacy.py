"""Privacy mechanics of the heads: noise really added at the declared scale (statistical tests with
fixed seeds), symmetric where declared, ρ equal to each theorem, and one example's influence on
every release bounded by the declared sensitivity (remove-one test with an adversarial huge-norm
point)."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
)
from private_engine.heads._noise import NoiseSource, symmetric_noise

# fixed seeds make these checks reproducible (each such fit warns)
pytestmark = pytest.mark.filterwarnings(
    "ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")


CLASSES = [0, 1, 2]  # the public label set of clustered()


def clustered(n=200, d=6, m=3, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(m, d))
    y = rng.integers(0, m, n)
    return scale * (centres[y] + rng.normal(size=(n, d))), y


@pytest.fixture
def spy(monkeypatch):
    """Record every Gaussian release: (name, value before noise, value after, sensitivity, σ,
    symmetric)."""
    calls = []
    original = NoiseSource.release

    def release(self, name, value, sensitivity, noise_multiplier, symmetric=False, count=1,
                record=True):
        out = original(self, name, value, sensitivity, noise_multiplier, symmetric=symmetric,
                       count=count, record=record)
        calls.append(dict(name=name, before=value.detach().clone(), after=out.detach().clone(),
                          sensitivity=float(sensitivity), sigma=float(noise_multiplier),
                          symmetric=symmetric))
        return out

    monkeypatch.setattr(NoiseSource, "release", release)
    return calls


HEADS = {
    "ls": lambda **kw: DPLeastSquares(**kw),
    "newton": lambda **kw: DPNewton(steps=2, **kw),
    "fc": lambda **kw: DPFeatureCovariance(steps=3, **kw),
    "adam": lambda **kw: DPAdamHead(steps=3, **kw),
    "mean": lambda **kw: DPMeanEstimator(**kw),
}
# ρ·σ² per theorem
THEOREM_RHO_SIGMA2 = {"ls": 1.5, "newton": 2.0, "fc": 2.0, "adam": 1.5, "mean": 0.5}


def _standardised(calls):
    """Noise divided by its declared std, split into (plain + diagonal) and (off-diagonal ×√2)
    parts."""
    z = []
    for c in calls:
        noise = (c["after"] - c["before"]).double()
        std = c["sigma"] * c["sensitivity"]
        if c["symmetric"]:
            assert torch.equal(c["after"], c["after"].transpose(-1, -2)), \
                f"{c['name']}: release not symmetric"
            torch.testing.assert_close(noise, noise.transpose(-1, -2), rtol=0, atol=1e-9 * std)
            d = noise.shape[-1]
            iu = torch.triu_indices(d, d, offset=1)
            z.append((torch.diagonal(noise, dim1=-2, dim2=-1) / std).reshape(-1))
            z.append((noise[..., iu[0], iu[1]] * math.sqrt(2) / std).reshape(-1))
        else:
            z.append((noise / std).reshape(-1))
    return torch.cat(z).numpy()


@pytest.mark.parametrize("head", list(HEADS))
def test_noise_is_gaussian_at_the_declared_scale(head, spy):
    X, y = clustered(n=150, d=20, m=5)
    sigma = 0.8
    clf = HEADS[head](noise_multiplier=sigma, delta=1e-5, random_state=3,
                      classes=range(5)).fit(X, y)
    assert spy and all(c["sigma"] > 0 for c in spy)
    z = _standardised(spy)
    assert z.size > 100
    # N(0, 1) after standardisation by the declared std: KS test and moment checks (fixed seed)
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert abs(z.std() - 1) < 4 / math.sqrt(2 * z.size)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # every release goes through the ledger, whose ρ is the theorem's
    names = {r.name for r in clf.privacy_ledger_.releases}
    assert {c["name"] for c in spy} <= names
    for r in clf.privacy_ledger_.releases:
        stds = {c["sigma"] * c["sensitivity"] for c in spy if c["name"] == r.name}
        assert stds and all(s == pytest.approx(r.noise_std, rel=1e-12) for s in stds)
    assert clf.rho_ == pytest.approx(THEOREM_RHO_SIGMA2[head] / sigma ** 2, rel=1e-12)


def test_least_squares_released_statistics_noise_scale_end_to_end():
    """No hooks: compare the released G̃ and b̃ with the exact clipped statistics over many
    seeds."""
    X, y = clustered(n=100, d=10, m=3)
    Xc = X * np.minimum(1.0, 1.0 / np.linalg.norm(X, axis=1, keepdims=True))
    G = Xc.T @ Xc
    B = np.stack([Xc[y == j].sum(0) for j in range(3)])
    sigma = 2.0
    diag, off, rhs = [], [], []
    for seed in range(30):
        clf = DPLeastSquares(noise_multiplier=sigma, classes=CLASSES, random_state=seed).fit(X, y)
        E = clf.noisy_gram_.numpy() - G
        assert np.array_equal(E, E.T)
        diag.append(np.diag(E))
        off.append(E[np.triu_indices(10, 1)])
        rhs.append((clf.noisy_class_sums_.numpy() - B).ravel())
    for values, expected in ((np.concatenate(diag), sigma),
                             (np.concatenate(off), sigma / math.sqrt(2)),
                             (np.concatenate(rhs), sigma)):
        n = values.size
        lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], n)
        assert lo / n < np.mean(values ** 2) / expected ** 2 < hi / n


def test_mean_estimator_noise_scale_over_many_seeds():
    X, y = clustered(n=80, d=4, m=3)
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    S = np.stack([U[y == j].sum(0) for j in range(3)])
    counts = np.bincount(y, minlength=3)
    eps, delta = 0.7, 1e-6
    noise = []
    for seed in range(200):
        clf = DPMeanEstimator(epsilon=eps, delta=delta, random_state=seed,
                              classes=CLASSES).fit(X, y)
        noise.append(np.concatenate([(clf.class_sums_.numpy() - S).ravel(),
                                     clf.class_counts_.numpy() - counts]))
    noise = np.array(noise)
    from private_engine.accounting.analytic_gaussian import analytic_gaussian_sigma

    s = analytic_gaussian_sigma(eps, delta, math.sqrt(2))
    assert clf.noise_std_ == pytest.approx(s, rel=1e-12)
    n = noise.size
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], n)
    assert lo / n < np.mean(noise ** 2) / s ** 2 < hi / n
    # each coordinate separately: its std over the seeds is s (no coordinate is left un-noised)
    per_coord = noise.std(axis=0) / s
    assert per_coord.min() > 0.7 and per_coord.max() < 1.3


def test_symmetric_noise_helper():
    g = torch.Generator().manual_seed(0)
    E = symmetric_noise(40, 3.0, g, batch=(50,))
    assert torch.equal(E, E.transpose(-1, -2))
    iu = torch.triu_indices(40, 40, 1)
    assert torch.diagonal(E, dim1=-2, dim2=-1).std().item() == pytest.approx(3.0, rel=0.05)
    assert E[:, iu[0], iu[1]].std().item() == pytest.approx(3.0 / math.sqrt(2), rel=0.03)
    # independent upper-triangle entries (no correlation between (i, j) and (j, k))
    a, b = E[:, 0, 1].numpy(), E[:, 1, 2].numpy()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.4


# ----------------------------------------------------------------------------- sensitivity
def _adversarial(X, y, label=0, norm=1e6, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=X.shape[1])
    x *= norm / np.linalg.norm(x)
    return np.vstack([X, x]), np.append(y, label)


def _releases(calls):
    out = {}
    for c in calls:
        out.setdefault(c["name"], []).append(c["before"])
    return {k: torch.cat([v.reshape(-1) for v in vs]) if len(vs) > 1 else vs[0]
            for k, vs in out.items()}


def _fit_pair(make, X, y, Xa, ya, spy):
    make().fit(Xa, ya)
    with_point = _releases(spy)
    spy.clear()
    make().fit(X, y)
    without = _releases(spy)
    spy.clear()
    return with_point, without


def test_least_squares_sensitivity_remove_one(spy):
    X, y = clustered()
    Xa, ya = _adversarial(X, y)
    C, k = 0.7, 1
    a, b = _fit_pair(lambda: DPLeastSquares(noise_multiplier=1.0, clip_norm=C, random_state=0,
                                            classes=CLASSES),
                     X, y, Xa, ya, spy)
    dG = torch.linalg.norm(a["G (shared Gram)"] - b["G (shared Gram)"])
    dA = torch.linalg.norm(a["A (class Grams)"] - b["A (class Grams)"])
    db = torch.linalg.norm(a["b (class sums)"] - b["b (class sums)"])
    # bounded by the declared sensitivities C², √k C², √k C — and tight for a huge point
    assert C ** 2 * (1 - 1e-9) <= dG <= C ** 2 * (1 + 1e-9)
    assert math.sqrt(k) * C ** 2 * (1 - 1e-9) <= dA <= math.sqrt(k) * C ** 2 * (1 + 1e-9)
    assert math.sqrt(k) * C * (1 - 1e-9) <= db <= math.sqrt(k) * C * (1 + 1e-9)


def test_least_squares_multilabel_sensitivity_scales_with_sqrt_k(spy):
    X, y = clustered()
    Y = np.eye(3)[y]
    x = np.full((1, X.shape[1]), 1e5)
    Ya = np.vstack([Y, [[1, 1, 0]]])
    Xa = np.vstack([X, x])
    a, b = _fit_pair(lambda: DPLeastSquares(noise_multiplier=1.0, k=2, random_state=0),
                     X, Y, Xa, Ya, spy)
    assert torch.linalg.norm(a["A (class Grams)"] - b["A (class Grams)"]) == pytest.approx(
        math.sqrt(2), rel=1e-9)
    assert torch.linalg.norm(a["b (class sums)"] - b["b (class sums)"]) == pytest.approx(
        math.sqrt(2), rel=1e-9)


def test_newton_sensitivity_remove_one(spy):
    X, y = clustered()
    Xa, ya = _adversarial(X, y)
    C = 1.3
    a, b = _fit_pair(lambda: DPNewton(noise_multiplier=1.0, steps=1, clip_norm=C, random_state=0,
                                      classes=CLASSES),
                     X, y, Xa, ya, spy)
    # (m, d): one mechanism per class, sensitivity C each
    dg = a["gradient[t=0]"] - b["gradient[t=0]"]
    assert torch.linalg.norm(dg, dim=1).max() <= C * (1 + 1e-9)
    assert torch.linalg.norm(dg, dim=1).max() >= 0.49 * C  # |ℓ'| = 1/2 at θ = 0: not vacuous
    dH = (a["Hessian[t=0]"] - b["Hessian[t=0]"]).reshape(3, -1)  # per class: ‖ℓ'' x̃x̃ᵀ‖_F ≤ β_H C²
    assert torch.linalg.norm(dH, dim=1).max() == pytest.approx(0.25 * C ** 2, rel=1e-9)


def test_feature_covariance_sensitivity_remove_one(spy):
    X, y = clustered()
    Xa, ya = _adversarial(X, y)
    CG, Cg = 0.5, 2.0
    make = lambda: DPFeatureCovariance(noise_multiplier=1.0, steps=1, clip_norm_cov=CG,  # noqa
                                       clip_norm_grad=Cg, random_state=0, classes=CLASSES)
    a, b = _fit_pair(make, X, y, Xa, ya, spy)
    assert torch.linalg.norm(a["feature covariance"] - b["feature covariance"]) == pytest.approx(
        CG ** 2, rel=1e-9)
    assert torch.linalg.norm(a["gradient[t=0]"] - b["gradient[t=0]"]) == pytest.approx(Cg, rel=1e-9)


@pytest.mark.parametrize("loss", ["sigmoid", "softmax"])
def test_adam_sensitivity_remove_one(spy, loss):
    X, y = clustered()
    Xa, ya = _adversarial(X, y)
    a, b = _fit_pair(lambda: DPAdamHead(noise_multiplier=1.0, steps=1, clip_norm=0.3, loss=loss,
                                        random_state=0, classes=CLASSES),
                     X, y, Xa, ya, spy)
    assert torch.linalg.norm(a["gradient[t=0]"] - b["gradient[t=0]"]) == pytest.approx(
        0.3, rel=1e-9)


def test_mean_estimator_sensitivity_remove_one(spy):
    X, y = clustered()
    Xa, ya = _adversarial(X, y, label=2)
    a, b = _fit_pair(lambda: DPMeanEstimator(noise_multiplier=1.0, classes=CLASSES, random_state=0),
                     X, y, Xa, ya, spy)
    diff = a["class sums and counts"] - b["class sums and counts"]
    assert torch.linalg.norm(diff) == pytest.approx(math.sqrt(2), rel=1e-9)  # (φ(x), 1): Δ = √2
    a, b = _fit_pair(lambda: DPMeanEstimator(noise_multiplier=1.0, release_counts=False,
                                             random_state=0, classes=CLASSES),
                     X, y, Xa, ya, spy)
    assert torch.linalg.norm(a["class sums"] - b["class sums"]) == pytest.approx(1.0, rel=1e-9)


def test_noiseless_influence_of_any_point_is_bounded_randomised(spy):
    """Many random adversarial points (huge and tiny norms, all labels): never above the declared
    Δ."""
    X, y = clustered(n=60, d=5)
    rng = np.random.default_rng(7)
    for trial in range(6):
        norm = 10.0 ** rng.uniform(-3, 7)
        Xa, ya = _adversarial(X, y, label=int(rng.integers(0, 3)), norm=norm, seed=trial)
        a, b = _fit_pair(lambda: DPLeastSquares(noise_multiplier=1.0, random_state=0,
                                                classes=CLASSES),
                         X, y, Xa, ya, spy)
        assert torch.linalg.norm(a["G (shared Gram)"] - b["G (shared Gram)"]) <= 1 + 1e-9
        assert torch.linalg.norm(a["A (class Grams)"] - b["A (class Grams)"]) <= 1 + 1e-9
        assert torch.linalg.norm(a["b (class sums)"] - b["b (class sums)"]) <= 1 + 1e-9
        a, b = _fit_pair(lambda: DPAdamHead(noise_multiplier=1.0, steps=1, random_state=0,
                                            classes=CLASSES),
                         X, y, Xa, ya, spy)
        assert torch.linalg.norm(a["gradient[t=0]"] - b["gradient[t=0]"]) <= 1 + 1e-9
