"""The MAE of private_engine.pretrain under the engine: every parameter (mask token, both position
embeddings, the class token, patch embedding, blocks, decoder) clipped exactly per sample.

* the clipped gradient sum (noise 0) against the float64 one-sample-at-a-time reference in every
  clipping mode, with a different mask per sample, every parameter reached;
* a crafted sample (huge pixel values) moves the released update by at most R/B;
* a mask-token insertion the tracer cannot follow is refused, naming the parameter; encoders with
  parameters the reconstruction would not use are refused.
"""
import copy
import math

import pytest
import torch
from torch import nn

import private_engine as pe
from engine_checks import MODES, check_against_reference, ref_abadi
from private_engine.capture.tracer import UnsupportedEntryError
from private_engine.guards.model_check import traced_parameters
from private_engine.pretrain.mae import MaskedAutoencoder, build_mae, patchify
from reference import reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")


B = 4


def tiny_mae(seed: int = 0, **kw) -> MaskedAutoencoder:
    torch.manual_seed(seed)
    kw = dict(dict(img_size=8, patch_size=2, depth=1, embed_dim=16, num_heads=2, decoder_dim=16,
                   decoder_depth=1, decoder_heads=2), **kw)
    return build_mae(**kw)


def batch(model: MaskedAutoencoder, seed: int = 1, n: int = B, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g, dtype=dtype)
    ids = model.shuffle_ids(torch.rand(n, model.num_patches, generator=g))
    return x, ids


def mae_loss(model, x, ids):
    return model(x, ids_shuffle=ids)


def test_masks_differ_per_sample_and_are_reproducible():
    model = tiny_mae()
    x, ids = batch(model)
    kept = [frozenset(ids[i, :model.num_kept].tolist()) for i in range(B)]
    assert len(set(kept)) == B, "every sample must have its own mask"
    assert model.num_kept == model.num_patches // 4  # mask ratio 0.75
    with torch.no_grad():
        model.double()
        full = model(x, ids_shuffle=ids)
        one = torch.cat([model(x[i:i + 1], ids_shuffle=ids[i:i + 1]) for i in range(B)])
        other = model(x, ids_shuffle=ids.roll(1, 0))
    torch.testing.assert_close(full, one, rtol=1e-12, atol=0)  # sample i's loss: x_i, mask_i
    assert not torch.allclose(full, other)


def test_noise_and_ids_give_the_same_masks():
    model = tiny_mae().double()
    x, _ = batch(model)
    u = torch.rand(B, model.num_patches, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x, noise=u), model(x, ids_shuffle=model.shuffle_ids(u)))


def test_every_parameter_is_reached_and_traced():
    model = tiny_mae().double()
    x, ids = batch(model)
    grads, _ = reference_clipped_sum(model, (x, ids), mae_loss, 1e9, ref_abadi)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    zero = [n for n, g in zip(names, grads) if float(g.abs().sum()) == 0.0]
    assert not zero, f"parameters without gradient: {zero}"
    assert set(traced_parameters(model)) == {"mask_token", "decoder_pos_embed",
                                             "encoder.cls_token", "encoder.pos_embed"}


@pytest.mark.parametrize("mode", MODES)
def test_clipped_sum_matches_the_reference(mode):
    model = tiny_mae().double()
    x, ids = batch(model)
    check_against_reference(model, (x, ids), mae_loss, mode=mode, clip="abadi", rtol=1e-6)


@pytest.mark.parametrize("clip", ["automatic", "global"])
def test_clipped_sum_other_clip_functions(clip):
    model = tiny_mae(seed=2, norm_pix_loss=False).double()
    x, ids = batch(model, seed=5)
    check_against_reference(model, (x, ids), mae_loss, mode="bk_mixed", clip=clip, rtol=1e-6)


def test_without_class_token():
    import timm

    torch.manual_seed(0)
    enc = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, depth=1,
                            embed_dim=16, num_heads=2, num_classes=0, global_pool="avg",
                            fc_norm=False, class_token=False)
    model = MaskedAutoencoder(enc, decoder_dim=16, decoder_depth=1, decoder_heads=2).double()
    x, ids = batch(model)
    check_against_reference(model, (x, ids), mae_loss, mode="bk_mixed", clip="abadi", rtol=1e-6)


