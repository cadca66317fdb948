"""The sample-separability probe (private_engine/guards/separability).

Targets are built as the engine's recorder builds them: the GradientEdge of the output of every
Linear / Conv2d / Embedding call, taken by a plain forward hook.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from private_engine.guards.separability import BatchMixingError, SeparabilityProbe
from private_engine.guards.separability import probe as probe_module

D, C = 6, 3


class Recorder:
    """``[(name, edge)]`` of every Linear/Conv2d/Embedding call (the engine's recorded calls).

    With ``layout``, the edge is that of the output's flat base when it has one (as ``hooks.py``
    records a 3-D Linear output): ``layout=()`` gives ``(name, edge)`` (the native engine),
    ``layout=(batch_dim,)`` gives ``(name, edge, batch_dim, output shape)``."""

    def __init__(self, model: nn.Module, layout=None):
        self.targets = []
        self.layout = layout
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules()
                        if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))]

    def _hook(self, name):
        def hook(module, inputs, output):
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor)
                    and output.requires_grad):
                return
            if self.layout is None:
                self.targets.append((name, get_gradient_edge(output)))
                return
            root = output._base if output._base is not None else output
            shape = (output.shape,) if self.layout else ()
            self.targets.append((name, get_gradient_edge(root), *self.layout, *shape))
        return hook

    def take(self):
        out, self.targets = self.targets, []
        return out


def probe_for(model, **kw):
    probe = SeparabilityProbe(model, **kw)
    probe.install()
    return probe, Recorder(model)


def per_sample_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def run_check(model, x, y, loss_fn=per_sample_ce, **kw):
    """One probed step: forward, per-sample losses, check; returns the probe."""
    probe, rec = probe_for(model)
    out = model(x, **kw)
    assert probe.pending
    probe.check(loss_fn(out, y), rec.take())
    assert not probe.pending
    return probe


class Mixer(nn.Module):
    """Linear -> ReLU -> mix(h) -> Linear, with ``mix`` the op under test."""

    def __init__(self, mix, d=D, hidden=8):
        super().__init__()
        self.a = nn.Linear(d, hidden)
        self.b = nn.Linear(hidden, C)
        self.mix = mix

    def forward(self, x):
        return self.b(self.mix(torch.relu(self.a(x))))


def batch(B=8, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, generator=g), torch.randint(0, C, (B,), generator=g)


# -- models that must be accepted ---------------------------------------------------------------
def test_plain_mlp_is_accepted_and_second_step_does_no_work(monkeypatch):
    torch.manual_seed(0)
    model = Mixer(lambda h: h)
    probe, rec = probe_for(model)
    x, y = batch()
    probe.check(per_sample_ce(model(x), y), rec.take())
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    seen = []
    model.a.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x2, y2 = batch(seed=1)
    out = model(x2)
    assert not probe.pending and seen[-1] is x2  # same signature: inputs untouched
    probe.check(per_sample_ce(out, y2), rec.take())
    assert calls == []
    # another batch size is the same signature (Poisson sampling does not re-probe)
    x3, y3 = batch(B=5, seed=2)
    model(x3)
    assert not probe.pending
    # eval mode is a new signature
    model.eval()
    model(x3)
    assert probe.pending


def test_new_signature_reprobes_and_mixing_there_is_caught():
    class ShapeBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x):
            h = self.a(x).mean(1)  # (B, T, C) -> (B, C)
            return h if x.shape[1] < 4 else h.flip(0)  # a bug on long sequences only

    model = ShapeBranch()
    probe, rec = probe_for(model)
    y = torch.randint(0, C, (4,))
    probe.check(per_sample_ce(model(torch.randn(4, 3, D)), y), rec.take())
    model(torch.randn(4, 3, D))
    assert not probe.pending
    rec.take()
    out = model(torch.randn(4, 5, D))
    assert probe.pending
    with pytest.raises(BatchMixingError, match="flip over dim 0"):
        probe.check(per_sample_ce(out, y), rec.take())


def test_signatures_are_capped(monkeypatch):
    monkeypatch.setattr(probe_module, "MAX_SIGNATURES", 3)
    model = nn.Sequential(nn.Linear(D, C))
    probe, rec = probe_for(model)
    for T in range(1, 7):
        out = model(torch.randn(4, T, D)).sum(1)
        probe.check(per_sample_ce(out, torch.zeros(4, dtype=torch.long)), rec.take())
    assert len(probe._forwards) == 3 and len(probe.records) == 3


def test_a_batch_of_one_sample_is_a_probed_step_without_a_verdict():
    """It cannot show mixing, but is one of the signature's probed batches (the batch size does
    not decide which batches run the probe): recorded without a verdict, no warning."""
    model = Mixer(lambda h: h)
    probe, rec = probe_for(model)
    x, y = batch(B=1)
    probe.check(per_sample_ce(model(x), y), rec.take())
    (record,) = probe.records.values()
    assert (record.probes, record.verdicts) == (1, 0) and record.unseen
    model(torch.randn(4, D))
    assert not probe.pending


def test_mae_random_masking_and_unshuffle_are_accepted():
    class MAE(nn.Module):
        def __init__(self, d=8, N=10, keep=4):
            super().__init__()
            self.keep = keep
            self.embed = nn.Linear(D, d)
            self.enc = nn.Linear(d, d)
            self.mask_token = nn.Parameter(torch.randn(1, 1, d))
            self.dec = nn.Linear(d, D)

        def forward(self, x):  # x: (B, N, D)
            B, N, _ = x.shape
            h = self.embed(x)
            d = h.shape[-1]
            noise = torch.rand(B, N)
            ids = noise.argsort(1)
            restore = ids.argsort(1)
            kept = torch.gather(h, 1, ids[:, :self.keep, None].expand(-1, -1, d))
            kept = torch.relu(self.enc(kept))
            full = torch.cat([kept, self.mask_token.expand(B, N - self.keep, -1)], 1)
            full = torch.gather(full, 1, restore[:, :, None].expand(-1, -1, d))
            return self.dec(full)

    torch.manual_seed(0)
    x = torch.randn(6, 10, D)
    run_check(MAE(), x, None, loss_fn=lambda out, _: (out - x).pow(2).mean((1, 2)))


def test_cls_token_attention_masks_dropout_and_pooling_are_accepted():
    class Tokens(nn.Module):
        def __init__(self, d=8, heads=2):
            super().__init__()
            self.embed = nn.Linear(D, d)
            self.cls = nn.Parameter(torch.randn(1, 1, d))
            self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
            self.qkv = nn.Linear(d, 3 * d)
            self.heads = heads
            self.drop = nn.Dropout(0.3)
            self.head = nn.Linear(2 * d, C)

        def forward(self, x, pad):  # pad: (B, T) True where padded
            B = x.shape[0]
            h = self.embed(x)
            h = torch.cat([self.cls.expand(B, -1, -1), h], 1)
            pad = torch.cat([torch.zeros(B, 1, dtype=torch.bool), pad], 1)
            a, _ = self.mha(h, h, h, key_padding_mask=pad)
            h = self.drop(h + a)
            q, k, v = self.qkv(h).view(B, h.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            allowed = ~pad[:, None, None, :]  # (B, 1, 1, T): attend to real tokens only
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            h = h + o.transpose(1, 2).reshape(h.shape)
            return self.head(torch.cat([h.mean(1), h.mean(-1) @ torch.ones(h.shape[1], h.shape[2])
                                        / h.shape[1]], -1))

    torch.manual_seed(0)
    B = T = 5  # T == B: the attention's internal sequence-first tensors do not matter
    x = torch.randn(B, T, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 3:] = True
    pad[4, 1:] = True
    model = Tokens().train()
    run_check(model, x, torch.randint(0, C, (B,)), pad=pad)


def test_swin_like_windows_with_k_rows_per_sample_are_accepted():
    class Windows(nn.Module):
        def __init__(self, k=4, d=8):
            super().__init__()
            self.k = k
            self.proj = nn.Linear(D, d)
            self.head = nn.Linear(d, C)

        def forward(self, x):  # (B, k*T, D) -> windows (B*k, T, d)
            B = x.shape[0]
            w = x.view(B, self.k, -1, D).flatten(0, 1)
            h = torch.relu(self.proj(w))  # the Linear sees B*k rows, k per sample
            return self.head(h.view(B, -1, h.shape[-1]).mean(1))

    torch.manual_seed(0)
    run_check(Windows(), torch.randn(3, 12, D), torch.randint(0, C, (3,)))


def test_conv_and_embedding_models_are_accepted():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, C))
    run_check(conv, torch.randn(4, 3, 8, 8), torch.randint(0, C, (4,)))

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.head = nn.Linear(8, C)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    run_check(Bag(), torch.randint(0, 20, (4, 7)), torch.randint(0, C, (4,)))


def test_timm_vit_is_accepted():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                              num_classes=10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    run_check(model.train(), x, y)
    # float16 autocast: CPU flash attention is exact to one rounding only (the tolerance)
    with torch.autocast("cpu", dtype=torch.float16):
        run_check(model, x, y, loss_fn=lambda o, y: per_sample_ce(o.float(), y))


def test_opacus_dplstm_is_accepted():
    layers = pytest.importorskip("opacus.layers")

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = layers.DPLSTM(D, 8, batch_first=True)
            self.head = nn.Linear(8, C)

        def forward(self, x):
            out, _ = self.lstm(x)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    run_check(Tagger(), torch.randn(4, 5, D), torch.randint(0, C, (4,)))


def test_in_place_ops_on_inputs_and_a_prior_root_pre_hook_see_the_copy():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x):
            x.mul_(2.0)  # in place on the model's input
            return self.a(x)

    model = InPlace()
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].requires_grad))
    run_check(model, torch.randn(4, D), torch.randint(0, C, (4,)))
    assert seen == [True]  # hooks that look at inputs (the engine's tracer) see the copy


def test_bfloat16_autocast_is_accepted_and_mixing_still_caught():
    torch.manual_seed(0)
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run_check(Mixer(lambda h: h), x, y)
    with pytest.raises(BatchMixingError, match="flip over dim 0"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run_check(Mixer(lambda h: h.flip(0)), x, y)


@pytest.mark.parametrize("scale", [2.0 ** -12, 1.0, 2.0 ** 13])
def test_float16_models_with_small_or_large_loss_scales_are_accepted(scale):
    # small: float16 gradients in the subnormal range (both passes are scaled up first);
    # large: weights > 1 would overflow (the weights only scale down)
    torch.manual_seed(0)
    x, y = batch()
    run_check(Mixer(lambda h: h).half(), x.half(), y,
              loss_fn=lambda o, y: per_sample_ce(o.float(), y).half() * scale)
    with pytest.raises(BatchMixingError, match="flip over dim 0"):
        run_check(Mixer(lambda h: h.flip(0)).half(), x.half(), y,
                  loss_fn=lambda o, y: per_sample_ce(o.float(), y).half() * scale)


def test_float32_overflow_of_the_weighted_pass_is_retried_with_smaller_weights():
    torch.manual_seed(0)
    x, y = batch()

    def huge(o, y):  # weights up to 2^7 (8 samples) overflow float32 gradients
        return per_sample_ce(o, y) * 1e37

    run_check(Mixer(lambda h: h), x, y, loss_fn=huge)
    with pytest.raises(BatchMixingError, match="flip over dim 0"):
        run_check(Mixer(lambda h: h.flip(0)), x, y, loss_fn=huge)


def test_non_finite_gradients_leave_the_other_samples_to_compare():
    """A sample whose gradients are not finite is not compared; the others are, so the batch
    has a verdict (recorded, no warning), and the next batch is not probed."""
    model = Mixer(lambda h: h)
    probe, rec = probe_for(model)
    x, y = batch()
    x[2, 0] = float("inf")  # sample 2's gradients are not finite: its rows cannot be compared
    probe.check(per_sample_ce(model(x), y), rec.take())
    (record,) = probe.records.values()
    assert (record.probes, record.verdicts, record.unseen) == (1, 1, {})
    model(batch()[0])
    assert not probe.pending


# -- models that must be rejected ---------------------------------------------------------------
MIXING_OPS = {
    "mean over batch": (lambda h: h - h.mean(0), "mean over dim 0"),
    "flip": (lambda h: h.flip(0), "flip over dim 0"),
    "softmax over batch": (lambda h: torch.softmax(h, 0), "softmax over dim 0"),
    "roll": (lambda h: h.roll(1, 0), "roll over dim 0"),
    "random permutation": (lambda h: h[torch.randperm(h.shape[0])], "indexing"),
}


@pytest.mark.parametrize("case", sorted(MIXING_OPS))
def test_ops_that_mix_rows_are_rejected_naming_layer_and_op(case):
    torch.manual_seed(0)
    mix, op = MIXING_OPS[case]
    x, y = batch()
    with pytest.raises(BatchMixingError) as info:
        run_check(Mixer(mix), x, y)
    msg = str(info.value)
    assert "layer a" in msg and op in msg
    assert "no reductions, sorting, flipping or softmax over the batch dimension" in msg


def test_mean_over_batch_named_when_hidden_size_equals_batch_size():
    x, y = batch(B=8)
    with pytest.raises(BatchMixingError, match=r"mean over dim 0 \(MeanBackward1\)"):
        run_check(Mixer(lambda h: h - h.mean(0), hidden=8), x, y)


def test_loss_out_of_batch_order_is_rejected():
    torch.manual_seed(0)
    x, y = batch()
    with pytest.raises(BatchMixingError, match="layer b.*flip over dim 0") as info:
        run_check(Mixer(lambda h: h), x, y, loss_fn=lambda o, y: per_sample_ce(o, y).flip(0))
    assert "entry i must be sample i's loss" in str(info.value)
    with pytest.raises(BatchMixingError, match="layer b.*flip over dim 0"):
        run_check(Mixer(lambda h: h), x, y, loss_fn=lambda o, y: per_sample_ce(o.flip(0), y))


def test_sequence_first_linear_with_T_equal_B_is_rejected():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, 8)
            self.head = nn.Linear(8, C)

        def forward(self, x):  # (B, T, D) -> (T, B, D): the Linear's rows are positions
            h = torch.relu(self.proj(x.transpose(0, 1)))
            return self.head(h.transpose(0, 1).mean(1))

    torch.manual_seed(0)
    B = T = 4  # the shapes cannot tell: (T, B, d) has B rows
    with pytest.raises(BatchMixingError, match="layer proj.*transpose of dims 0 and 1"):
        run_check(SeqFirst(), torch.randn(B, T, D), torch.randint(0, C, (B,)))


def test_sequence_first_linear_recorded_by_its_flat_base_is_rejected():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, 8)
            self.head = nn.Linear(8, C)

        def forward(self, x):  # (B, T, D), T != B: the Linear's flat base has T·B rows
            h = torch.relu(self.proj(x.transpose(0, 1).contiguous()))
            return self.head(h.mean(0))

    torch.manual_seed(0)
    model = SeqFirst()
    probe = SeparabilityProbe(model)
    probe.install()
    rec = Recorder(model, layout=())
    x, y = torch.randn(4, 6, D), torch.randint(0, C, (4,))
    # rows t·B + b of the (T·B, 8) base are not sample-major (T consecutive rows per sample)
    with pytest.raises(BatchMixingError, match=r"layer proj.*view/reshape \(ViewBackward0\)"):
        probe.check(per_sample_ce(model(x), y), rec.take())
    # told its layout (batch in dim 1 of the (T, B, 8) output), the same call is per sample
    for T, layout in ((6, (1,)), (5, (None,))):  # a new sequence length: a new signature
        rec.layout = layout
        out = model(torch.randn(4, T, D))
        assert probe.pending
        probe.check(per_sample_ce(out, y), rec.take())


def test_unknown_layouts_opacus_batch_first_false():
    class SeqFirstText(nn.Module):  # batch-first float input, sequence-first layers, (B, C) out
        def __init__(self, mix=lambda h: h):
            super().__init__()
            self.emb = nn.Linear(D, 8)
            self.fc = nn.Linear(8, C)
            self.mix = mix

        def forward(self, x):  # x: (B, T, D)
            h = torch.tanh(self.emb(x.transpose(0, 1)))  # (T, B, 8)
            return self.fc(self.mix(h))[-1]  # (B, C)

    torch.manual_seed(0)
    B, T = 4, 4  # T == B: the layouts cannot be told apart by shape
    x = torch.randn(B, T, D)
    for mix, ok in ((lambda h: h, True), (lambda h: h.flip(1), False)):
        model = SeqFirstText(mix)
        probe = SeparabilityProbe(model, batch_dim=None)
        probe.install()
        rec = Recorder(model, layout=(None,))
        out = model(x)
        if ok:
            probe.check_outputs(out, rec.take(), batch_dim=None, batch_size=B)
            assert not probe.pending
        else:
            with pytest.raises(BatchMixingError, match="flip over dim 1"):
                probe.check_outputs(out, rec.take(), batch_dim=None, batch_size=B)


def test_mixing_the_input_before_the_first_layer_is_rejected():
    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x):
            return self.a(x - x.mean(0))

    x, y = batch()
    with pytest.raises(BatchMixingError, match=r"model input args\[0\] \(before the first "
                                               r"clipped layer\).*mean over dim 0"):
        run_check(Centered(), x, y)


def test_mixing_in_a_keyword_input_is_named():
    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x, *, extra):
            return self.a(x + extra.roll(1, 0))

    x, y = batch()
    with pytest.raises(BatchMixingError, match=r"model input extra .*roll over dim 0"):
        run_check(Kw(), x, y, extra=torch.randn(8, D))


def test_failed_check_keeps_the_signature_unprobed_and_removes_node_hooks():
    x, y = batch()
    model = Mixer(lambda h: h.flip(0))
    probe, rec = probe_for(model)
    out = model(x)
    loss = per_sample_ce(out, y)
    with pytest.raises(BatchMixingError):
        probe.check(loss, rec.take())
    assert not probe.pending
    loss.sum().backward()  # the diagnostic's node hooks are gone: a plain backward runs
    model.zero_grad()
    model(x)
    assert probe.pending  # the next step is probed (and rejected) again


def test_targets_may_be_tensors():
    model = Mixer(lambda h: h.flip(0))
    probe = SeparabilityProbe(model)
    probe.install()
    outs = []
    model.a.register_forward_hook(lambda m, i, o: outs.append(o))
    x, y = batch()
    loss = per_sample_ce(model(x), y)
    with pytest.raises(BatchMixingError, match="layer a.*flip"):
        probe.check(loss, [("a", outs[0])])


def test_unrelated_pending_forward_is_not_probed():
    model = Mixer(lambda h: h)
    probe, rec = probe_for(model)
    x, y = batch()
    probe.check(per_sample_ce(model(x), y), rec.take())
    model.eval()
    model(x)  # an evaluation forward with grad enabled: pending, but never backpropagated
    model.train()
    out = model(x)
    assert probe.pending
    probe.check(per_sample_ce(out, y), rec.take())
    model.eval()
    model(x)  # the eval signature's 2nd forward: not probed (its 1st, never checked, was)
    assert not probe.pending
    model(x)
    model(x)
    assert probe.pending  # its 4th


# -- check_outputs (a reduced loss: Opacus' front door) -----------------------------------------
def outputs_check(model, x, batch_dim=0, **kw):
    probe, rec = probe_for(model, **kw)
    out = model(x)
    probe.check_outputs(out, rec.take(), batch_dim=batch_dim)
    assert not probe.pending
    return out


def test_check_outputs_accepts_separable_models():
    torch.manual_seed(0)
    x, _ = batch()
    outputs_check(Mixer(lambda h: h), x)

    class SeqOut(nn.Module):  # batch-first inside, sequence-first output (T, B, C)
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x):
            return self.a(x).transpose(0, 1)

    outputs_check(SeqOut(), torch.randn(4, 4, D), batch_dim=1)


@pytest.mark.parametrize("case", ["flip", "mean over batch"])
def test_check_outputs_rejects_mixing(case):
    torch.manual_seed(0)
    mix, op = MIXING_OPS[case]
    x, _ = batch()
    with pytest.raises(BatchMixingError, match=f"layer a.*{op}"):
        outputs_check(Mixer(mix), x)


def test_check_outputs_sees_input_mixing_and_sequence_first_inputs():
    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, C)

        def forward(self, x):  # x: (T, B, D) (batch_first=False)
            return self.a((x - x.mean(1, keepdim=True)).transpose(0, 1))

    model = Centered()
    probe, rec = probe_for(model, batch_dim=1)  # inputs are sequence-first
    out = model(torch.randn(5, 4, D))
    assert probe.pending
    with pytest.raises(BatchMixingError, match=r"model input args\[0\].*mean over dim 1"):
        probe.check_outputs(out, rec.take(), batch_dim=0)
