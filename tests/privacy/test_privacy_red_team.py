"""Red-team attacks on the one promise that tests/privacy/test_privacy_under_attack.py does
not cover.

Same contract and harness (imported from that module): with noise 0 and SGD at lr 1, one step
on a batch WITH a crafted sample and on the same batch WITHOUT it, compared in float64::

    ratio = B·‖Δ(released)‖ / R  ≤  1 + 1e-6

or both runs refused (ValueError) before anything is released. A refusal that happens for one
batch and not for the other depends on the data and leaks the sample.

Each attack here released more than R (or made a refusal depend on the sample) on the tree it was
written against, each with its defense now:

1. The separability probe is a numerical test at the batch it is given. A sample that saturates
   the mixing op (softmax over the batch dimension: every other row's weight underflows to 0, so
   every gradient through it is exactly 0) or makes every row non-finite (a NaN input through a
   batch mean) leaves the probe nothing to compare. The batch flow
   (:mod:`private_engine.guards.batch_flow`) follows the ops rather than the values, so both
   batches are refused at the step, whatever the sample.
2. ``nn.Embedding(max_norm=...)`` renormalises, in place and without noise, the weight rows of
   the tokens a batch contains: the released parameters move with the sample. Refused.
3. ``engine.max_grad_norm`` (native) or ``optimizer.max_grad_norm`` (Opacus door) lowered while
   a logical batch is being accumulated: earlier physical batches were clipped to the old R,
   the step's noise and accounting use the new one. Refused.
4. A parameter made trainable after ``engine.attach`` is stepped with whatever ``.grad`` holds:
   after a stray ``loss.mean().backward()`` the raw gradient is released. The native step now
   checks the optimizer's parameters, as the Opacus door does.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, List

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine import opacus_compat
from test_privacy_under_attack import (
    DOOR_IDS,
    DOORS,
    FLOWS,
    MODES,
    B,
    CapturingSGD,
    Case,
    Mixer,
    R,
    Refused,
    assert_bounded,
    honest_vectors,
    large_vector_case,
    mse,
    opacus_objective,
    opacus_private,
    ratio,
    refused,
    released,
    run_pair,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore")]


# -- 1. blinding the separability probe ----------------------------------------------------------
def saturating_input(model: Mixer, level: float = 1e3) -> torch.Tensor:
    """An input whose first-layer output is ``level`` in every unit: in ``softmax(h, 0)`` the
    crafted row takes weight 1 in every column, every other row ``exp(-1000) = 0`` in float32,
    and the softmax's Jacobian ``s(δ - s)`` is exactly 0 for every row."""
    with torch.no_grad():
        w, b = model.l1.weight.double(), model.l1.bias.double()
        x = torch.linalg.solve(w, level * torch.ones(8, dtype=torch.float64) - b)
    return x.float()[None]


def saturated_softmax_case() -> Case:
    """The harness' ``Mixer("softmax-dim0")`` (refused on ordinary batches) and the saturating
    sample, target 0."""
    model = Mixer("softmax-dim0")
    return Case(model, honest_vectors(model), (saturating_input(model), torch.zeros(1, 4)))


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_saturating_sample_blinds_the_separability_probe(door, how):
    """``softmax(h, dim=0)`` inside the model: with the saturating sample every gradient reaching
    ``l1`` and the model input is exactly 0 in both passes of the numerical separability probe,
    which then has no verdict. The batch flow follows the softmax over the batch dimension
    whatever the values, so both batches are refused at the step."""
    case = saturated_softmax_case()
    assert_bounded(*run_pair(case, door, how), may_refuse=True,
                   what=f"saturated softmax(h, 0) {door}-{how}")


def two_native_steps(model: nn.Module, batches, mode: str) -> List[object]:
    """Two private steps of one native engine on a fresh copy of ``model``: the released
    tensors (or :class:`Refused`) of each."""
    model = copy.deepcopy(model)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    out: List[object] = []
    for x, t in batches:
        try:
            opt.step(loss=mse(model(x), t))
        except ValueError as e:
            out.append(Refused(e, "step"))
            continue
        out.append(released(model, opt))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_probe_blinded_once_lets_later_batches_mix(mode):
    """Step 1 runs on a batch that holds the saturating sample (the probe passes and marks the
    input signature probed). Step 2 runs on the honest batch with, and without, an ordinary
    large sample: the model mixes (softmax over the batch), and before the probe counted only
    batches whose gradients reach two samples, nothing checked it any more: one sample moved the
    second release by 1.54·R. The batch flow refuses both steps, whatever the data."""
    case = saturated_softmax_case()
    blind = case.with_sample
    big = large_vector_case().crafted
    honest = case.honest
    with_big = (torch.cat([honest[0], big[0]]), torch.cat([honest[1], big[1]]))
    first_w, second_w = two_native_steps(case.model, [blind, with_big], mode)
    _, second_wo = two_native_steps(case.model, [blind, honest], mode)
    assert isinstance(first_w, Refused)  # the blinding batch itself is refused
    assert_bounded(second_w, second_wo, may_refuse=True,
                   what=f"softmax(h, 0) after a blinded probe, {mode}")


