"""A malformed record in the input of a head is named by its position (and the type found, never
its value) instead of a numpy error about the whole array."""
import numpy as np
import pytest

from private_engine.heads import DPFeatureCovariance, DPLeastSquares

Y = [0, 1, 0, 1, 0, 1]


def _fit(X):
    return DPLeastSquares(epsilon=1.0, delta=1e-5, classes=[0, 1]).fit(X, Y)


@pytest.mark.parametrize("X, message", [
    ([[1.0, 2.0], [3.0, 4.0], [5.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
     "X record 2 has 1 features where record 0 has 2"),
    ([[1.0, 2.0], [3.0, "4"], [5.0, 6.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
     "X record 1, feature 1 is a str, not a number"),
    ([[1.0, 2.0], None, [5.0, 6.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
     "X record 1 is a NoneType, not a row of numbers"),
])
def test_a_malformed_record_is_named(X, message):
    with pytest.raises(TypeError) as info:
        _fit(X)
    assert message in str(info.value), str(info.value)
    assert "'4'" not in str(info.value)   # the position and the type, never the value


def test_predict_names_the_rows_that_are_not_finite():
    clf = DPFeatureCovariance(epsilon=1.0, delta=1e-5, classes=[0, 1]).fit(np.ones((6, 2)), Y)
    X = np.ones((6, 2))
    X[4, 1] = np.nan
    with pytest.raises(ValueError, match=r"in 1 record\(s\) \(rows 4\)"):
        clf.predict(X)


def test_well_formed_lists_still_fit():
    _fit([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