# -- a crafted sample ---------------------------------------------------------------------------
def released_update(model, x, ids, mode, R):
    """Parameter change of one SGD step (lr 1, noise 0) on the batch, in float64."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    pe.PrivacyEngine(m, batch_size=B, sample_size=100 * B, max_grad_norm=R, noise_multiplier=0.0,
                     clipping_mode=mode).attach(opt)
    before = [p.detach().double().clone() for p in m.parameters()]
    opt.step(loss=m(x, ids_shuffle=ids))
    return [p.detach().double() - b for p, b in zip(m.parameters(), before)]


@pytest.mark.parametrize("mode", ["bk_mixed", "ghost", "per_sample"])
@pytest.mark.parametrize("scale", [1e4, 1e18, 1e30])
def test_crafted_sample_moves_the_release_by_at_most_R(mode, scale):
    """B·‖Δupdate‖/R ≤ 1 between the batch with and without a sample of huge pixel values
    (float32; unclipped, the 1e4 sample moves it by 27·R/B; at 1e30 the forward overflows and
    the sample is dropped, C_i = 0)."""
    R = 0.1
    model = tiny_mae(seed=3)
    x, ids = batch(model, seed=4, n=B, dtype=torch.float32)
    crafted = torch.full((1, 3, 8, 8), scale)
    crafted[..., ::2, :] *= -1  # maximal contrast inside every patch
    honest_x, honest_ids = x[:B - 1], ids[:B - 1]
    with_x = torch.cat([honest_x, crafted])
    with_sample = released_update(model, with_x, ids, mode, R)
    without = released_update(model, honest_x, honest_ids, mode, R)
    sq = sum(float((a - b).pow(2).sum()) for a, b in zip(with_sample, without))
    assert math.isfinite(sq)
    ratio = B * math.sqrt(sq) / R
    assert ratio <= 1 + 1e-5, ratio
    if scale < 1e20:
        assert ratio > 0.5  # the sample counts, clipped to R


# -- refusals --------------------------------------------------------------------------------------
class ScatterMAE(MaskedAutoencoder):
    """Inserts the mask token by index_put (``full[hidden] = mask_token``), an op the tracer
    does not follow: the engine must refuse, not release unclipped."""

    def forward_decoder(self, latent, mask, ids_restore):
        x = self.decoder_embed(latent)
        Bn, _, D = x.shape
        vis = x[:, 1:]
        pad = torch.zeros(Bn, self.num_patches - vis.shape[1], D, dtype=x.dtype)
        full = torch.gather(torch.cat([vis, pad], 1), 1,
                            ids_restore.unsqueeze(-1).expand(Bn, self.num_patches, D))
        full = full.clone()
        full[mask > 0] = self.mask_token.reshape(-1).to(full.dtype)
        full = torch.cat([x[:, :1], full], 1) + self.decoder_pos_embed
        return self.decoder_pred(self.decoder_norm(self.decoder_blocks(full)))[:, 1:]


def test_untraceable_mask_token_insertion_is_refused():
    base = tiny_mae()
    model = ScatterMAE(base.encoder, decoder_dim=16, decoder_depth=1, decoder_heads=2)
    x, ids = batch(model, dtype=torch.float32)
    engine = pe.PrivacyEngine(model, batch_size=B, sample_size=100 * B, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    with pytest.raises((UnsupportedEntryError, ValueError), match="mask_token"):
        engine.clipped_grad_sum(model(x, ids_shuffle=ids))


def test_encoder_with_unused_parameters_is_refused():
    import timm

    enc = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, depth=1,
                            embed_dim=16, num_heads=2, num_classes=10)
    with pytest.raises(ValueError, match="head"):
        MaskedAutoencoder(enc)
    avg = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, depth=1,
                            embed_dim=16, num_heads=2, num_classes=0, global_pool="avg")
    with pytest.raises(ValueError, match="fc_norm"):
        MaskedAutoencoder(avg)
    with pytest.raises(ValueError, match="not a timm VisionTransformer"):
        MaskedAutoencoder(nn.Linear(2, 2))


def test_patchify_and_target():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float64).reshape(2, 3, 4, 4)
    p = patchify(x, 2)
    assert p.shape == (2, 4, 12)
    # patch 1 = rows 0-1, cols 2-3; (row, col, channel) order
    assert p[0, 1, :3].tolist() == [x[0, c, 0, 2].item() for c in range(3)]
    model = tiny_mae()
    t = model.target(torch.randn(3, 3, 8, 8, dtype=torch.float32))
    torch.testing.assert_close(t.mean(-1), torch.zeros(3, 16), atol=1e-5, rtol=0)
