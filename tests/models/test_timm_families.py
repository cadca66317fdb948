"""Every trainable parameter of the common timm vision families, clipped exactly
(issue 4, engine side).

Each family is built tiny (pretrained=False), every parameter trainable, BatchNorm replaced by
``fix_batchnorm``, in float64. The parameters without a layer rule (tokens, pos_embed, gammas,
temperature, gating, bias tables) get random values of order one (timm initialises some to zero
or 1e-5, which would hide a wrong per-sample attribution). For every clipping mode:

(a) every trainable parameter receives a non-zero clipped gradient;
(b) the clipped sum (noise 0, abadi, a threshold between the per-sample norms) and the norms equal
    the float64 one-sample-at-a-time reference (tests/reference.py) to 1e-6 relative, as does an
    SGD step through the attached optimizer (mixed mode).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import private_engine as pe
from engine_checks import MODES, check_against_reference, gen_for, make_engine
from private_engine.guards import model_check
from reference import assert_close_rel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

timm = pytest.importorskip("timm")

RTOL = 1e-6
S = dict(img_size=32, num_classes=3, drop_path_rate=0.0)
FAMILIES = {
    # family: (timm name, kwargs, image size, mechanism we expect for the non-layer parameters)
    "vit_reg": ("vit_tiny_patch16_224",
                dict(S, patch_size=8, embed_dim=16, depth=1, num_heads=2, reg_tokens=2,
                     init_values=0.1), 32),
    "deit_distilled": ("deit_tiny_distilled_patch16_224",
                       dict(S, patch_size=8, embed_dim=16, depth=1, num_heads=2), 32),
    "beit": ("beit_base_patch16_224",
             dict(S, patch_size=8, embed_dim=16, depth=1, num_heads=2), 32),
    "convit": ("convit_tiny",
               dict(S, patch_size=8, embed_dim=16, depth=2, num_heads=2, local_up_to_layer=1), 32),
    "crossvit": ("crossvit_tiny_240",
                 dict(img_size=(32, 48), patch_size=(8, 16), embed_dim=(16, 16),
                      depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2, 2, 1), num_classes=3),
                 48),
    "cait": ("cait_xxs24_224",
             dict(S, patch_size=8, embed_dim=16, depth=1, depth_token_only=1, num_heads=2), 32),
    "xcit": ("xcit_nano_12_p16_224",
             dict(S, patch_size=16, embed_dim=16, depth=1, cls_attn_layers=1, num_heads=2), 32),
    "pit": ("pit_ti_224",
            dict(img_size=32, num_classes=3, patch_size=8, stride=4, base_dims=[8, 8],
                 depth=[1, 1], heads=[2, 2]), 32),
    # depths (2, 1): the second block of stage 0 uses shifted windows (bias table + window mask)
    "swin": ("swin_tiny_patch4_window7_224",
             dict(S, patch_size=4, window_size=4, embed_dim=16, depths=(2, 1), num_heads=(2, 2)),
             32),
    "visformer": ("visformer_tiny",
                  dict(img_size=32, num_classes=3, init_channels=8, embed_dim=32, depth=(1, 1, 1),
                       num_heads=2), 32),
    # 64 px: 4×4 tokens in stage 0, 2×2 in stage 1 (at 32 px stage 1 has one token: its bias gets
    # no gradient)
    # BEiT-style q_bias/v_bias with F.linear(x, qkv.weight, …) + RoPE; the bias/qkv paths of BEiT,
    # at rule speed
    "eva": ("eva02_tiny_patch14_224",
            dict(S, img_size=28, patch_size=14, embed_dim=16, depth=1, num_heads=2), 28),
    # continuous position bias MLP on a fixed grid (handed over to the tracer), logit_scale,
    # q/v bias
    "swinv2": ("swinv2_tiny_window8_256",
               dict(S, patch_size=4, window_size=4, embed_dim=16, depths=(2, 1),
                    num_heads=(2, 2)), 32),
    # attention pooling: latent.expand(B, …) fed to a Linear; no_embed_class and dynamic image size
    "vit_map": ("vit_tiny_patch16_224",
                dict(S, patch_size=8, embed_dim=16, depth=1, num_heads=2, global_pool="map",
                     no_embed_class=True, dynamic_img_size=True), 32),
    "levit": ("levit_128s",
              dict(img_size=64, num_classes=3, embed_dim=(16, 24), key_dim=8, depth=(1, 1),
                   num_heads=(2, 2)), 64),
}


def ce_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _randomize_non_layer_params(model):
    """Order-one values for parameters that no layer rule covers (zeros/1e-5 at init would test
    little)."""
    gen = gen_for(1)
    with torch.no_grad():
        for name in model_check.traced_parameters(model):
            p = model.get_parameter(name)
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
                    + (0.5 if "gamma" in name else 0.0))
        # SwinV2 zero-initialises its post-norms (the blocks would add nothing)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) and m.weight is not None \
                    and not bool(m.weight.abs().sum() > 0):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen,
                                                     dtype=m.weight.dtype))


def build(family):
    name, kwargs, size = FAMILIES[family]
    torch.manual_seed(0)
    model = pe.fix_batchnorm(timm.create_model(name, pretrained=False, **kwargs),
                             num_groups=4).double()
    model.requires_grad_(True)
    _randomize_non_layer_params(model)
    gen = gen_for(2)
    x = torch.randn(3, 3, size, size, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1, 2])
    return model, [x, y]


def _check(model, inputs, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning is tested on its own
        engine = check_against_reference(model, inputs, ce_loss, mode=mode, clip="abadi", rtol=RTOL,
                                         check_step=mode == "mixed")
    return engine


def _every_param_gets_a_gradient(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = make_engine(model, inputs[0].shape[0], R=1e6)  # no clipping: the plain gradient
    grads, _ = engine.clipped_grad_sum(ce_loss(model, *inputs))
    engine.detach()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    zero = [n for n, g in zip(names, grads) if not bool(g.abs().sum() > 0)]
    assert not zero, f"trainable parameters without a gradient: {zero}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_clipped_exactly_in_every_mode(family):
    model, inputs = build(family)
    _every_param_gets_a_gradient(model, inputs)
    for mode in MODES:
        engine = _check(model, inputs, mode)
    # the non-layer parameters have their own rows in the plan (always instantiated)
    traced = set(model_check.traced_parameters(model))
    rows = {d.name for d in engine.layer_plan if d.layer_type == "param-entry"}
    assert traced <= rows | {n for n in traced
                             if n.startswith(tuple(model_check.fallback_modules(model)))}, \
        (traced, rows)


@pytest.mark.parametrize("family", ["beit", "eva", "swinv2"])
def test_qkv_weight_passed_to_f_linear_is_clipped_by_the_linear_rule(family):
    """``F.linear(x, self.qkv.weight, cat(q_bias, 0, v_bias))``: the qkv Linear never runs its
    forward; the tracer records the call for it (Linear rule, ghost or instantiated) and clips
    q_bias/v_bias as entries."""
    model, inputs = build(family)
    assert model_check.fallback_modules(model) == []
    engine = make_engine(model, 3, mode="ghost")
    engine.clipped_grad_sum(ce_loss(model, *inputs))
    engine.detach()
    qkv = [d for d in engine.layer_plan if d.name.endswith("attn.qkv")]
    assert qkv and all(d.layer_type == "Linear" and d.use_ghost for d in qkv), qkv
    assert any(d.name.endswith("attn.q_bias") and d.layer_type == "param-entry"
               for d in engine.layer_plan)


def test_resnet_with_groupnorm():
    from timm.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    model = pe.fix_batchnorm(ResNet(BasicBlock, [1, 1, 1, 1], channels=(8, 8, 16, 16), stem_width=8,
                                    num_classes=3), num_groups=4).double()
    gen = gen_for(3)
    inputs = [torch.randn(3, 3, 16, 16, generator=gen, dtype=torch.float64),
              torch.tensor([0, 1, 2])]
    _every_param_gets_a_gradient(model, inputs)
    for mode in MODES:
        _check(model, inputs, mode)
    assert not model_check.traced_parameters(model) and not model_check.fallback_modules(model)


def test_vit_fused_attention_stays_fused():
    """timm's fused attention (F.scaled_dot_product_attention) keeps running under the tracer."""
    model, inputs = build("vit_reg")
    assert model.blocks[0].attn.fused_attn
    seen = []
    orig = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(1)
        return orig(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        engine = make_engine(model, 3, R=1.0)
        engine.clipped_grad_sum(ce_loss(model, *inputs))
        engine.detach()
    finally:
        F.scaled_dot_product_attention = orig
    assert seen


# -- nn.MultiheadAttention (torch.func fallback) ---------------------------------------------------
class MHAModel(nn.Module):
    def __init__(self, d=8, heads=2, need_weights=False):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, 3)
        self.need_weights = need_weights

    def forward(self, x):
        h = self.inp(x)
        out, w = self.attn(h, h, h, need_weights=self.need_weights)
        y = self.head(out).mean(1)
        return y + w.sum((1, 2))[:, None] if self.need_weights else y


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention(need_weights):
    torch.manual_seed(0)
    model = MHAModel(need_weights=need_weights).double()
    gen = gen_for(4)
    inputs = [torch.randn(4, 5, 4, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0])]
    with pytest.warns(UserWarning, match="fallback") as rec:
        make_engine(model, 4).detach()
    assert sum("fallback" in str(w.message) for w in rec) == 1 and "attn" in str(rec[0].message)
    assert model_check.fallback_modules(model) == ["attn"]
    _every_param_gets_a_gradient(model, inputs)
    for mode in MODES:
        engine = _check(model, inputs, mode)
    assert any(d.layer_type == "fallback:MultiheadAttention" for d in engine.layer_plan)


