"""LayerNorm per-sample gradients instantiated together at the end of a norm pass
(LayerNormGradStack) are, layer by layer, those of LayerNormRule.per_sample_grads, bit for bit."""
import torch
from torch import nn

import private_engine.layers.norm_stack as norm_stack
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
    monkeypatch.setattr(norm_stack, "HELD_ELEMENTS", a.numel() + g.numel())
    assert LayerNormRule().defer_per_sample_grads(m, [(a, g)], stack)
    assert not LayerNormRule().defer_per_sample_grads(m, [(a, g)], stack)  # over the budget
    assert not LayerNormRule().defer_per_sample_grads(m, [(a, g), (a, g)], stack)
    rms = nn.RMSNorm(8)
    assert not RMSNormRule().defer_per_sample_grads(rms, [(a, g)], stack)
    assert len(stack) == 1


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
