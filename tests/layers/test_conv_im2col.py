"""im2col of convolutions: non-overlapping windows (patch embeddings) as a view of the input and one
copy, the window copy chosen off the CPU, every result equal to ``F.unfold``'s bit for bit."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine_checks import MODES, check_against_reference, gen_for, target_like
from private_engine.layers import conv as conv_rule

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

pytestmark = pytest.mark.usefixtures("one_thread")


class DataOps(TorchDispatchMode):
    """The aten ops that write memory (neither views nor allocations) run under the mode."""

    SHAPE_ONLY = ("aten._unsafe_view.default", "aten.new_empty.default",
                  "aten.empty.memory_format")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in self.SHAPE_ONLY:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def patches_by_slicing(x: torch.Tensor, kernel, groups: int) -> torch.Tensor:
    """Reference im2col ``(B, groups, D, T)`` of a layer with stride = kernel, dilation 1 and no
    padding, for any spatial rank: for each kernel offset ``κ`` the strided slice
    ``x[..., κ_j : κ_j + n_j k_j : k_j]`` (``n_j = S_j // k_j``), offsets stacked after the
    channels in row-major order (the order of ``weight.view(p, -1)``)."""
    B, C, *S = x.shape
    n = [s // k for s, k in zip(S, kernel)]
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        index = tuple(slice(o, o + m * k, k) for o, m, k in zip(offset, n, kernel))
        taps.append(x[(slice(None), slice(None)) + index])
    cols = torch.stack(taps, 2)  # (B, C, Πk, *n)
    return cols.reshape(B, groups, (C // groups) * math.prod(kernel), math.prod(n))


def f_unfold(x: torch.Tensor, kernel, groups: int) -> torch.Tensor:
    """``F.unfold``'s im2col ``(B, groups, D, T)`` of a 1-d or 2-d layer with stride = kernel."""
    if x.dim() == 3:
        x, kernel = x.unsqueeze(2), (1,) + tuple(kernel)
    cols = F.unfold(x, kernel, stride=kernel)
    return cols.reshape(x.shape[0], groups, -1, cols.shape[-1])


#: (spatial sizes, kernel, channels, groups): divisible and non-divisible sizes, groups > 1
PATCH_CASES = [
    ((12,), (4,), 3, 1), ((13,), (3,), 4, 2),
    ((12, 13), (4, 4), 3, 1), ((9, 10), (2, 3), 4, 2), ((16, 16), (4, 4), 6, 3),
    ((4, 5, 6), (2, 2, 3), 3, 1), ((5, 6, 7), (2, 3, 2), 4, 4),
]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes,kernel,channels,groups", PATCH_CASES)
def test_patch_im2col_is_f_unfold_bit_for_bit(sizes, kernel, channels, groups, dtype,
                                              channels_last):
    """Non-overlapping windows in 1-d, 2-d and 3-d (trailing positions the layer drops, groups,
    channels_last inputs): the rule's im2col equals ``F.unfold`` (1-d, 2-d) and the strided-slice
    reference (every rank) entry for entry, converted to another dtype by its copy as well."""
    nd = len(sizes)
    conv = CONV[nd](channels, 2 * groups, kernel, stride=kernel, groups=groups)
    x = torch.randn(3, channels, *sizes, generator=gen_for(nd)).to(dtype)
    if channels_last and nd > 1:
        x = x.to(memory_format=torch.channels_last if nd == 2 else torch.channels_last_3d)
    assert conv_rule.non_overlapping(conv)
    expected = patches_by_slicing(x, kernel, groups)
    if nd < 3:
        assert torch.equal(f_unfold(x, kernel, groups), expected)
    cols = conv_rule.unfolded_columns(conv, x)
    assert cols.shape == expected.shape and cols.dtype == dtype
    assert torch.equal(cols, expected)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    converted = conv_rule.unfolded_columns(conv, x, other)
    assert converted.dtype == other
    assert torch.equal(converted, expected.to(other))


@pytest.mark.parametrize("sizes,kernel,channels,groups", PATCH_CASES)
def test_patch_im2col_is_one_copy(sizes, kernel, channels, groups):
    """Non-overlapping windows: views of the input and one copy (a reshape, or the copy that
    converts the dtype); no ``F.unfold``."""
    conv = CONV[len(sizes)](channels, groups, kernel, stride=kernel, groups=groups)
    x = torch.randn(2, channels, *sizes)
    with DataOps() as same_dtype:
        conv_rule.unfolded_columns(conv, x)
    assert same_dtype.ops == ["aten.clone.default"]
    with DataOps() as converted:
        conv_rule.unfolded_columns(conv, x, torch.bfloat16)
    assert converted.ops == ["aten.copy_.default"]


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_pointwise_im2col_is_a_view(nd):
    """A 1×1 convolution of stride 1 (non-overlapping windows of one position): im2col and the
    rule's ``(B·groups, T, D)`` operand are views of the input, nothing copied."""
    conv = CONV[nd](4, 6, 1, groups=2)
    x, g = torch.randn(3, 4, *(5,) * nd), torch.randn(3, 6, *(5,) * nd)
    with DataOps() as log:
        cols = conv_rule.unfolded_columns(conv, x)
        U, _ = conv_rule.ConvRule()._views(conv, [(x, g)])
    assert log.ops == []
    assert cols.data_ptr() == U.data_ptr() == x.data_ptr()
    assert torch.equal(cols, x.reshape(3, 2, 2, -1))


def test_window_copy_off_the_cpu():
    """Off the CPU every layer's im2col is the window copy (CUDA's ``F.unfold`` launches one kernel
    per sample); on the CPU non-overlapping windows too, and ``F.unfold`` stays for padded or
    overlapping 1-d / 2-d layers with few positions."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    x = torch.zeros(2, 3, 224, 224)
    vit = nn.Conv2d(3, 768, 16, stride=16)  # 196 positions
    assert conv_rule.output_positions(vit, x) == 196 < conv_rule.WINDOW_COPY_MIN_POSITIONS
    assert conv_rule.unfold_by_windows(vit, x, cuda)
    assert conv_rule.unfold_by_windows(vit, x, cpu)
    assert conv_rule.unfold_by_windows(vit, x)  # a's device (the CPU)
    small = nn.Conv2d(256, 256, 3, padding=1)
    y = torch.zeros(2, 256, 4, 4)
    assert conv_rule.unfold_by_windows(small, y, cuda)
    assert not conv_rule.unfold_by_windows(small, y, cpu)
    line = nn.Conv1d(4, 4, 3, stride=2, dilation=2)
    z = torch.zeros(2, 4, 9)
    assert conv_rule.unfold_by_windows(line, z, cuda)
    assert not conv_rule.unfold_by_windows(line, z)


class PatchEmbed(nn.Module):
    """A ViT-like patch embedding: non-overlapping 4×4 patches, tokens, a linear head."""

    def __init__(self, channels_last: bool = False):
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, stride=4)
        self.head = nn.Linear(8, 2)
        self.channels_last = channels_last

    def forward(self, x):
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        tokens = self.proj(x).flatten(2).transpose(1, 2)  # (B, T, 8)
        return self.head(torch.tanh(tokens)).sum(1)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_patch_embed_matches_reference(mode, channels_last, monkeypatch):
    """A patch embedding on 12×13 images (the 13th column dropped by the layer): per-sample
    gradients, ghost norms and clipped sums match the float64 sample-by-sample reference in every
    mode, with im2col formed without ``F.unfold``."""
    def no_f_unfold(*args, **kwargs):
        raise AssertionError("F.unfold used for non-overlapping windows")

    torch.manual_seed(0)
    model = PatchEmbed(channels_last).double()
    gen = gen_for(3)
    x = torch.randn(4, 3, 12, 13, generator=gen, dtype=torch.float64)
    inputs = [x, target_like(model, x, gen)]
    monkeypatch.setattr(torch.nn.functional, "unfold", no_f_unfold)
    check_against_reference(model, inputs, mode=mode, clip="abadi")
