"""Two-pass modes hand their ghost Linears' bounds to the clipper's GhostBoundStack, formed together
at the end of the norm pass, and release these layers from the operands the stack held: a second
pass that takes every output gradient as changed (as after a non-deterministic kernel) releases
exactly what the plain path does."""
import warnings

import torch
from torch import nn

import private_engine as pe
from private_engine.clipping import two_pass
from private_engine.layers.ghost_stack import GhostBoundStack


def _step(recompute: bool, monkeypatch, taken: list):
    torch.manual_seed(0)
    # ghost where 2T² < pD (T = 5): the first three Linears; the head is instantiated
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8), nn.GELU(),
                          nn.Linear(8, 8), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = pe.PrivacyEngine(model, batch_size=4, sample_size=100, max_grad_norm=0.5,
                                  noise_multiplier=0.0, clipping_mode="mixed",
                                  check_sampling=False)
    engine.attach(opt)
    x = torch.randn(4, 5, 6)
    x[1] *= 1e3  # a sample far above R
    if recompute:  # every layer's output gradient taken as changed: bounds recomputed, compared
        monkeypatch.setattr(two_pass, "same_tensors", lambda xs, ys: False)
    take = GhostBoundStack.take

    def counted(self):
        blocks = take(self)
        taken.append(sum(b.shape[0] for b in blocks))
        return blocks

    monkeypatch.setattr(GhostBoundStack, "take", counted)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(loss=model(x).square().sum((1, 2)))
    monkeypatch.undo()
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


def test_two_pass_deferred_bounds_release_the_plain_update(monkeypatch):
    taken: list = []
    plain = _step(False, monkeypatch, taken)
    update = _step(True, monkeypatch, taken)
    assert taken == [3, 3]  # the three ghost Linears' bounds, formed together
    for u, v in zip(update, plain):
        assert torch.equal(u, v)
