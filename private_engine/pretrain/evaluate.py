"""Evaluation of an MAE encoder: masked-reconstruction loss with fixed masks, encoder features,
and linear probes (non-private logistic regression and the DP heads of
:mod:`private_engine.heads`), as a table and a plot."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .mae import MaskedAutoencoder

__all__ = ["images_of", "reconstruction_loss", "encoder_features", "ProbeRow", "probe_encoder",
           "format_comparison", "plot_comparison"]


def images_of(data) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(images, labels or None)`` of a tensor, a ``TensorDataset`` or any ``Dataset`` whose
    items are ``x`` or ``(x, y, …)`` (read in order)."""
    if isinstance(data, torch.Tensor):
        return data, None
    tensors = getattr(data, "tensors", None)
    if tensors is not None:
        return tensors[0], (tensors[1] if len(tensors) > 1 else None)
    xs, ys = [], []
    for item in DataLoader(data, batch_size=512, shuffle=False):
        if isinstance(item, (list, tuple)):
            xs.append(item[0])
            if len(item) > 1:
                ys.append(torch.as_tensor(item[1]))
        else:
            xs.append(item)
    return torch.cat(xs), (torch.cat(ys) if ys else None)


@torch.no_grad()
def reconstruction_loss(model: MaskedAutoencoder, data, batch_size: int = 256, seed: int = 0,
                        device: Optional[torch.device] = None) -> float:
    """Mean masked-reconstruction loss ``(1/N) Σ_i ℓ_i`` over ``data`` (images, a TensorDataset
    or a Dataset of ``(x, …)``), with mask noise drawn from a generator seeded by ``seed`` — the
    same masks for every model compared. Eval mode, restored afterwards."""
    x, _ = images_of(data)
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(x.shape[0], model.num_patches, generator=g)
    was = model.training
    model.eval()
    total = 0.0
    try:
        for start in range(0, x.shape[0], batch_size):
            xb, nb = x[start:start + batch_size], noise[start:start + batch_size]
            if device is not None:
                xb, nb = xb.to(device), nb.to(device)
            total += float(model(xb, noise=nb).double().sum())
    finally:
        model.train(was)
    return total / max(x.shape[0], 1)


