"""Shared machinery of the DP feature heads: input conversion, label handling, clipping, noise
(with a ledger of every Gaussian release), symmetric/PSD post-processing, σ calibration and the
sklearn-style estimator surface (``fit``/``predict``/``decision_function``/``score``).

Privacy conventions used by every head
--------------------------------------
* **Neighbouring datasets** differ by adding or removing one example (Mehta, Krichene, Thakurta,
  Kurakin & Cutkosky, "Differentially Private Image Classification from Features", Def. 1.1).
  The number of examples ``n`` is treated as public, as in Mehta et al. (Algorithms 1 and 3
  divide by n); here n counts the records that contribute (see below).
* **The label set is public.** A fitted head publishes ``classes_`` and one block of releases
  (a row of ``coef_``, a class sum) per class, without noise. A private fit therefore takes the
  label set from ``classes=`` and never from the labels: ``np.unique(y)`` would publish every
  label of the private data (one record with a label no other record has adds a class: ε = ∞).
  A private fit without ``classes`` is refused before the data is read; only the non-private
  reference (σ = 0) infers the label set from ``y``.
* **Records that contribute nothing.** A record whose features are not all finite (NaN, ±inf)
  or whose label is not in ``classes`` is dropped before any statistic is computed, without an
  error or a warning: the fit on ``D ∪ {r}`` is then the fit on ``D``, bit for bit, so every
  release moves by 0 ≤ its sensitivity, and whether ``fit`` succeeds does not depend on the
  record. (Refusing such a record would reveal it with certainty; zeroing its row instead
  would still count it in n and, for the heads with an intercept or class counts, give it a
  contribution.) The counts ``n_dropped_nonfinite_`` and ``n_dropped_unknown_label_`` are exact
  diagnostics of the private data, **not part of the release**: they carry no noise and must
  not be published.
* Every private quantity is released by a Gaussian mechanism with an L2 sensitivity ``Δ`` that is
  guaranteed by clipping (or normalisation), and noise std ``σ_i·Δ``; each release is recorded in
  a :class:`~private_engine.accounting.zcdp.ZCDPLedger`; the fitted ``rho_`` is the ledger's sum
  and is checked against the head's theorem.
* ``epsilon=inf`` (or ``noise_multiplier=0``) is the non-private reference: **no noise and no
  clipping** (Mehta et al., Table 1 caption), and ``rho_ = epsilon_ = inf``.

Noisy symmetric matrices (Gram matrices, Hessians)
--------------------------------------------------
Let ``vec_s(A) = (A_11, …, A_dd, √2·A_ij for i<j)``. It is an isometry from symmetric matrices
with the Frobenius norm onto ``R^{d(d+1)/2}``, so the query ``vec_s(G(D))`` has the same L2
sensitivity ``Δ`` as ``G`` in Frobenius norm (e.g. ``‖x xᵀ‖_F = ‖x‖² ≤ C²``). We add
``N(0, (σΔ)²)`` to each coordinate of ``vec_s(G)`` and map back (post-processing), which gives
``G̃ = G + E`` with ``E`` symmetric, ``E_ii ~ N(0, (σΔ)²)`` and ``E_ij = E_ji ~ N(0, (σΔ)²/2)``
for i ≠ j — the same ρ = 1/(2σ²) as the paper's full i.i.d. d×d noise matrix (which has the same
Frobenius sensitivity), but symmetric by construction and with half the off-diagonal variance.
(Adding ``N(0, (σΔ)²)`` to the upper triangle and mirroring, without the √2, is also valid at the
same σ since it only drops coordinates' weights, but it is noisier.) Equivalently ``E = (N+Nᵀ)/2``
for the paper's i.i.d. matrix N, i.e. symmetrising the paper's release — pure post-processing.

Positive definiteness is restored by post-processing only: eigenvalues of the noisy symmetric
system matrix are floored at ``eig_floor`` (default 0: projection onto the PSD cone) before the
ridge ``λI`` is added, so every matrix that is inverted has eigenvalues ≥ λ > 0.

Randomness
----------
Every head draws its noise from :func:`private_engine.foundation.randomness.secret_generator` (the
library's one randomness policy): ``random_state=None`` (default) gives a generator whose whole
state comes from OS entropy (the 19,968-bit MT19937 state on the CPU); an int, a ``torch.Generator``
or a numpy ``Generator`` makes the noise reproducible (an int keys the whole state through
SHAKE-256, all of its bits count) and warns with a ``ReproducibleRandomnessWarning``.

Extreme records
---------------
Clipping and normalisation hold for every finite record, whatever its magnitude (subnormal,
near the largest float, mixed): a row is first scaled by its largest magnitude,
``u = x/max_j|x_j|`` (so ``1 ≤ ‖u‖ ≤ √d`` and no square under- or overflows), and the clipping
norm is shrunk by a rounding margin ``(d + 16)·eps`` so that the computed clipped row has
``‖x̃‖ ≤ C`` in floating point, not only in exact arithmetic (:func:`clip_rows`,
:func:`normalize_rows`, :func:`row_scales`).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..accounting.zcdp import (CONVERSIONS, ZCDPLedger, epsilon_to_rho, rho_to_epsilon)
from ..foundation.randomness import secret_generator

__all__ = ["NotFittedError", "DPHeadBase", "to_tensor", "finite_records", "labels_array",
           "public_classes", "encode_labels", "row_scales", "row_norms", "rounding_margin",
           "clip_rows", "normalize_rows", "check_clip_norm", "symmetric_noise", "psd_floor",
           "sym_eigh", "solve", "NoiseSource"]


class NotFittedError(ValueError, AttributeError):
    """Raised when ``predict``/``decision_function``/``score`` is called before ``fit``."""


# ----------------------------------------------------------------------------- inputs
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


def finite_records(X: Any, dtype: torch.dtype = torch.float64,
                   device: Optional[torch.device] = None,
                   name: str = "X") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(X', finite)``: the records of ``X`` as in :func:`to_tensor`, without refusing any.

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
    return _saturating_cast(t, dtype), finite


def _labels_to_numpy(y: Any) -> np.ndarray:
    if isinstance(y, torch.Tensor):
        return y.detach().cpu().numpy()
    return np.asarray(y)


def labels_array(y: Any) -> np.ndarray:
    """``y`` as a 1-D numpy array of integer labels (an integer dtype) or of floats.

    Raises for what does not depend on the values: a rank other than 1, a type that cannot hold
    integers (strings, objects, complex). Floats are kept as they are: whether a float label is
    an integer is a property of the record, decided by :func:`encode_labels`.
    """
    arr = _labels_to_numpy(y)
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


def encode_labels(y: Any, classes: Any = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(index, classes)``: ``index[i]`` is the position of label ``y_i`` in the sorted
    ``classes``, or −1 for a label that is in none (a float that is not an integer — NaN,
    ±inf, 0.5 — or an integer not in ``classes``). Never raises because of a label's value when
    ``classes`` is given: the caller drops the records with index −1.

    ``classes=None`` infers the label set, ``np.unique(y)``: for the non-private reference only
    (the label set is released, see the module docstring). It raises if a float label is not an
    integer, as there is then no label set to infer.
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
    return np.where(known, index, -1).astype(np.int64), classes


# ----------------------------------------------------------------------------- clipping
def row_scales(X: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(s, U)`` with ``s_i = max_j |x_ij|`` (1 for a zero row) and ``U = X / s`` row-wise.

    Every ``|u_ij| ≤ 1`` and a nonzero row's largest is exactly 1, so ``1 ≤ ‖u_i‖₂ ≤ √d``: the
    squares in ``‖u_i‖`` neither overflow (rows near the largest float) nor all underflow
    (subnormal rows), and ``‖x_i‖ = s_i·‖u_i‖`` (the scaling of LAPACK's ``dnrm2``; Higham,
    "Accuracy and Stability of Numerical Algorithms", §27.5). A zero row gives ``u_i = 0``.
    """
    s = torch.amax(X.abs(), dim=1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return s, X / s[:, None]


def row_norms(X: torch.Tensor) -> torch.Tensor:
    """``‖x_i‖₂`` for every row ``x_i`` of X, as ``s_i·‖u_i‖`` (:func:`row_scales`): exact to
    rounding for every finite row; ``inf`` only where the norm itself exceeds the dtype's range."""
    s, U = row_scales(X)
    return s * torch.linalg.vector_norm(U, dim=1)


def rounding_margin(k: int, dtype: torch.dtype) -> float:
    """``(k + 16)·eps``: relative shrink of a clipping bound that absorbs the rounding of
    clipping a vector of ``k`` entries in ``dtype``.

    The computed ``‖u‖`` of :func:`row_scales`'s ``u`` has relative error at most about
    ``(k/2 + 2)·u`` (squares, any summation order, square root; Higham, Lemma 3.1, with
    ``u = eps/2`` the unit roundoff), and scaling by ``C/‖u‖`` adds two more roundings: a
    computed clipped row is within ``(1 + (k/2 + 5)·u)`` of the bound. Shrinking the bound by
    ``(k + 16)·eps`` (four times that, covering second-order terms) makes ``‖x̃‖ ≤ C`` hold
    for the floating-point result. In float64 this is ≈ 1e-13 for k = 512. A margin above 1 %
    (float32 with more than about 84,000 entries) is refused with a ValueError: fit in float64.
    """
    margin = (int(k) + 16) * torch.finfo(dtype).eps
    if margin > 1e-2:
        raise ValueError(f"{k} features are too many to clip exactly in {dtype} (rounding margin "
                         f"{margin:.3g}); fit with dtype=torch.float64.")
    return margin


def clip_rows(X: torch.Tensor, C: float) -> torch.Tensor:
    """``clip(x) = x·min(1, C/‖x‖₂)`` row-wise (Mehta et al., Alg. 1 line 1), for every finite x.

    Computed on ``u = x/max|x|`` (:func:`row_scales`) against ``C' = C·(1 − m)``,
    ``m = rounding_margin(d)``: a row with ``‖u‖ ≤ C'/s`` (``‖x‖ ≤ C'``) is returned unchanged,
    any other becomes ``u·C'/‖u‖``, so the floating-point result has ``‖x̃‖ ≤ C`` whether x is
    subnormal, near the largest float, or mixes both (no square is formed of x itself, so
    nothing under- or overflows; ``C'/s`` is 0 or inf only where the answer is clear: ``s`` is
    then far above C, resp. ``‖x‖ ≤ √d·s`` far below it). Zero rows stay zero.
    """
    s, U = row_scales(X)
    nu = torch.linalg.vector_norm(U, dim=1)
    bound = float(C) * (1.0 - rounding_margin(X.shape[1], X.dtype))
    keep = nu <= bound / s
    factor = bound / torch.where(nu > 0, nu, torch.ones_like(nu))
    return torch.where(keep[:, None], X, U * factor[:, None])


def normalize_rows(X: torch.Tensor) -> torch.Tensor:
    """``φ(x) = x/‖x‖₂`` row-wise (zero rows stay zero): a per-example map, free of privacy cost.

    Computed as ``u·(1 − m)/‖u‖`` with ``u = x/max|x|`` (:func:`row_scales`) and
    ``m = rounding_margin(d)``, so ``1 − 2m ≤ ‖φ(x)‖ ≤ 1`` in floating point for every finite
    nonzero x: subnormal rows (whose squares would underflow) and rows near the largest float
    (whose squares would overflow) included.
    """
    _, U = row_scales(X)
    nu = torch.linalg.vector_norm(U, dim=1)
    scale = (1.0 - rounding_margin(X.shape[1], X.dtype)) / torch.where(nu > 0, nu,
                                                                       torch.ones_like(nu))
    return U * scale[:, None]


def check_clip_norm(name: str, value: float, n: int, dtype: torch.dtype) -> float:
    """``float(value)`` if it is a usable clipping norm C for ``n`` examples in ``dtype``, else a
    ValueError naming it: ``C > 0`` finite, ``C²`` not below the smallest normal number (the
    Gram sensitivity C² and its noise would lose their precision) and ``(n + 1)·C²`` finite (the
    clipped sums stay finite)."""
    try:
        C = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number > 0, got {value!r}.") from None
    info = torch.finfo(dtype)
    if not (C > 0 and math.isfinite(C)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    if C * C < info.tiny or (n + 1) * C * C > info.max:
        raise ValueError(
            f"{name}={value!r} is out of range for {dtype} with {n} examples: C² must lie in "
            f"[{info.tiny:.3g}, {info.max / (n + 1):.3g}]. Rescale the features (and C) or fit "
            "in float64.")
    return C


# ----------------------------------------------------------------------------- noise
class NoiseSource:
    """Gaussian noise from one ``torch.Generator`` plus the ledger of releases it served.

    ``release(name, value, sensitivity, noise_multiplier)`` returns ``value + N(0, (σΔ)²)``
    (or the isometric symmetric noise of the module docstring with ``symmetric=True``) and records
    ``(Δ, σΔ)`` in the ledger. ``count`` records several same-size mechanisms at once (e.g. the m
    per-class gradients of DP-Newton). ``generator`` may be None only for releases without noise
    (σ = 0).
    """

    def __init__(self, generator: Optional[torch.Generator],
                 ledger: Optional[ZCDPLedger] = None):
        self.generator = generator
        self.ledger = ledger if ledger is not None else ZCDPLedger()

    def _source(self) -> torch.Generator:
        if self.generator is None:  # never fall back on torch's global (user-seeded) generator
            raise RuntimeError("this NoiseSource has no generator: it serves releases with σ = 0 "
                               "only.")
        return self.generator

    def gaussian(self, shape, std: float, like: torch.Tensor) -> torch.Tensor:
        """i.i.d. ``N(0, std²)`` of ``shape`` with ``like``'s dtype and device (not recorded)."""
        return torch.randn(shape, generator=self._source(), dtype=like.dtype,
                           device=like.device) * std

    def symmetric(self, d: int, std: float, like: torch.Tensor,
                  batch: Tuple[int, ...] = ()) -> torch.Tensor:
        """Symmetric d×d noise of :func:`symmetric_noise` (not recorded)."""
        return symmetric_noise(d, std, self._source(), like.dtype, like.device, batch)

    def release(self, name: str, value: torch.Tensor, sensitivity: float, noise_multiplier: float,
                symmetric: bool = False, count: int = 1, record: bool = True) -> torch.Tensor:
        """Gaussian mechanism: ``value + N(0, (σΔ)²)`` (isometric symmetric noise if ``symmetric``).

        ``record=False`` is for the later chunks of a release already entered in the ledger.
        """
        std = float(noise_multiplier) * float(sensitivity)
        if record:
            self.ledger.add(name, sensitivity, std, count=count, shape=tuple(value.shape))
        # the statistic is symmetric in exact arithmetic; make it so in floating point too
        if symmetric:
            value = 0.5 * (value + value.transpose(-1, -2))
        if std == 0:
            return value
        if symmetric:
            d = value.shape[-1]
            return value + self.symmetric(d, std, value, tuple(value.shape[:-2]))
        return value + self.gaussian(value.shape, std, value)


def symmetric_noise(d: int, std: float, generator: torch.Generator, dtype=torch.float64,
                    device=None, batch: Tuple[int, ...] = ()) -> torch.Tensor:
    """Symmetric noise E with ``E_ii ~ N(0, std²)``, ``E_ij = E_ji ~ N(0, std²/2)`` (i ≠ j).

    This is ``vec_s⁻¹(N(0, std² I))`` for the isometry ``vec_s`` of the module docstring, i.e. the
    Gaussian mechanism on the upper triangle of a symmetric query with Frobenius sensitivity Δ when
    ``std = σΔ`` (same ρ = 1/(2σ²) as the i.i.d. d×d noise of Mehta et al.), mirrored to the
    lower triangle.
    """
    Z = torch.randn(*batch, d, d, generator=generator, dtype=dtype, device=device) * std
    upper = torch.triu(Z, diagonal=1) / math.sqrt(2.0)
    return upper + upper.transpose(-1, -2) + torch.diag_embed(torch.diagonal(Z, dim1=-2, dim2=-1))


@contextlib.contextmanager
def small_lapack(t: torch.Tensor, max_dim: int = 1024):
    """Run CPU LAPACK calls on matrices of size ≤ ``max_dim`` single-threaded.

    Multi-threaded MKL gains nothing on such matrices and, on a busy machine, its spinning
    threads made 192×192 eigendecompositions take seconds instead of milliseconds (and print
    spurious "DLASWP" errors). The previous thread count is restored on exit.
    """
    if t.device.type != "cpu" or t.shape[-1] > max_dim:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sym_eigh(M: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of the symmetric part of ``M`` (batched), see :func:`small_lapack`."""
    M = 0.5 * (M + M.transpose(-1, -2))
    with small_lapack(M):
        return torch.linalg.eigh(M)


def solve(M: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.solve(M, rhs)`` (batched), see :func:`small_lapack`."""
    with small_lapack(M):
        return torch.linalg.solve(M, rhs)


def psd_floor(M: torch.Tensor, floor: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of symmetric ``M`` (batched) with eigenvalues floored at ``floor``.

    Returns ``(eigvals, eigvecs)`` with ``M_psd = V diag(max(Λ, floor)) Vᵀ``. Post-processing of
    an already-released matrix: it costs no privacy.
    """
    evals, evecs = sym_eigh(M)
    return torch.clamp(evals, min=floor), evecs


# ----------------------------------------------------------------------------- estimator base
class DPHeadBase:
    """Base class of the DP feature heads (sklearn-style estimator).

    Privacy arguments (exactly one of ``epsilon`` / ``noise_multiplier``):

    * ``epsilon`` (with ``delta``): the noise multiplier σ is calibrated so the whole fit is
      (ε, δ)-DP: ``σ = sqrt(c/ρ*)`` where the head is ``c/σ²``-zCDP (its theorem) and ρ* is the
      largest ρ whose (ε, δ) conversion (``accounting``) is ≤ ε (bisection, see
      :func:`~private_engine.accounting.zcdp.epsilon_to_rho`). ``epsilon=float("inf")`` fits
      without noise and without clipping.
    * ``noise_multiplier``: σ directly; ``epsilon_`` is then reported if ``delta`` is given.

    ``random_state``: None (default) draws the noise from a generator whose whole state comes
    from OS entropy (:func:`~private_engine.foundation.randomness.entropy_seeded_generator`); an
    int, a ``torch.Generator`` or a numpy ``Generator`` makes it reproducible — and known to whoever
    knows the seed — with a ``ReproducibleRandomnessWarning``
    (:func:`~private_engine.foundation.randomness.secret_generator`). ``dtype``: float64 (default)
    or float32.

    ``classes``: the label set, public (it is released as ``classes_``); required for a private
    fit, where it is never inferred from the private labels. Records whose label is not in it
    contribute nothing (dropped). Only a non-private fit (σ = 0) may leave it None and infer
    ``np.unique(y)``.

    Fitted attributes common to all heads: ``classes_``, ``n_features_in_``,
    ``noise_multiplier_`` (σ), ``rho_`` (zCDP of the fit, from the release ledger),
    ``epsilon_`` (ε at ``delta_``), ``delta_``, ``privacy_ledger_`` (every release with its
    sensitivity and noise std). Diagnostics, **not part of the release** (exact counts on the
    private data, no noise: do not publish them): ``n_dropped_nonfinite_`` (records with a NaN
    or ±inf feature) and ``n_dropped_unknown_label_`` (records whose label is not in
    ``classes_``), both dropped before any statistic is computed (a record may count in both).
    """

    _estimator_name = "DP head"
    _has_proba = False

    def __init__(self, *, epsilon: Optional[float] = None, delta: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, accounting: str = "rdp",
                 random_state: Any = None, classes: Any = None, normalize: bool = False,
                 dtype: torch.dtype = torch.float64):
        self.epsilon = epsilon
        self.delta = delta
        self.noise_multiplier = noise_multiplier
        self.accounting = accounting
        self.random_state = random_state
        self.classes = classes
        self.normalize = normalize
        self.dtype = dtype

    # -- sklearn parameter protocol --------------------------------------------------------
    @classmethod
    def _param_names(cls):
        names = []
        for klass in cls.__mro__:
            if klass is object or "__init__" not in klass.__dict__:
                continue
            sig = inspect.signature(klass.__init__)
            for p in sig.parameters.values():
                if (p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                        and p.name not in names):
                    names.append(p.name)
            break  # the most derived __init__ lists every parameter
        return names

    def get_params(self, deep: bool = True) -> Dict[str, Any]:
        """Constructor parameters (sklearn protocol; lets ``sklearn.base.clone`` work)."""
        return {k: getattr(self, k) for k in self._param_names()}

    def set_params(self, **params) -> "DPHeadBase":
        """Set constructor parameters (sklearn protocol); unknown names raise a ValueError."""
        valid = set(self._param_names())
        for k, v in params.items():
            if k not in valid:
                raise ValueError(f"unknown parameter {k!r} for {type(self).__name__}; "
                                 f"valid: {sorted(valid)}.")
            setattr(self, k, v)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items()
                         if k in ("epsilon", "delta", "noise_multiplier") and v is not None)
        return f"{type(self).__name__}({args})"

    # -- privacy plumbing --------------------------------------------------------------------
    def _rho_sigma2(self) -> float:
        """The constant c of the head's theorem: the fit is ``c/σ²``-zCDP."""
        raise NotImplementedError

    def _check_privacy_args(self) -> None:
        if self.accounting not in CONVERSIONS:
            raise ValueError(f"accounting must be one of {CONVERSIONS}, got {self.accounting!r}.")
        if self.epsilon is None and self.noise_multiplier is None:
            raise ValueError(
                f"{type(self).__name__} needs a privacy level: pass epsilon=... together with "
                "delta=... to calibrate the noise, or noise_multiplier=... to set it directly "
                "(epsilon=float('inf') fits without privacy).")
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ValueError("pass either epsilon (σ is then calibrated) or noise_multiplier, "
                             "not both.")
        if self.delta is not None and not (0 < float(self.delta) < 1):
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}; a common choice is "
                             "delta < 1/n.")
        if self.epsilon is not None:
            if not (float(self.epsilon) > 0):
                raise ValueError(f"epsilon must be > 0 (or float('inf')), got {self.epsilon!r}.")
            if self.delta is None and not math.isinf(float(self.epsilon)):
                raise ValueError(
                    f"epsilon={self.epsilon} needs delta: pass delta=..., typically below "
                    "1/n_samples (e.g. delta=1e-5).")
        if self.noise_multiplier is not None and not (
                float(self.noise_multiplier) >= 0 and math.isfinite(float(self.noise_multiplier))):
            raise ValueError("noise_multiplier must be a finite number ≥ 0, "
                             f"got {self.noise_multiplier!r}.")

    def _resolve_noise_multiplier(self) -> float:
        """σ: calibrated from (ε, δ) or as given; 0 means a non-private fit."""
        self._check_privacy_args()
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        eps = float(self.epsilon)
        if math.isinf(eps):
            return 0.0
        rho = epsilon_to_rho(eps, float(self.delta), self.accounting)
        return math.sqrt(self._rho_sigma2() / rho)

    def _finalize_privacy(self, sigma: float, ledger: ZCDPLedger) -> None:
        self.noise_multiplier_ = float(sigma)
        self.privacy_ledger_ = ledger
        self.delta_ = None if self.delta is None else float(self.delta)
        if sigma == 0:
            self.rho_ = math.inf
            self.epsilon_ = math.inf
            return
        rho = ledger.rho
        planned = self._rho_sigma2() / sigma ** 2
        if rho > planned * (1 + 1e-9) or rho < planned * (1 - 1e-9):
            raise RuntimeError(f"{type(self).__name__}: released ρ={rho} differs from its "
                               f"theorem's ρ={planned}.")
        self.rho_ = rho
        self.epsilon_ = (None if self.delta_ is None
                         else rho_to_epsilon(rho, self.delta_, self.accounting))

    # -- fit/predict surface -----------------------------------------------------------------
    @property
    def private_(self) -> bool:
        """Whether the fit added noise (False for the ε = ∞ reference)."""
        self._check_fitted()
        return self.noise_multiplier_ > 0

    def _require_public_classes(self, private: bool) -> None:
        """Refuse a private fit without ``classes``, before the data is read (module docstring:
        the label set is released, so it must not come from the private labels)."""
        if private and self.classes is None:
            raise ValueError(
                f"{type(self).__name__} publishes its label set (classes_, and one block of "
                "the release per class), so a private fit needs it public: pass "
                "classes=... (e.g. classes=range(10)); it is never read from the private labels. "
                "Records whose label is not in classes are dropped. Only the non-private "
                "reference (epsilon=float('inf') or noise_multiplier=0) infers it from y.")

    def _records_kept(self, finite: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """The mask of the records that contribute, ``finite & known``; sets the diagnostic
        counts of the others (a record may count in both)."""
        self.n_dropped_nonfinite_ = int((~finite).sum())
        self.n_dropped_unknown_label_ = int((~known).sum())
        return finite & known

    def _prepare_fit(self, X, y, private: bool = True):
        """``(X, Y)``: the records that contribute (finite features, label in ``classes_``) and
        their one-hot labels; the other records are dropped (module docstring)."""
        self._require_public_classes(private)
        labels = labels_array(y)
        Xt, finite = finite_records(X, self.dtype)
        if len(labels) != Xt.shape[0]:
            raise ValueError(f"X has {Xt.shape[0]} samples but y has {len(labels)}.")
        idx, classes = encode_labels(labels, self.classes)
        self.classes_ = classes
        self.n_features_in_ = Xt.shape[1]
        idx = torch.as_tensor(idx, device=Xt.device)
        keep = self._records_kept(finite, idx >= 0)
        Xt, idx = Xt[keep], idx[keep]
        Y = torch.zeros(Xt.shape[0], len(classes), dtype=self.dtype, device=Xt.device)
        Y[torch.arange(Xt.shape[0], device=Xt.device), idx] = 1.0
        return Xt, Y

    def _features(self, X: torch.Tensor) -> torch.Tensor:
        """The per-example feature map applied at fit and at inference (normalisation)."""
        return normalize_rows(X) if self.normalize else X

    def fit(self, X, y) -> "DPHeadBase":
        """Fit the head on features ``X`` (n, d) and integer labels ``y`` (n,).

        A private fit (σ > 0) needs ``classes`` (the public label set). Records with a
        non-finite feature or a label outside ``classes`` are dropped, without an error
        (``n_dropped_nonfinite_``, ``n_dropped_unknown_label_``: diagnostics, not released).

        The noise comes from ``secret_generator(random_state, device, ...)``
        (:mod:`private_engine.foundation.randomness`): secret and full-entropy for
        ``random_state=None``, reproducible (with a ``ReproducibleRandomnessWarning``) for an int or
        a generator.
        """
        sigma = self._resolve_noise_multiplier()
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float64 (default) or torch.float32, got "
                             f"{self.dtype!r}: the sufficient statistics and their noise need at "
                             "least single precision.")
        Xt, Y = self._prepare_fit(X, y, private=sigma > 0)
        # a fit without noise (σ = 0) draws nothing, so it needs no generator
        gen = (secret_generator(self.random_state, Xt.device,
                                f"the noise of {type(self).__name__}") if sigma > 0 else None)
        noise = NoiseSource(gen)
        # small CPU problems run single-threaded: faster, and robust on a busy machine
        # (see small_lapack)
        with small_lapack(Xt, max_dim=1024 if Xt.numel() <= 2 ** 22 else 0):
            self._fit(self._features(Xt), Y, sigma, noise)
        self._finalize_privacy(sigma, noise.ledger)
        return self

    def _fit(self, X: torch.Tensor, Y: torch.Tensor, sigma: float, noise: NoiseSource) -> None:
        raise NotImplementedError

    def _check_fitted(self) -> None:
        if not hasattr(self, "classes_"):
            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet; "
                                 "call fit(X, y) first.")

    def _prepare_predict(self, X) -> Tuple[torch.Tensor, bool, Optional[torch.device]]:
        self._check_fitted()
        is_torch = isinstance(X, torch.Tensor)
        Xt = to_tensor(X, self.dtype, device=self._device())
        if Xt.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {Xt.shape[1]} features, but {type(self).__name__} was "
                             f"fitted with {self.n_features_in_}.")
        return self._features(Xt), is_torch, (X.device if is_torch else None)

    def _device(self) -> torch.device:
        raise NotImplementedError

    @staticmethod
    def _out(t: torch.Tensor, is_torch: bool, device):
        if is_torch:
            return t.to(device)
        return t.detach().cpu().numpy()

    def _decision(self, X: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decision_function(self, X):
        """Class scores (n, m); ``predict`` is their arg-max. Same array type as ``X``."""
        Xt, is_torch, dev = self._prepare_predict(X)
        return self._out(self._decision(Xt), is_torch, dev)

    def predict(self, X):
        """Predicted labels ``classes_[argmax_j score_j(x)]``; numpy for numpy input, torch for
        torch."""
        Xt, is_torch, dev = self._prepare_predict(X)
        idx = torch.argmax(self._decision(Xt), dim=1).cpu().numpy()
        labels = self.classes_[idx]
        if is_torch:
            return torch.as_tensor(labels, device=dev)
        return labels

    def score(self, X, y) -> float:
        """Accuracy of ``predict(X)`` against ``y``."""
        pred = self.predict(X)
        pred = pred.cpu().numpy() if isinstance(pred, torch.Tensor) else pred
        truth = _labels_to_numpy(y)
        if truth.shape != pred.shape:
            raise ValueError(f"y has shape {truth.shape}, predictions have shape {pred.shape}.")
        return float(np.mean(pred == truth))
