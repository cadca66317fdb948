"""Adversarial sensitivity on CUDA: the crafted samples of ``test_privacy_under_attack`` run on a
GPU, with TF32 off and on, in every clipping mode and both doors.

A GPU rounds differently from the CPU: cuBLAS and cuDNN pick their own kernels and summation
orders, the tensor cores round their products and accumulate in their own way (Fasi, Higham,
Mikaitis & Pranesh 2021, "Numerical behavior of NVIDIA tensor cores"), and TF32 — on by default
for cuDNN convolutions, switched on for matmuls by many training scripts — keeps 10 bits of each
float32 operand. The samples that cancel in the CPU's float32 arithmetic were found by a search
over seeds on the CPU, so here every family runs over several seeds: each one is a valid attack,
and on the GPU some of them cancel. The measure is the CPU file's: with noise 0 and SGD at lr 1,

    ratio = B·‖Δ(released gradient)‖ / R  ≤  1 + tol

between a batch with the crafted sample and the same batch without it. ``tol`` covers the
rounding of the honest samples' sums, which two batches of different sizes may sum in different
orders (a few float32 units; with TF32, a few units of its 2⁻¹¹): a sample that escapes clipping
moves the release by orders of magnitude more. Set ``PE_RATIO_LOG=path`` to append every measured
ratio to a file.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_privacy_under_attack import (
    BF16,
    BOOK_KEEPING,
    CANCELLATION,
    DOOR_IDS,
    DOORS,
    EMBEDDING,
    FIXED_SCALE,
    MAGNITUDES,
    assert_bounded,
    assert_large,
    bf16_case,
    cancellation_case,
    conv_case,
    embedding_case,
    fp16_case,
    layer_norm_case,
    magnitude_case,
    run_pair,
    tied_case,
)

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: honest sums rounded in float32 in orders that depend on the batch size
CUDA_FP32_TOL = 1e-4
#: with TF32 the honest sums themselves are products of 10-bit operands (2⁻¹¹ relative)
CUDA_TF32_TOL = 1e-2
SEEDS = range(4)


@pytest.fixture(params=[False, True], ids=["fp32", "tf32"])
def tf32(request):
    """TF32 for matmuls and cuDNN convolutions off (``fp32``) or on (``tf32``)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = request.param
    try:
        yield request.param
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check(case, door, how, tf32, what, *, large=True, **kw):
    """Run the pair on CUDA and assert the bound; log the ratio when ``PE_RATIO_LOG`` is set."""
    if large:
        assert_large(case)
    tol = CUDA_TF32_TOL if tf32 else CUDA_FP32_TOL
    r = assert_bounded(*run_pair(case, door, how, device="cuda", **kw), tol=tol,
                       what=f"{what} {door}-{how}")
    log = os.environ.get("PE_RATIO_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{what}\t{door}-{how}\t{'tf32' if tf32 else 'fp32'}\t{r}\n")


FAMILIES = {
    "f32-large": lambda s: cancellation_case(*CANCELLATION["large-zero"][:3], s),
    "f32-mild": lambda s: cancellation_case(*CANCELLATION["mild-zero"][:3], s),
    "embedding": lambda s: embedding_case(*EMBEDDING["embedding-zero"][:2], s),
    "conv": lambda s: conv_case(1e4, 1e-5, 1e3, s),
}


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_cancellation(family, door, how, tf32):
    """Samples whose positions cancel in the ghost norm's Grams, over several seeds."""
    for seed in SEEDS:
        check(FAMILIES[family](seed), door, how, tf32, f"{family} seed {seed}")


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_cuda_bfloat16_autocast_cancellation(door, how, tf32):
    """Ordinary magnitudes that cancel in bfloat16 Grams (tensor-core products), CUDA autocast."""
    scale, eps, K, _ = BF16["bf16-zero"]
    for seed in SEEDS:
        if (door, how) == ("opacus", "hooks"):  # a batch-mean loss refused, a sum loss bounded
            case = bf16_case(scale, eps, K, seed)
            assert_bounded(*run_pair(case, door, how, device="cuda", amp=torch.bfloat16),
                           may_refuse=True, refuse_at="step", what=f"bf16 seed {seed} mean")
            assert_bounded(*run_pair(case, door, how, device="cuda", amp=torch.bfloat16,
                                     loss_reduction="sum"),
                           tol=CUDA_TF32_TOL if tf32 else CUDA_FP32_TOL, batch=1,
                           what=f"bf16 seed {seed} sum")
            continue
        check(bf16_case(scale, eps, K, seed), door, how, tf32, f"bf16 seed {seed}",
              amp=torch.bfloat16)


@pytest.mark.parametrize("mode", BOOK_KEEPING)
def test_cuda_float16_grad_scaler_cancellation(mode, tf32):
    """float16 autocast with ``GradScaler("cuda")``: positions one float16 step apart."""
    for seed in SEEDS:
        check(fp16_case(1e3, 50.0, seed), "native", mode, tf32, f"fp16 seed {seed}",
              amp=torch.float16, scaler_args=FIXED_SCALE)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
@pytest.mark.parametrize("variant", list(MAGNITUDES))
def test_cuda_extreme_magnitudes(variant, door, how, tf32):
    """Huge, tiny, subnormal and overflowing samples (the GPU's kernels may flush subnormals)."""
    *args, large = MAGNITUDES[variant]
    check(magnitude_case(*args), door, how, tf32, variant, large=large)


@pytest.mark.parametrize("door,how", DOORS, ids=DOOR_IDS)
def test_cuda_layer_norm_and_tied_weights(door, how, tf32):
    """LayerNorm affine positions that cancel; tied uses that align, at scales up to overflow."""
    check(layer_norm_case(), door, how, tf32, "LayerNorm")
    for scale in (1.0, 1e6, 1e15):
        check(tied_case(scale=scale), door, how, tf32, f"tied x{scale:g}", large=scale < 1e10)
