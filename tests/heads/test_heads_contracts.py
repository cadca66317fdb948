"""The typed results that travel between the heads' modules: records, labels, row scales and
clipped gradient sums carry named fields (and still unpack as before)."""
import numpy as np
import torch

from private_engine.heads._glm import clipped_gradient_sum
from private_engine.heads._labels import encode_labels
from private_engine.heads._records import finite_records
from private_engine.heads._row_clipping import row_scales


def test_records_name_their_values_and_finite_mask():
    recs = finite_records([[1.0, 2.0], [float("nan"), 1.0]])
    assert recs.values.tolist() == [[1.0, 2.0], [0.0, 0.0]]
    assert recs.finite.tolist() == [True, False]
    values, finite = recs
    assert values is recs.values and finite is recs.finite


def test_encoded_labels_name_positions_and_classes():
    enc = encode_labels(np.array([3, 5, 7]), classes=[5, 3])
    assert enc.positions.tolist() == [0, 1, -1] and enc.classes.tolist() == [3, 5]


def test_row_scales_and_clipped_gradients_name_their_parts():
    X = torch.tensor([[2.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    rows = row_scales(X)
    assert rows.scales.tolist() == [4.0, 1.0]
    assert rows.unit.tolist() == [[0.5, -1.0], [0.0, 0.0]]
    Y = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    W, b = torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    sums = clipped_gradient_sum(X, Y, W, b, "softmax", clip=1.0, rows=rows)
    assert sums.weight.shape == (2, 2) and sums.bias.shape == (2,) and sums.norms.shape == (2,)
    no_bias = clipped_gradient_sum(X, Y, W, None, "softmax", clip=None)
    assert no_bias.bias is None
    torch.testing.assert_close(no_bias.weight, (torch.softmax(X @ W.T, 1) - Y).T @ X)
