"""DP-SGD warm-up via DP mean estimation (Algorithm 2, Definition 2.4 and Theorem 2.5 of Zhu &
Zhang, "Mean Estimation Strikes Back! An Efficient Solution to Private Classification").

1. Release class centres ``q_1..q_K`` with :class:`DPMeanEstimator` under (ε₁, δ₁)
   (Algorithm 1), on the features ``φ(x)`` of the *pre-trained* backbone (a frozen copy of the
   model).
2. Prior ``h(x) = (cos(φ(x), q_1), …, cos(φ(x), q_K))`` (divided by ``temperature``; 1 in the
   paper).
3. Full fine-tuning of the model with the privacy engine under (ε₂, δ₂) on the residual loss::

       L(x, y) = KL(e_y ‖ ½ softmax(g(x)) + ½ softmax(h(x)))
               = −log(½ softmax(g(x))_y + ½ softmax(h(x))_y)

   where g(x) are the model's logits. (Definition 2.4 writes
   ``ℓ_KL(softmax(g) + softmax(h); y)``; the ½ makes the mixture a distribution and only shifts
   the loss by log 2 — same gradients.)
4. Inference: ``argmax_j softmax(g(x))_j + softmax(h(x))_j``.

Privacy: step 1 is (ε₁, δ₁)-DP (analytic Gaussian); ``h`` is a post-processing of the released
centres applied per example, so each example's residual loss depends on that example only and the
engine's DP-SGD guarantee (ε₂, δ₂) holds; by basic composition the whole procedure is
(ε₁ + ε₂, δ₁ + δ₂)-DP (Theorem 2.5). ``WarmupResult.epsilon`` reports
``ε₁ + engine.get_epsilon(δ₂)``.
"""
from __future__ import annotations

import copy
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from ..clipping.plan import DEFAULT_CLIPPING_MODE
from ..foundation.randomness import entropy_seeded_generator, seeded_generator

log = logging.getLogger(__name__)
from ._row_clipping import normalize_rows
from .features import penultimate_features, saturating_float32
from .mean_estimator import DPMeanEstimator

__all__ = ["residual_loss", "WarmupClassifier", "WarmupResult", "warmup_finetune"]


def residual_loss(logits: torch.Tensor, prior_logits: torch.Tensor, target: torch.Tensor,
                  reduction: str = "none") -> torch.Tensor:
    """Zhu & Zhang Definition 2.4: ``−log(½ softmax(g)_y + ½ softmax(h)_y)`` per sample.

    Computed stably as ``−logsumexp(log_softmax(g)_y, log_softmax(h)_y) + log 2``.
    ``reduction``: "none" (per-sample vector, what the engine needs), "mean" or "sum".
    """
    lg = torch.log_softmax(logits, dim=1).gather(1, target[:, None]).squeeze(1)
    lh = (torch.log_softmax(prior_logits.to(logits.dtype), dim=1)
          .gather(1, target[:, None]).squeeze(1))
    loss = math.log(2.0) - torch.logaddexp(lg, lh)
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}.")


