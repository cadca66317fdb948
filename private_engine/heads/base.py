"""The estimator base of the DP feature heads, :class:`DPHeadBase`: σ calibrated from (ε, δ),
the records that contribute, the release ledger checked against the head's theorem, and the
sklearn-style surface (``fit``/``predict``/``decision_function``/``score``, ``get_params``).

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

The machinery the heads share lives beside this module: records and labels
(:mod:`._records`, :mod:`._labels`), row clipping with its rounding margins
(:mod:`._row_clipping`), the noise source and its ledger (:mod:`._noise`, which also says how
symmetric matrices are noised and where the randomness comes from), and the small linear algebra
with the PSD floor (:mod:`._linalg`).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Optional, Tuple, cast

import numpy as np
import torch

from ..accounting.zcdp import CONVERSIONS, ZCDPLedger, epsilon_to_rho, rho_to_epsilon
from ..foundation.randomness import secret_generator
from ._labels import encode_labels, labels_array, labels_to_numpy
from ._linalg import small_lapack
from ._noise import NoiseSource
from ._records import finite_records, to_tensor
from ._row_clipping import normalize_rows

__all__ = ["NotFittedError", "DPHeadBase"]


class NotFittedError(ValueError, AttributeError):
    """Raised when ``predict``/``decision_function``/``score`` is called before ``fit``."""


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
    from OS entropy
    (:func:`~private_engine.foundation.randomness.entropy_seeded_generator`); an int, a
    ``torch.Generator`` or a numpy ``Generator`` makes it reproducible — and known to whoever
    knows the seed — with a ``ReproducibleRandomnessWarning``
    (:func:`~private_engine.foundation.randomness.secret_generator`). ``dtype``: float64
    (default) or float32.

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
        # _check_privacy_args: epsilon is given here, and delta too unless epsilon is infinite
        eps = float(cast(float, self.epsilon))
        if math.isinf(eps):
            return 0.0
        rho = epsilon_to_rho(eps, float(cast(float, self.delta)), self.accounting)
        return math.sqrt(self._rho_sigma2() / rho)

    def _finalize_privacy(self, sigma: float, ledger: ZCDPLedger) -> None:
        self.noise_multiplier_ = float(sigma)
        self.privacy_ledger_ = ledger
        self.delta_ = None if self.delta is None else float(self.delta)
        if sigma == 0:
            self.rho_ = math.inf
            self.epsilon_: Optional[float] = math.inf
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
        positions, classes = encode_labels(labels, self.classes)
        self.classes_ = classes
        self.n_features_in_ = Xt.shape[1]
        idx = torch.as_tensor(positions, device=Xt.device)
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
        ``random_state=None``,
        reproducible (with a ``ReproducibleRandomnessWarning``) for an int or a generator.
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
        truth = labels_to_numpy(y)
        if truth.shape != pred.shape:
            raise ValueError(f"y has shape {truth.shape}, predictions have shape {pred.shape}.")
        return float(np.mean(pred == truth))
