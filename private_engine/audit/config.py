"""What an audit is asked (:class:`AuditConfig`) and what it finds (:class:`AuditResult`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Tuple, Union

from ..clipping.plan import CLIPPING_MODES, DEFAULT_CLIPPING_MODE
from .paths import PATHS

__all__ = ["AuditConfig", "AuditResult", "PathResult", "CONTROLS", "SCORES", "DIRECTIONS",
           "DOORS", "PATHS"]

#: positive controls: deliberately broken runs that a working audit must flag
CONTROLS = ("none", "noise_scaled", "clip_scaled")
#: canary scores from the per-step observations
SCORES = ("likelihood", "sum")
#: canary gradient directions
DIRECTIONS = ("dirac", "random")
#: the engine's front doors: ``PrivacyEngine(model, …)`` with ``optimizer.step(loss=…)``, or the
#: Opacus drop-in's ``make_private`` with ``loss.backward()``
DOORS = ("native", "opacus")


@dataclass
class AuditConfig:
    """An empirical privacy audit of the engine with gradient canaries (docs/audit.md).

    Training: a small MLP on ``data_size`` synthetic examples plus ``canaries`` canary rows,
    ``n = data_size + canaries`` rows in all, Poisson batches of expected size ``batch_size``
    (rate ``q = batch_size / n``; default ``n // 2``, q ≈ 1/2) for ``steps`` DP-SGD steps of
    the real engine at clipping norm ``max_grad_norm`` (R) and noise multiplier
    ``noise_multiplier`` (σ) or σ calibrated to ``epsilon`` at ``delta``. The canaries are split
    evenly over the clipping ``paths`` audited, each path with a canary head of its own kind
    (:mod:`private_engine.audit.paths`).

    Args:
        canaries: m, each included independently with probability 1/2, split evenly over
            ``paths``.
        paths: the clipping paths to audit: "all" (default, :data:`PATHS`) or names from it —
            e.g. those :func:`private_engine.audit.paths_of` finds in a model.
        door: "native" (``PrivacyEngine(model, …)``, ``optimizer.step(loss=…)``) or "opacus"
            (``private_engine.opacus_compat.PrivacyEngine().make_private(…)``,
            ``loss.mean().backward()``; its Poisson loader samples at ``1/len(loader)``, so
            ``batch_size`` must divide n).
        clipping_mode: the engine's clipping mode (native door; the Opacus door runs
            "bk_mixed").
        steps / batch_size / data_size: training length, expected batch (None: ``n // 2``),
            non-canary examples.
        epsilon / noise_multiplier: the claim, at most one: σ calibrated to ε by the
            accountant, or the ε of σ (neither: ε = 4).
        delta: δ of the claim and of the bound.
        max_grad_norm: R.
        accountant: "rdp", "prv" or "gdp".
        confidence: 1 − β of the lower bound.
        control: "none" (the engine as it is), "noise_scaled" (the engine run at σ/factor while
            ε is claimed for σ: too little noise) or "clip_scaled" (R·factor and σ/factor: the
            noise's standard deviation σR is as claimed but samples are clipped at factor·R).
        control_factor: the factor of the controls (100: a run 100× less private).
        score: "likelihood" (per-step log-likelihood ratio of included vs excluded) or "sum"
            (``⟨θ₀ − θ_T, u_i⟩``: the final model's white-box score).
        directions: "dirac" (each canary owns one coordinate of the canary head: orthogonal) or
            "random" (random unit rank-one directions ``c_i v_iᵀ`` of a wider head).
        guess_fractions: the guessing rules tried on all canaries together: for each f,
            ``k₊ = k₋ = round(f·m)`` (top and bottom scores).
        path_guess_fractions: the rules tried on each path's canaries alone (with more than one
            path): ``k₊ = k₋ = round(f·m_p)``. The rules on all canaries share β/2 and the
            per-path rules the other β/2, each rule tested at its share (a union bound: the best
            bound holds at confidence 1 − β); with one path its rules share all of β.
        canary_scale: a canary's gradient norm before clipping, in units of the clipping norm
            (so the engine clips it to exactly R along its direction).
        seed: seeds the data, the model's initialisation, the canaries' inclusion and
            directions; never the engine's noise or its Poisson sampling (secret, OS entropy).
        lr: SGD learning rate (no momentum, no weight decay: the update is the noisy gradient).
        progress: a tqdm bar over the steps.
    """

    canaries: int = 1000
    paths: Union[str, Tuple[str, ...]] = "all"
    door: str = "native"
    clipping_mode: str = DEFAULT_CLIPPING_MODE
    steps: int = 20
    batch_size: Optional[int] = None
    data_size: int = 1000
    epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: str = "rdp"
    confidence: float = 0.95
    control: str = "none"
    control_factor: float = 100.0
    score: str = "likelihood"
    directions: str = "dirac"
    guess_fractions: Tuple[float, ...] = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
    path_guess_fractions: Tuple[float, ...] = (0.2, 0.4)
    canary_scale: float = 1000.0
    seed: int = 0
    lr: float = 0.5
    progress: bool = False

    #: the claimed ε when neither epsilon nor noise_multiplier is given
    DEFAULT_EPSILON = 4.0

    @property
    def target_epsilon(self) -> Optional[float]:
        """The ε σ is calibrated to (None when σ is given)."""
        if self.noise_multiplier is not None:
            return None
        return self.DEFAULT_EPSILON if self.epsilon is None else self.epsilon

    @property
    def path_names(self) -> Tuple[str, ...]:
        """The audited paths, in :data:`PATHS` order."""
        if self.paths == "all":
            return PATHS
        names = (self.paths,) if isinstance(self.paths, str) else tuple(self.paths)
        unknown = [p for p in names if p not in PATHS]
        if unknown or not names:
            raise ValueError(f"paths must be 'all' or names from {PATHS}, got {self.paths!r}.")
        return tuple(p for p in PATHS if p in names)

    @property
    def sample_size(self) -> int:
        """n: the examples and the canary rows (included or not)."""
        return self.data_size + self.canaries

    @property
    def logical_batch_size(self) -> int:
        """B: ``batch_size``, or ``n // 2`` when it is None."""
        return self.batch_size if self.batch_size is not None else max(1, self.sample_size // 2)

    def validate(self) -> "AuditConfig":
        """Raise ValueError on an option out of range; return self."""
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ValueError("give epsilon or noise_multiplier, not both.")
        for name in ("canaries", "steps", "batch_size"):
            value = getattr(self, name)
            if name == "batch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.door not in DOORS:
            raise ValueError(f"door must be one of {DOORS}, got {self.door!r}.")
        if self.clipping_mode not in CLIPPING_MODES:
            raise ValueError(f"clipping_mode must be one of {CLIPPING_MODES}, got "
                             f"{self.clipping_mode!r}.")
        if self.door == "opacus" and self.clipping_mode != "bk_mixed":
            raise ValueError("the Opacus door clips in mode 'bk_mixed' only, got "
                             f"clipping_mode={self.clipping_mode!r}.")
        if self.door == "opacus" and self.sample_size % self.logical_batch_size:
            raise ValueError(f"the Opacus door samples at rate 1/len(loader): batch_size "
                             f"({self.logical_batch_size}) must divide the {self.data_size} "
                             f"examples + {self.canaries} canaries.")
        if isinstance(self.data_size, bool) or not isinstance(self.data_size, int) \
                or self.data_size < 0:
            raise ValueError(f"data_size must be an integer ≥ 0, got {self.data_size!r}.")
        if self.logical_batch_size > self.sample_size:
            raise ValueError(f"batch_size ({self.batch_size}) exceeds the {self.data_size} "
                             f"examples + {self.canaries} canaries.")
        if self.epsilon is not None and not 0 < self.epsilon < math.inf:
            raise ValueError(f"epsilon must be a positive finite number, got {self.epsilon}.")
        if self.noise_multiplier is not None and not 0 < self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be > 0, got {self.noise_multiplier}.")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}.")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}.")
        if not 0 < self.max_grad_norm < math.inf:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}.")
        if self.control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {self.control!r}.")
        if not self.control_factor >= 1:
            raise ValueError(f"control_factor must be ≥ 1, got {self.control_factor}.")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}.")
        if self.directions not in DIRECTIONS:
            raise ValueError(f"directions must be one of {DIRECTIONS}, got {self.directions!r}.")
        for name in ("guess_fractions", "path_guess_fractions"):
            fractions = getattr(self, name)
            if not fractions or not all(0 < f <= 0.5 for f in fractions):
                raise ValueError(f"{name} must be fractions in (0, 0.5], got {fractions!r}.")
        if not self.canary_scale > 1:
            raise ValueError(f"canary_scale must be > 1, got {self.canary_scale}.")
        if self.canaries < 2 * len(self.path_names):
            raise ValueError(f"canaries must be at least 2 per path audited "
                             f"({2 * len(self.path_names)}), got {self.canaries}.")
        return self


