"""Two-pass modes keep the per-sample gradients of elementwise-affine norms from the norm pass
(LayerNorms formed together by LayerNormGradStack): the second pass neither recomputes them nor
compares their output gradients, and the release is still the float64 per-sample reference, with
a crafted sample moving the update by at most R/B."""
import warnings

import pytest
import torch
from torch import nn

import private_engine as pe
from private_engine.layers.norm_stack import LayerNormGradStack
from private_engine.layers.normalization import LayerNormRule
from tests.reference import assert_close_rel, reference_clipped_sum

MODES = ("mixed", "ghost", "per_sample")
B, R = 4, 0.5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8),
                         nn.LayerNorm(8), nn.RMSNorm(8), nn.Linear(8, 3))


def _loss(model, x):
    return model(x).square().sum((1, 2))


def _update(mode, x, monkeypatch=None, seen=None):
    """``(parameter changes of one SGD step at lr 1, noise 0, the model before it)``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=B, sample_size=100, max_grad_norm=R,
                                  noise_multiplier=0.0, clipping_mode=mode,
                                  check_sampling=False)
    engine.attach(opt)
    if monkeypatch is not None:
        take, weighted = LayerNormGradStack.take, LayerNormRule.weighted_grads

        def counted_take(self):
            out = take(self)
            seen["stacked"] += len(out)
            return out

        def counted_weighted(self, *args, **kwargs):
            seen["second_pass"] += 1
            return weighted(self, *args, **kwargs)

        monkeypatch.setattr(LayerNormGradStack, "take", counted_take)
        monkeypatch.setattr(LayerNormRule, "weighted_grads", counted_weighted)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(loss=_loss(model, x))
    if monkeypatch is not None:
        monkeypatch.undo()
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


def _batch():
    torch.manual_seed(1)
    x = torch.randn(B, 5, 6)
    x[1] *= 1e3  # far above R: clipped
    return x


@pytest.mark.parametrize("mode", MODES)
def test_two_pass_layer_norms_are_stacked_and_skipped_by_the_second_pass(mode, monkeypatch):
    seen = {"stacked": 0, "second_pass": 0}
    _update(mode, _batch(), monkeypatch, seen)
    # both LayerNorms (and the RMSNorm, kept alone) from the norm pass; none formed again
    assert seen == {"stacked": 2, "second_pass": 0}


@pytest.mark.parametrize("mode", MODES)
def test_two_pass_kept_norm_grads_release_the_reference(mode):
    x = _batch()
    update = _update(mode, x)
    expected, _ = reference_clipped_sum(_model(), [x], _loss, R,
                                        lambda n, r: torch.clamp(r / n, max=1.0))
    assert_close_rel([-u * B for u in update], expected, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("crafted", [1e30, 1e-41, "cancel"])
def test_two_pass_kept_norm_grads_bound_a_crafted_sample(mode, crafted):
    torch.manual_seed(2)
    honest = torch.randn(B - 1, 5, 6)
    if crafted == "cancel":  # two positions of opposite sign: LayerNorm inputs that cancel
        sample = torch.randn(1, 5, 6) * 1e4
        sample[0, 1] = -sample[0, 0] * (1 + 2.0 ** -20)
    else:
        sample = torch.full((1, 5, 6), float(crafted))
        sample[0, 0, 0] *= -1
    honest_only = _update(mode, honest)  # the expected batch size B divides both updates
    with_crafted = _update(mode, torch.cat([honest, sample]))
    moved = torch.sqrt(sum(((u - v).double() * B).square().sum()
                           for u, v in zip(with_crafted, honest_only)))
    assert torch.isfinite(moved) and float(moved) / R <= 1.0 + 1e-6, float(moved) / R
