"""Linear-probe sweep: every DP head over a list of ε on one feature set, as a table and a plot.

:func:`probe_sweep` fits each head of :data:`METHODS` at each ε; :func:`format_table` and
:func:`plot_results` present the result. The ``private-engine probe`` command and
``examples/linear_probe.py`` (:mod:`private_engine.commands.probe`) build the data and call it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..foundation.randomness import seeded_generator
from .adam_head import DPAdamHead
from .feature_covariance import DPFeatureCovariance
from .least_squares import DPLeastSquares
from .mean_estimator import DPMeanEstimator
from .newton import DPNewton

__all__ = ["METHODS", "probe_sweep", "ProbeResults", "format_table", "plot_results"]

def _zcdp_head(cls) -> Callable:
    """``factory(ε, δ, random_state, accounting, classes)`` of a head of Mehta et al. (zCDP
    accounting, normalised features)."""
    return lambda e, d, s, a, c: cls(epsilon=e, delta=d, normalize=True, random_state=s,
                                     accounting=a, classes=c)


# name -> (display name, factory(epsilon, delta, random_state, accounting, classes) -> estimator)
METHODS: Dict[str, Tuple[str, Callable]] = {
    "ls": ("DP-LS", _zcdp_head(DPLeastSquares)),
    "newton": ("DP-Newton", _zcdp_head(DPNewton)),
    "fc": ("DP-FC", _zcdp_head(DPFeatureCovariance)),
    "adam": ("DP-Adam", _zcdp_head(DPAdamHead)),
    # the analytic Gaussian calibration (no accounting choice), on the records as given
    "mean": ("DP-Mean", lambda e, d, s, a, c: DPMeanEstimator(epsilon=e, delta=d, random_state=s,
                                                              classes=c)),
}


# ----------------------------------------------------------------------------- sweep
@dataclass
class ProbeResults:
    """accuracies[method][i] = list of test accuracies (one per fit) at ``epsilons[i]``."""

    epsilons: List[float]
    delta: float
    accuracies: Dict[str, List[List[float]]] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    description: str = ""

    def mean(self, method: str) -> np.ndarray:
        return np.array([np.mean(a) for a in self.accuracies[method]])

    def std(self, method: str) -> np.ndarray:
        return np.array([np.std(a) for a in self.accuracies[method]])

    def to_json(self) -> dict:
        return {"epsilons": [("inf" if math.isinf(e) else e) for e in self.epsilons],
                "delta": self.delta, "description": self.description,
                "accuracies": self.accuracies, "seconds": self.seconds}


def probe_sweep(X_train, y_train, X_test, y_test, methods: Sequence[str] = tuple(METHODS),
                epsilons: Sequence[float] = (0.1, 1.0, 8.0, math.inf), delta: float = 1e-5,
                seeds: int = 3, accounting: str = "rdp", progress: bool = True,
                description: str = "", noise_seed: Optional[int] = None,
                classes: Optional[Sequence[int]] = None) -> ProbeResults:
    """Fit every method at every ε ``seeds`` times; test accuracies in a :class:`ProbeResults`.

    Each fit draws its own noise: secret (``random_state=None``, a generator whose whole state
    comes from OS entropy, :mod:`private_engine.foundation.randomness`) by default; with
    ``noise_seed`` all fits draw in turn from one generator keyed by every bit of it
    (:func:`~private_engine.foundation.randomness.seeded_generator`), so the sweep is reproducible —
    and its noise known to whoever knows the seed (each fit warns:
    ``ReproducibleRandomnessWarning``).

    ``classes``: the public label set given to every head (a private fit releases it, so it is
    never read from ``y_train``; training records with another label are dropped). None takes
    the labels of ``y_test``: the sweep scores the test set without noise, so it treats it as
    public already.
    """
    from tqdm.auto import tqdm

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}.")
    if classes is None:
        classes = np.unique(np.asarray(y_test))  # the evaluation labels, public in the sweep
    res = ProbeResults(list(epsilons), delta, description=description)
    parent = None if noise_seed is None else seeded_generator(int(noise_seed))
    bar = tqdm(total=len(methods) * len(epsilons), desc="probe sweep", disable=not progress)
    for name in methods:
        _, factory = METHODS[name]
        start = time.perf_counter()
        res.accuracies[name] = []
        for eps in epsilons:
            n_seeds = 1 if math.isinf(eps) else seeds  # the non-private fit is deterministic
            accs = [factory(eps, delta, parent, accounting, classes).fit(X_train, y_train)
                    .score(X_test, y_test) for _ in range(n_seeds)]
            res.accuracies[name].append(accs)
            bar.update(1)
        res.seconds[name] = time.perf_counter() - start
    bar.close()
    return res


def format_table(res: ProbeResults) -> str:
    """Markdown table: methods × ε, test accuracy in % as mean ± std over fits."""
    heads = (["method"] + [("ε=∞" if math.isinf(e) else f"ε={e:g}") for e in res.epsilons]
             + ["time (s)"])
    lines = ["| " + " | ".join(heads) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
    for name, accs in res.accuracies.items():
        cells = []
        for a in accs:
            mean, std = 100 * np.mean(a), 100 * np.std(a)
            cells.append(f"{mean:.1f}" if len(a) == 1 else f"{mean:.1f} ± {std:.1f}")
        row = [METHODS[name][0]] + cells + [f"{res.seconds.get(name, 0):.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_results(res: ProbeResults, path: str) -> None:
    """Accuracy vs ε (log axis) per method; the non-private value is a dashed line of the same
    colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    finite = [i for i, e in enumerate(res.epsilons) if not math.isinf(e)]
    for name in res.accuracies:
        mean, std = 100 * res.mean(name), 100 * res.std(name)
        if finite:
            xs = [res.epsilons[i] for i in finite]
            line = ax.errorbar(xs, mean[finite], yerr=std[finite], marker="o", capsize=3,
                               label=METHODS[name][0])
            color = line[0].get_color()
        else:
            color = None
        for i, e in enumerate(res.epsilons):
            if math.isinf(e):
                ax.axhline(mean[i], ls="--", lw=1, color=color)
    ax.set_xscale("log")
    ax.set_xlabel(f"ε (δ = {res.delta:g}); dashed: non-private")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(res.description or "DP linear probe", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
