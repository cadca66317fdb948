"""The separability probe's backward passes are a fixed sequence: their number (which tensor hooks
of the model see, one call per pass) does not depend on any sample's data, in every dtype; and
which batches run them is a function of the input signatures alone (the first ``probed_steps``
checked batches of each), not of a verdict, a sample's values or the batch size.

A model hook with a side effect (a ``.data`` write at every backward) makes the state after the
step depend on how many backward passes ran; a pass count that follows the data (a rescaled pass
run only when the batch's largest gradient is small, a retry when a weighted pass overflows) lets
one sample change what the other samples release.
"""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from private_engine.guards.separability import (
    BatchMixingError,
    SeparabilityProbe,
    probed_at,
)

pytestmark = pytest.mark.usefixtures("one_thread")

D, H, B = 6, 8, 8
#: backward passes of one probe: plain and weighted; float16 adds the plain pass rescaled
PASSES = {torch.float32: 2, torch.bfloat16: 2, torch.float16: 3}


class Amplified(nn.Module):
    """``b(mix(relu(a(x))·2⁻¹⁰)·2¹⁰)``: the gradient between the two products is 2¹⁰ times the
    compared ones (the outputs of ``a`` and ``b``, the input). A hook on the hidden tensor counts
    the backward passes, as model code sees them."""

    def __init__(self, mix=lambda h: h):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, H)
        self.mix = mix
        self.backwards = 0

    def forward(self, x):
        h = torch.relu(self.a(x)) * 2.0 ** -10
        if h.requires_grad:
            h.register_hook(self._count)
        return self.b(self.mix(h) * 2.0 ** 10)

    def _count(self, g):
        self.backwards += 1


def probe_passes(model: Amplified, x: torch.Tensor, y: torch.Tensor, dtype) -> int:
    """One probe on the per-sample losses ``⟨b(...)_j, y_j⟩`` (gradient ``y_j`` at ``b``'s
    output): the backward passes it ran. Raises BatchMixingError as the probe does."""
    model = model.to(dtype)
    probe = SeparabilityProbe(model)
    probe._gen.manual_seed(0)  # the same weights at every run
    probe.install()
    targets = []
    for name in ("a", "b"):
        getattr(model, name).register_forward_hook(
            lambda m, i, o, name=name: targets.append((name, get_gradient_edge(o))))
    out = model(x.to(dtype))
    assert probe.pending
    model.backwards = 0
    probe.check((out * y.to(dtype)).sum(1), targets)
    assert not probe.pending
    return model.backwards


def targets(dtype, crafted: float):
    """Output gradients ``y``: 2⁻¹² (float16: deep in the subnormal range after the hidden
    2⁻¹⁰) for honest samples, ``crafted`` for the last one."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(B, H, generator=g) * 2.0 ** -12
    y[-1] = crafted * torch.sign(torch.randn(H, generator=g))
    return y


#: one sample's output gradient: like the others', tiny, and huge for the dtype (2¹⁰ times that
#: between the products is still finite in the plain pass, not with weights 2¹ to 2⁷)
CRAFTED = {
    torch.float16: (2.0 ** -12, 2.0 ** -20, 2.0 ** 4),
    torch.bfloat16: (2.0 ** -12, 1e-30, 1e35),
    torch.float32: (2.0 ** -12, 1e-30, 1e35),
}


@pytest.mark.parametrize("dtype", list(CRAFTED), ids=str)
def test_the_number_of_backward_passes_does_not_depend_on_a_sample(dtype):
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    counts = [probe_passes(Amplified(), x, targets(dtype, c), dtype) for c in CRAFTED[dtype]]
    assert counts == [PASSES[dtype]] * len(counts), f"{dtype}: passes {counts}"


@pytest.mark.parametrize("crafted", [2.0 ** -12, 2.0 ** 4], ids=["tiny", "huge"])
def test_float16_with_large_gradients_between_the_compared_points_still_sees_mixing(crafted):
    """The common float16 scale keeps the gradient between the two products (2¹⁰ times the
    compared ones) finite, without a retry: mixing is named, the honest model accepted."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    y = targets(torch.float16, crafted)
    assert probe_passes(Amplified(), x, y, torch.float16) == PASSES[torch.float16]
    with pytest.raises(BatchMixingError, match="flip over dim 0"):
        probe_passes(Amplified(lambda h: h.flip(0)), x, y, torch.float16)


# -- which batches run the probe: a function of the input signatures alone ---------------------
def honest_targets(n: int = B) -> torch.Tensor:
    """Output gradients of ``n`` honest samples (those of :func:`targets` without the crafted
    one)."""
    return targets(torch.float32, 2.0 ** -12)[:n]


