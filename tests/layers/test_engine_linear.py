"""nn.Linear on inputs of rank 2, 3 and 4: every mode × every clip function × random shapes."""
import pytest
import torch
from torch import nn

from engine_checks import CLIPS, MODES, check_against_reference, gen_for, rng_for, target_like

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(3)


def linear_case(rank: int, seed: int):
    rng = rng_for("linear", rank, seed)
    B = rng.randint(3, 6)
    d, p = rng.randint(1, 6), rng.randint(1, 6)
    positions = {2: (), 3: (rng.randint(1, 6),), 4: (rng.randint(1, 3), rng.randint(1, 4))}[rank]
    bias = rng.random() < 0.7
    torch.manual_seed(seed)
    layer = nn.Linear(d, p, bias=bias)
    if seed % 2:  # a trainable layer before it: its input requires grad
        d0 = rng.randint(1, 5)
        model = nn.Sequential(nn.Linear(d0, d), nn.Tanh(), layer)
    else:
        d0 = d
        model = nn.Sequential(layer)
    model = model.double()
    gen = gen_for(seed)
    x = torch.randn(B, *positions, d0, generator=gen, dtype=torch.float64)
    return model, [x, target_like(model, x, gen)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_linear_matches_reference(rank, mode, clip, seed):
    model, inputs = linear_case(rank, seed)
    check_against_reference(model, inputs, mode=mode, clip=clip)


@pytest.mark.parametrize("mode", MODES)
def test_linear_mixed_plan_uses_both_strategies(mode):
    """One model where eq. (4.1) picks ghost for one layer and instantiation for the other."""
    torch.manual_seed(0)
    # layer "0": T=1 → 2T² = 2 < pD = 144 (ghost); layer "3": T=12 → 2T² = 288 > pD = 6
    # (instantiate)
    gen = gen_for(0)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Unflatten(1, (12, 2)),
                          nn.Linear(2, 3)).double()
    engine = check_against_reference(model, [x, target_like(model, x, gen)], mode=mode,
                                     clip="abadi")
    choice = {d.name: d.use_ghost for d in engine.layer_plan}
    # bk_mixopt's time rule T²(D+p) < pD: layer "0" 1·30 < 144 (ghost), layer "3" 144·5 > 6
    # (instantiate)
    expected = {"mixed": {"0": True, "3": False}, "ghost": {"0": True, "3": True},
                "per_sample": {"0": False, "3": False}, "bk": {"0": True, "3": True},
                "bk_mixed": {"0": True, "3": False}, "bk_mixopt": {"0": True, "3": False}}[mode]
    assert choice == expected


@pytest.mark.parametrize("mode", ["mixed", "bk_mixed"])
def test_bk_mixed_instantiates_when_the_gradient_is_smaller_than_what_ghost_keeps(mode):
    """T = 20, D = p = 32: eq. (4.1) picks ghost (2T² = 800 < pD = 1024), but book-keeping would
    keep (a, g) = T·(D + p) = 1280 elements per sample for a ghost layer and only pD = 1024 for an
    instantiated one, so "bk_mixed" instantiates (and keeps G_i); both match the reference."""
    gen = gen_for(3)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh()).double()
    x = torch.randn(4, 20, 32, generator=gen, dtype=torch.float64)
    engine = check_against_reference(model, [x, target_like(model, x, gen)], mode=mode,
                                     clip="abadi")
    (d,) = engine.layer_plan
    assert (d.T, d.D, d.p, d.io_size) == (20, 32, 32, 1280)
    assert d.use_ghost == (mode == "mixed")
