"""LoRA adapters from ``peft`` (a test extra) on a timm ViT and on Hugging Face GPT-2: only the
adapters train, and their clipped sums equal the float64 one-sample-at-a-time reference in both
doors (tests/reference.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_tied_weights import gpt2, hf_lm_loss, opacus_step

from engine_checks import check_against_reference
from reference import assert_close_rel, reference_clipped_sum

pytestmark = pytest.mark.usefixtures("one_thread")

peft = pytest.importorskip("peft")


def lora_vit():
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=16,
                              depth=1, num_heads=2, num_classes=3)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv", "fc1"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg).double()


def lora_gpt2():
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
                          fan_in_fan_out=True)
    return peft.get_peft_model(gpt2(), cfg).double()


def vit_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def cases():
    g = torch.Generator().manual_seed(5)
    return {
        "vit": (lora_vit, [torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64),
                           torch.randint(0, 3, (4,), generator=g)], vit_loss),
        "gpt2": (lora_gpt2, [torch.randint(0, 31, (4, 6), generator=g)], hf_lm_loss),
    }


@pytest.mark.parametrize("mode", ["bk_mixed", "mixed"])
@pytest.mark.parametrize("case", ["vit", "gpt2"])
def test_lora_adapters_are_exact_natively(case, mode):
    build, batch, loss_fn = cases()[case]
    model = build()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    check_against_reference(model, batch, loss_fn, mode=mode, clip="abadi")


@pytest.mark.parametrize("case", ["vit", "gpt2"])
def test_lora_adapters_are_exact_through_the_opacus_door(case):
    build, batch, loss_fn = cases()[case]
    model = build()
    _, norms = reference_clipped_sum(model, batch, loss_fn, 1.0, lambda n, r: torch.ones_like(n))
    R = float(norms.median())
    ref, _ = reference_clipped_sum(model, batch, loss_fn, R,
                                   lambda n, r: torch.clamp(r / (n + 1e-6), max=1.0))
    delta = opacus_step(model, batch, loss_fn, R)
    assert_close_rel(delta, [-r / batch[0].shape[0] for r in ref], 1e-9)
