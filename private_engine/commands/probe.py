"""The ``private-engine probe`` command (and ``examples/linear_probe.py``): options, data and
features, then :func:`private_engine.heads.probe.probe_sweep` — every DP head over a list of ε —
printed as a table and drawn as a plot.

Data (no download): scikit-learn's embedded digits (1,797 8×8 images, 10 classes) or synthetic
class-clustered features. ``--features backbone`` (default) upsamples the digits to the model's
input size and extracts penultimate features with a timm model built offline (random weights
unless ``--pretrained``), cached on disk; ``--features raw`` uses the 64 pixels. With random
weights, ``--center blank`` (default for backbone features) subtracts the features of a blank
image — a data-independent shift, so it costs no privacy — which removes the large common
component random networks put in every feature vector.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import List, NamedTuple, Optional

import numpy as np
import torch

from ..heads.probe import METHODS, format_table, plot_results, probe_sweep

__all__ = ["add_probe_arguments", "run_probe", "ProbeData", "load_probe_data", "probe_classes",
           "main", "synthetic_clusters"]


def _epsilon(text: str) -> float:
    t = text.strip().lower()
    if t in ("inf", "infinity", "∞", "none"):
        return math.inf
    value = float(t)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"epsilon must be > 0 or 'inf', got {text!r}")
    return value


def add_probe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the probe's options to ``parser`` (used by the example script and
    ``private-engine probe``)."""
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", choices=["digits", "synthetic"], default="digits",
                   help="embedded sklearn digits, or synthetic class-clustered features")
    g.add_argument("--features", choices=["backbone", "raw"], default="backbone",
                   help="digits: penultimate features of --model, or the raw 64 pixels")
    g.add_argument("--model", default="vit_tiny_patch16_224",
                   help="timm (or torchvision) backbone name")
    g.add_argument("--pretrained", action="store_true",
                   help="load real hub weights (network; off by default)")
    g.add_argument("--img-size", type=int, default=32, help="images are upsampled to this size")
    g.add_argument("--patch-size", type=int, default=8,
                   help="ViT patch size (ignored by other models)")
    g.add_argument("--global-pool", default="avg",
                   help="ViT pooling: 'avg' or 'token' (ignored by other models)")
    g.add_argument("--center", choices=["blank", "none"], default=None,
                   help="subtract the features of a blank image "
                        "(default: blank for random backbones)")
    g.add_argument("--test-fraction", type=float, default=0.2)
    g.add_argument("--n-samples", type=int, default=6000, help="synthetic: number of examples")
    g.add_argument("--n-classes", type=int, default=50, help="synthetic: number of classes")
    g.add_argument("--dim", type=int, default=64, help="synthetic: feature dimension")
    g.add_argument("--batch-size", type=int, default=256, help="feature-extraction batch size")
    g.add_argument("--cache-dir", default=".cache/features", help="feature cache folder")
    g.add_argument("--no-cache", action="store_true",
                   help="do not read or write the feature cache")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    s = parser.add_argument_group("sweep")
    s.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    s.add_argument("--epsilons", nargs="+", type=_epsilon,
                   default=[0.1, 0.3, 1.0, 3.0, 8.0, math.inf],
                   help="privacy levels; 'inf' is the non-private reference "
                        "(no noise, no clipping)")
    s.add_argument("--delta", type=float, default=1e-5)
    s.add_argument("--accounting", choices=["rdp", "gdp", "classical"], default="rdp",
                   help="zCDP → (ε, δ) conversion of the heads of Mehta et al. "
                        "(DP-Mean always uses the exact analytic Gaussian)")
    s.add_argument("--seeds", type=int, default=3,
                   help="fits per (method, ε), each with its own noise draw (secret, from OS "
                        "entropy, unless --noise-seed is given)")
    s.add_argument("--noise-seed", type=int, default=None,
                   help="make the heads' noise reproducible from this seed (for debugging: "
                        "whoever knows it can remove the noise; default: secret noise)")
    s.add_argument("--seed", type=int, default=0,
                   help="data split / synthetic data / backbone init seed")
    o = parser.add_argument_group("output")
    o.add_argument("--plot", default="linear_probe.png",
                   help="accuracy-vs-ε plot (PNG); '' to skip")
    o.add_argument("--json", default="", help="also save the results as JSON here")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


