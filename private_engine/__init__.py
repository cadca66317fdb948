"""private_engine — exact, fast, memory-lean differentially private training for PyTorch.

The library reports through :mod:`logging` (the ``"private_engine"`` logger and one child per
module; nothing is shown until the application configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``) and warns through :mod:`warnings`.
"""
import logging as _logging

_logging.getLogger(__name__).addHandler(_logging.NullHandler())
from . import layers, optim
from .accounting import BudgetExceededError, SamplingRateError
from .checkpoint import load_checkpoint, save_checkpoint
from .clipping.functions import abadi_clip, automatic_clip, global_clip
from .clipping.plan import (
    CLIPPING_MODES,
    DEFAULT_CLIPPING_MODE,
    LayerDecision,
    format_plan,
    layer_plan,
)
from .engine import PrivacyEngine
from .guards.buffers import BufferGuard
from .guards.model_check import fix_batchnorm
from .guards.separability import BatchMixingError
from .layers.recurrent import fix_recurrent

__version__ = "0.1.0"

# Subpackages loaded on first use (``private_engine.data.poisson_loader`` after a bare
# ``import private_engine``), so that importing the package stays as fast as its core.
_LAZY_SUBMODULES = ("accounting", "audit", "capture", "clipping", "data", "demo", "guards",
                    "heads", "opacus_compat", "pretrain", "training")


def __getattr__(name):
    """Import the subpackage ``name`` on first access (PEP 562 module ``__getattr__``)."""
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
__all__ = ["PrivacyEngine", "CLIPPING_MODES", "DEFAULT_CLIPPING_MODE",
           "LayerDecision", "layer_plan", "format_plan", "fix_batchnorm", "fix_recurrent", "optim",
           "layers",
           "abadi_clip", "automatic_clip", "global_clip", "BatchMixingError", "BufferGuard",
           "save_checkpoint", "load_checkpoint", "BudgetExceededError", "SamplingRateError",
           "__version__"]
