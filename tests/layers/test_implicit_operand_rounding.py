"""Float32 matmuls and convolutions whose operands torch's precision switches let a kernel round
(TF32 on CUDA; bfloat16 or TF32 in oneDNN on the CPU, which ``set_float32_matmul_precision``
also sets) enter the certified bounds with that rounding; IEEE float32 adds none. The switches
are read without torch's refusal when its legacy and current APIs were mixed."""
import pytest
import torch

from private_engine.layers.gram import fast_gram_model
from private_engine.layers.rounding import TF32_UNIT, operand_unit, release_coefficient

pytestmark = pytest.mark.usefixtures("one_thread")

BF16_UNIT = 2.0 ** -8
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _switches():
    b = torch.backends
    return [b, b.cudnn, b.mkldnn, b.cuda.matmul, b.cudnn.conv, b.mkldnn.matmul, b.mkldnn.conv]


@pytest.fixture(autouse=True)
def restore_switches():
    saved = [s.fp32_precision for s in _switches()]
    legacy = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    for s, value in zip(_switches(), saved):
        s.fp32_precision = value
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
    assert torch.get_float32_matmul_precision() == "highest"


def test_ieee_float32_defaults():
    assert operand_unit(torch.float32, CPU) == 0.0
    assert operand_unit(torch.float32, CPU, conv=True) == 0.0
    assert operand_unit(torch.float32, CUDA) == 0.0
    expected_conv = TF32_UNIT if torch.backends.cudnn.allow_tf32 else 0.0
    assert operand_unit(torch.float32, CUDA, conv=True) == expected_conv


@pytest.mark.parametrize("precision", ["medium", "high"])
def test_float32_matmul_precision_on_the_cpu_counts(precision):
    torch.set_float32_matmul_precision(precision)
    unit = operand_unit(torch.float32, CPU)
    assert unit >= (BF16_UNIT if precision == "medium" else TF32_UNIT)
    assert release_coefficient(torch.float32, CPU, 8) > unit


@pytest.mark.parametrize("switch, conv", [("matmul", False), ("conv", True)])
def test_onednn_bf16_operands_count(switch, conv):
    setattr(getattr(torch.backends.mkldnn, switch), "fp32_precision", "bf16")
    assert operand_unit(torch.float32, CPU, conv=conv) == BF16_UNIT
    assert operand_unit(torch.bfloat16, CPU, conv=conv) == 0.0  # already 16-bit operands


def test_a_backend_wide_switch_counts_for_its_operations():
    torch.backends.mkldnn.fp32_precision = "bf16"
    assert operand_unit(torch.float32, CPU) == BF16_UNIT
    assert operand_unit(torch.float32, CPU, conv=True) == BF16_UNIT


def test_cuda_switches_read_through_the_current_api():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # legacy and current APIs now mixed
    assert operand_unit(torch.float32, CUDA) == TF32_UNIT


def test_no_float32_fast_gram_when_operands_may_be_rounded():
    t = torch.randn(2, 3, 4)
    assert fast_gram_model(t) is not None
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    assert fast_gram_model(t) is None