#: (mix, door, how) where a NaN sample turns a refusal into a release (the Opacus door refuses
#: the centred model anyway: its probe starts from the outputs)
NAN_CASES = [("center", "native", m) for m in MODES] + \
    [("softmax-dim0", d, h) for d, h in DOORS]


@pytest.mark.parametrize("mix,door,how", NAN_CASES,
                         ids=[f"{m}-{d}-{h}" for m, d, h in NAN_CASES])
def test_non_finite_sample_hides_batch_mixing(mix, door, how):
    """A NaN input in a batch of a mixing model (``h - h.mean(0)``, ``softmax(h, 0)``): the mix
    spreads it to every row, the probe compares only finite rows (none), returns without a
    verdict, and the step goes on (every sample dropped: a release of zeros) — while the batch
    without the sample is refused. The batch flow refuses both: it follows the ops, not the
    values."""
    model = Mixer(mix)
    case = Case(model, honest_vectors(model), (torch.full((1, 8), math.nan), torch.zeros(1, 4)))
    assert_bounded(*run_pair(case, door, how), may_refuse=True,
                   what=f"NaN sample, {mix} {door}-{how}")


# -- 2. parameters written by the forward --------------------------------------------------------
class MaxNormEmbedding(nn.Module):
    """``Embedding(10, 16, max_norm=1) → Linear(16, 16)``: at initialisation every row has norm
    2.6–5.0, so the forward renormalises (in place, under no_grad) the rows of the tokens it
    sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 16, max_norm=1.0)
        self.head = nn.Linear(16, 16)

    def forward(self, ids):
        return self.head(self.emb(ids))


def release_with_params(model: nn.Module, x, t, door: str, how: str,
                        loss: Callable = mse) -> object:
    """One step through ``door`` on a fresh copy of ``model``: the parameters after the step
    (the released model) followed by the consumed gradients and buffers, or :class:`Refused`."""
    model = copy.deepcopy(model)
    opt = CapturingSGD(model.parameters())
    try:
        if door == "native":
            engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                                      noise_multiplier=0.0, clipping_mode=how)
            engine.attach(opt)
        else:
            out = opacus_private(opacus_compat.PrivacyEngine(accountant="rdp"), model, opt, how)
            handle, dp_opt = out[0], out[1]
    except ValueError as e:
        return refused(e, "construction", opt)
    try:
        if door == "native":
            opt.step(loss=loss(model(x), t))
        else:
            opacus_objective(out, how, handle(x), t, loss).backward()
            dp_opt.step()
    except ValueError as e:
        return refused(e, "step", opt)
    return [p.detach().double().clone() for p in model.parameters()] + released(model, opt)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_embedding_max_norm_renormalises_rows_in_the_forward(door, how):
    """The crafted sample uses token 9, which no honest sample uses: its forward rescales row 9
    of the embedding from norm 2.6 to 1 — a change of the released parameters of 1.6 (ratio
    ≈ 6.9 with B = 4, gradients included), outside the clipped sum and without noise.
    Expected: refused when the engine is built (as BatchNorm and InstanceNorm running
    statistics are), or within R.

    ``F.embedding`` calls ``torch.embedding_renorm_`` on the weight (``BufferGuard`` watches
    buffers, not parameters): ``EmbeddingRule.check`` refuses ``max_norm`` as it refuses
    ``sparse`` and ``scale_grad_by_freq``."""
    model = MaxNormEmbedding()
    g = torch.Generator().manual_seed(1)
    xh = torch.randint(0, 9, (3, 2), generator=g)  # tokens 0..8
    th = 0.1 * torch.randn(3, 2, 16, generator=g)
    xc, tc = torch.tensor([[9, 9]]), torch.zeros(1, 2, 16)
    with_run = release_with_params(model, torch.cat([xh, xc]), torch.cat([th, tc]), door, how)
    without_run = release_with_params(model, xh, th, door, how)
    assert_bounded(with_run, without_run, may_refuse=True,
                   what=f"Embedding(max_norm=1) {door}-{how}")


# -- 3. R lowered in the middle of a logical batch -----------------------------------------------
R_LOW = 0.25  # the threshold set between the two physical batches
LOGICAL = 2 * B  # two physical batches of (up to) B samples


def accumulate_then_lower_r(door: str, how: str, with_sample: bool) -> object:
    """Physical batch 1 (honest + the crafted sample, or honest alone) accumulated at R = 1,
    then R lowered to ``R_LOW``, then physical batch 2 (honest) and the step. The released
    gradient divided by the logical batch size ``2B`` in both doors."""
    case = large_vector_case()
    (hx, ht), (cx, ct) = case.honest, case.crafted
    x1 = torch.cat([hx, cx]) if with_sample else hx
    t1 = torch.cat([ht, ct]) if with_sample else ht
    model = copy.deepcopy(case.model)
    opt = CapturingSGD(model.parameters())
    try:
        if door == "native":
            engine = pe.PrivacyEngine(model, batch_size=LOGICAL, sample_size=10 * LOGICAL,
                                      max_grad_norm=R, noise_multiplier=0.0, clipping_mode=how)
            engine.attach(opt)
            opt.virtual_step(loss=mse(model(x1), t1))
            engine.max_grad_norm = R_LOW
            opt.step(loss=mse(model(hx), ht))
        else:
            out = opacus_private(opacus_compat.PrivacyEngine(accountant="rdp"), model, opt, how)
            handle, dp_opt = out[0], out[1]
            for i, (x, t) in enumerate([(x1, t1), (hx, ht)]):
                if i == 1:
                    dp_opt.max_grad_norm = R_LOW  # e.g. a clipping schedule applied per batch
                opacus_objective(out, how, handle(x), t).backward()
            dp_opt.step()  # divides by expected batch size B × 2 accumulated passes
    except ValueError as e:
        return refused(e, "step", opt)
    return released(model, opt)


R_DOORS = [("native", m) for m in MODES] + [("opacus", f) for f in FLOWS]


@pytest.mark.parametrize("door,how", R_DOORS, ids=[f"{d}-{h}" for d, h in R_DOORS])
def test_max_grad_norm_lowered_during_accumulation(door, how):
    """The step's noise is ``σ·R_LOW`` (and the accountant assumes sensitivity R_LOW), but the
    crafted sample, in the first physical batch, was clipped to R = 1: it moves the release by
    ``R/LOGICAL`` = 4·R_LOW/LOGICAL (ratio 4 measured against the step's R).

    The clipped sums are formed per physical batch with the R of that moment, so a change of R is
    refused while a logical batch is being accumulated: by ``PrivacyEngine.max_grad_norm``'s
    setter (native), and at the step when the R of the accumulated backward passes differs from
    the optimizer's (Opacus door)."""
    with_run = accumulate_then_lower_r(door, how, True)
    without_run = accumulate_then_lower_r(door, how, False)
    if not isinstance(with_run, Refused) and not isinstance(without_run, Refused):
        # measured against the step's threshold R_LOW (ratio() divides by R = 1)
        r = ratio(with_run, without_run, LOGICAL) / R_LOW
        assert r <= 1 + 1e-6, f"{door}-{how}: ratio against the step's R = {r:.6g} > 1"
    else:
        assert_bounded(with_run, without_run, may_refuse=True, what=f"R lowered {door}-{how}")


# -- 4. a parameter unfrozen after attach --------------------------------------------------------
def unfrozen_after_attach(mode: str, x: torch.Tensor, t: torch.Tensor) -> object:
    """The MLP with its first layer frozen when the engine is built and attached (the optimizer
    holds every parameter), then unfrozen (a fine-tuning schedule); the step follows a stray
    ``loss.mean().backward()``, as in non-private code."""
    model = copy.deepcopy(large_vector_case().model)
    model[0].requires_grad_(False)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=10 * B, max_grad_norm=R,
                              noise_multiplier=0.0, clipping_mode=mode)
    opt = CapturingSGD(model.parameters())
    engine.attach(opt)
    model[0].requires_grad_(True)
    try:
        losses = mse(model(x), t)
        losses.mean().backward(retain_graph=True)
        opt.step(loss=losses)
    except ValueError as e:
        return refused(e, "step", opt)
    return released(model, opt)


@pytest.mark.parametrize("mode", MODES)
def test_parameter_unfrozen_after_attach_is_released_unclipped(mode):
    """The unfrozen layer is not among ``engine.params``: the private step writes ``.grad`` of
    the engine's parameters only and lets the wrapped optimizer step every parameter that has a
    ``.grad`` — here the raw, unclipped mean gradient (ratio ≈ 53). The Opacus door refuses the
    same situation ("became trainable after make_private"); the native door should too (at the
    step, before anything is released), or clip it.

    The native step checks, as ``attach`` does, that every trainable parameter the optimizer
    updates is one the engine clips (``PrivacyEngine.check_optimizer``)."""
    case = large_vector_case()
    with_run = unfrozen_after_attach(mode, *case.with_sample)
    without_run = unfrozen_after_attach(mode, *case.honest)
    assert_bounded(with_run, without_run, may_refuse=True, what=f"unfrozen layer {mode}")
