"""The two-pass norm pass holds the operands of the last layers it leaves to the second pass
(within ``HELD_LOWEST`` output-gradient elements), forms their bounds at its end from these
operands as they are then and releases them from the same operands; the layers it stops holding
get their bounds and fingerprints then and stay with the second pass."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from private_engine.capture.recorder import RecordedLayer
from private_engine.clipping import release, two_pass
from private_engine.clipping.fingerprints import fingerprint_pairs
from private_engine.layers.linear import LinearRule


def _normed(strategy: two_pass.TwoPass, d_in: int, d_out: int, seed: int):
    """A Linear ghost-normed by ``strategy``, held if there is room: its layer record."""
    torch.manual_seed(seed)
    module, rule = nn.Linear(d_in, d_out), LinearRule()
    pairs = [(torch.randn(3, 4, d_in), torch.randn(3, 4, d_out))]
    layer = RecordedLayer(f"l{seed}", module, rule)
    first = two_pass.FirstPass(True, 1, [], None)
    strategy.first[id(layer)] = first
    if not strategy._hold(layer, pairs, first):
        strategy._bound(first, layer, pairs)
    return layer, pairs


def _done(strategy: two_pass.TwoPass) -> list:
    """End the pass: the kept ``(module, rule, pairs)``."""
    kept: list = []
    clipper = SimpleNamespace(keep_pairs=lambda *k: kept.append(k),
                              recorder=SimpleNamespace(extras=[]))
    strategy.norm_pass_done(clipper, [], True)
    return kept


@pytest.mark.parametrize("which", ["a", "g"])
def test_a_held_layer_is_bounded_from_its_operands_as_released(which):
    """One element of the second layer's activation or output gradient scaled by 10⁶ after it
    was normed (a ``.data`` write from a later hook): its certified term is formed at the end of
    the pass from the operands as they are then — those its clipped sum is formed from — and
    bounds the exact norm of that release; neither layer is fingerprinted, and both are released
    from their held operands, not by the second pass."""
    strategy = two_pass.TwoPass("ghost")
    strategy.start()
    first, _ = _normed(strategy, 6, 4, 0)
    layer, pairs = _normed(strategy, 5, 7, 1)
    a, g = pairs[0]
    (a if which == "a" else g).data[1, 2, 3] *= 1e6
    terms = strategy.changed_terms()
    assert len(terms) == 2
    assert torch.equal(terms[1], layer.rule.certified_norm_sq(layer.module, pairs, True))
    a64, g64 = a.double(), g.double()
    exact = (torch.einsum("ntp,ntd->npd", g64, a64).pow(2).sum((1, 2))
             + g64.sum(1).pow(2).sum(1))
    assert bool((terms[1] >= exact).all())
    assert all(strategy.first[id(x)].fingerprints == [] for x in (first, layer))
    kept = _done(strategy)
    assert [k[0] for k in kept] == [first.module, layer.module]
    assert strategy.second_pass_layers([first, layer]) == []


def test_the_layers_held_are_the_last_normed_within_the_limit(monkeypatch):
    """Room for 2·48 output-gradient elements: of three layers of 48, 48 and 84 normed in this
    order, the last alone is held (the first two dropped as it came, their bounds and
    fingerprints formed then); the dropped layers' bounds and the held one's are the terms
    added at the end of the pass, and the dropped ones stay with the second pass."""
    monkeypatch.setattr(two_pass, "HELD_LOWEST", 2 * 48)
    strategy = two_pass.TwoPass("ghost")
    strategy.start()
    records = [_normed(strategy, 6, 4, 0), _normed(strategy, 6, 4, 1)]
    layers = [r[0] for r in records]
    assert [h.layer for h in strategy._held] == layers
    assert all(strategy.first[id(x)].bound is None for x in layers)
    records.append(_normed(strategy, 5, 7, 2))
    layers.append(records[2][0])
    assert [h.layer for h in strategy._held] == layers[2:]
    dropped = [strategy.first[id(x)] for x in layers[:2]]
    for f, (x, pairs) in zip(dropped, records):
        assert torch.equal(f.bound, x.rule.certified_norm_sq(x.module, pairs, True))
        assert release.same_tensors(f.fingerprints, fingerprint_pairs(pairs))
    terms = strategy.changed_terms()
    x, pairs = records[2]
    assert len(terms) == 3 and all(t is f.bound for t, f in zip(terms, dropped))
    assert torch.equal(terms[2], x.rule.certified_norm_sq(x.module, pairs, True))
    assert [k[0] for k in _done(strategy)] == [layers[2].module]
    assert strategy.second_pass_layers(layers) == layers[:2]
