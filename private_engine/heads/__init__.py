"""Last-layer DP solvers for feature heads.

Estimators (sklearn-style ``fit``/``predict``/``decision_function``/``score``; numpy or torch
inputs, computed on the data's device in float64):

* :class:`DPLeastSquares` — Algorithm 2 (DP-LS) of Mehta, Krichene, Thakurta, Kurakin &
  Cutkosky, "Differentially Private Image Classification from Features", ``3/(2σ²)``-zCDP;
* :class:`DPNewton` — Mehta et al. Algorithm 1 (DP-Newton), ``T/σ²``-zCDP;
* :class:`DPFeatureCovariance` — Mehta et al. Algorithm 3 (DP-FC), ``(T+1)/(2σ²)``-zCDP;
* :class:`DPAdamHead` — full-batch DP-Adam baseline, ``T/(2σ²)``-zCDP;
* :class:`DPMeanEstimator` — Algorithm 1 of Zhu & Zhang, "Mean Estimation Strikes Back! An
  Efficient Solution to Private Classification", analytic Gaussian calibration (Δ = √2).

Also :func:`extract_features` (penultimate features, cached and resumable), the warm-up of
Zhu & Zhang (:func:`warmup_finetune`, :func:`residual_loss`) and the probe sweep
(:func:`probe_sweep`; the ``private-engine probe`` command is :mod:`private_engine.commands.probe`).
See ``docs/heads.md``.
"""
from .adam_head import DPAdamHead
from .base import DPHeadBase, NotFittedError
from .feature_covariance import DPFeatureCovariance
from .features import FeatureSet, extract_features, penultimate_features
from .least_squares import DPLeastSquares
from .mean_estimator import DPMeanEstimator
from .newton import DPNewton
from .probe import ProbeResults, probe_sweep
from .warmup import WarmupClassifier, WarmupResult, residual_loss, warmup_accuracy, warmup_finetune

__all__ = ["DPHeadBase", "NotFittedError", "DPLeastSquares", "DPNewton", "DPFeatureCovariance",
           "DPAdamHead", "DPMeanEstimator", "FeatureSet", "extract_features",
           "penultimate_features", "WarmupClassifier", "WarmupResult", "residual_loss",
           "warmup_accuracy", "warmup_finetune", "ProbeResults", "probe_sweep"]