@torch.no_grad()
def encoder_features(model: MaskedAutoencoder, images: torch.Tensor, batch_size: int = 256,
                     device: Optional[torch.device] = None,
                     blank: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pooled features of the unmasked images, ``f(x) = pool(ψ(x))`` (timm's ``forward_features``
    then ``forward_head(pre_logits=True)``: the mean of the patch tokens after the final
    LayerNorm for :func:`~private_engine.pretrain.mae.build_mae` encoders), minus ``f(blank)``
    when a blank image (C, H, W) is given — a data-independent shift."""
    from ..heads.features import penultimate_features

    enc = model.encoder
    was = enc.training
    enc.eval()
    out = []
    try:
        for start in range(0, images.shape[0], batch_size):
            xb = images[start:start + batch_size]
            if device is not None:
                xb = xb.to(device)
            out.append(penultimate_features(enc, xb).float().cpu())
        feats = torch.cat(out)
        if blank is not None:
            b = blank.unsqueeze(0) if blank.dim() == 3 else blank
            if device is not None:
                b = b.to(device)
            feats = feats - penultimate_features(enc, b).float().cpu()
    finally:
        enc.train(was)
    return feats


@dataclass
class ProbeRow:
    """One encoder's evaluation: masked-reconstruction loss, non-private logistic-regression
    accuracy, and DP-head accuracies ``dp[method][ε] = [accuracy per seed]``."""

    name: str
    loss: float
    logreg: float
    dp: Dict[str, Dict[float, List[float]]] = field(default_factory=dict)


def _logreg_accuracy(Xtr, ytr, Xte, yte) -> float:
    """Non-private multinomial logistic regression (L2, C = 1) on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(Xtr)
    clf = LogisticRegression(max_iter=2000).fit(scaler.transform(Xtr), ytr)
    return float(clf.score(scaler.transform(Xte), yte))


def probe_encoder(name: str, model: MaskedAutoencoder, train: Dataset, test: Dataset, *,
                  methods: Sequence[str] = ("ls",), epsilons: Sequence[float] = (1.0, 8.0),
                  delta: float = 1e-5, seeds: int = 3, blank: Optional[torch.Tensor] = None,
                  device: Optional[torch.device] = None, loss_seed: int = 0) -> ProbeRow:
    """Evaluate one encoder on labelled ``train``/``test``: its reconstruction loss on ``test``
    (:func:`reconstruction_loss`), a non-private logistic-regression probe, and the DP heads
    ``methods`` (:data:`private_engine.heads.probe.METHODS`: DP-LS, DP-Newton, … of Mehta,
    Krichene, Thakurta, Kurakin & Cutkosky, "Differentially Private Image Classification from
    Features") at each ε (δ = ``delta``; ``math.inf``: the head without noise)."""
    from ..heads.probe import probe_sweep

    xtr, ytr = images_of(train)
    xte, yte = images_of(test)
    if ytr is None or yte is None:
        raise ValueError("the probe needs labelled data: items (x, y)")
    Ftr = encoder_features(model, xtr, device=device, blank=blank).double().numpy()
    Fte = encoder_features(model, xte, device=device, blank=blank).double().numpy()
    ytr, yte = ytr.numpy(), yte.numpy()
    loss = reconstruction_loss(model, xte, seed=loss_seed, device=device)
    row = ProbeRow(name, loss, _logreg_accuracy(Ftr, ytr, Fte, yte))
    if methods:
        res = probe_sweep(Ftr, ytr, Fte, yte, methods=methods, epsilons=epsilons, delta=delta,
                          seeds=seeds, progress=False)
        for m in methods:
            row.dp[m] = {e: accs for e, accs in zip(epsilons, res.accuracies[m])}
    return row


def _eps_label(e: float) -> str:
    return "ε=∞" if math.isinf(e) else f"ε={e:g}"


def format_comparison(rows: Sequence[ProbeRow]) -> str:
    """Markdown table: one row per encoder; the test reconstruction loss, the non-private probe
    and each DP head at each ε (accuracy in %, mean ± std over noise seeds)."""
    from ..heads.probe import METHODS

    first = rows[0]
    cols = [(m, e) for m in first.dp for e in first.dp[m]]
    heads = (["encoder", "masked recon. loss (test)", "logistic regression (non-private)"]
             + [f"{METHODS[m][0]} {_eps_label(e)}" for m, e in cols])
    lines = ["| " + " | ".join(heads) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
    for r in rows:
        cells = [r.name, f"{r.loss:.4f}", f"{100 * r.logreg:.1f}"]
        for m, e in cols:
            a = np.asarray(r.dp[m][e])
            cells.append(f"{100 * a.mean():.1f}" if a.size == 1
                         else f"{100 * a.mean():.1f} ± {100 * a.std():.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_comparison(rows: Sequence[ProbeRow], curves: Dict[str, Sequence[float]],
                    path: str, title: str = "",
                    starts: Optional[Dict[str, int]] = None) -> None:
    """Two panels: the masked-reconstruction loss on the real test images along the recipe
    (``curves[stage]`` = values after 0, 1, 2, … epochs of that stage, drawn from epoch
    ``starts[stage]``, default 0), and the probe accuracies of each encoder as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..heads.probe import METHODS

    starts = starts or {}
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.4))
    for stage, values in curves.items():
        first = starts.get(stage, 0)
        ax0.plot(range(first, first + len(values)), list(values), marker="o", ms=3, label=stage)
    ax0.set_xlabel("epoch (step 1 on synthetic images, then step 2 on the private ones)")
    ax0.set_ylabel("masked reconstruction loss (test)")
    ax0.grid(alpha=0.3)
    ax0.legend(fontsize=8)
    first = rows[0]
    cols = [("logreg", None)] + [(m, e) for m in first.dp for e in first.dp[m]]
    width = 0.8 / len(rows)
    for k, r in enumerate(rows):
        vals, errs = [], []
        for m, e in cols:
            a = np.asarray([r.logreg] if m == "logreg" else r.dp[m][e])
            vals.append(100 * a.mean())
            errs.append(100 * a.std())
        ax1.bar(np.arange(len(cols)) + k * width, vals, width, yerr=errs, capsize=2,
                label=r.name)
    labels = ["log. regression" if m == "logreg" else f"{METHODS[m][0]} {_eps_label(e)}"
              for m, e in cols]
    ax1.set_xticks(np.arange(len(cols)) + 0.4 - width / 2)
    ax1.set_xticklabels(labels, fontsize=8, rotation=30, ha="right")
    ax1.set_ylabel("probe test accuracy (%)")
    ax1.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
