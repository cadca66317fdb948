"""nn.Conv1d/2d/3d with random stride, padding (ints, tuples, "same", "valid"), every padding mode,
dilation, groups (incl. depthwise) and bias on/off: every mode × every clip function."""
import pytest
import torch
from torch import nn

from engine_checks import CLIPS, MODES, check_against_reference, gen_for, rng_for, target_like
from private_engine.layers import conv as conv_rule

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SEEDS = range(4)
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")]


def conv_case(nd: int, seed: int, **force):
    """A random conv layer and batch; ``force`` fixes some hyper-parameters."""
    rng = rng_for("conv", nd, seed, tuple(sorted(force.items())))
    B = rng.randint(2, 4)
    kind = force.get("groups_kind", rng.choice(["plain", "grouped", "depthwise"]))
    if kind == "depthwise":
        groups = cin = rng.randint(2, 4)
        cout = cin * rng.randint(1, 2)
    elif kind == "grouped":
        groups = rng.randint(2, 3)
        cin, cout = groups * rng.randint(1, 2), groups * rng.randint(1, 2)
    else:
        groups, cin, cout = 1, rng.randint(1, 3), rng.randint(1, 4)
    small = nd == 3
    kernel = tuple(rng.randint(1, 2 if small else 3) for _ in range(nd))
    dilation = tuple(rng.randint(1, 2) for _ in range(nd))
    padding = force.get("padding", rng.choice(["int", "tuple", "same", "valid"]))
    if padding == "int":
        padding = rng.randint(0, 2)
    elif padding == "tuple":
        padding = tuple(rng.randint(0, 2) for _ in range(nd))
    stride = 1 if padding == "same" else tuple(rng.randint(1, 3) for _ in range(nd))
    padding_mode = force.get("padding_mode", rng.choice(PADDING_MODES))
    bias = force.get("bias", rng.random() < 0.6)
    # every spatial size ≥ the dilated kernel and > any padding (reflect needs pad < size)
    sizes = [max(d * (k - 1) + 1, 3) + rng.randint(0, 2 if small else 4)
             for k, d in zip(kernel, dilation)]

    torch.manual_seed(seed)
    layer = CONV[nd](cin, cout, kernel, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=bias, padding_mode=padding_mode)
    if seed % 2:  # a trainable 1×1 conv and tanh before it: its input requires grad
        c0 = rng.randint(1, 3)
        model = nn.Sequential(CONV[nd](c0, cin, 1), nn.Tanh(), layer)
    else:
        c0 = cin
        model = nn.Sequential(layer)
    model = model.double()
    gen = gen_for(seed)
    x = torch.randn(B, c0, *sizes, generator=gen, dtype=torch.float64)
    return model, [x, target_like(model, x, gen)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_matches_reference(nd, mode, clip, seed):
    model, inputs = conv_case(nd, seed)
    check_against_reference(model, inputs, mode=mode, clip=clip)


@pytest.mark.parametrize("padding", ["same", "valid", "int"])
@pytest.mark.parametrize("padding_mode", PADDING_MODES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_every_padding(nd, padding_mode, padding):
    """Every padding mode × padding kind (random kernel/dilation, so "same" is often asymmetric)."""
    for seed in range(2):
        model, inputs = conv_case(nd, seed, padding=padding, padding_mode=padding_mode)
        for mode in ("ghost", "per_sample"):
            check_against_reference(model, inputs, mode=mode, clip="abadi", check_step=False)


@pytest.mark.parametrize("groups_kind", ["grouped", "depthwise"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_groups(nd, groups_kind):
    for seed in range(3):
        model, inputs = conv_case(nd, seed, groups_kind=groups_kind)
        for mode in MODES:
            check_against_reference(model, inputs, mode=mode, clip="abadi", check_step=False)


def test_conv_same_asymmetric_padding_depthwise():
    """Even kernel + "same": PyTorch pads one more on the right; depthwise with channel
    multiplier."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, (4, 2), padding="same", groups=3, dilation=(1, 3),
                                    padding_mode="reflect")).double()
    gen = gen_for(0)
    x = torch.randn(3, 3, 7, 8, generator=gen, dtype=torch.float64)
    for mode in MODES:
        check_against_reference(model, [x, target_like(model, x, gen)], mode=mode, clip="automatic")


#: (PER_SAMPLE_UNFOLD_RATIO, RELEASE_KERNEL_MIN_POSITIONS) that force one formulation everywhere
FORMULATIONS = {"kernels": (0, 0), "unfold": (1 << 30, 1 << 30)}


def force_formulation(monkeypatch, name: str) -> None:
    """Per-sample gradients and clipped sums of every convolution by the cuDNN/oneDNN kernels
    ("kernels": grouped convolution, weight gradient) or by im2col and matmuls ("unfold")."""
    ratio, positions = FORMULATIONS[name]
    monkeypatch.setattr(conv_rule, "PER_SAMPLE_UNFOLD_RATIO", ratio)
    monkeypatch.setattr(conv_rule, "RELEASE_KERNEL_MIN_POSITIONS", positions)


@pytest.mark.parametrize("formulation", list(FORMULATIONS))
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_both_formulations_match_reference(nd, formulation, monkeypatch):
    """Per-sample gradients and clipped sums by the kernels and by im2col + matmul alike match the
    float64 sample-by-sample reference (random stride, padding and padding mode, dilation, groups,
    bias)."""
    force_formulation(monkeypatch, formulation)
    for seed in range(4):
        model, inputs = conv_case(nd, seed)
        for mode in ("per_sample", "bk_mixed", "bk_mixopt", "ghost"):
            check_against_reference(model, inputs, mode=mode, clip="abadi", check_step=False)


class TwoCalls(nn.Module):
    """One convolution applied to an image and to its mirror image (two calls, summed)."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return self.conv(x) + self.conv(x.flip(-1))


@pytest.mark.parametrize("formulation", list(FORMULATIONS))
def test_conv_called_twice_both_formulations(formulation, monkeypatch):
    """A convolution called twice: its per-sample gradient is the sum over both calls (cross
    terms in the norm), in either formulation."""
    force_formulation(monkeypatch, formulation)
    torch.manual_seed(0)
    model = TwoCalls(nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)).double()
    gen = gen_for(0)
    x = torch.randn(3, 4, 6, 5, generator=gen, dtype=torch.float64)
    for mode in ("per_sample", "bk_mixed", "bk_mixopt", "ghost"):
        check_against_reference(model, [x, target_like(model, x, gen)], mode=mode, clip="abadi",
                                check_step=False)


@pytest.mark.parametrize("formulation", list(FORMULATIONS))
def test_conv_channels_last_both_formulations(formulation, monkeypatch):
    """A channels_last model and input (strided activations and output gradients) in either
    formulation."""
    force_formulation(monkeypatch, formulation)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
                          nn.Conv2d(4, 6, 2, stride=2, dilation=1, bias=False))
    model = model.double().to(memory_format=torch.channels_last)
    gen = gen_for(1)
    x = torch.randn(3, 3, 6, 6, generator=gen, dtype=torch.float64)
    x = x.to(memory_format=torch.channels_last)
    for mode in ("per_sample", "bk_mixed", "bk_mixopt", "ghost"):
        check_against_reference(model, [x, target_like(model, x, gen)], mode=mode, clip="abadi",
                                check_step=False)
