"""Last-layer DP solvers for feature heads (issue 5): seed 000's DP-LS, DP-Newton, DP-FC and the
DP-Adam baseline, seed 003's DP class-mean classifier and warm-up, and feature extraction."""
from .adam_head import DPAdamHead
from .base import DPHeadBase, NotFittedError
from .feature_covariance import DPFeatureCovariance
from .least_squares import DPLeastSquares
from .mean_estimator import DPMeanEstimator
from .newton import DPNewton

__all__ = ["DPHeadBase", "NotFittedError", "DPLeastSquares", "DPNewton", "DPFeatureCovariance", "DPAdamHead",
           "DPMeanEstimator"]
