"""Whole models: unsupported trainable parameters, timm ViT, fix_batchnorm on torchvision and timm
models, and subclasses whose forward changes the math of their parent layer."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES, check_against_reference, gen_for, make_engine, target_like
from private_engine.guards import model_check

pytestmark = pytest.mark.usefixtures("one_thread")

timm = pytest.importorskip("timm")


def ce_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _images(B, C, H, W, classes, seed=0):
    gen = gen_for(seed)
    return [torch.randn(B, C, H, W, generator=gen, dtype=torch.float64),
            torch.randint(0, classes, (B,), generator=gen)]


# -- parameters without a rule -------------------------------------------------------------------
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.ones(4))  # used directly: no rule

    def forward(self, x):
        return self.fc(x) * self.scale


class WithRawParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Scaled()
        self.shift = nn.Parameter(torch.zeros(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.block(x) + self.shift))


def test_raw_parameters_clipped_by_the_tracer():
    """Parameters without a layer rule (``x * scale``, ``x + shift``) go to the parameter-entry
    tracer."""
    model = WithRawParams().double()
    assert sorted(model_check.traced_parameters(model)) == ["block.scale", "shift"]
    with torch.no_grad():
        model.block.scale.uniform_(0.5, 1.5)
        model.shift.uniform_(-0.5, 0.5)
    gen = gen_for(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (5,), generator=gen)
    for mode in MODES:
        engine = check_against_reference(model, [x, y], ce_loss, mode=mode, clip="abadi")
    assert {"block.scale", "shift"} <= {d.name for d in engine.layer_plan
                                        if d.layer_type == "param-entry"}
    model.block.scale.requires_grad_(False)  # frozen: not traced, not clipped
    model.shift.requires_grad_(False)
    assert model_check.traced_parameters(model) == []
    for mode in MODES:
        check_against_reference(model, [x, y], ce_loss, mode=mode, clip="abadi")


def _small_vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2,
                             embed_dim=24, num_heads=2, num_classes=3).double()


def test_timm_vit_cls_token_and_pos_embed():
    """cls_token/pos_embed are clipped by the tracer; freezing them still works
    (tests/models/test_timm_families.py has the full matrix)."""
    model = _small_vit()
    assert sorted(model_check.traced_parameters(model)) == ["cls_token", "pos_embed"]
    inputs = _images(3, 3, 16, 16, 3)
    engine = check_against_reference(model, inputs, ce_loss, mode="mixed", clip="abadi")
    assert {"cls_token", "pos_embed"} <= {d.name for d in engine.layer_plan}
    model.cls_token.requires_grad_(False)
    model.pos_embed.requires_grad_(False)
    for mode in MODES:
        engine = check_against_reference(model, inputs, ce_loss, mode=mode, clip="abadi",
                                         check_step=mode == "mixed")
    layer_types = {d.layer_type for d in engine.layer_plan}
    assert {"Linear", "Conv2d", "LayerNorm"} <= layer_types


# -- BatchNorm and fix_batchnorm -------------------------------------------------------------------
def _no_batchnorm(model):
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_fix_batchnorm_torchvision_resnet18():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=3)
    with pytest.raises(ValueError, match="fix_batchnorm"):
        make_engine(model, 2)
    model = pe.fix_batchnorm(model)
    assert _no_batchnorm(model)
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    model = model.double()
    inputs = _images(2, 3, 16, 16, 3)
    check_against_reference(model, inputs, ce_loss, mode="mixed", clip="abadi", check_step=False)


def test_fix_batchnorm_timm_batchnormact():
    """timm's BatchNormAct2d (norm + activation in one module) becomes GroupNorm + the same
    activation."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", num_classes=3)
    acts = [type(m.act) for m in model.modules() if isinstance(m, BatchNormAct2d)]
    assert acts and any(a is not nn.Identity for a in acts)
    with pytest.raises(ValueError, match="fix_batchnorm"):
        make_engine(model, 2)
    model = pe.fix_batchnorm(model)
    assert _no_batchnorm(model)
    model = model.double()
    inputs = _images(3, 3, 16, 16, 3)
    for mode in ("mixed", "ghost"):
        check_against_reference(model, inputs, ce_loss, mode=mode, clip="abadi",
                                check_step=mode == "mixed")
    # the activations are kept
    fixed_acts = [type(m) for m in model.modules() if isinstance(m, (nn.SiLU, nn.ReLU, nn.GELU))]
    assert len(fixed_acts) >= sum(a is not nn.Identity for a in acts)


