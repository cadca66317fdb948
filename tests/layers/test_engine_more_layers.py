"""nn.RMSNorm and timm's RmsNorm, nn.PReLU, nn.InstanceNorm1d/2d/3d(affine=True) and
nn.ConvTranspose1d/2d/3d (stride, padding, output_padding, dilation, groups, bias): every mode ×
every clip function against the float64 sample-by-sample reference."""
import pytest
import torch
from torch import nn

from engine_checks import CLIPS, MODES, check_against_reference, gen_for, rng_for, target_like

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(2)
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
INSTANCE = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


def _randomize(module: nn.Module, seed: int) -> None:
    """Parameters away from their initial values (1, 0, 0.25), so that mistakes show."""
    gen = gen_for(seed + 100)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _batch(model: nn.Module, shape, seed: int):
    model = model.double()
    gen = gen_for(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    return model, [x, target_like(model, x, gen)]


def rmsnorm_case(seed: int, norm_cls=nn.RMSNorm):
    rng = rng_for("rmsnorm", seed, norm_cls.__name__)
    B, T, d = rng.randint(3, 5), rng.randint(1, 3), rng.randint(2, 5)
    torch.manual_seed(seed)
    if norm_cls is nn.RMSNorm:  # eps None: the input dtype's epsilon; a 2-d normalized_shape
        norm = nn.RMSNorm((T, d) if seed % 2 else d, eps=None if seed % 2 else 1e-3)
    else:
        norm = norm_cls(d)
    _randomize(norm, seed)
    d0 = rng.randint(1, 4)
    return _batch(nn.Sequential(nn.Linear(d0, d), norm), (B, T, d0), seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_rmsnorm_matches_reference(mode, seed):
    for clip in CLIPS:
        check_against_reference(*rmsnorm_case(seed), mode=mode, clip=clip)


@pytest.mark.parametrize("mode", MODES)
def test_timm_rmsnorm_matches_reference(mode):
    timm_layers = pytest.importorskip("timm.layers")
    for seed, clip in zip(SEEDS, CLIPS):
        model, inputs = rmsnorm_case(seed, timm_layers.RmsNorm)
        assert type(model[-1]) is timm_layers.RmsNorm
        check_against_reference(model, inputs, mode=mode, clip=clip)


def prelu_case(seed: int, shared: bool):
    rng = rng_for("prelu", seed, shared)
    B, C = rng.randint(3, 5), rng.randint(2, 4)
    nd = rng.randint(0, 2)  # spatial dims after (B, C)
    spatial = [rng.randint(2, 3) for _ in range(nd)]
    torch.manual_seed(seed)
    act = nn.PReLU(1 if shared else C)
    _randomize(act, seed)
    c0 = rng.randint(1, 3)
    pre = nn.Linear(c0, C) if nd == 0 else CONV[nd](c0, C, 1)
    return _batch(nn.Sequential(pre, act, nn.Tanh()), (B, c0, *spatial), seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [True, False], ids=["one_slope", "per_channel"])
def test_prelu_matches_reference(shared, mode, seed):
    for clip in CLIPS:
        check_against_reference(*prelu_case(seed, shared), mode=mode, clip=clip)


class ScalarPReLU(nn.Module):
    """One shared slope on a batch of scalars ``(B,)``."""

    def __init__(self):
        super().__init__()
        self.pre, self.act = nn.Linear(3, 1), nn.PReLU()

    def forward(self, x):
        return self.act(self.pre(x).squeeze(1))[:, None]


@pytest.mark.parametrize("mode", MODES)
def test_prelu_on_scalars_matches_reference(mode):
    torch.manual_seed(0)
    model = ScalarPReLU()
    _randomize(model, 0)
    check_against_reference(*_batch(model, (5, 3), 0), mode=mode, clip="abadi")


def instancenorm_case(nd: int, seed: int):
    rng = rng_for("instancenorm", nd, seed)
    B, C = rng.randint(3, 4), rng.randint(1, 3)
    spatial = [rng.randint(2, 4 if nd < 3 else 2) for _ in range(nd)]
    torch.manual_seed(seed)
    norm = INSTANCE[nd](C, affine=True)
    _randomize(norm, seed)
    if seed % 2:  # a trainable conv before it (no bias: the norm removes it)
        c0 = rng.randint(1, 3)
        return _batch(nn.Sequential(CONV[nd](c0, C, 1, bias=False), norm), (B, c0, *spatial), seed)
    return _batch(nn.Sequential(norm), (B, C, *spatial), seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_instancenorm_matches_reference(nd, mode, seed):
    for clip in CLIPS:
        check_against_reference(*instancenorm_case(nd, seed), mode=mode, clip=clip)


def conv_transpose_case(nd: int, seed: int):
    rng = rng_for("conv_transpose", nd, seed)
    B = rng.randint(2, 4)
    groups = rng.randint(1, 2)
    cin, cout = groups * rng.randint(1, 2), groups * rng.randint(1, 2)
    small = nd == 3
    kernel = tuple(rng.randint(1, 2 if small else 3) for _ in range(nd))
    stride = tuple(rng.randint(1, 3) for _ in range(nd))
    dilation = tuple(rng.randint(1, 2) for _ in range(nd))
    padding = tuple(rng.randint(0, 1) for _ in range(nd))
    # output_padding must be smaller than the stride or the dilation
    output_padding = tuple(rng.randint(0, max(s, d) - 1) for s, d in zip(stride, dilation))
    bias = rng.random() < 0.7
    sizes = [rng.randint(2, 3 if small else 4) for _ in range(nd)]
    torch.manual_seed(seed)
    layer = CONV_T[nd](cin, cout, kernel, stride=stride, padding=padding,
                       output_padding=output_padding, groups=groups, bias=bias, dilation=dilation)
    if seed % 2:  # a trainable 1×1 conv and tanh before it: its input requires grad
        c0 = rng.randint(1, 3)
        return _batch(nn.Sequential(CONV[nd](c0, cin, 1), nn.Tanh(), layer), (B, c0, *sizes), seed)
    return _batch(nn.Sequential(layer), (B, cin, *sizes), seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_transpose_matches_reference(nd, mode, seed):
    for clip in CLIPS:
        check_against_reference(*conv_transpose_case(nd, seed), mode=mode, clip=clip)


class TwiceTransposed(nn.Module):
    """One ConvTranspose2d applied twice (the per-sample gradient is the sum of both calls'), the
    second time with an ``output_size`` that picks another output_padding."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        size = [2 * s - 1 for s in h.shape[2:]]  # output_padding 0
        return self.up(h, output_size=size)


@pytest.mark.parametrize("mode", MODES)
def test_conv_transpose_called_twice(mode):
    torch.manual_seed(0)
    model, inputs = _batch(TwiceTransposed(), (3, 2, 3, 3), 0)
    check_against_reference(model, inputs, mode=mode, clip="abadi")


# -- weight normalisation: W = g·v/‖v‖ (torch.nn.utils.parametrizations.weight_norm, the older
# torch.nn.utils.weight_norm hook), clipped through g and v by the torch.func fallback -----------
def weight_norm_case(kind: str, seed: int):
    from torch.nn.utils import parametrizations, weight_norm

    rng = rng_for("weight_norm", kind, seed)
    B = rng.randint(3, 4)
    torch.manual_seed(seed)
    if kind.startswith("linear"):
        layer, shape = nn.Linear(3, 4), (B, rng.randint(1, 3), 3)
    elif kind == "conv":
        layer, shape = nn.Conv2d(2, 3, 2, padding=1), (B, 2, 3, 3)
    else:
        layer, shape = nn.ConvTranspose1d(2, 3, 3, stride=2), (B, 2, 3)
    if kind == "linear_hook":
        layer = weight_norm(layer)
    else:
        layer = parametrizations.weight_norm(layer, dim=None if kind == "linear_whole" else 0)
    _randomize(layer, seed)
    pre = nn.Linear(shape[-1], shape[-1]) if kind.startswith("linear") else nn.Identity()
    return _batch(nn.Sequential(pre, nn.Tanh(), layer), shape, seed)


@pytest.mark.filterwarnings("ignore:these modules are clipped by the torch.func fallback")
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["linear", "linear_whole", "linear_hook", "conv", "conv_t"])
def test_weight_norm_matches_reference(kind, mode):
    model, inputs = weight_norm_case(kind, 0)
    names = [n for n, p in model.named_parameters()]
    assert any("original1" in n or "weight_v" in n for n in names), names
    for clip in CLIPS:
        # the hook of torch.nn.utils.weight_norm leaves a non-leaf ``weight`` attribute after a
        # forward with grad, which the reference's deepcopy cannot copy: recompute it without grad
        with torch.no_grad():
            model(inputs[0])
        check_against_reference(model, inputs, mode=mode, clip=clip)


def test_spectral_norm_stays_refused():
    """spectral_norm's power iteration writes its buffers from the data in every training forward:
    refused, naming the buffer."""
    from torch.nn.utils import parametrizations

    import private_engine as pe

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(3, 4)))
    with pytest.raises(ValueError, match="_u of _SpectralNorm was modified"):
        engine = pe.PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0,
                                  noise_multiplier=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(opt)
        opt.step(loss=model(torch.randn(3, 3)).pow(2).sum(1))


# -- transformers' Llama-family RMSNorm (x̂ computed in float32, cast back to the input dtype) ---
def test_transformers_rmsnorm_classes_share_llamas_forward():
    """Each class the rule is registered for computes what LlamaRMSNorm computes."""
    import importlib
    import inspect

    pytest.importorskip("transformers")
    from private_engine.layers.normalization import HF_RMSNORMS

    llama = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm
    for name in HF_RMSNORMS:
        module_name, cls_name = name.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), cls_name)
        assert f"{cls.__module__}.{cls.__qualname__}" == name
        assert inspect.getsource(cls.forward) == inspect.getsource(llama.forward), name
        norm = cls(5, eps=1e-5)
        assert norm.weight.shape == (5,) and norm.variance_epsilon == 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_transformers_rmsnorm_matches_reference(mode):
    modeling = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    for seed, clip in zip(SEEDS, CLIPS):
        rng = rng_for("hf_rmsnorm", seed)
        B, T, d = rng.randint(3, 5), rng.randint(1, 3), rng.randint(2, 5)
        torch.manual_seed(seed)
        norm = modeling.Qwen2RMSNorm(d, eps=1e-3)
        _randomize(norm, seed)
        model, inputs = _batch(nn.Sequential(nn.Linear(2, d), norm), (B, T, 2), seed)
        engine = check_against_reference(model, inputs, mode=mode, clip=clip)
        # by the rule (the parameter tracer, which clips a lone norm's ``weight * x̂`` too, loses
        # the batch inside attention blocks)
        assert "Qwen2RMSNorm" in [d.layer_type for d in engine.layer_plan]
