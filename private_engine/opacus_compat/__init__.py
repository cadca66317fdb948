"""The Opacus door: :class:`PrivacyEngine`, a subclass of ``opacus.PrivacyEngine`` that is a
drop-in replacement for it (see docs/migrating-from-opacus.md)."""
from .arguments import GRAD_SAMPLE_MODES
from .engine import PrivacyEngine
from .loss import PrivateLoss, PrivateLossTensor
from .module import PrivateModule
from .optimizer import (
                        ClippedSumOptimizer,
                        DistributedClippedSumOptimizer,
                        DistributedPerLayerClippedSumOptimizer,
                        PerLayerClippedSumOptimizer,
)

__all__ = ["PrivacyEngine", "PrivateModule", "PrivateLoss", "PrivateLossTensor",
           "ClippedSumOptimizer", "PerLayerClippedSumOptimizer", "DistributedClippedSumOptimizer",
           "DistributedPerLayerClippedSumOptimizer", "GRAD_SAMPLE_MODES"]
