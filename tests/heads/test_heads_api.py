"""Estimator surface of the heads: arguments, errors that say what to do, input/output types,
fitted privacy attributes and calibration to a target ε."""
import math

import numpy as np
import pytest
import torch

from private_engine.accounting.zcdp import rho_to_epsilon
from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
    NotFittedError,
)

# fixed seeds make these checks reproducible (each such fit warns)
pytestmark = pytest.mark.filterwarnings(
    "ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")

ALL = [DPLeastSquares, DPNewton, DPFeatureCovariance, DPAdamHead, DPMeanEstimator]
CLASSES = [0, 1, 2]  # the public label set of data()


def data(n=120, d=5, m=3, seed=0):
    rng = np.random.default_rng(seed)
    centres = 3 * rng.normal(size=(m, d))
    y = rng.integers(0, m, n)
    return centres[y] + rng.normal(size=(n, d)), y


@pytest.mark.parametrize("cls", ALL)
def test_privacy_argument_errors(cls):
    X, y = data()
    with pytest.raises(ValueError, match="epsilon=... together with delta"):
        cls().fit(X, y)
    with pytest.raises(ValueError, match="not both"):
        cls(epsilon=1.0, delta=1e-5, noise_multiplier=1.0).fit(X, y)
    with pytest.raises(ValueError, match="needs delta"):
        cls(epsilon=1.0).fit(X, y)
    with pytest.raises(ValueError, match="delta must be in"):
        cls(epsilon=1.0, delta=2.0).fit(X, y)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        cls(epsilon=-1.0, delta=1e-5).fit(X, y)
    with pytest.raises(ValueError, match="noise_multiplier must be"):
        cls(noise_multiplier=-0.5).fit(X, y)


@pytest.mark.parametrize("cls", ALL)
def test_label_and_input_errors(cls):
    X, y = data()
    with pytest.raises(ValueError, match="integer class labels"):
        cls(epsilon=math.inf).fit(X, y + 0.5)  # no label set to infer
    with pytest.raises((ValueError, TypeError), match="integer class labels|numbers"):
        cls(noise_multiplier=1.0, classes=CLASSES).fit(X, np.array(["a", "b", "c"] * 40))
    with pytest.raises(ValueError, match="samples"):
        cls(noise_multiplier=1.0, classes=CLASSES).fit(X, y[:-1])
    with pytest.raises(ValueError, match="2-D"):
        cls(noise_multiplier=1.0, classes=CLASSES).fit(X[:, 0], y)
    with pytest.raises(ValueError, match="classes must be"):
        cls(noise_multiplier=1.0, classes=[0.5, 1.5]).fit(X, y)
    clf = cls(noise_multiplier=1.0, classes=CLASSES)
    with pytest.raises(NotFittedError, match="not fitted yet; call fit"):
        clf.predict(X)
    with pytest.raises(NotFittedError):
        clf.score(X, y)
    clf.fit(X, y.astype(float))  # integral floats are accepted
    assert clf.n_dropped_unknown_label_ == 0 and clf.n_dropped_nonfinite_ == 0
    with pytest.raises(ValueError, match="features"):
        clf.predict(X[:, :3])
    with pytest.raises(ValueError, match="NaN"):
        clf.predict(np.full((2, X.shape[1]), np.nan))  # inputs to predict are not private


@pytest.mark.parametrize("cls", ALL)
def test_a_private_fit_needs_the_label_set_before_reading_the_data(cls):
    """The label set is released (``classes_``, one block per class): a private fit takes it
    from ``classes=`` only, and without it is refused whatever the data — even data that is not
    an array at all; the non-private reference may infer it."""
    X, y = data()
    for data_ in ((X, y), (None, None)):
        with pytest.raises(ValueError, match="publishes its label set.*classes="):
            cls(noise_multiplier=1.0).fit(*data_)
        with pytest.raises(ValueError, match="publishes its label set"):
            cls(epsilon=1.0, delta=1e-5).fit(*data_)
    np.testing.assert_array_equal(cls(noise_multiplier=0.0).fit(X, y).classes_, CLASSES)
    np.testing.assert_array_equal(cls(epsilon=math.inf).fit(X, y).classes_, CLASSES)
    # range and numpy label sets are accepted, sorted
    np.testing.assert_array_equal(
        cls(noise_multiplier=1.0, classes=range(4)).fit(X, y).classes_, [0, 1, 2, 3])
    np.testing.assert_array_equal(
        cls(noise_multiplier=1.0, classes=np.array([2, 0, 1])).fit(X, y).classes_, CLASSES)


