"""One crafted record against every head: its influence on each release stays within the
release's calibrated sensitivity, and nothing released is NaN or infinite, whatever the record
holds — subnormal values, values whose squares round to zero or to the smallest subnormal (so
that an unscaled norm is off by √(d/2)), values near the largest float, mixed signs and
magnitudes, zeros — in float64 and float32, and beyond float32's range for a float32 fit.

Each head is run twice, with and without the record (label 0). The second run replays the first
run's noisy releases (rescaled by n'/n for the heads that divide by the public n), so that every
release of both runs is computed from the same released history: the difference of the
statistics before noise is exactly what the adaptive composition bounds by the sensitivity that
the ledger records (per mechanism when ``count > 1``)."""
import math

import numpy as np
import pytest
import torch

from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
)
from private_engine.heads._noise import NoiseSource
from private_engine.heads._records import to_tensor
from private_engine.heads._row_clipping import clip_rows, normalize_rows, rounding_margin, row_norms

N, D, M = 30, 32, 3
CLASSES = list(range(M))  # the public label set
#: relative tolerance on a sensitivity: the rounding of sums of N records
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}

# name -> (factory, divides its releases by n before using them)
HEADS = {
    "ls": (lambda **kw: DPLeastSquares(clip_norm=0.7, **kw), False),
    "ls_normalize": (lambda **kw: DPLeastSquares(normalize=True, **kw), False),
    "newton": (lambda **kw: DPNewton(steps=3, reg=0.05, clip_norm=1.3, **kw), True),
    "fc": (lambda **kw: DPFeatureCovariance(steps=3, reg=0.05, clip_norm_cov=0.5,
                                            clip_norm_grad=2.0, **kw), True),
    "fc_softmax": (lambda **kw: DPFeatureCovariance(steps=3, reg=0.05, loss="softmax", **kw),
                   True),
    "adam": (lambda **kw: DPAdamHead(steps=4, lr=0.5, clip_norm=0.3, **kw), True),
    "adam_softmax": (lambda **kw: DPAdamHead(steps=4, lr=0.5, loss="softmax", **kw), True),
    "adam_no_bias": (lambda **kw: DPAdamHead(steps=4, lr=0.5, fit_intercept=False, **kw), True),
    "mean": (lambda **kw: DPMeanEstimator(**kw), False),
    "mean_sums_only": (lambda **kw: DPMeanEstimator(release_counts=False, **kw), False),
}


def base_data():
    rng = np.random.default_rng(0)
    y = np.arange(N) % M
    return rng.normal(size=(N, D)) + 3 * np.eye(M, D)[y], y


