"""Building models by name (timm first, then torchvision), never downloading unless asked."""
from __future__ import annotations

from torch import nn


def create_model(name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    """A timm model, or a torchvision model if timm has no such name.

    ``pretrained=True`` loads real weights from the hub (network needed); the default builds
    randomly initialised weights with no network access.
    """
    import timm

    if name in timm.list_models() or timm.is_model(name):
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    import torchvision

    try:
        weights = "DEFAULT" if pretrained else None
        return torchvision.models.get_model(name, weights=weights, **kwargs)
    except ValueError:
        raise ValueError(f"unknown model {name!r}: neither timm nor torchvision has it.") from None
