"""On synthetic class-clustered features with many classes, every head's test accuracy rises with ε
toward its non-private value."""
import math

import numpy as np
import pytest

from private_engine.commands.probe import synthetic_clusters as _synthetic
from private_engine.heads import (
    DPAdamHead,
    DPFeatureCovariance,
    DPLeastSquares,
    DPMeanEstimator,
    DPNewton,
)

# fixed seeds make these checks reproducible (each such fit warns)
pytestmark = pytest.mark.filterwarnings(
    "ignore::private_engine.foundation.randomness.ReproducibleRandomnessWarning")

EPSILONS = [0.1, 0.5, 2.0, 10.0, 100.0, math.inf]


@pytest.fixture(scope="module")
def clusters():
    X, y = _synthetic(4000, 16, 20, seed=0, spread=1.2)  # 20 classes, d = 16
    return X[:3000], y[:3000], X[3000:], y[3000:]


@pytest.mark.parametrize("cls", [DPLeastSquares, DPNewton, DPFeatureCovariance, DPAdamHead,
                                 DPMeanEstimator])
def test_accuracy_rises_with_epsilon_toward_non_private(cls, clusters):
    Xtr, ytr, Xte, yte = clusters
    kw = {"classes": range(20)}  # the public label set
    if cls is not DPMeanEstimator:
        kw["normalize"] = True
    acc = [np.mean([cls(epsilon=e, delta=1e-5, random_state=s, **kw).fit(Xtr, ytr).score(Xte, yte)
                    for s in range(2)]) for e in EPSILONS]
    non_private = acc[-1]
    assert non_private > 0.75  # the features are informative (chance is 0.05)
    assert acc[0] < non_private - 0.4  # ε = 0.1 is far from it ...
    # ... accuracy increases with ε (up to seed noise) ...
    assert all(b >= a - 0.03 for a, b in zip(acc, acc[1:])), acc
    # ... and reaches the non-private value at large ε
    assert acc[-2] >= non_private - 0.03, acc
