"""Feature records of the DP heads as tensors: a numpy array, torch tensor or nested list turned
into a 2-D real tensor of the fit's dtype (a tensor keeps its device).

What depends only on the input's type and shape (a non-numeric type, a rank other than 2, an empty
shape, a malformed record) raises, naming the record by position and never by its values. What
depends on a record's values does not: :func:`finite_records` marks the records that are not all
finite so that a fit drops them (see "Records that contribute nothing" in
:mod:`private_engine.heads.base`), while :func:`to_tensor`, for inputs that are not private
(``predict``, ``score``), refuses them. A finite value beyond the dtype's range saturates at
``±finfo(dtype).max``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

__all__ = ["to_tensor", "Records", "finite_records"]


def _as_2d(X: Any, device: Optional[torch.device], name: str) -> torch.Tensor:
    """``X`` as a 2-D real tensor (numpy, torch or nested lists; a tensor keeps its device).

    Raises for what does not depend on the values: a non-numeric or complex type, a rank other
    than 2, an empty shape."""
    if isinstance(X, torch.Tensor):
        t = X.detach()
        if device is not None:
            t = t.to(device=device)
    else:
        try:
            arr = np.asarray(X)
        except Exception as exc:
            bad = _malformed_record(X, name)
            raise TypeError(bad or f"{name} must be a numpy array or torch tensor, "
                                   f"got {type(X).__name__}.") from exc
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.number) and arr.dtype != bool:
            bad = _malformed_record(X, name)
            raise TypeError(bad or f"{name} must hold numbers, got dtype {arr.dtype}.")
        t = torch.as_tensor(arr.astype(np.float64, copy=False), device=device)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (n_samples, n_features), got shape {tuple(t.shape)}; "
                         "reshape a single sample with X.reshape(1, -1).")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}).")
    if t.is_complex():
        raise TypeError(f"{name} must hold real numbers, got dtype {t.dtype}.")
    return t


def _malformed_record(X: Any, name: str) -> Optional[str]:
    """For records given as a sequence of rows: a message naming the first record (by position)
    that is not a row of numbers as long as the first one — its position and the type found,
    never a value — or ``None`` when every record is well formed."""
    import numbers

    try:
        rows = list(X)
    except TypeError:
        return None
    width = None
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
            return (f"{name} record {i} is a {type(row).__name__}, not a row of numbers: give "
                    "every record as a sequence of its features.")
        if width is None:
            width = len(row)
        if len(row) != width:
            return (f"{name} record {i} has {len(row)} features where record 0 has {width}: "
                    "every record needs the same number of features (fix or drop that record).")
        for j, v in enumerate(row):
            scalar = isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0
            if not (scalar or isinstance(v, (numbers.Real, np.number, np.bool_))):
                return (f"{name} record {i}, feature {j} is a {type(v).__name__}, not a number: "
                        "convert or drop that record.")
    return None


def _saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, a finite value beyond its range saturating at ``±finfo(dtype).max``."""
    if t.is_floating_point():
        top = torch.finfo(dtype).max
        if torch.finfo(t.dtype).max > top:
            t = t.clamp(-top, top)  # saturating cast: finite stays finite
    return t.to(dtype=dtype)


def to_tensor(X: Any, dtype: torch.dtype = torch.float64, device: Optional[torch.device] = None,
              name: str = "X") -> torch.Tensor:
    """2-D float tensor from a numpy array, torch tensor or nested list; keeps a tensor's device.

    Raises a ValueError naming the problem for wrong rank, empty input or non-finite values (NaN
    or ±inf in the input itself). A finite value beyond the range of ``dtype`` (e.g. 1e300 fitted
    in float32) saturates at ``±finfo(dtype).max`` instead of becoming infinite: a fixed map
    applied to each value on its own, so it costs no privacy, and every record stays finite (the
    clipping that follows bounds its influence whatever its values).

    For inputs that are not private (``predict``, ``score``): a fit reads its records with
    :func:`finite_records`, which drops what this refuses.
    """
    t = _as_2d(X, device, name)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t).all(dim=1)).nonzero().flatten().tolist()
        shown = ", ".join(map(str, bad[:5])) + (", …" if len(bad) > 5 else "")
        raise ValueError(f"{name} contains NaN or infinite values in {len(bad)} record(s) "
                         f"(rows {shown}); clean or drop those rows first.")
    return _saturating_cast(t, dtype)


class Records(NamedTuple):
    """The records of a fit as a tensor, and which of them are finite (:func:`finite_records`)."""

    #: the records (n, d) in the fit's dtype; a record that is not all finite is zeros
    values: torch.Tensor
    #: ``finite[i]``: every value of record i is finite in the input, shape (n,), bool
    finite: torch.Tensor


def finite_records(X: Any, dtype: torch.dtype = torch.float64,
                   device: Optional[torch.device] = None,
                   name: str = "X") -> Records:
    """``Records(X', finite)``: the records of ``X`` as in :func:`to_tensor`, without refusing any.

    ``finite[i]`` says whether every value of row i is finite in the input (before the
    saturating cast, so ±inf is not mistaken for a saturated value); a row that is not has its
    values set to 0 in ``X'``. A fit drops those rows: refusing one would depend on one
    record's values. Only what does not depend on the values (type, rank, empty shape) raises.
    """
    t = _as_2d(X, device, name)
    if t.is_floating_point():
        finite = torch.isfinite(t).all(dim=1)
        t = torch.where(finite[:, None], t, torch.zeros((), dtype=t.dtype, device=t.device))
    else:
        finite = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    return Records(_saturating_cast(t, dtype), finite)
