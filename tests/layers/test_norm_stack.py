"""LayerNorm per-sample gradients instantiated together at the end of a norm pass, or in groups when
the held operands reach their budget (LayerNormGradStack), are, layer by layer, those of
LayerNormRule.per_sample_grads, bit for bit."""
import pytest
import torch
from torch import nn

import private_engine.layers.norm_stack as norm_stack
from engine_checks import check_against_reference, gen_for
from private_engine.layers.norm_stack import LayerNormGradStack
from private_engine.layers.normalization import LayerNormRule, RMSNormRule


def _layers():
    torch.manual_seed(0)
    out = []
    for width, bias, eps in [(8, True, 1e-5), (8, True, 1e-5), (8, False, 1e-5), (8, True, 1e-6),
                             (6, True, 1e-5)]:
        m = nn.LayerNorm(width, eps=eps, bias=bias)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
        a, g = torch.randn(3, 4, width) * 3 + 1, torch.randn(3, 4, width)
        a[1, 2] = 1e30  # crafted: a row whose variance overflows (NaN gradients, dropped)
        a[2, 1] = 1e-40  # subnormal
        out.append((m, a, g))
    out[1][0].weight.requires_grad_(False)
    return out


def test_stacked_layer_norm_grads_equal_the_rule_bit_for_bit():
    rule = LayerNormRule()
    layers = _layers()
    stack = LayerNormGradStack()
    for m, a, g in layers:
        assert rule.defer_per_sample_grads(m, [(a, g)], stack)
    taken = stack.take()
    assert len(stack) == 0 and [m for m, _ in taken] == [m for m, _, _ in layers]
    for (m, a, g), (_, grads) in zip(layers, taken):
        expected = rule.per_sample_grads(m, [(a, g)])
        assert grads.keys() == expected.keys()
        for name in expected:
            assert torch.allclose(grads[name], expected[name], rtol=0, atol=0,
                                  equal_nan=True), name


def test_layer_norms_beyond_the_budget_or_of_other_rules_are_instantiated_at_once(monkeypatch):
    m, a, g = _layers()[0]
    stack = LayerNormGradStack()
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", a.numel() + g.numel() - 1)
    assert not LayerNormRule().defer_per_sample_grads(m, [(a, g)], stack)  # over the budget
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", a.numel() + g.numel())
    assert LayerNormRule().defer_per_sample_grads(m, [(a, g)], stack)
    assert not LayerNormRule().defer_per_sample_grads(m, [(a, g), (a, g)], stack)
    rms = nn.RMSNorm(8)
    assert not RMSNormRule().defer_per_sample_grads(rms, [(a, g)], stack)
    assert len(stack) == 1


@pytest.mark.parametrize("fit", [1, 2, 3])
def test_layers_held_beyond_the_budget_are_instantiated_in_groups_bit_for_bit(monkeypatch, fit):
    """When the next layer would exceed HELD_ELEMENTS, the layers held so far are instantiated
    (stacked) at once and the stack starts again: every layer is taken, in order, with the rule's
    gradients bit for bit (crafted rows included), and at most ``fit`` layers' operands are held
    (one set of operations per group and key)."""
    rule = LayerNormRule()
    layers = _layers()
    _, a, g = layers[0]
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", fit * (a.numel() + g.numel()))
    stacked = []
    own = norm_stack._instantiate

    def spy(module, As, Gs, names):
        stacked.append(len(As))
        return own(module, As, Gs, names)

    monkeypatch.setattr(norm_stack, "_instantiate", spy)
    stack = LayerNormGradStack()
    for m, a, g in layers:
        assert rule.defer_per_sample_grads(m, [(a, g)], stack)
        assert len(stack._pending) <= fit
    assert len(stack) == len(layers)
    taken = stack.take()
    assert len(stack) == 0 and [m for m, _ in taken] == [m for m, _, _ in layers]
    for (m, a, g), (_, grads) in zip(layers, taken):
        expected = rule.per_sample_grads(m, [(a, g)])
        assert grads.keys() == expected.keys()
        for name in expected:
            assert torch.equal(grads[name].nan_to_num(7.0), expected[name].nan_to_num(7.0)), name
    assert max(stacked) <= fit and sum(stacked) == len(layers)


def _ln_model(depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(depth):
        blocks += [nn.Linear(16, 16), nn.LayerNorm(16)]
        with torch.no_grad():
            blocks[-1].weight.uniform_(0.5, 1.5)
            blocks[-1].bias.uniform_(-0.5, 0.5)
    return nn.Sequential(*blocks, nn.Linear(16, 2))


@pytest.mark.parametrize("fit", [1, 2])
def test_layer_norms_in_groups_match_the_float64_reference(monkeypatch, fit):
    """The engine with LayerNorm gradients instantiated in groups of ``fit`` layers (float64
    model, 5 positions): certified norms and clipped sums equal the one-sample-at-a-time float64
    reference."""
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", fit * 2 * 6 * 5 * 16)
    stacked = []
    own = norm_stack._instantiate

    def spy(module, As, Gs, names):
        stacked.append(len(As))
        return own(module, As, Gs, names)

    monkeypatch.setattr(norm_stack, "_instantiate", spy)
    model = _ln_model().double()
    x = torch.randn(6, 5, 16, generator=gen_for(7), dtype=torch.float64)
    check_against_reference(model, [x], lambda m, x: m(x).pow(2).sum((1, 2)), mode="bk_mixed",
                            clip="abadi")
    assert stacked[:2] == ([1, 1] if fit == 1 else [2, 1]), stacked  # the groups of one step


def test_large_layer_norms_on_the_cpu_are_instantiated_at_once():
    """On the CPU a layer whose operand exceeds CPU_LAYER_ELEMENTS is not stacked (the copy into
    the stacked operands costs more there than the operations it saves)."""
    m = nn.LayerNorm(64)
    a, g = torch.randn(2, 600, 64), torch.randn(2, 600, 64)
    assert a.numel() > norm_stack.CPU_LAYER_ELEMENTS
    stack = LayerNormGradStack()
    assert not LayerNormRule().defer_per_sample_grads(m, [(a, g)], stack)
    assert LayerNormRule().defer_per_sample_grads(m, [(a[:, :4], g[:, :4])], stack)
    assert len(stack) == 1