def without_verdict(kind: str):
    """A first batch ``(x, y)`` that leaves the probe without a verdict: a sample whose gradient
    is infinite, or finite at the output and overflowing inside the model (the engine drops such
    a sample and releases the rest), a batch whose other samples have zero output gradients
    (every point reaches one sample), a batch of one."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    y = honest_targets()
    if kind == "infinite gradient":
        y[-1] = float("inf")
    elif kind == "overflowing gradient":
        y[-1] = 3e38  # finite, its gradient inside the model is not
    elif kind == "others' gradients zero":
        y[:-1] = 0.0
    else:  # one sample
        x, y = x[:1], y[:1]
    return x, y


def passes_per_step(model: Amplified, probe: SeparabilityProbe, batches, caught=None) -> list:
    """One probed step per batch ``(x, y)`` (forward, per-sample losses ``⟨b(...)_j, y_j⟩``,
    check): the backward passes the model's hook saw at each. The warnings' messages go to
    ``caught``."""
    seen = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for x, y in batches:
            edges = []
            hooks = [getattr(model, n).register_forward_hook(
                lambda m, i, o, n=n: edges.append((n, get_gradient_edge(o)))) for n in "ab"]
            out = model(x)
            for h in hooks:
                h.remove()
            model.backwards = 0
            probe.check((out * y).sum(1), edges)
            seen.append(model.backwards)
    if caught is not None:
        caught += [str(w.message) for w in records]
    return seen


def schedule(first, K: int = 1, steps: int = 3, mix=lambda h: h, caught=None) -> list:
    """The backward passes at each of ``steps`` steps of one signature: ``first`` then honest
    batches, on a fresh model and probe with ``probed_steps=K`` (warnings to ``caught``)."""
    model = Amplified(mix)
    probe = SeparabilityProbe(model, **({"probed_steps": K} if K != 1 else {}))
    probe.install()
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(2))
    return passes_per_step(model, probe, [first] + [(x, honest_targets())] * (steps - 1),
                           caught)


KINDS = ["infinite gradient", "overflowing gradient", "others' gradients zero", "one sample"]
#: the passes at the first nine forwards of a signature: probes at n = 1, 4, 8 (K = 1)
HONEST_SCHEDULE = [2, 0, 0, 2, 0, 0, 0, 2, 0]


def test_probed_forwards_are_the_first_K_then_powers_of_two_from_4():
    """13 probes of a signature over 10,000 forwards with K = 1, 15 with K = 3."""
    assert [n for n in range(1, 10_001) if probed_at(n)] == [1] + [2 ** j for j in range(2, 14)]
    assert sum(probed_at(n, 3) for n in range(1, 10_001)) == 15


@pytest.mark.parametrize("kind", KINDS)
def test_whether_a_batch_is_probed_does_not_depend_on_a_sample_and_lasts(kind):
    """Nine forwards of one signature, the first batch honest or one without a verdict: the
    backward passes at every step are the same, and the probe comes back at the 4th and the 8th
    forward (a model that changes after its first steps is probed again)."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    honest = schedule((x, honest_targets()), steps=9)
    assert honest == HONEST_SCHEDULE
    assert schedule(without_verdict(kind), steps=9) == honest, kind


@pytest.mark.parametrize("kind", KINDS)
def test_probed_steps_probes_the_first_K_batches_whatever_their_outcome(kind):
    """``probed_steps=2``: the first two forwards of the signature run the probe, with or
    without a verdict at the first; then the 4th and the 8th."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    want = [2, 2, 0, 2, 0, 0, 0, 2, 0]
    assert schedule((x, honest_targets()), K=2, steps=9) == want
    assert schedule(without_verdict(kind), K=2, steps=9) == want, kind


class BackwardMean(torch.autograd.Function):
    """The identity in the forward; its backward adds the batch mean of the gradient to every
    row (mixing in the backward only: the batch flow, which follows the forward, cannot see it)."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True)