@dataclass
class PathResult:
    """One path's canaries judged alone: its best rule's bound (each per-path rule is tested at
    its share of β/2) and guesses. ``epsilon_reach``: the bound its rules give when every guess
    is right (at the run's δ) — what the path shows when its clipping is broken, so a path
    broken alone is flagged only where ``epsilon_reach`` exceeds the claimed ε."""

    path: str
    canaries: int
    included: int
    epsilon_lower: float
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    epsilon_reach: float


@dataclass
class AuditResult:
    """The outcome of :func:`private_engine.audit.run_audit`.

    ``epsilon_lower`` is a lower bound on the ε of the run at ``delta``, valid with probability
    ``confidence`` over the run's randomness: the best of the guessing rules tried on all canaries
    together and on each path's canaries alone (``rule``: "all" or the path's name), each tested
    at its share of β. ``epsilon_claimed`` is the accountant's ε for the σ claimed. ``verdict``:
    "consistent" when ``epsilon_lower ≤ epsilon_claimed``, otherwise "VIOLATION: empirical
    ε_lower > claimed ε"; ``flagged_paths`` names the paths whose own canaries refute the claim.
    """

    epsilon_lower: float
    epsilon_claimed: float
    delta: float
    confidence: float
    #: m, the canaries included (|S = +1|), the guesses r = k₊ + k₋ and the correct ones v
    canaries: int
    included: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    verdict: str
    #: the best bound any r guesses could give (all right, δ = 0) at the same β per rule
    epsilon_ceiling: float
    control: str
    control_factor: float
    #: σ and R claimed, and those the engine ran with (different under a control)
    noise_multiplier: float
    max_grad_norm: float
    run_noise_multiplier: float
    run_max_grad_norm: float
    sample_rate: float
    steps: int
    score: str
    directions: str
    #: mean cross-entropy of the non-canary examples in the first and last batch
    first_loss: float
    last_loss: float
    seconds: float
    #: the canaries' scores and inclusion bits (not printed)
    scores: Optional[list] = field(default=None, repr=False)
    inclusion: Optional[list] = field(default=None, repr=False)
    #: the audited paths, the door and clipping mode of the run, the rule of the best bound
    #: ("all": the rules on every canary; else a path's name), the rules tested in all
    paths: Tuple[str, ...] = ("linear",)
    door: str = "native"
    clipping_mode: str = DEFAULT_CLIPPING_MODE
    rule: str = "all"
    rules: int = 0
    #: each path's canaries judged alone (empty with one path)
    path_results: list = field(default_factory=list)

    @property
    def violation(self) -> bool:
        return self.epsilon_lower > self.epsilon_claimed

    @property
    def path_reach(self) -> Optional[float]:
        """The smallest ``epsilon_reach`` over the paths (None with one path): a single broken
        path can be flagged only where this exceeds the claimed ε."""
        return min((r.epsilon_reach for r in self.path_results), default=None)

    @property
    def flagged_paths(self) -> Tuple[str, ...]:
        """The paths whose own canaries give a bound above the claimed ε."""
        return tuple(r.path for r in self.path_results
                     if r.epsilon_lower > self.epsilon_claimed)

    def summary(self) -> str:
        """One line: the verdict, both ε, the guesses and the run."""
        control = ("" if self.control == "none"
                   else f" control={self.control}×{self.control_factor:g}")
        on = "" if self.rule == "all" else f" on the {self.rule} canaries"
        flagged = (f"; flagged paths: {', '.join(self.flagged_paths)}" if self.flagged_paths
                   else "")
        reach = self.path_reach
        if reach is not None and reach <= self.epsilon_claimed and not self.violation:
            flagged += (f"; one path's canaries reach at most ε={reach:.2f}: a path broken alone "
                        "would not be flagged at this size")
        paths = ("" if len(self.paths) == 1 and self.paths[0] == "linear"
                 else f", {len(self.paths)} paths")
        run = "" if self.door == "native" else f" door={self.door}"
        run += "" if self.clipping_mode == DEFAULT_CLIPPING_MODE else f" mode={self.clipping_mode}"
        return (f"{self.verdict}: ε_lower={self.epsilon_lower:.3f} claimed ε="
                f"{self.epsilon_claimed:.3f} δ={self.delta:.3g} ({self.confidence:.0%} "
                f"confidence; {self.correct}/{self.guesses} correct guesses{on}, "
                f"k+={self.k_plus} k-={self.k_minus}, {self.canaries} canaries{paths}, ceiling "
                f"{self.epsilon_ceiling:.2f}{flagged}; σ={self.noise_multiplier:.4g} "
                f"R={self.max_grad_norm:g} q={self.sample_rate:.3g} steps={self.steps}"
                f"{run}{control}; {self.seconds:.1f} s)")

    def as_dict(self) -> dict:
        """The fields without the per-canary arrays."""
        d = asdict(self)
        d.pop("scores")
        d.pop("inclusion")
        return d
