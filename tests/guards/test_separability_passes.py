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

import warnings

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from private_engine.guards.separability import BatchMixingError, SeparabilityProbe

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


@pytest.mark.parametrize("kind", KINDS)
def test_whether_the_next_batch_is_probed_does_not_depend_on_a_sample(kind):
    """Three steps of one signature, the first batch honest or one without a verdict: the
    backward passes at every step are the same (the probe runs its two passes at the first
    step, a batch of one sample included, and never again)."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    honest = schedule((x, honest_targets()))
    assert honest == [2, 0, 0]
    assert schedule(without_verdict(kind)) == honest, kind


@pytest.mark.parametrize("kind", KINDS)
def test_probed_steps_probes_K_batches_whatever_their_outcome(kind):
    """``probed_steps=2``: the first two checked batches of the signature run the probe, with
    or without a verdict at the first; a third does not."""
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    assert schedule((x, honest_targets()), K=2) == [2, 2, 0]
    assert schedule(without_verdict(kind), K=2) == [2, 2, 0], kind


def test_mixing_hidden_by_a_crafted_first_batch_is_warned_and_seen_at_a_later_probed_step():
    """``h - h.mean(0)`` spreads one sample's infinite gradient to every row: the first probe
    compares nothing. With one probed step the signature is accepted with a warning that names
    what was not compared and what to do; with two, the second (honest) batch names the mix."""
    center = lambda h: h - h.mean(0)  # noqa: E731
    caught: list = []
    assert schedule(without_verdict("infinite gradient"), mix=center, caught=caught) == [2, 0, 0]
    assert len(caught) == 1 and "could not compare samples" in caught[0], caught
    assert "raise probed_steps" in caught[0]
    with pytest.raises(BatchMixingError, match="mean over dim 0"):
        schedule(without_verdict("infinite gradient"), K=2, mix=center)
    caught.clear()  # an honest first batch: a verdict, no warning
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    assert schedule((x, honest_targets()), caught=caught) == [2, 0, 0] and caught == []


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
