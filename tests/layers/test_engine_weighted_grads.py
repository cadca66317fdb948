"""``LayerRule.weighted_grads`` (book-keeping: Σ_i C_i ∂L_i/∂θ from recorded (a, g)) against a
per-sample loop."""
import pytest
import torch
from torch import nn

from private_engine.layers import find_rule


def weight_frozen(module):
    module.weight.requires_grad_(False)
    return module


CASES = [
    ("linear-3d", lambda: nn.Linear(5, 3),
     lambda g: torch.randn(4, 7, 5, generator=g, dtype=torch.float64)),
    # D < p: diag(C) scales the input A instead of G, the bias is Σ_i C_i Σ_t g_{i,t} from the
    # unscaled G
    ("linear-3d-widening", lambda: nn.Linear(3, 6),
     lambda g: torch.randn(4, 7, 3, generator=g, dtype=torch.float64)),
    ("linear-bias-only", lambda: weight_frozen(nn.Linear(3, 6)),
     lambda g: torch.randn(4, 7, 3, generator=g, dtype=torch.float64)),
    ("linear-2d-nobias", lambda: nn.Linear(5, 3, bias=False),
     lambda g: torch.randn(4, 5, generator=g, dtype=torch.float64)),
    ("conv2d-grouped", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2),
     lambda g: torch.randn(4, 4, 6, 6, generator=g, dtype=torch.float64)),
    ("conv1d-strided", lambda: nn.Conv1d(3, 2, 3, stride=2),
     lambda g: torch.randn(4, 3, 9, generator=g, dtype=torch.float64)),
    ("conv2d-dilated-reflect",
     lambda: nn.Conv2d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"),
     lambda g: torch.randn(3, 2, 7, 7, generator=g, dtype=torch.float64)),
    ("conv3d-depthwise", lambda: nn.Conv3d(2, 2, 2, groups=2),
     lambda g: torch.randn(3, 2, 3, 3, 3, generator=g, dtype=torch.float64)),
    ("embedding", lambda: nn.Embedding(10, 3, padding_idx=0),
     lambda g: torch.randint(0, 10, (4, 6), generator=g)),
    ("layernorm", lambda: nn.LayerNorm(5),
     lambda g: torch.randn(4, 7, 5, generator=g, dtype=torch.float64)),
    ("groupnorm", lambda: nn.GroupNorm(2, 4),
     lambda g: torch.randn(4, 4, 5, 5, generator=g, dtype=torch.float64)),
]


@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_weighted_grads_equal_sum_of_clipped_per_sample_grads(name, make, inputs):
    gen = torch.Generator().manual_seed(0)
    module = make().double()
    x = inputs(gen)
    out = module(x)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    factors = torch.rand(x.shape[0], generator=gen, dtype=torch.float64)
    params = dict((n, p) for n, p in module.named_parameters() if p.requires_grad)
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad((module(x[i:i + 1]) * g[i:i + 1]).sum(), list(params.values()))
        for n, gr in zip(params, grads):
            expected[n] += factors[i] * gr
    got = find_rule(module).weighted_grads(module, [(x, g)], factors)
    assert set(got) == set(expected)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,make,inputs", CASES, ids=[c[0] for c in CASES])
def test_weighted_grads_written_into_out(name, make, inputs, out_dtype):
    """``out=``: the sums land in the given tensors (NaN-filled beforehand: each fully overwritten,
    not added to), which are the ones returned; a float32 target of a float64 computation gets the
    rounded value."""
    gen = torch.Generator().manual_seed(1)
    module = make().double()
    x = inputs(gen)
    g = torch.randn(module(x).shape, generator=gen, dtype=torch.float64)
    factors = torch.rand(x.shape[0], generator=gen, dtype=torch.float64)
    rule = find_rule(module)
    expected = rule.weighted_grads(module, [(x, g)], factors)
    out = {n: torch.full_like(t, float("nan"), dtype=out_dtype) for n, t in expected.items()}
    got = rule.weighted_grads(module, [(x, g)], factors, out=dict(out))
    assert set(got) == set(expected)
    for n in expected:
        assert got[n] is out[n]
        torch.testing.assert_close(got[n], expected[n].to(out_dtype),
                                   rtol=1e-6 if out_dtype == torch.float32 else 1e-12,
                                   atol=1e-7 if out_dtype == torch.float32 else 1e-14)
