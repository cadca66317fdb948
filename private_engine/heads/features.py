"""Penultimate-layer features of a timm or torchvision backbone, batched, with a resumable disk
cache.

``extract_features(model, data, batch_size, device)`` returns ``FeatureSet(features, labels)``:

* **Which features.** timm models:
  ``model.forward_head(model.forward_features(x), pre_logits=True)`` (the pooled,
  pre-classifier representation, identical to ``model(x)`` when ``num_classes=0``). Other models
  (torchvision …): the input of the last ``nn.Linear`` in module order (the classifier of
  resnets, ViTs, convnexts, efficientnets, …) captured with a forward pre-hook; a model without
  any Linear layer is taken to output features itself. ``layer="name"`` overrides this with the
  input of a named submodule.
* **Data.** A tensor/array of inputs (N, …), a ``Dataset`` whose items are ``x`` or
  ``(x, y, …)``, or a ``DataLoader`` (its dataset is read in order; its sampler is ignored so
  that the cache is well defined). Labels are returned when the items carry them.
* **Cache.** With ``cache_dir``, features are stored under a key that hashes the model name and
  class, every weight and buffer (so a fine-tuned or re-initialised model gets a new key), the
  data (the bytes of a tensor; for a dataset every loaded input and label, unless ``data_id``
  names it), the ``transform_id`` and the feature layer. Each batch is written atomically to its
  own file as it is computed, so an interrupted run resumes where it stopped; the completed set
  is stored as one ``features.pt`` and the batch files are removed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from ..foundation.files import atomic_save

log = logging.getLogger(__name__)

__all__ = ["FeatureSet", "extract_features", "penultimate_features", "model_fingerprint",
           "saturating_float32"]


class FeatureSet(NamedTuple):
    """``features`` (N, d) float tensor on CPU, ``labels`` (N,) tensor or None, ``cache_path``
    or None."""

    features: torch.Tensor
    labels: Optional[torch.Tensor]
    cache_path: Optional[Path] = None


# ----------------------------------------------------------------------------- features
def _last_linear(model: nn.Module) -> Optional[nn.Module]:
    last = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last = module
    return last


def penultimate_features(model: nn.Module, x: torch.Tensor,
                         layer: Optional[str] = None) -> torch.Tensor:
    """Penultimate features of ``model`` on a batch ``x``, flattened to (B, d) (see module
    docstring)."""
    if layer is not None:
        target = dict(model.named_modules()).get(layer)
        if target is None:
            raise ValueError(f"model has no submodule named {layer!r}.")
    elif hasattr(model, "forward_features") and hasattr(model, "forward_head"):
        return model.forward_head(model.forward_features(x), pre_logits=True).flatten(1)
    else:
        target = _last_linear(model)
        if target is None:
            return model(x).flatten(1)
    captured: List[torch.Tensor] = []

    def hook(_module, inputs):
        captured.append(inputs[0])

    handle = target.register_forward_pre_hook(hook)
    try:
        model(x)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"the feature layer {layer or type(target).__name__} was not called "
                           "in forward.")
    return captured[-1].flatten(1)


def saturating_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32, finite values beyond float32's range saturating at ``±3.4028e38``.

    A plain ``.float()`` turns a finite float64 feature above float32's largest value into
    ``inf``, which a head then refuses: one record would decide whether a fit happens at all.
    Saturation is a fixed map of each value on its own, so it costs no privacy; the heads'
    clipping and normalisation then bound the record's influence. NaN and ±inf stay as they are.
    """
    if t.is_floating_point() and torch.finfo(t.dtype).max > torch.finfo(torch.float32).max:
        top = torch.finfo(torch.float32).max
        t = torch.where(torch.isfinite(t), t.clamp(-top, top), t)
    return t.float()


# ----------------------------------------------------------------------------- hashing
def _hash_tensor(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    h.update(t.numpy().tobytes())


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over the model class and every (name, shape, dtype, bytes) of its state dict."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            _hash_tensor(h, value)
        else:  # pragma: no cover - extra state
            h.update(repr(value).encode())
    return h.hexdigest()


def _model_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    return str(cfg.get("architecture") or type(model).__name__)


# ----------------------------------------------------------------------------- data
class _TensorItems(Dataset):
    def __init__(self, x: torch.Tensor, y: Optional[torch.Tensor] = None):
        self.x, self.y = x, y

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i] if self.y is None else (self.x[i], self.y[i])