def test_multihead_attention_as_the_whole_model():
    torch.manual_seed(0)
    model = nn.MultiheadAttention(6, 2, batch_first=True).double()
    gen = gen_for(5)
    x = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)

    def loss_fn(m, x):
        return m(x, x, x, need_weights=False)[0].pow(2).flatten(1).sum(1)

    for mode in MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_against_reference(model, [x], loss_fn, mode=mode, clip="abadi", rtol=RTOL,
                                    check_step=mode == "mixed")


# -- the tracer refuses what it cannot clip; the fallback takes it ---------------------------------
class MatmulParam(nn.Module):
    """A parameter used by an einsum with the batch: not an entry op of the tracer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.einsum("bi,ij->bj", x, self.w)


class WithMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.mm = MatmulParam()
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.mm(torch.tanh(self.fc(x)))))


def test_unsupported_entry_is_refused_then_fallback_registered():
    torch.manual_seed(0)
    model = WithMatmul().double()
    gen = gen_for(6)
    inputs = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 1])]
    engine = make_engine(model, 5)
    with pytest.raises(ValueError) as err:
        engine.clipped_grad_sum(ce_loss(model, *inputs))
    msg = str(err.value)
    assert "mm.w" in msg and "register_fallback" in msg, msg
    engine.detach()
    pe.layers.register_fallback(MatmulParam)
    try:
        with pytest.warns(UserWarning, match=r"fallback.*: mm \(MatmulParam\)$"):
            make_engine(model, 5).detach()
        for mode in MODES:
            _check(model, inputs, mode)
    finally:
        pe.layers.unregister(MatmulParam)


class Windows(nn.Module):
    """A fallback module that sees k·B rows (two windows per sample), with a constant kwarg."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x, scale=None):
        return torch.tanh(x @ self.w + self.b) * scale


class WindowModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.win = Windows()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x):  # x: (B, 2, 3)
        h = self.win(self.fc(x).reshape(-1, 3), scale=self.scale)
        return h.reshape(x.shape[0], -1).sum(1, keepdim=True)


def test_fallback_unit_against_reference_with_rows_per_sample():
    pe.layers.register_fallback(Windows)
    try:
        torch.manual_seed(0)
        model = WindowModel().double()
        gen = gen_for(7)
        x = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)

        def loss_fn(m, x):
            return m(x).pow(2).sum(1)

        for mode in MODES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_against_reference(model, [x], loss_fn, mode=mode, clip="abadi", rtol=RTOL)
    finally:
        pe.layers.unregister(Windows)


def test_traced_parameter_used_outside_the_forward_is_refused():
    model, inputs = build("vit_reg")
    engine = make_engine(model, 3)
    loss = ce_loss(model, *inputs) + model.cls_token.sum()  # a use the tracer never saw
    with pytest.raises(ValueError, match="cls_token"):
        engine.clipped_grad_sum(loss)
    engine.detach()


def _reference_per_sample(model, inputs, loss_fn):
    """``{name: (B, *shape)}``: one backward per sample, float64."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    out = {n: [] for n in names}
    for i in range(inputs[0].shape[0]):
        grads = torch.autograd.grad(loss_fn(model, *[t[i:i + 1] for t in inputs]).sum(), params,
                                    allow_unused=True)
        for n, p, g in zip(names, params, grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def spy_extra_grads(engine) -> dict:
    """``{parameter name: (B, *shape)}``: the per-sample gradients the clipper receives from the
    parameter tracer and the fallback modules in the next norm pass (what it norms and sums)."""
    got = {}
    clipper = engine.clipper
    if clipper.tracer is not None:
        tracer_grads = clipper.tracer.per_sample_grads

        def spied_tracer():
            out = tracer_grads()
            got.update(out)
            return out

        clipper.tracer.per_sample_grads = spied_tracer
    for fb in clipper.fallbacks:
        def spied_fallback(B, fb=fb, original=fb.per_sample_grads):
            out = original(B)
            prefix = f"{fb.name}." if fb.name else ""
            got.update({prefix + n: g for n, g in out.items()})
            return out

        fb.per_sample_grads = spied_fallback
    return got


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["mha"])
def test_per_sample_grads_of_traced_and_fallback_params(family):
    """Per parameter, not only through the total norm: a small parameter (a bias table) attributed
    to the wrong sample would move the total norm below the tolerance."""
    if family == "mha":
        torch.manual_seed(0)
        model = MHAModel().double()
        inputs = [torch.randn(4, 5, 4, generator=gen_for(4), dtype=torch.float64),
                  torch.tensor([0, 1, 2, 0])]
    else:
        model, inputs = build(family)
    B = inputs[0].shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = make_engine(model, B, R=1.0)
    got = spy_extra_grads(engine)
    grads, _ = engine.clipped_grad_sum(ce_loss(model, *inputs))
    factors = torch.linspace(0.2, 1.0, B, dtype=torch.float64)
    all_weighted = {n: torch.tensordot(factors.to(g.dtype), g, dims=1) for n, g in got.items()}
    engine.detach()
    expected = set(model_check.traced_parameters(model))
    for f in model_check.fallback_modules(model):
        expected |= {f"{f}.{n}" for n, p in model.get_submodule(f).named_parameters()
                     if p.requires_grad}
    assert expected <= set(got), expected - set(got)
    ref = _reference_per_sample(model, inputs, ce_loss)
    names = sorted(got)
    assert_close_rel([got[n] for n in names], [ref[n] for n in names], 1e-9, names)
    # book-keeping: Σ_i C_i ∂L_i/∂P from the per-sample gradients of the last norm pass
    assert set(all_weighted) == set(got)
    assert_close_rel([all_weighted[n] for n in names],
                     [torch.tensordot(factors, ref[n], dims=1) for n in names], 1e-9, names)


# -- tracer special paths, unit-sized --------------------------------------------------------------
class PendingBias(nn.Module):
    """A bias table plus an n-row constant (like Swin's bias + shifted-window mask summed before
    SDPA): the one-row table is spread over rows before it meets the k·B batched rows."""

    def __init__(self, via_sdpa=True):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(3, 3))
        self.register_buffer("mask", torch.randn(2, 3, 3))
        self.via_sdpa = via_sdpa

    def forward(self, x):  # x: (B, 2, 3, 4), two windows per sample
        h = self.fc(x).reshape(-1, 3, 4)
        # (2B, 3, 3), batch-free
        spread = self.table.unsqueeze(0) + self.mask.repeat(h.shape[0] // 2, 1, 1)
        if self.via_sdpa:
            out = F.scaled_dot_product_attention(h, h, h, attn_mask=spread)
        else:
            out = torch.softmax(h @ h.transpose(1, 2) * 0.5 + spread, -1) @ h
        return out.reshape(x.shape[0], -1)


@pytest.mark.parametrize("via_sdpa", [True, False])
def test_pending_rows_entry_against_reference(via_sdpa):
    torch.manual_seed(0)
    model = PendingBias(via_sdpa).double()
    x = torch.randn(3, 2, 3, 4, generator=gen_for(8), dtype=torch.float64)

    def loss_fn(m, x):
        return m(x).pow(2).sum(1)

    for mode in MODES:
        check_against_reference(model, [x], loss_fn, mode=mode, clip="abadi", rtol=RTOL)
    engine = make_engine(model, 3)
    kept = spy_extra_grads(engine)
    engine.clipped_grad_sum(loss_fn(model, x))
    got = kept["table"]
    engine.detach()
    ref = _reference_per_sample(model, [x], loss_fn)["table"]
    assert_close_rel([got], [ref], 1e-9, ["table"])


class RowMixing(nn.Module):
    """The spread table goes through a matmul (not elementwise) before meeting the batch:
    refused."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.table = nn.Parameter(torch.randn(3, 3))
        self.register_buffer("mask", torch.randn(4, 3, 3))

    def forward(self, x):  # x: (B, 3, 3)
        spread = (self.table.unsqueeze(0) + self.mask) @ self.mask  # rows spread, then a matmul
        return (self.fc(x) + spread[: x.shape[0]]).flatten(1).sum(1, keepdim=True)