class WarmupClassifier(nn.Module):
    """``log(½ softmax(g(x)) + ½ softmax(h(x)))``: the warm-started classifier of Algorithm 2.

    ``model`` gives g(x); ``feature_extractor`` (frozen copy of the pre-trained model) gives φ(x)
    and ``centers`` the released unit-norm centres; ``h(x) = cos(φ(x), q)/temperature``.
    ``forward`` returns log-probabilities, so ``argmax`` is the paper's prediction rule.
    """

    def __init__(self, model: nn.Module, feature_extractor: nn.Module, centers: torch.Tensor,
                 temperature: float = 1.0, feature_fn: Optional[Callable] = None):
        super().__init__()
        self.model = model
        self.feature_extractor = feature_extractor
        self.register_buffer("centers", centers.detach().float().clone())
        self.temperature = float(temperature)
        self.feature_fn = feature_fn or penultimate_features

    def prior_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``h(x)/temperature`` with ``h(x)_j = cos(φ(x), q_j)``."""
        with torch.no_grad():
            self.feature_extractor.eval()
            phi = normalize_rows(saturating_float32(self.feature_fn(self.feature_extractor, x)))
        return phi @ self.centers.T / self.temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.log_softmax(self.model(x), dim=1)
        h = torch.log_softmax(self.prior_logits(x), dim=1).to(g.dtype)
        return torch.logaddexp(g, h) - math.log(2.0)


@dataclass
class WarmupResult:
    """Outcome of :func:`warmup_finetune`; ``epsilon``/``delta`` are the totals of Theorem 2.5.

    ``n_dropped_unknown_label``: records whose label is not in ``0..K−1``, dropped before both
    stages (and ``centres.n_dropped_nonfinite_``: records whose features are not finite, left
    out of the centres) — exact diagnostics of the private data, not part of the release.
    """

    classifier: WarmupClassifier
    centres: DPMeanEstimator
    engine: Any
    epsilon_centres: float
    delta_centres: float
    epsilon_train: float
    delta_train: float
    history: List[Dict[str, float]] = field(default_factory=list)
    n_dropped_unknown_label: int = 0

    @property
    def epsilon(self) -> float:
        return self.epsilon_centres + self.epsilon_train

    @property
    def delta(self) -> float:
        return self.delta_centres + self.delta_train


#: 32-bit words drawn from a parent generator to key each of the warm-up's generators (256 bits)
_KEY_WORDS = 8


def _dp_generator(parent: Optional[torch.Generator], device) -> torch.Generator:
    """A generator on ``device`` for one of the warm-up's private draws.

    Without ``parent``: :func:`~private_engine.foundation.randomness.entropy_seeded_generator` (its
    whole state from OS entropy). With one:
    :func:`~private_engine.foundation.randomness.seeded_generator` of a 256-bit key drawn from
    ``parent`` — a full MT19937 state (SHAKE-256 of the key) on the CPU, a 64-bit Philox key on CUDA
    — reproducible from the parent (which advances), and a separate generator for each draw it keys.
    """
    if parent is None:
        return entropy_seeded_generator(device)
    words = torch.randint(0, 1 << 32, (_KEY_WORDS,), generator=parent, dtype=torch.int64,
                          device=parent.device).cpu().tolist()
    key = sum(int(w) << (32 * i) for i, w in enumerate(words))
    return seeded_generator(key, device)


def _features_of(extractor: nn.Module, X: torch.Tensor, batch_size: int, device,
                 feature_fn) -> torch.Tensor:
    out = []
    extractor.eval()
    with torch.no_grad():
        for s in range(0, X.shape[0], batch_size):
            out.append(saturating_float32(feature_fn(extractor,
                                                     X[s:s + batch_size].to(device))).cpu())
    return torch.cat(out)


def warmup_finetune(model: nn.Module, X: torch.Tensor, y: torch.Tensor, *, epsilon_centres: float,
                    delta_centres: float, epsilon_train: float, delta_train: float,
                    epochs: int = 2, batch_size: int = 256,
                    physical_batch_size: Optional[int] = None, lr: float = 1e-3,
                    max_grad_norm: float = 1.0, temperature: float = 1.0, optimizer: str = "adam",
                    clipping_mode: str = DEFAULT_CLIPPING_MODE, clipping_fn: str = "abadi",
                    accountant: str = "rdp", feature_extractor: Optional[nn.Module] = None,
                    feature_fn: Optional[Callable] = None, device: Any = None,
                    seed: Optional[int] = None, progress: bool = True,
                    eval_data: Optional[tuple] = None,
                    generator: Optional[torch.Generator] = None) -> WarmupResult:
    """Zhu & Zhang Algorithm 2: DP class centres (ε₁, δ₁), then DP full fine-tuning on the
    residual loss (ε₂, δ₂).

    Args:
        model: the network to fine-tune; its outputs are the K logits g(x). Every trainable
            parameter must be supported by the engine (see ``private_engine.PrivacyEngine``).
        X, y: training inputs (N, …) and integer labels 0..K−1 (tensors); K, the model's
            output width, is the public label set. A record with another label is dropped
            (no error: it contributes nothing to either stage; N counts the others).
        epsilon_centres, delta_centres: (ε₁, δ₁) of the class centres (analytic Gaussian).
        epsilon_train, delta_train: (ε₂, δ₂) of DP-SGD; σ is calibrated by the engine's accountant
            for ``epochs`` epochs of Poisson sampling at rate ``batch_size/N``.
        epochs, batch_size, physical_batch_size, lr, max_grad_norm, clipping_mode, clipping_fn,
            accountant: DP fine-tuning settings (engine contract).
        temperature: h(x) is divided by it before the softmax (1 = Zhu & Zhang's setting).
        optimizer: "adam" or "sgd".
        feature_extractor: network giving φ(x) (default: a frozen deep copy of ``model`` as given,
            i.e. the pre-trained backbone); ``feature_fn(extractor, x)`` extracts the features
            (default: penultimate features, :func:`penultimate_features`).
        device: where to train (default: the model's device).
        seed: deprecated, no effect (a ``DeprecationWarning`` if given): seeding the centres'
            noise, the Poisson sampler and the engine's noise would make all three known to
            anyone who knew the seed; pass ``generator`` for a reproducible run.
        eval_data: optional ``(X_test, y_test)`` evaluated after each epoch (recorded in history).
        generator: source of the three random draws that the privacy guarantee needs secret:
            the centres' Gaussian noise, the Poisson batches and DP-SGD's noise. None (default):
            each comes from :func:`private_engine.foundation.randomness.entropy_seeded_generator`
            (state from OS entropy), independent of ``torch.manual_seed``. A ``torch.Generator``
            given keys a separate full-state generator for each from 256 bits of its draws
            (:func:`_dp_generator`; the centres and the engine then warn:
            ``ReproducibleRandomnessWarning``, ``ReproducibleNoiseWarning``); a seeded one
            reproduces the run, and makes that randomness known to whoever knows the seed
            (tests, debugging).

    Returns:
        :class:`WarmupResult` with the classifier, the fitted :class:`DPMeanEstimator`, the
        engine and the privacy spent: ``epsilon = ε₁ + engine.get_epsilon(δ₂)``,
        ``delta = δ₁ + δ₂``.
    """
    from tqdm.auto import tqdm

    import private_engine as pe

    from ..data import poisson_loader
    from ..training import private_logical_step

    if epochs < 1:
        raise ValueError(f"epochs must be ≥ 1, got {epochs}.")
    if seed is not None:
        warnings.warn(
            "warmup_finetune(seed=...) is deprecated and has no effect: a seed would make the "
            "centres' noise, the Poisson batches and DP-SGD's noise known to anyone who knows it. "
            "For a reproducible (non-private) run pass generator=torch.Generator().manual_seed(s).",
            DeprecationWarning, stacklevel=2)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}.")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
    X = torch.as_tensor(X)
    y = torch.as_tensor(y).long()
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} samples but y has {y.shape[0]}.")
    if device is None:
        param = next(iter(model.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
    device = torch.device(device)
    feature_fn = feature_fn or penultimate_features
    if feature_extractor is None:
        feature_extractor = copy.deepcopy(model)
    feature_extractor = feature_extractor.to(device).eval()
    for p in feature_extractor.parameters():
        p.requires_grad_(False)
    model = model.to(device)
    with torch.no_grad():  # the number of classes is the model's output width (public)
        was = model.training
        model.eval()
        n_classes = int(model(X[:1].to(device)).shape[1])
        model.train(was)
    # a record whose label is not in 0..K−1 contributes nothing (refusing it would reveal it)
    known = (y >= 0) & (y < n_classes)
    n_dropped = int((~known).sum())
    X, y = X[known], y[known]
    if X.shape[0] == 0:  # what remains is the empty data set
        raise ValueError(f"no record has a label in 0..{n_classes - 1} (the model has "
                         f"{n_classes} outputs): nothing to train on.")

    # 1. DP class centres on the pre-trained features (Algorithm 1, budget (ε1, δ1))
    phi = _features_of(feature_extractor, X, physical_batch_size or batch_size, device, feature_fn)
    # without a generator the estimator draws its own secret one (random_state=None)
    centres = DPMeanEstimator(epsilon=epsilon_centres, delta=delta_centres,
                              random_state=(None if generator is None
                                            else _dp_generator(generator, phi.device)),
                              classes=list(range(n_classes)))
    centres.fit(phi, y)
    q = centres.centers_.float()
    # 2. prior h(x_i) for every training example (post-processing of q, per example)
    H = (normalize_rows(phi) @ q.T) / temperature

    # 3. DP full fine-tuning on the residual loss (budget (ε2, δ2))
    dataset = torch.utils.data.TensorDataset(X, y, H)
    loader = poisson_loader(dataset, batch_size, generator=_dp_generator(generator, "cpu"))
    noise_generator = None if generator is None else _dp_generator(generator, device)
    engine = pe.PrivacyEngine(model, batch_size=batch_size, sample_size=len(dataset),
                              steps=epochs * len(loader), max_grad_norm=max_grad_norm,
                              target_epsilon=epsilon_train, target_delta=delta_train,
                              clipping_mode=clipping_mode, clipping_fn=clipping_fn,
                              accountant=accountant, noise_generator=noise_generator)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.Adam(params, lr=lr) if optimizer == "adam"
           else torch.optim.SGD(params, lr=lr))
    engine.attach(opt)
    classifier = WarmupClassifier(model, feature_extractor, q.to(device), temperature, feature_fn)
    history: List[Dict[str, float]] = []
    phys = physical_batch_size or batch_size
    try:
        for epoch in range(1, epochs + 1):
            model.train()
            total, count = 0.0, 0
            for xb, yb, hb in tqdm(loader, desc=f"warm-up epoch {epoch}/{epochs}",
                                   disable=not progress, leave=False):
                mean_loss = private_logical_step(
                    opt, (xb, hb, yb), lambda x, h, t: residual_loss(model(x), h, t), phys,
                    device=device)
                total, count = total + mean_loss * xb.shape[0], count + xb.shape[0]
            record = {"epoch": epoch, "train_loss": total / max(count, 1),
                      "epsilon_train": engine.get_epsilon(delta_train)}
            if eval_data is not None:
                record["test_accuracy"] = warmup_accuracy(classifier, *eval_data, batch_size=phys)
            history.append(record)
            log.info("warm-up epoch %d/%d: %s", epoch, epochs,
                     ", ".join(f"{k}={v:.4g}" for k, v in record.items() if k != "epoch"))
    finally:
        engine.detach()
    model.eval()
    eps_train = engine.get_epsilon(delta_train)
    eps_centres = centres.epsilon_ if centres.epsilon_ is not None else math.inf
    return WarmupResult(classifier, centres, engine, float(eps_centres), float(delta_centres),
                        float(eps_train), float(delta_train), history, n_dropped)


@torch.no_grad()
def warmup_accuracy(classifier: nn.Module, X: torch.Tensor, y: torch.Tensor,
                    batch_size: int = 256) -> float:
    """Top-1 accuracy of ``classifier`` (argmax of its outputs) on ``(X, y)``."""
    was = classifier.training
    classifier.eval()
    device = next(iter(classifier.parameters())).device
    correct = 0
    for s in range(0, X.shape[0], batch_size):
        out = classifier(X[s:s + batch_size].to(device))
        correct += int((out.argmax(1).cpu() == y[s:s + batch_size].cpu()).sum())
    classifier.train(was)
    return correct / max(X.shape[0], 1)