# -- subclasses that change their parent's math ----------------------------------------------------
def _changed_math_models():
    from timm.layers import GroupNormAct, LayerNorm2d, StdConv2d

    return {
        # normalises the channel dim of NCHW: with W == C the LayerNorm shape check cannot tell
        "LayerNorm2d": (nn.Sequential(nn.Conv2d(3, 4, 1), LayerNorm2d(4)), (3, 3, 2, 4)),
        # norm followed by an activation inside the module: the hooked output gradient is
        # post-activation
        "GroupNormAct": (nn.Sequential(nn.Conv2d(3, 4, 1), GroupNormAct(4, num_groups=2)),
                         (3, 3, 4, 4)),
        # weight standardisation: the gradient w.r.t. the raw weight is not g·U(a)
        "StdConv2d": (nn.Sequential(StdConv2d(3, 4, 3)), (3, 3, 5, 5)),
    }


@pytest.mark.parametrize("name", ["LayerNorm2d", "GroupNormAct", "StdConv2d"])
def test_subclass_with_other_forward_goes_to_the_fallback(name):
    """A subclass that overrides forward must not silently inherit its parent's rule: its per-sample
    norms would be wrong (not a shape error, a wrong number), so the sensitivity would exceed R. It
    is clipped by the torch.func fallback instead (one warning naming it), exactly."""
    model, shape = _changed_math_models()[name]
    model = model.double()
    with pytest.warns(UserWarning, match="fallback") as rec:
        make_engine(model, shape[0]).detach()
    assert (sum("fallback" in str(w.message) for w in rec) == 1
            and f"({name})" in str(rec[0].message))
    gen = gen_for(1)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    t = target_like(model, x, gen)
    for mode in MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = check_against_reference(model, [x, t], mode=mode, clip="abadi")
    assert any(d.layer_type.startswith("fallback") for d in engine.layer_plan)


def test_registered_rule_for_a_subclass_is_used():
    """The way out for a same-math subclass: register the parent's rule for it."""
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    model = nn.Sequential(MyLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with pytest.warns(UserWarning, match="fallback"):  # without the rule: the slow path
        make_engine(model, 4).detach()
    pe.layers.register_rule(pe.layers.find_rule(nn.Linear(1, 1)), MyLinear)
    gen = gen_for(0)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (4,), generator=gen)
    check_against_reference(model, [x, y], ce_loss, mode="ghost", clip="abadi")


def test_subclass_without_forward_override_inherits_rule():
    class Plain(nn.Conv1d):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(Plain(2, 3, 3, padding="same", dilation=2), nn.Flatten(),
                          nn.Linear(15, 2)).double()
    gen = gen_for(0)
    x = torch.randn(4, 2, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (4,), generator=gen)
    for mode in MODES:
        check_against_reference(model, [x, y], ce_loss, mode=mode, clip="abadi")


def test_timm_linear_same_math():
    """timm's Linear overrides forward only for TorchScript: listed as same-math, checked here."""
    from timm.layers import Linear as TimmLinear

    torch.manual_seed(0)
    model = nn.Sequential(TimmLinear(3, 4), nn.Tanh(), TimmLinear(4, 2)).double()
    gen = gen_for(0)
    x = torch.randn(5, 2, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 2, 2, generator=gen, dtype=torch.float64)
    for mode in MODES:
        check_against_reference(model, [x, y], mode=mode, clip="abadi")