def test_spread_rows_through_a_non_elementwise_op_are_refused():
    model = RowMixing().double()
    engine = make_engine(model, 4)
    with pytest.raises(ValueError, match="table"):
        engine.clipped_grad_sum(model(torch.randn(4, 3, 3, dtype=torch.float64)).sum(1))
    engine.detach()


class UnusedBias(nn.Module):
    """Passes its child's weight to F.linear with its own bias while the child's bias is
    trainable."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(3, 3)  # bias trainable but never used
        self.q_bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return F.linear(x, self.qkv.weight, self.q_bias * 2)


def test_child_weight_with_unused_trainable_bias_is_refused():
    model = UnusedBias().double()
    engine = make_engine(model, 4)
    with pytest.raises(ValueError, match="qkv"):
        engine.clipped_grad_sum(model(torch.randn(4, 3, dtype=torch.float64)).sum(1))
    engine.detach()
    model.qkv.bias.requires_grad_(False)
    x = torch.randn(4, 3, generator=gen_for(9), dtype=torch.float64)
    for mode in MODES:
        check_against_reference(model, [x], lambda m, x: m(x).pow(2).sum(1), mode=mode,
                                clip="abadi", rtol=RTOL)


class SeqFirst(nn.Module):
    """A Linear on a sequence-first view (L, B, d) with L = 2B: its rows are not sample-major."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        # a traced parameter: the tracer follows the layout
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):  # x: (B, 2B, 3)
        h = self.fc(x.transpose(0, 1))
        return (h.transpose(0, 1) * self.scale).flatten(1).sum(1, keepdim=True)