@pytest.mark.parametrize("cls", ALL)
def test_records_outside_the_label_set_or_not_finite_are_dropped(cls):
    """Such a record contributes nothing: the fit with it is the fit without it, bit for bit
    (same noise draws), with no error; the diagnostic counts say how many were dropped."""
    X, y = data()
    extra = np.array([[np.nan] * 5, [np.inf] * 5, [1.0] * 5, [2.0] * 5, [-np.inf, 0, 0, 0, 0],
                      [3.0] * 5])
    labels = np.array([0, 1, 7, -1, 2, 0.5])
    Xa, ya = np.vstack([X, extra]), np.concatenate([y.astype(float), labels])
    a = cls(noise_multiplier=1.0, classes=CLASSES, random_state=0).fit(Xa, ya)
    b = cls(noise_multiplier=1.0, classes=CLASSES, random_state=0).fit(X, y)
    assert (a.n_dropped_nonfinite_, a.n_dropped_unknown_label_) == (3, 3)
    assert (b.n_dropped_nonfinite_, b.n_dropped_unknown_label_) == (0, 0)
    np.testing.assert_array_equal(a.classes_, b.classes_)
    assert torch.equal(torch.as_tensor(a.decision_function(X)),
                       torch.as_tensor(b.decision_function(X)))
    # the non-private reference drops the same records
    c = cls(epsilon=math.inf, classes=CLASSES).fit(Xa, ya)
    d = cls(epsilon=math.inf, classes=CLASSES).fit(X, y)
    np.testing.assert_array_equal(c.decision_function(X), d.decision_function(X))


@pytest.mark.parametrize("cls", ALL)
def test_a_fit_with_no_record_left_still_fits(cls):
    """When every record is dropped the fit releases noise alone (n = 1 where a head divides
    by n): refusing would reveal that the data holds no usable record."""
    X, y = data(n=4)
    for Xa, ya in ((np.full_like(X, np.nan), y), (X, y + 10)):
        clf = cls(noise_multiplier=1.0, classes=CLASSES).fit(Xa, ya)
        assert clf.n_dropped_nonfinite_ + clf.n_dropped_unknown_label_ >= 4
        assert np.isfinite(clf.decision_function(X)).all()


@pytest.mark.parametrize("cls", ALL)
def test_numpy_in_numpy_out_torch_in_torch_out(cls):
    X, y = data()
    clf = cls(epsilon=4.0, delta=1e-5, random_state=0, classes=CLASSES).fit(torch.tensor(X),
                                                                            torch.tensor(y))
    p_np, p_t = clf.predict(X), clf.predict(torch.tensor(X))
    assert isinstance(p_np, np.ndarray) and isinstance(p_t, torch.Tensor)
    np.testing.assert_array_equal(p_np, p_t.numpy())
    s = clf.decision_function(torch.tensor(X, dtype=torch.float32))
    assert isinstance(s, torch.Tensor) and s.shape == (len(y), 3)
    assert 0.0 <= clf.score(X, y) <= 1.0
    assert clf.score(X, y) == pytest.approx(np.mean(p_np == y))
    if hasattr(clf, "predict_proba"):
        proba = clf.predict_proba(X)
        np.testing.assert_allclose(proba.sum(1), 1.0)
        np.testing.assert_array_equal(proba.argmax(1), p_np)


def test_arbitrary_integer_labels_and_fixed_classes():
    X, y = data()
    labels = np.array([3, 7, 42])[y]
    clf = DPLeastSquares(epsilon=math.inf).fit(X, labels)
    np.testing.assert_array_equal(clf.classes_, [3, 7, 42])
    assert set(np.unique(clf.predict(X))) <= {3, 7, 42}
    clf = DPLeastSquares(noise_multiplier=1.0, classes=[42, 3, 7]).fit(X, labels)
    np.testing.assert_array_equal(clf.classes_, [3, 7, 42])
    clf = DPMeanEstimator(epsilon=math.inf, classes=[0, 1, 2, 3]).fit(X, y)  # class 3 absent in y
    assert clf.decision_function(X).shape == (len(y), 4)
    clf = DPMeanEstimator(epsilon=math.inf, classes=[0, 1]).fit(X, y)  # class 2 is dropped
    assert clf.n_dropped_unknown_label_ == int(np.sum(y == 2))
    assert clf.decision_function(X).shape == (len(y), 2)