class BackwardRoll(torch.autograd.Function):
    """The identity in the forward; its backward adds row m - 1's gradient to row m: a
    non-finite row spreads to one other row only."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.roll(1, 0)


def first_refusal(first, mix, steps: int = 9):
    """The step (1-based) at which the probe refuses ``mix`` (None: never), the first batch
    ``first`` and honest batches after it, as in :func:`schedule`."""
    model = Amplified(mix)
    probe = SeparabilityProbe(model)
    probe.install()
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(2))
    batches = [first] + [(x, honest_targets())] * (steps - 1)
    for step, batch in enumerate(batches, 1):
        try:
            passes_per_step(model, probe, [batch])
        except BatchMixingError as e:
            assert "BackwardMean" in str(e) or "BackwardRoll" in str(e), str(e)
            return step
    return None


#: the last sample's output gradient: infinite, huge, subnormal, and the step at which mixing
#: in the backward is refused: an infinite gradient averaged into every row leaves no row to
#: compare below the mix (the probe at the 4th forward sees it), the others show it at once
CRAFTED_FIRST = {"inf": (float("inf"), 4), "1e30": (1e30, 1), "subnormal": (1e-40, 1)}


@pytest.mark.parametrize("crafted", list(CRAFTED_FIRST))
def test_mixing_in_the_backward_only_is_refused_at_a_probed_step_whatever_the_first_batch(
        crafted):
    """A custom ``autograd.Function`` whose backward adds the batch mean: refused at the first
    probed step whose honest samples can show it, whatever one crafted sample in the first
    batch holds; a backward that spreads one row to one other leaves the others to show it."""
    value, step = CRAFTED_FIRST[crafted]
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    assert first_refusal((x, honest_targets()), BackwardMean.apply) == 1
    y = honest_targets()
    y[-1] = value
    assert first_refusal((x, y), BackwardMean.apply) == step, crafted
    assert first_refusal((x, y), BackwardRoll.apply) == 1, crafted


@pytest.mark.parametrize("kind", ["infinite gradient", "overflowing gradient"])
def test_a_batch_is_judged_on_the_rows_that_are_finite(kind):
    """A separable model, one sample whose gradient is not finite: the other samples are
    compared at every point, so the probe has a verdict (no warning, none of the points
    unseen)."""
    model = Amplified()
    probe = SeparabilityProbe(model)
    probe.install()
    caught: list = []
    passes_per_step(model, probe, [without_verdict(kind)], caught)
    assert caught == []
    (record,) = probe.records.values()
    assert (record.probes, record.verdicts, record.unseen) == (1, 1, {}), record


def warnings_and_logs(batches, caplog) -> list:
    """Nine forwards of one signature on a separable model: the warnings' messages and the log
    records at INFO and above."""
    model = Amplified()
    probe = SeparabilityProbe(model)
    probe.install()
    caught: list = []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="private_engine"):
        passes_per_step(model, probe, batches, caught)
    return caught + [r.getMessage() for r in caplog.records]


def test_a_crafted_sample_in_or_out_of_the_probed_batches_leaves_the_same_warnings(caplog):
    """The probe's warnings and INFO records are the same whether a sample whose gradient is
    not finite is in every probed batch or not, for a separable model (nothing) and for one
    whose batches are of one sample (the structural warning after three probes)."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    honest = [(x, honest_targets())] * 9
    crafted = [without_verdict("infinite gradient")] * 9
    assert warnings_and_logs(honest, caplog) == warnings_and_logs(crafted, caplog) == []
    one = [(x[:1], honest_targets(1))] * 9
    two = [(x[:2], torch.cat([honest_targets(1), torch.full((1, H), float("inf"))]))] * 9
    told = warnings_and_logs(one, caplog)
    assert len(told) == 1 and "fewer than two samples" in told[0], told
    assert warnings_and_logs(two, caplog) == told


def test_probed_steps_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="probed_steps must be an integer >= 1"):
        SeparabilityProbe(Amplified(), probed_steps=0)


def test_the_schedule_follows_the_input_shapes_not_the_values_or_the_batch_size():
    """Which steps run the probe is a function of the input signatures (shapes other than the
    batch size, dtypes, devices, train/eval): a new sequence length is probed at its first batch
    — under padding to the longest sample of each batch, one sample's length sets it, as it sets
    the shape the model's own forward receives — and batch sizes and values change nothing."""

    class Tokens(Amplified):
        def forward(self, x):  # (B, T, D) -> (B, H)
            return super().forward(x).mean(1)

    def run(lengths, sizes, seed):
        g = torch.Generator().manual_seed(seed)
        model = Tokens()
        probe = SeparabilityProbe(model)
        probe.install()
        batches = [(torch.randn(n, T, D, generator=g) * 10.0 ** seed,
                    torch.randn(n, H, generator=g)) for T, n in zip(lengths, sizes)]
        return passes_per_step(model, probe, batches)

    lengths = [3, 3, 5, 3, 5, 7]
    want = [2, 0, 2, 0, 0, 2]
    assert run(lengths, [8] * 6, 0) == want
    assert run(lengths, [1, 5, 2, 8, 3, 4], 3) == want