def test_k_rows_per_sample_only_when_dim0_is_sample_major():
    model = SeqFirst().double()
    x = torch.randn(3, 6, 3, dtype=torch.float64)
    engine = make_engine(model, 3)
    with pytest.raises(ValueError, match="mixes samples.*layer fc"):  # the separability probe
        engine.clipped_grad_sum(model(x).pow(2).sum(1))
    engine.detach()


def test_fallback_refuses_a_sequence_first_input():
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            # batch_first=False: (L, B, E)
            self.inp, self.attn = nn.Linear(4, 6), nn.MultiheadAttention(6, 2)

        def forward(self, x):  # x: (B, L, 4)
            h = self.inp(x).transpose(0, 1)
            return self.attn(h, h, h, need_weights=False)[0].transpose(0, 1).flatten(1).sum(
                1, keepdim=True)

    wrapped = Wrap().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = make_engine(wrapped, 3)
    with pytest.raises(ValueError, match="batch_first=True"):
        wrapped(torch.randn(3, 6, 4, dtype=torch.float64))
    engine.detach()


@pytest.mark.parametrize("family", ["vit_reg", "beit", "swin", "eva"])
def test_other_attention_path(family):
    """timm's other attention branch: fused (SDPA, bias + window mask as attn_mask — Swin's is off
    by default) or explicit logits (bias tables and masks added to them)."""
    model, inputs = build(family)
    n = 0
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = not m.fused_attn
            n += 1
    assert n
    for mode in ("mixed", "per_sample"):
        _check(model, inputs, mode)


def test_frozen_patch_embedding():
    """The tokens still meet the batch when the patch embedding is frozen (its output needs no
    gradient)."""
    model, inputs = build("vit_reg")
    model.patch_embed.requires_grad_(False)
    for mode in MODES:
        _check(model, inputs, mode)


@pytest.mark.parametrize("family", ["vit_reg", "beit"])
def test_bfloat16_autocast_forward_is_unchanged(family):
    """Under CPU bfloat16 autocast the tracer's substitutions keep the forward (and F.linear's
    output dtype): without clipping, the engine's gradient equals the plain autocast gradient."""
    model, inputs = build(family)
    model = model.float()
    x, y = inputs[0].float(), inputs[1]
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.autograd.grad(ce_loss(model, x, y).sum(), params)
    engine = make_engine(model, 3, R=1e9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ce_loss(model, x, y)
    grads, _ = engine.clipped_grad_sum(loss)
    engine.detach()
    # one relative error over all parameters: autograd rounds each bfloat16 weight gradient to
    # bfloat16 (2⁻⁹ relative), the engine accumulates and keeps its clipped sums in float32, so they
    # agree to bfloat16 precision; a changed forward would differ by far more
    flat = [torch.cat([g.flatten() for g in gs]) for gs in (grads, plain)]
    assert_close_rel(flat[:1], flat[1:], 2 ** -7)


class ListArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, xs):
        return xs[0] * self.w


def test_fallback_refuses_tensors_inside_a_list():
    pe.layers.register_fallback(ListArg)
    try:
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.la = nn.Linear(3, 3), ListArg()

            def forward(self, x):
                return self.la([self.fc(x)]).sum(1, keepdim=True)

        m = M().double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = make_engine(m, 4)
        with pytest.raises(TypeError, match="list/tuple/dict"):
            m(torch.randn(4, 3, dtype=torch.float64))
        engine.detach()
    finally:
        pe.layers.unregister(ListArg)
