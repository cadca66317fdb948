"""Per-sample losses from logits and labels (private_engine.integrations.losses), each written
out sample by sample."""
import pytest
import torch
import torch.nn.functional as F

from private_engine.integrations.losses import per_sample_loss


def test_causal_token_loss_is_each_samples_own_mean():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 3:] = -100
    labels[2, 1:] = -100  # no labelled next token: loss 0
    got = per_sample_loss(logits, labels, causal=True)
    for i in range(3):
        terms = [F.cross_entropy(logits[i, t], labels[i, t + 1]) for t in range(4)
                 if labels[i, t + 1] != -100]
        want = torch.stack(terms).mean() if terms else torch.zeros((), dtype=torch.float64)
        assert torch.allclose(got[i], want)
    unshifted = per_sample_loss(logits, labels, causal=False)
    keep = labels[1] != -100
    assert torch.allclose(unshifted[1], F.cross_entropy(logits[1][keep], labels[1][keep]))


def test_sequence_losses():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, generator=g)
    y = torch.randint(0, 3, (4,), generator=g)
    assert torch.allclose(per_sample_loss(logits, y, causal=False),
                          torch.stack([F.cross_entropy(logits[i], y[i]) for i in range(4)]))
    z, t = torch.randn(4, 1, generator=g), torch.randn(4, generator=g)
    assert torch.allclose(per_sample_loss(z, t, causal=False), (z[:, 0] - t) ** 2)


def test_causal_models_are_recognised():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from private_engine.integrations.transformers import is_causal_lm

    cfg = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    gpt2 = transformers.GPT2LMHeadModel(cfg)
    assert is_causal_lm(gpt2)
    lora = peft.get_peft_model(gpt2, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                     fan_in_fan_out=True))
    assert is_causal_lm(lora)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=8))
    assert not is_causal_lm(bert)
