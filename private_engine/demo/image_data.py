"""Image data for fine-tuning a timm (or torchvision) model: its input size and normalisation,
four sources.

* ``model_data_config``: the model's input size, mean, std and interpolation (timm's
  ``resolve_data_config``; an explicit size wins).
* ``image_transform``: resize to the model's input size, then ``(x − mean)/std``.
* ``num_classes``: the number of classes of a source, before any image is loaded.
* ``load_image_data``: train/test datasets and class names from one of ``SOURCES``:

  ``digits``    scikit-learn's embedded 8×8 handwritten digits (no download;
                ``demo.digits.load_digits_images``)
  ``folder``    an image folder: ``ROOT/train/<class>/*`` (+ ``ROOT/val`` or ``ROOT/test``), or
                ``ROOT/<class>/*`` split 80/20 by a seeded permutation
  ``cifar10``   torchvision's CIFAR-10 already on disk (``ROOT/cifar-10-batches-py``); never
                downloaded
  ``cifar100``  torchvision's CIFAR-100 already on disk (``ROOT/cifar-100-python``); never
                downloaded

The preprocessing is fixed and data-independent (the model's published mean/std, no statistic
of the private training set), so it needs no privacy budget. No augmentation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

SOURCES = ("digits", "folder", "cifar10", "cifar100")
_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def model_data_config(model: nn.Module, img_size: Optional[int] = None) -> Dict:
    """``{"input_size": (C, H, W), "mean", "std", "interpolation"}`` for ``model``.

    From the model's ``pretrained_cfg`` (timm's ``resolve_data_config``; ImageNet defaults for
    models without one, e.g. torchvision's). ``img_size`` overrides H = W, e.g. for a ViT built
    with ``img_size=`` (its ``pretrained_cfg`` still names the checkpoint's size).
    """
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    if img_size is not None:
        cfg["input_size"] = (cfg["input_size"][0], img_size, img_size)
    return {k: cfg[k] for k in ("input_size", "mean", "std", "interpolation")}


def image_transform(config: Dict):
    """RGB PIL image → ``(C, H, W)`` tensor: resize to ``config["input_size"]``, ``(x − mean)/std``.

    ``x`` is the pixel scaled to [0, 1]; mean/std are the model's (fixed, not estimated from data).
    """
    from torchvision import transforms
    from torchvision.transforms import InterpolationMode

    _, h, w = config["input_size"]
    mode = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
            "nearest": InterpolationMode.NEAREST}.get(config.get("interpolation"),
                                                      InterpolationMode.BILINEAR)
    return transforms.Compose([
        transforms.Resize((h, w), interpolation=mode, antialias=True),
        transforms.ToTensor(),
        transforms.Normalize(config["mean"], config["std"]),
    ])


def load_image_data(source: str, config: Dict, root: Optional[str] = None, seed: int = 0,
                    test_fraction: float = 0.2) -> Tuple[Dataset, Dataset, List[str]]:
    """``(train, test, class_names)`` of ``source`` (one of ``SOURCES``), preprocessed for
    ``config``.

    Items are ``(image (C, H, W) float tensor, label int)``. ``root`` is the folder of the
    ``folder`` and CIFAR sources. Missing data raises ``FileNotFoundError`` saying what was
    expected where; nothing is ever downloaded.
    """
    if source == "digits":
        return _digits(config, seed, test_fraction)
    if root is None:
        raise ValueError(f"--data {source} needs a folder: pass --data-dir DIR")
    if source == "folder":
        return _folder(Path(root), config, seed, test_fraction)
    if source in _CIFAR_FOLDERS:
        return _cifar(source, Path(root), config)
    raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")


def num_classes(source: str, root: Optional[str] = None) -> int:
    """Number of classes of ``source`` without loading any image (the folder source counts class
    folders)."""
    if source == "folder":
        from torchvision.datasets.folder import find_classes

        root_path = Path(root) if root is not None else None
        if root_path is None or not root_path.is_dir():
            raise FileNotFoundError(f"image folder {root} does not exist")
        folder = root_path / "train" if (root_path / "train").is_dir() else root_path
        return len(find_classes(str(folder))[0])
    counts = {"digits": 10, "cifar10": 10, "cifar100": 100}
    if source not in counts:
        raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
    if source in _CIFAR_FOLDERS:
        _cifar_folder(source, root)  # fail before anything is built when the files are absent
    return counts[source]


def _normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    shape = (1, -1, 1, 1)
    return (x - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)


def _digits(config, seed, test_fraction):
    from .digits import load_digits_images

    c, h, w = config["input_size"]
    if h != w:
        raise ValueError(f"the digits are square; the model wants {h}×{w} inputs")
    train, test = load_digits_images(image_size=h, channels=c, test_fraction=test_fraction,
                                     seed=seed, normalize=False)
    out = [TensorDataset(_normalize(d.tensors[0], config["mean"], config["std"]), d.tensors[1])
           for d in (train, test)]
    return out[0], out[1], [str(k) for k in range(10)]


def _folder(root: Path, config, seed, test_fraction):
    from torchvision.datasets import ImageFolder

    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist (expected "
                                f"{root}/<class>/<image> or {root}/train/<class>/<image> with "
                                f"{root}/val or {root}/test beside it)")
    tf = image_transform(config)
    if (root / "train").is_dir():
        train = ImageFolder(str(root / "train"), transform=tf)
        held = next((root / s for s in ("val", "test") if (root / s).is_dir()), None)
        if held is None:
            train, test = _split(train, seed, test_fraction)
            return train, test, train.dataset.classes
        test = ImageFolder(str(held), transform=tf)
        if test.classes != train.classes:
            raise ValueError(f"{held} has classes {test.classes}, {root / 'train'} has "
                             f"{train.classes}: they must be the same folders")
        return train, test, train.classes
    full = ImageFolder(str(root), transform=tf)
    train, test = _split(full, seed, test_fraction)
    return train, test, full.classes


def _split(dataset, seed, test_fraction):
    """Seeded permutation: the first ``test_fraction`` (rounded) is the test set."""
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = int(round(test_fraction * len(dataset)))
    if n_test == 0 or n_test == len(dataset):
        raise ValueError(f"{len(dataset)} images cannot be split into train and test at "
                         f"{test_fraction:.0%}")
    return Subset(dataset, perm[n_test:]), Subset(dataset, perm[:n_test])


def _cifar_hint(source: str, root) -> str:
    name = "CIFAR10" if source == "cifar10" else "CIFAR100"
    return (f"{source} is not on disk: expected torchvision's "
            f"{Path(root) / _CIFAR_FOLDERS[source]}/ (this example never downloads). Fetch it "
            f"once elsewhere with torchvision.datasets.{name}({str(root)!r}, download=True), or "
            "use --data digits / --data folder")


def _cifar_folder(source: str, root) -> Path:
    """The folder torchvision reads ``source`` from; ``FileNotFoundError`` with what to do if it
    is absent."""
    if root is None:
        raise ValueError(f"--data {source} needs a folder: pass --data-dir DIR")
    expected = Path(root) / _CIFAR_FOLDERS[source]
    if not expected.is_dir():
        raise FileNotFoundError(_cifar_hint(source, root))
    return expected


def _cifar(source: str, root: Path, config):
    from torchvision import datasets

    cls = datasets.CIFAR10 if source == "cifar10" else datasets.CIFAR100
    expected = _cifar_folder(source, root)
    hint = _cifar_hint(source, root)
    tf = image_transform(config)
    try:
        train = cls(str(root), train=True, transform=tf, download=False)
        test = cls(str(root), train=False, transform=tf, download=False)
    # torchvision: "Dataset not found or corrupted" (a file missing or its md5 off)
    except RuntimeError as e:
        raise FileNotFoundError(f"{hint} ({expected} is incomplete or corrupted: {e})") from None
    return train, test, list(train.classes)
