"""Class labels of the DP heads: labels checked to be integers, the public label set validated
and sorted, and each label's position in it.

The label set is public (see "The label set is public" in :mod:`private_engine.heads.base`): a
private fit takes it from ``classes=``. :func:`encode_labels` never raises because of a label's
value when the label set is given: a label in none of the classes gets the position −1 and its
record is dropped.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["labels_to_numpy", "labels_array", "public_classes", "EncodedLabels",
           "encode_labels"]


def labels_to_numpy(y: Any) -> np.ndarray:
    """``y`` (a tensor, array or list) as a numpy array, on the CPU."""
    if isinstance(y, torch.Tensor):
        return y.detach().cpu().numpy()
    return np.asarray(y)


def labels_array(y: Any) -> np.ndarray:
    """``y`` as a 1-D numpy array of integer labels (an integer dtype) or of floats.

    Raises for what does not depend on the values: a rank other than 1, a type that cannot hold
    integers (strings, objects, complex). Floats are kept as they are: whether a float label is
    an integer is a property of the record, decided by :func:`encode_labels`.
    """
    arr = labels_to_numpy(y)
    if arr.ndim != 1:
        raise ValueError(f"y must be 1-D (n_samples,) integer class labels, got shape {arr.shape}.")
    if arr.dtype == bool:
        return arr.astype(np.int64)
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(  # the message names the type, never a value of the private labels
            f"y must hold integer class labels, got dtype {arr.dtype}. Encode them first, e.g. "
            "classes, y = np.unique(y, return_inverse=True), with classes public.")
    return arr


def public_classes(classes: Any) -> np.ndarray:
    """``classes`` (a public label set: list, range, array) validated and sorted."""
    arr = np.asarray(classes)
    if (arr.ndim != 1 or len(arr) == 0 or len(np.unique(arr)) != len(arr)
            or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError("classes must be a non-empty 1-D list of distinct integer labels, "
                         f"got {classes!r}.")
    return np.sort(arr).astype(np.int64)


#: a float label is an integer label only if it is one exactly (|y| ≤ 2^53: exact in float64)
_EXACT_FLOAT_INT = 2.0 ** 53


class EncodedLabels(NamedTuple):
    """Each label's position in the sorted label set (:func:`encode_labels`)."""

    #: ``positions[i]``: the position of label ``y_i`` in ``classes``, or −1 (int64, shape (n,))
    positions: np.ndarray
    #: the label set, sorted (int64)
    classes: np.ndarray


def encode_labels(y: Any, classes: Any = None) -> EncodedLabels:
    """``EncodedLabels(positions, classes)``: ``positions[i]`` is the position of label ``y_i`` in
    the sorted ``classes``, or −1 for a label that is in none (a float that is not an integer — NaN,
    ±inf, 0.5 — or an integer not in ``classes``). Never raises because of a label's value when
    ``classes`` is given: the caller drops the records with index −1.

    ``classes=None`` infers the label set, ``np.unique(y)``: for the non-private reference only
    (the label set is released, see :mod:`private_engine.heads.base`). It raises if a float
    label is not an integer, as there is then no label set to infer.
    """
    arr = labels_array(y)
    if np.issubdtype(arr.dtype, np.floating):
        integral = np.isfinite(arr) & (np.abs(arr) <= _EXACT_FLOAT_INT)
        integral[integral] = arr[integral] == np.round(arr[integral])
        values = np.where(integral, arr, 0).astype(np.int64)
    else:
        integral = np.ones(arr.shape, dtype=bool)
        values = arr
    if classes is None:
        if not integral.all():
            raise ValueError(
                f"y must hold integer class labels, got dtype {arr.dtype} (e.g. "
                f"{arr[~integral][:3].tolist()}). Encode them first, e.g. "
                "classes, y = np.unique(y, return_inverse=True).")
        classes = np.unique(values).astype(np.int64)
    else:
        classes = public_classes(classes)
    index = np.clip(np.searchsorted(classes, values), 0, len(classes) - 1)
    known = integral & (classes[index] == values)
    return EncodedLabels(np.where(known, index, -1).astype(np.int64), classes)