THEOREM = {  # ρ·σ² of each head's theorem
    DPLeastSquares: lambda c: 1.5,  # seed 000 Thm 2.2
    DPNewton: lambda c: float(c.steps),  # Thm 2.1
    DPFeatureCovariance: lambda c: (c.steps + 1) / 2,  # Thm 2.3
    DPAdamHead: lambda c: c.steps / 2,
    DPMeanEstimator: lambda c: 0.5,
}


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("eps", [0.3, 2.0])
def test_calibrated_fit_spends_exactly_the_target(cls, eps):
    X, y = data()
    clf = cls(epsilon=eps, delta=1e-6, random_state=1, classes=CLASSES).fit(X, y)
    assert clf.epsilon_ <= eps * (1 + 1e-9)
    assert clf.epsilon_ == pytest.approx(eps, rel=1e-6)
    assert clf.rho_ == pytest.approx(THEOREM[cls](clf) / clf.noise_multiplier_ ** 2, rel=1e-12)
    assert clf.private_
    assert clf.delta_ == 1e-6


@pytest.mark.parametrize("cls", ALL)
def test_noise_multiplier_reports_rho_and_epsilon(cls):
    X, y = data()
    clf = cls(noise_multiplier=3.0, delta=1e-5, random_state=0, classes=CLASSES).fit(X, y)
    rho = THEOREM[cls](clf) / 9.0
    assert clf.rho_ == pytest.approx(rho, rel=1e-12)
    method = "gdp" if cls is DPMeanEstimator else "rdp"
    assert clf.epsilon_ == pytest.approx(rho_to_epsilon(rho, 1e-5, method), rel=1e-9)
    no_delta = cls(noise_multiplier=3.0, random_state=0, classes=CLASSES).fit(X, y)
    assert no_delta.epsilon_ is None and no_delta.rho_ == pytest.approx(rho)


def test_exact_accounting_gives_less_noise_than_rdp():
    X, y = data()
    rdp = DPFeatureCovariance(epsilon=1.0, delta=1e-5, classes=CLASSES).fit(X, y).noise_multiplier_
    gdp = DPFeatureCovariance(epsilon=1.0, delta=1e-5, accounting="gdp",
                              classes=CLASSES).fit(X, y).noise_multiplier_
    assert gdp < rdp


def test_least_squares_budget_split_keeps_rho():
    X, y = data()
    clf = DPLeastSquares(epsilon=1.0, delta=1e-5, budget_split=(0.2, 0.2, 0.6),
                         classes=CLASSES).fit(X, y)
    assert clf.rho_ == pytest.approx(1.5 / clf.noise_multiplier_ ** 2, rel=1e-12)
    stds = {r.name: r.noise_multiplier for r in clf.privacy_ledger_.releases}
    sigma = clf.noise_multiplier_
    assert stds["b (class sums)"] == pytest.approx(sigma / math.sqrt(3 * 0.6))
    assert stds["G (shared Gram)"] == pytest.approx(sigma / math.sqrt(3 * 0.2))
    with pytest.raises(ValueError, match="budget_split"):
        DPLeastSquares(epsilon=1.0, delta=1e-5, budget_split=(0.5, 0.5, 0.5),
                       classes=CLASSES).fit(X, y)


def test_same_seed_same_model_different_seed_different_noise():
    X, y = data()
    a = DPNewton(epsilon=1.0, delta=1e-5, random_state=5, classes=CLASSES).fit(X, y).coef_
    b = DPNewton(epsilon=1.0, delta=1e-5, random_state=5, classes=CLASSES).fit(X, y).coef_
    c = DPNewton(epsilon=1.0, delta=1e-5, random_state=6, classes=CLASSES).fit(X, y).coef_
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sklearn_clone_and_params():
    from sklearn.base import clone

    clf = DPFeatureCovariance(epsilon=2.0, delta=1e-5, steps=7, lr=0.3)
    copy = clone(clf)
    assert copy.get_params()["steps"] == 7 and copy.get_params()["lr"] == 0.3
    copy.set_params(steps=3)
    assert copy.steps == 3
    with pytest.raises(ValueError, match="unknown parameter"):
        copy.set_params(stepz=3)
    assert "epsilon=2.0" in repr(clf)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", ALL)
def test_cuda_data_is_fitted_on_cuda(cls):
    X, y = data()
    Xc, yc = torch.tensor(X, device="cuda"), torch.tensor(y, device="cuda")
    clf = cls(epsilon=2.0, delta=1e-5, random_state=0, classes=CLASSES).fit(Xc, yc)
    pred = clf.predict(Xc)
    assert pred.device.type == "cuda"
    assert clf.decision_function(Xc).device.type == "cuda"
    cpu = cls(epsilon=math.inf).fit(X, y)
    gpu = cls(epsilon=math.inf).fit(Xc, yc)
    np.testing.assert_allclose(gpu.decision_function(X), cpu.decision_function(X), rtol=1e-6,
                               atol=1e-8)