def records(dtype):
    """Crafted records (float64 arrays, as a user would pass them) for a fit in ``dtype``."""
    info = torch.finfo(dtype)
    sub = 2.0 ** (-1074 if dtype == torch.float64 else -149)  # the smallest subnormal
    rng = np.random.default_rng(1)
    signs = np.where(np.arange(D) % 2 == 0, 1.0, -1.0)
    # squares of the first entry round up to the smallest subnormal, all others round to 0:
    # an unscaled norm is then √(d/2) times too small
    rounding = np.full(D, math.sqrt(0.5) * math.sqrt(sub) * (1 - 2 ** -8))  # 0.5·sub underflows
    rounding[0] = math.sqrt(1.5) * math.sqrt(sub) * (1 - 2 ** -8)
    one_huge = rng.normal(size=D)
    one_huge[3] = info.max
    mixed = np.where(np.arange(D) < D // 2, info.max / 2, info.tiny / 1000) * signs
    out = {
        "zero": np.zeros(D),
        "smallest_subnormal": np.full(D, sub),
        "subnormal": np.full(D, 1e-310 if dtype == torch.float64 else 1e-40) * signs,
        "rounding": rounding,
        "tiny": np.full(D, 1e-200 if dtype == torch.float64 else 1e-30) * signs,
        "huge": np.full(D, info.max * 0.99),
        "huge_mixed_signs": info.max * signs,
        "one_huge": one_huge,
        "mixed_extremes": mixed,
    }
    if dtype == torch.float32:
        out["beyond_float32"] = np.full(D, 1e300) * signs
    return out


CASES = [(head, dtype, rec) for head in HEADS for dtype in (torch.float64, torch.float32)
         for rec in records(dtype)]


class Replay:
    """Patches NoiseSource.release: records (name, statistic before noise, release), and in
    replay mode returns a recorded run's releases (times ``scale``) instead of drawing noise."""

    def __init__(self, monkeypatch):
        self.calls, self.replay, self.scale = [], None, 1.0
        original = NoiseSource.release
        replay = self

        def release(source, name, value, sensitivity, noise_multiplier, symmetric=False,
                    count=1, record=True):
            if replay.replay is None:
                out = original(source, name, value, sensitivity, noise_multiplier,
                               symmetric=symmetric, count=count, record=record)
            else:
                if record:
                    source.ledger.add(name, sensitivity, float(noise_multiplier) * sensitivity,
                                      count=count, shape=tuple(value.shape))
                ref = replay.replay[len(replay.calls)]
                assert ref["name"] == name
                out = ref["after"] * replay.scale
            before = 0.5 * (value + value.transpose(-1, -2)) if symmetric else value
            replay.calls.append(dict(name=name, before=before.detach().clone(),
                                     after=out.detach().clone()))
            return out

        monkeypatch.setattr(NoiseSource, "release", release)

    def run(self, make, X, y, replay=None, scale=1.0):
        self.calls, self.replay, self.scale = [], replay, scale
        clf = make().fit(X, y)
        calls, self.calls, self.replay = self.calls, [], None
        return clf, calls


@pytest.fixture
def replay(monkeypatch):
    return Replay(monkeypatch)


def by_name(calls, key):
    out = {}
    for c in calls:
        out.setdefault(c["name"], []).append(c[key].double())
    return {k: torch.cat([v.reshape(-1) for v in vs]) for k, vs in out.items()}


def fitted_tensors(clf):
    names = ("coef_", "intercept_", "centers_", "class_sums_", "class_counts_", "class_means_",
             "noisy_gram_", "noisy_class_sums_", "noisy_covariance_")
    return {k: getattr(clf, k) for k in names if getattr(clf, k, None) is not None}


def influence(head, dtype, record, replay, device=None):
    """Fit with and without ``record``; ``(fit with it, {release: (per-mechanism norms of the
    difference of the statistics, sensitivity)})``, after checking that everything is finite.
    With a ``device``, the features are float64 tensors there (the heads compute on it)."""
    make_head, divides = HEADS[head]
    X, y = base_data()
    Xa, ya = np.vstack([X, record]), np.append(y, 0)
    if device is not None:
        X, Xa = (torch.tensor(a, device=device) for a in (X, Xa))

    def make():
        return make_head(noise_multiplier=1.0, dtype=dtype, classes=CLASSES)

    with_it, calls_a = replay.run(make, Xa, ya)
    without, calls_b = replay.run(make, X, y, replay=calls_a,
                                  scale=(N / (N + 1)) if divides else 1.0)
    for run, calls in (("with", calls_a), ("without", calls_b)):
        for c in calls:
            for key in ("before", "after"):
                assert torch.isfinite(c[key]).all(), f"{head}: {c['name']} {key} noise, {run}"
    for clf in (with_it, without):
        for name, value in fitted_tensors(clf).items():
            assert torch.isfinite(value).all(), f"{head}: fitted {name} is not finite"
    before_a, before_b = by_name(calls_a, "before"), by_name(calls_b, "before")
    assert before_a.keys() == before_b.keys()
    out = {}
    for rel in with_it.privacy_ledger_.releases:
        diff = before_a[rel.name] - before_b[rel.name]
        norms = torch.linalg.vector_norm(diff.reshape(rel.count, -1), dim=1)
        out[rel.name] = (norms, rel.sensitivity)
    return with_it, out


def check_sensitivities(head, dtype, name, replay, device=None):
    _, releases = influence(head, dtype, records(dtype)[name], replay, device)
    assert releases
    for release, (norms, sensitivity) in releases.items():
        worst = float(norms.max())
        assert worst <= sensitivity * (1 + TOL[dtype]), (
            f"{head} ({dtype}), record {name}: {release} moved by {worst:.6g}, "
            f"{worst / sensitivity:.4g}× its sensitivity {sensitivity:.6g}")


@pytest.mark.parametrize("head,dtype,name", CASES,
                         ids=[f"{h}-{str(t)[6:]}-{r}" for h, t, r in CASES])
def test_crafted_record_moves_each_release_by_at_most_its_sensitivity(head, dtype, name, replay):
    check_sensitivities(head, dtype, name, replay)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head", list(HEADS))
def test_crafted_records_on_cuda(head, replay):
    for dtype in (torch.float64, torch.float32):
        for name in records(dtype):
            check_sensitivities(head, dtype, name, replay, device="cuda")


# the records whose norm is far above every clipping norm: clipped to it, not dropped
LARGE = ["huge", "huge_mixed_signs", "one_huge", "mixed_extremes"]
# release -> the exact influence of a record clipped to the bound (first release of each kind)
TIGHT = {
    "ls": {"b (class sums)": 0.7, "G (shared Gram)": 0.49, "A (class Grams)": 0.49},
    "newton": {"gradient[t=0]": 0.5 * 1.3, "Hessian[t=0]": 0.25 * 1.3 ** 2},  # ℓ' = ½, ℓ'' = ¼
    "fc": {"feature covariance": 0.25, "gradient[t=0]": 2.0},
    "adam": {"gradient[t=0]": 0.3},
    "adam_softmax": {"gradient[t=0]": 1.0},
    "mean": {"class sums and counts": math.sqrt(2)},
}
TIGHT_CASES = [(head, dtype, rec) for head in TIGHT for dtype in (torch.float64, torch.float32)
               for rec in LARGE + (["beyond_float32"] if dtype == torch.float32 else [])]


@pytest.mark.parametrize("head,dtype,name", TIGHT_CASES,
                         ids=[f"{h}-{str(t)[6:]}-{r}" for h, t, r in TIGHT_CASES])
def test_huge_records_are_clipped_to_the_bound_not_dropped(head, dtype, name, replay):
    """``x·min(1, C/‖x‖)`` keeps a huge record's direction at norm C: its influence is the
    bound itself (an unscaled ‖x‖² overflows to inf and would zero the record instead)."""
    _, releases = influence(head, dtype, records(dtype)[name], replay)
    for release, expected in TIGHT[head].items():
        norms, _ = releases[release]
        assert float(norms.max()) == pytest.approx(expected, rel=TOL[dtype]), release


MEAN_CASES = [(dtype, rec) for dtype in (torch.float64, torch.float32) for rec in records(dtype)]


@pytest.mark.parametrize("dtype,name", MEAN_CASES,
                         ids=[f"{str(t)[6:]}-{r}" for t, r in MEAN_CASES])
def test_mean_estimator_maps_every_nonzero_record_to_the_unit_sphere(dtype, name, replay):
    """``φ(x) = x/‖x‖`` has norm 1 for every finite nonzero x (Zhu & Zhang need ‖φ(x)‖ = 1):
    the record moves the (sums, counts) release by exactly √(‖φ(x)‖² + 1) = √2, or 1 for a zero
    record."""
    record = records(dtype)[name]
    _, releases = influence("mean", dtype, record, replay)
    norms, _ = releases["class sums and counts"]
    expected = 1.0 if not record.any() else math.sqrt(2)
    assert float(norms.max()) == pytest.approx(expected, rel=TOL[dtype])


def non_finite_records():
    """Records with a NaN or ±inf feature, alone or among huge, tiny and ordinary values."""
    rng = np.random.default_rng(2)
    out = {"nan": np.full(D, np.nan), "inf": np.full(D, np.inf), "minus_inf": np.full(D, -np.inf)}
    for name, bad in (("one_nan", np.nan), ("one_inf", np.inf)):
        row = rng.normal(size=D)
        row[5] = bad
        out[name] = row
    out["inf_and_huge"] = np.where(np.arange(D) % 2 == 0, np.inf, 1e300)
    out["nan_and_subnormal"] = np.where(np.arange(D) == 0, np.nan, 1e-310)
    return out


NON_FINITE_CASES = [(head, dtype, rec) for head in HEADS for dtype in (torch.float64, torch.float32)
                    for rec in non_finite_records()]


@pytest.mark.filterwarnings("ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")
@pytest.mark.parametrize("head,dtype,name", NON_FINITE_CASES,
                         ids=[f"{h}-{str(t)[6:]}-{r}" for h, t, r in NON_FINITE_CASES])
def test_a_non_finite_record_is_dropped_and_moves_nothing(head, dtype, name):
    """A record with a NaN or ±inf feature is dropped before any statistic: no error, and the
    fit with it is the fit without it (same noise draws, same n), every release moving by 0."""
    make_head, _ = HEADS[head]
    X, y = base_data()
    fits = []
    for XX, yy in ((np.vstack([X, non_finite_records()[name]]), np.append(y, 1)), (X, y)):
        fits.append(make_head(noise_multiplier=1.0, dtype=dtype, classes=CLASSES,
                              random_state=0).fit(XX, yy))
    with_it, without = fits
    assert with_it.n_dropped_nonfinite_ == 1 and without.n_dropped_nonfinite_ == 0
    assert with_it.n_dropped_unknown_label_ == without.n_dropped_unknown_label_ == 0
    a, b = fitted_tensors(with_it), fitted_tensors(without)
    assert a and a.keys() == b.keys()
    for k in a:
        assert torch.isfinite(a[k]).all() and torch.equal(a[k], b[k]), k
    assert with_it.privacy_ledger_.rho == without.privacy_ledger_.rho


# ----------------------------------------------------------------------------- the row helpers
def exact_norm(row: np.ndarray) -> float:
    """‖row‖ in float64 from the float64 values of a row, scaled (and in long double)."""
    s = np.max(np.abs(row))
    if s == 0:
        return 0.0
    u = (row / s).astype(np.longdouble)
    return float(s * np.sqrt(np.sum(u * u)))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_row_helpers_hold_on_every_crafted_record(dtype, device):
    recs = records(dtype)
    X = to_tensor(np.stack(list(recs.values())), dtype, device=torch.device(device))
    assert torch.isfinite(X).all()  # beyond-range values saturate instead of becoming inf
    rows = X.double().cpu().numpy()
    exact = np.array([exact_norm(r) for r in rows])
    norms = row_norms(X).double().cpu().numpy()
    finite = exact <= torch.finfo(dtype).max
    eps, sub = torch.finfo(dtype).eps, 2.0 ** (-1074 if dtype == torch.float64 else -149)
    # relative accuracy, up to the absolute spacing of subnormal results
    np.testing.assert_allclose(norms[finite], exact[finite], rtol=10 * eps, atol=8 * sub)
    assert np.all(np.isinf(norms[~finite]))
    for C in (1e-3, 1.0, 1e6):
        clipped = clip_rows(X, C).double().cpu().numpy()
        got = np.array([exact_norm(r) for r in clipped])
        assert np.all(got <= C), (C, got.max() / C)  # in floating point, with no tolerance
        big = exact > C
        np.testing.assert_allclose(got[big], C, rtol=2 * rounding_margin(D, dtype))
        np.testing.assert_array_equal(clipped[~big], rows[~big])  # small rows unchanged
    phi = normalize_rows(X).double().cpu().numpy()
    got = np.array([exact_norm(r) for r in phi])
    nonzero = exact > 0
    assert np.all(got <= 1.0)
    np.testing.assert_allclose(got[nonzero], 1.0, rtol=2 * rounding_margin(D, dtype))
    assert not np.any(phi[~nonzero])
    # the direction is kept: φ(x) is a positive multiple of x
    for r, p in zip(rows[nonzero], phi[nonzero]):
        np.testing.assert_allclose(p / np.max(np.abs(p)), r / np.max(np.abs(r)), rtol=0,
                                   atol=8 * eps)


def test_out_of_range_settings_are_refused_by_name():
    X, y = base_data()
    for cls in (DPLeastSquares, DPNewton, DPFeatureCovariance, DPAdamHead, DPMeanEstimator):
        with pytest.raises(ValueError, match="publishes its label set"):
            cls(noise_multiplier=1.0).fit(X, y)
    with pytest.raises(ValueError, match="clip_norm=1e-200 is out of range"):
        DPLeastSquares(noise_multiplier=1.0, classes=CLASSES, clip_norm=1e-200).fit(X, y)
    with pytest.raises(ValueError, match="clip_norm_cov=1e\\+200 is out of range"):
        DPFeatureCovariance(noise_multiplier=1.0, classes=CLASSES, clip_norm_cov=1e200).fit(X, y)
    with pytest.raises(ValueError, match="clip_norm=1e\\+20 is out of range for torch.float32"):
        DPAdamHead(noise_multiplier=1.0, classes=CLASSES, clip_norm=1e20,
                   dtype=torch.float32).fit(X, y)
    with pytest.raises(ValueError, match="clip_norm must be a finite number > 0"):
        DPNewton(noise_multiplier=1.0, classes=CLASSES, clip_norm=math.inf).fit(X, y)
    with pytest.raises(ValueError, match="clip_norm must be a finite number > 0"):
        DPNewton(noise_multiplier=1.0, classes=CLASSES, clip_norm=0.0).fit(X, y)
    with pytest.raises(ValueError, match="dtype must be torch.float64"):
        DPMeanEstimator(noise_multiplier=1.0, classes=CLASSES, dtype=torch.float16).fit(X, y)
    with pytest.raises(ValueError, match="too many to clip exactly in torch.float32"):
        DPMeanEstimator(noise_multiplier=1.0, classes=CLASSES,
                        dtype=torch.float32).fit(np.ones((4, 90_000)), [0, 1, 0, 1])


def test_float32_features_saturate_instead_of_overflowing():
    from private_engine.heads.features import saturating_float32

    t = torch.tensor([1e300, -1e300, 1.5, 1e-300, math.nan, -math.inf], dtype=torch.float64)
    f = saturating_float32(t)
    assert f.dtype == torch.float32
    big = torch.finfo(torch.float32).max
    assert f[:4].tolist() == [big, -big, 1.5, 0.0]
    assert math.isnan(f[4]) and f[5] == -math.inf  # not finite in, not finite out