def _as_dataset(data: Any, labels: Any) -> Tuple[Dataset, Optional[torch.Tensor]]:
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, torch.Tensor):
        y = None if labels is None else torch.as_tensor(
            np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels)
        if y is not None and y.shape[0] != data.shape[0]:
            raise ValueError(f"data has {data.shape[0]} items but labels has {y.shape[0]}.")
        return _TensorItems(data, y), None
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        if labels is not None:
            raise ValueError("labels= is only for tensor/array data; a dataset's items carry "
                             "their labels.")
        return data, None
    raise TypeError("data must be a tensor, an array, a Dataset or a DataLoader, "
                    f"got {type(data).__name__}.")


def _split_batch(batch: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(batch, (list, tuple)):
        x = batch[0]
        y = batch[1] if len(batch) > 1 and isinstance(batch[1], torch.Tensor) else None
        return x, y
    if isinstance(batch, dict):
        x = batch.get("pixel_values", batch.get("image", batch.get("x")))
        y = batch.get("label", batch.get("labels", batch.get("y")))
        if x is None:
            raise ValueError("dict items need an 'image', 'pixel_values' or 'x' entry.")
        return x, y
    return batch, None


def _batches(dataset: Dataset, start: int, stop: int, batch_size: int,
             num_workers: int) -> Iterator:
    indices = range(start, stop)
    if isinstance(dataset, _TensorItems):  # slicing is much faster than per-item collation
        for s in range(start, stop, batch_size):
            e = min(stop, s + batch_size)
            yield (dataset.x[s:e],) if dataset.y is None else (dataset.x[s:e], dataset.y[s:e])
        return
    subset = torch.utils.data.Subset(dataset, list(indices))
    loader = DataLoader(subset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        collate_fn=default_collate)
    yield from loader


def _data_fingerprint(dataset: Dataset, batch_size: int, num_workers: int, progress: bool) -> str:
    h = hashlib.sha256()
    if isinstance(dataset, _TensorItems):
        _hash_tensor(h, dataset.x)
        if dataset.y is not None:
            _hash_tensor(h, dataset.y)
        return h.hexdigest()
    from tqdm.auto import tqdm

    n = len(dataset)
    for batch in tqdm(_batches(dataset, 0, n, batch_size, num_workers), total=-(-n // batch_size),
                      desc="fingerprinting data", disable=not progress, leave=False):
        x, y = _split_batch(batch)
        _hash_tensor(h, x)
        if y is not None:
            _hash_tensor(h, y)
    return h.hexdigest()


# ----------------------------------------------------------------------------- main entry
def extract_features(model: Union[nn.Module, str], data: Any, batch_size: int = 256,
                     device: Union[str, torch.device, None] = None, *, labels: Any = None,
                     cache_dir: Union[str, os.PathLike, None] = None,
                     model_name: Optional[str] = None, data_id: Optional[str] = None,
                     transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     transform_id: Optional[str] = None, layer: Optional[str] = None,
                     pretrained: bool = False, num_workers: int = 0,
                     progress: bool = True) -> FeatureSet:
    """Penultimate features of ``model`` on ``data``, batched, with a tqdm bar and a resumable
    cache.

    Args:
        model: an ``nn.Module`` (timm, torchvision or any) or a model name, built with
            ``private_engine.demo.models.create_model(name, pretrained=pretrained)`` (no download
            unless ``pretrained=True``).
        data: inputs as a tensor/array (N, …), a Dataset (items ``x`` or ``(x, y, …)``) or a
            DataLoader.
        batch_size: inputs per forward pass.
        device: where to run; default: the model's device. The model is moved there and put in
            eval mode (its training flag is restored afterwards).
        labels: labels for tensor/array ``data`` (returned and cached alongside).
        cache_dir: enable the disk cache there (see module docstring for the key).
        model_name: name used in the cache folder (default: timm architecture or class name).
        data_id: identify a dataset without hashing all of it (you guarantee it is unique).
        transform: applied to each input batch on the device before the model (e.g. resizing).
        transform_id: identifies ``transform`` in the cache key (default: its qualified name; pass
            one if the transform has parameters).
        layer: take the input of this named submodule instead of the default penultimate layer.
        pretrained: only used when ``model`` is a name.
        num_workers: DataLoader workers for Dataset inputs.
        progress: show tqdm progress bars.

    Returns:
        ``FeatureSet(features (N, d) float32 on CPU, labels or None, cache_path or None)``;
        float64 features beyond float32's range saturate (:func:`saturating_float32`).
    """
    from tqdm.auto import tqdm

    if isinstance(model, str):
        from ..demo.models import create_model

        model_name = model_name or model
        model = create_model(model, pretrained=pretrained)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a model name, got {type(model).__name__}.")
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    dataset, _ = _as_dataset(data, labels)
    n = len(dataset)
    if n == 0:
        raise ValueError("data is empty.")
    if device is None:
        param = next(iter(model.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
    device = torch.device(device)
    name = model_name or _model_name(model)

    cache_path: Optional[Path] = None
    parts_dir: Optional[Path] = None
    if cache_dir is not None:
        key = hashlib.sha256()
        key.update(name.encode())
        key.update(model_fingerprint(model).encode())
        key.update((data_id or _data_fingerprint(dataset, batch_size, num_workers,
                                                 progress)).encode())
        tid = transform_id if transform_id is not None else (
            getattr(transform, "__qualname__", type(transform).__qualname__)
            if transform is not None else "none")
        key.update(f"transform={tid};layer={layer};n={n}".encode())
        digest = key.hexdigest()[:24]
        folder = Path(cache_dir) / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{digest}"
        folder.mkdir(parents=True, exist_ok=True)
        cache_path = folder / "features.pt"
        if cache_path.exists():
            log.info("features of %s read from the cache %s", name, cache_path)
            saved = torch.load(cache_path, map_location="cpu", weights_only=True)
            return FeatureSet(saved["features"], saved.get("labels"), cache_path)
        parts_dir = folder / "parts"
        parts_dir.mkdir(exist_ok=True)
        meta = folder / "meta.json"
        info = {"model_name": name, "n": n, "batch_size": batch_size, "transform_id": tid,
                "layer": layer}
        if meta.exists():
            old = json.loads(meta.read_text())
            # batch boundaries changed: old parts are unusable
            if old.get("batch_size") != batch_size:
                for p in parts_dir.glob("part-*.pt"):
                    p.unlink()
        meta.write_text(json.dumps(info, indent=1))

    was_training = model.training
    model.to(device).eval()
    starts = list(range(0, n, batch_size))
    feats: List[Optional[torch.Tensor]] = [None] * len(starts)
    labs: List[Optional[torch.Tensor]] = [None] * len(starts)
    todo = []
    for b, s in enumerate(starts):
        part = parts_dir / f"part-{s:010d}.pt" if parts_dir is not None else None
        if part is not None and part.exists():
            saved = torch.load(part, map_location="cpu", weights_only=True)
            feats[b], labs[b] = saved["features"], saved.get("labels")
        else:
            todo.append(b)
    try:
        bar = tqdm(total=len(starts), initial=len(starts) - len(todo), desc=f"features {name}",
                   disable=not progress, unit="batch")
        with torch.inference_mode():
            # contiguous runs of missing batches are read with one loader each
            runs: List[List[int]] = []
            for b in todo:
                if runs and runs[-1][-1] == b - 1:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            for run in runs:
                start, stop = starts[run[0]], min(n, starts[run[-1]] + batch_size)
                for b, batch in zip(run, _batches(dataset, start, stop, batch_size, num_workers)):
                    x, y = _split_batch(batch)
                    x = x.to(device)
                    if transform is not None:
                        x = transform(x)
                    f = saturating_float32(penultimate_features(model, x, layer)).cpu()
                    feats[b] = f
                    labs[b] = y.cpu() if y is not None else None
                    if parts_dir is not None:
                        atomic_save({"features": f, "labels": labs[b]},
                                     parts_dir / f"part-{starts[b]:010d}.pt")
                    bar.update(1)
        bar.close()
    finally:
        model.train(was_training)
    features = torch.cat(feats)
    all_labels = (torch.cat(labs)
                  if all(lb is not None for lb in labs) else None)
    if cache_path is not None:
        atomic_save({"features": features, "labels": all_labels}, cache_path)
        log.info("features of %s written to the cache %s", name, cache_path)
        for p in parts_dir.glob("part-*.pt"):
            p.unlink()
    return FeatureSet(features, all_labels, cache_path)