# ----------------------------------------------------------------------------- data
def synthetic_clusters(n: int, d: int, m: int, seed: int, spread: float = 1.6):
    """``(X, y)``: ``n`` features in ``d`` dimensions from ``m`` classes, ``x = c_y + s·z/√d +
    0.5/√d`` with unit-norm class centres ``c_y ~ N(0, I)/‖·‖``, ``z ~ N(0, I)`` and ``s`` =
    ``spread`` (class-clustered data for the probe, seeded by ``seed``; float32 features)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(m, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.integers(0, m, n)
    X = centres[y] + spread * rng.normal(size=(n, d)) / math.sqrt(d) + 0.5 / math.sqrt(d)
    return X.astype(np.float32), y


def _backbone(args) -> torch.nn.Module:
    from ..demo.models import create_model

    kwargs = {}
    name = args.model.lower()
    if any(k in name for k in ("vit", "deit", "eva", "beit")):
        kwargs = dict(img_size=args.img_size, patch_size=args.patch_size,
                      global_pool=args.global_pool)
    import timm

    torch.manual_seed(args.seed)
    if timm.is_model(args.model):
        return create_model(args.model, pretrained=args.pretrained, num_classes=0, **kwargs)
    # torchvision: features before its last Linear
    return create_model(args.model, pretrained=args.pretrained)


def probe_classes(args) -> np.ndarray:
    """The label set of the probe's dataset, from its definition (public): the 10 digits, or
    ``0..n_classes−1`` for the synthetic clusters — never read from the labels."""
    return np.arange(args.n_classes if args.dataset == "synthetic" else 10)


class ProbeData(NamedTuple):
    """The probe's features and labels (:func:`load_probe_data`)."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    #: one line saying what the data and its features are
    description: str


def load_probe_data(args) -> ProbeData:
    """``ProbeData(X_train, y_train, X_test, y_test, description)`` for the probe's options."""
    if args.dataset == "synthetic":
        X, y = synthetic_clusters(args.n_samples, args.dim, args.n_classes, args.seed)
        n_test = int(round(args.test_fraction * len(y)))
        return ProbeData(X[n_test:], y[n_test:], X[:n_test], y[:n_test],
                         f"synthetic clusters: n={len(y)}, d={args.dim}, {args.n_classes} classes")
    from ..demo.digits import load_digits_images

    if args.features == "raw":
        train, test = load_digits_images(image_size=8, channels=1,
                                         test_fraction=args.test_fraction, seed=args.seed,
                                         normalize=False)
        (xtr, ytr), (xte, yte) = train.tensors, test.tensors
        return ProbeData(xtr.flatten(1).numpy(), ytr.numpy(), xte.flatten(1).numpy(),
                         yte.numpy(), "digits, raw 8x8 pixels (d=64)")
    from ..heads.features import extract_features

    train, test = load_digits_images(image_size=args.img_size, channels=3,
                                     test_fraction=args.test_fraction, seed=args.seed,
                                     normalize=False)
    model = _backbone(args)
    device = torch.device(args.device)
    norm = lambda x: (x - 0.5) / 0.5  # noqa: E731 - fixed, data-independent input scaling
    cache = None if args.no_cache else args.cache_dir
    out = []
    for split, ds in (("train", train), ("test", test)):
        fs = extract_features(model, ds.tensors[0], batch_size=args.batch_size, device=device,
                              labels=ds.tensors[1], cache_dir=cache, model_name=args.model,
                              transform=norm, transform_id="(x-0.5)/0.5",
                              progress=not args.quiet)
        out.append((fs.features.numpy(), fs.labels.numpy()))
    (Xtr, ytr), (Xte, yte) = out
    center = args.center or ("none" if args.pretrained else "blank")
    if center == "blank":
        blank = torch.zeros(1, 3, args.img_size, args.img_size)  # background pixel value 0
        from ..heads.features import penultimate_features

        model.eval()
        with torch.inference_mode():
            ref = (penultimate_features(model.to(device), norm(blank.to(device)))
                   .float().cpu().numpy())
        Xtr, Xte = Xtr - ref, Xte - ref
    weights = "pretrained" if args.pretrained else "random-init"
    return ProbeData(Xtr, ytr, Xte, yte, f"digits → {args.model} ({weights}) at "
                                         f"{args.img_size}px, d={Xtr.shape[1]}, centre={center}")


def run_probe(args) -> int:
    """Run the probe for parsed ``args`` (see :func:`add_probe_arguments`): print the table,
    save the plot."""
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    t0 = time.perf_counter()
    Xtr, ytr, Xte, yte, desc = load_probe_data(args)
    t_feat = time.perf_counter() - t0
    print(f"{desc}; train n={len(ytr)}, test n={len(yte)}, features in {t_feat:.1f}s")
    noise_seed = getattr(args, "noise_seed", None)
    res = probe_sweep(Xtr, ytr, Xte, yte, args.methods, args.epsilons, args.delta, args.seeds,
                      args.accounting, progress=not args.quiet, description=desc,
                      noise_seed=noise_seed, classes=probe_classes(args))
    noise = "secret noise" if noise_seed is None else f"noise seeded by {noise_seed}"
    print(f"\nTest accuracy (%), mean ± std over {args.seeds} fits ({noise}), "
          f"δ = {args.delta:g}, accounting = {args.accounting}:\n")
    print(format_table(res))
    if args.plot:
        plot_results(res, args.plot)
        print(f"\nplot saved to {args.plot}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.to_json(), fh, indent=1)
        print(f"results saved to {args.json}")
    print(f"total {time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``examples/linear_probe.py``: parse ``argv`` with the probe options and
    run."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_arguments(parser)
    return run_probe(parser.parse_args(argv))
