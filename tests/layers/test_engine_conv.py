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


#: settings of private_engine.layers.conv that force one formulation everywhere: per-sample
#: gradients and clipped sums by the cuDNN/oneDNN kernels ("kernels") or by im2col and matmuls
#: ("unfold"), and im2col (where one is formed) by the strided window copy ("windows") or by
#: ``F.unfold`` for 1-d and 2-d layers
FORMULATIONS = {
    "kernels-windows": dict(PER_SAMPLE_UNFOLD_RATIO=0, PER_SAMPLE_UNFOLD_MAX_CHANNELS=0,
                            RELEASE_KERNEL_MIN_POSITIONS=0, WINDOW_COPY_MIN_POSITIONS=0),
    "unfold": dict(PER_SAMPLE_UNFOLD_RATIO=1 << 30, PER_SAMPLE_UNFOLD_MAX_CHANNELS=1 << 30,
                   RELEASE_KERNEL_MIN_POSITIONS=1 << 30, WINDOW_COPY_MIN_POSITIONS=1 << 30),
    "unfold-windows": dict(PER_SAMPLE_UNFOLD_RATIO=1 << 30, PER_SAMPLE_UNFOLD_MAX_CHANNELS=1 << 30,
                           RELEASE_KERNEL_MIN_POSITIONS=1 << 30, WINDOW_COPY_MIN_POSITIONS=0),
}


def force_formulation(monkeypatch, name: str) -> None:
    """Every convolution's per-sample gradients, clipped sums and im2col by one formulation
    (:data:`FORMULATIONS`)."""
    for setting, value in FORMULATIONS[name].items():
        assert hasattr(conv_rule, setting), setting
        monkeypatch.setattr(conv_rule, setting, value)


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


@pytest.mark.parametrize("nd", [1, 2])
def test_window_copy_is_f_unfold_bit_for_bit(nd, monkeypatch):
    """im2col by the strided window copy equals ``F.unfold``'s entry for entry (random stride,
    padding, padding mode, dilation, groups): both only copy input or padding values."""
    for seed in range(8):
        model, inputs = conv_case(nd, seed)
        conv = [m for m in model.modules() if isinstance(m, CONV[nd])][-1].float()
        x = torch.randn(inputs[0].shape[0], conv.in_channels, *inputs[0].shape[2:],
                        generator=gen_for(seed))
        monkeypatch.setattr(conv_rule, "WINDOW_COPY_MIN_POSITIONS", 1 << 30)
        by_unfold = conv_rule.unfolded_columns(conv, x)
        monkeypatch.setattr(conv_rule, "WINDOW_COPY_MIN_POSITIONS", 0)
        by_windows = conv_rule.unfolded_columns(conv, x)
        assert by_windows.shape == by_unfold.shape
        assert torch.equal(by_windows, by_unfold), seed
        assert conv_rule.output_positions(conv, x) == by_unfold.shape[-1]


def test_image_stem_uses_im2col_by_windows():
    """An RGB stem (3 input channels, 7×7, stride 2, 32×32 output) on the CPU: per-sample
    gradients by im2col + bmm and im2col by the window copy, where the grouped kernel and
    ``F.unfold`` are the slow ones; a 64-channel 3×3 layer on a 16×16 map keeps the grouped
    kernel."""
    stem = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
    x = torch.zeros(2, 3, 64, 64)
    assert conv_rule.output_positions(stem, x) == 1024
    assert conv_rule.unfold_by_windows(stem, x)
    assert conv_rule.per_sample_by_unfold(stem, 1024, torch.float32, torch.device("cpu"))
    body = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    assert not conv_rule.per_sample_by_unfold(body, 256, torch.float32, torch.device("cpu"))
    assert not conv_rule.unfold_by_windows(nn.Conv2d(256, 256, 3, padding=1), x[:, :, :4, :4])
