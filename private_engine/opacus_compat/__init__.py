"""Drop-in replacement for ``opacus.PrivacyEngine`` (see docs/migrating-from-opacus.md)."""
from .engine import GRAD_SAMPLE_MODES, OpacusPrivacyEngine
from .loss import PrivateLoss, PrivateLossTensor
from .module import PrivateModule
from .optimizer import ClippedSumOptimizer, PerLayerClippedSumOptimizer

__all__ = ["OpacusPrivacyEngine", "PrivateModule", "PrivateLoss", "PrivateLossTensor", "ClippedSumOptimizer",
           "PerLayerClippedSumOptimizer", "GRAD_SAMPLE_MODES"]
