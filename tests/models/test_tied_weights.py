"""Tied weights: one trainable tensor used by several ruled layers, clipped exactly.

The per-sample gradient of a shared tensor is the sum of its uses, so its norm includes the cross
terms between uses. Checked against the float64 one-sample-at-a-time reference
(tests/reference.py) in every clipping mode and clipping function, for a GPT-2-style tied
``wte``/``lm_head`` pair, two Linears sharing one weight, Hugging Face GPT-2 (tied embeddings and
``Conv1D`` layers) and BERT's masked-LM head, in the native engine and through the Opacus door.
Sharing the engine cannot clip exactly (a parameter shared with a traced or ``torch.func`` use)
is refused, naming the parameter.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import private_engine as pe
from engine_checks import CLIPS, MODES, check_against_reference
from private_engine import opacus_compat
from reference import assert_close_rel, reference_clipped_sum
from tied_models import SharedLinear

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyTiedLM(nn.Module):
    """GPT-2's shape in miniature: token and position embeddings, a residual MLP, and an output
    projection tied to the token embedding (``lm_head.weight is wte.weight``)."""

    def __init__(self, vocab: int = 13, d: int = 6, positions: int = 5):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        h = self.wte(ids) + self.wpe(pos)
        h = h + torch.tanh(self.fc(self.ln(h)))
        return self.lm_head(h)


def lm_loss(model, ids, tgt):
    """Per-sample next-token cross-entropy, summed over positions."""
    return F.cross_entropy(model(ids).transpose(1, 2), tgt, reduction="none").sum(1)


def square_loss(model, x, t):
    """Per-sample ``Σ (y − t)²``."""
    return (model(x) - t).pow(2).flatten(1).sum(1)


def tokens(B=6, T=5, vocab=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T),
                                                                         generator=g)


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
def test_tied_embedding_and_output_projection_are_exact(mode, clip):
    torch.manual_seed(0)
    model = TinyTiedLM().double()
    engine = check_against_reference(model, list(tokens()), lm_loss, mode=mode, clip=clip)
    tied = {d.name: d.use_ghost for d in engine.layer_plan if d.name in ("wte", "lm_head")}
    # "bk", and "bk_mixopt" (its float32 Grams cost less than moving G_i here): the joint ghost
    # norm of the two uses; elsewhere here: instantiated and summed
    ghost = mode in ("bk", "bk_mixopt")
    assert tied == {"wte": ghost, "lm_head": ghost}


@pytest.mark.parametrize("clip", ["abadi", "automatic"])
@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "bk_mixopt"])
def test_joint_ghost_norm_of_a_large_tied_vocabulary(mode, clip):
    """A vocabulary large against the sequence (``2·T² < V·d``, and the 3×3 Grams far cheaper
    than moving ``V·d`` per sample: bk_mixopt's time rule too): book-keeping norms the tied weight
    by the joint ghost norm (T×T Grams with the cross terms), exact."""
    torch.manual_seed(0)
    model = TinyTiedLM(vocab=97, d=8, positions=3).double()
    engine = check_against_reference(model, list(tokens(B=5, T=3, vocab=97)), lm_loss, mode=mode,
                                     clip=clip)
    tied = {d.name: d.use_ghost for d in engine.layer_plan if d.name in ("wte", "lm_head")}
    assert tied == {"wte": True, "lm_head": True}


def test_joint_ghost_norm_with_repeated_tokens_and_padding():
    """Repeated tokens (the Embedding–Embedding block) and a padding index (rows that carry no
    gradient), with the Linear–Embedding gather, against the reference."""
    torch.manual_seed(0)
    model = TinyTiedLM(vocab=40, d=8, positions=4).double()
    model.wte.padding_idx = 0
    ids = torch.tensor([[3, 3, 0, 5], [7, 7, 7, 7], [0, 0, 1, 2], [9, 3, 9, 3]])
    tgt = torch.tensor([[3, 5, 5, 1], [7, 7, 2, 7], [1, 2, 3, 4], [3, 9, 3, 9]])
    engine = check_against_reference(model, [ids, tgt], lm_loss, mode="bk", clip="abadi")
    assert all(d.use_ghost for d in engine.layer_plan if d.name in ("wte", "lm_head"))


@pytest.mark.parametrize("mode", MODES)
def test_one_weight_in_two_linears_is_exact(mode):
    torch.manual_seed(0)
    model = SharedLinear().double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 5, generator=g, dtype=torch.float64)
    t = torch.randn(6, 3, 5, generator=g, dtype=torch.float64)
    for clip in ("abadi", "automatic"):
        check_against_reference(model, [x, t], square_loss, mode=mode, clip=clip)


def test_cross_terms_matter_for_these_cases():
    """The tests above would fail without the cross terms: the norm of the sum of the uses is not
    the norm of their norms (float64, one sample)."""
    torch.manual_seed(0)
    model = TinyTiedLM().double()
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(untied.wte.weight.detach().clone())
    ids, tgt = tokens(B=1)
    g_emb, g_head = torch.autograd.grad(lm_loss(untied, ids, tgt).sum(),
                                        [untied.wte.weight, untied.lm_head.weight])
    joint = (g_emb + g_head).pow(2).sum()
    apart = g_emb.pow(2).sum() + g_head.pow(2).sum()
    assert abs(float(joint / apart) - 1) > 1e-3


def test_shared_with_a_traced_use_is_refused_naming_it():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = self.lin.bias  # the same tensor, used directly as a raw parameter

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Mixed()
    engine = pe.PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"lin\.bias|scale"):
        opt.step(loss=model(torch.randn(3, 4)).sum(1))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- Hugging Face language models (transformers is a test extra) ------------------------------
def gpt2(vocab=31):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


def hf_lm_loss(model, ids):
    """GPT-2's next-token loss per sample, with per-sample ``position_ids``."""
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = model(input_ids=ids, position_ids=pos).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                           reduction="none").sum(1)


def hf_default_lm_loss(model, ids):
    """GPT-2's next-token loss per sample as Hugging Face users call the model: default
    ``position_ids`` (one row, ``(1, T)``, broadcast against the batch inside the model)."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                           reduction="none").sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_full_fine_tuning_is_exact(mode):
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 31, (4, 6), generator=torch.Generator().manual_seed(3))
    engine = check_against_reference(model, [ids], hf_lm_loss, mode=mode, clip="abadi")
    types = {d.layer_type for d in engine.layer_plan}
    assert "Conv1D" in types and "Embedding" in types


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_default_position_ids_are_exact(mode):
    """Hugging Face's default ``position_ids`` have batch 1: the position embedding's output is
    shared by every sample and broadcast later. Its per-sample gradients come from the output
    gradient before that broadcast sums it: exact against the float64 reference."""
    model = gpt2()
    ids = torch.randint(0, 31, (4, 6), generator=torch.Generator().manual_seed(3))
    check_against_reference(model, [ids], hf_default_lm_loss, mode=mode, clip="abadi")


def test_gpt2_default_position_ids_clip_fns():
    """The same with the other clipping functions (a clip factor per sample, never a batch's)."""
    model = gpt2()
    ids = torch.randint(0, 31, (4, 6), generator=torch.Generator().manual_seed(3))
    for clip in ("automatic", "global"):
        check_against_reference(model, [ids], hf_default_lm_loss, mode="bk_mixed", clip=clip)


@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "mixed", "per_sample"])
def test_gpt2_default_position_ids_crafted_sample(mode):
    """A crafted sample (its loss weighted by 1e6: a huge gradient, most of it through the shared
    position rows) moves the released update by at most R: B·‖Δ(update)‖/R ≤ 1 between the batch
    with it and without it (noise 0, SGD lr 1, declared batch size B = 4)."""
    model = gpt2().float()
    g = torch.Generator().manual_seed(8)
    honest, crafted = torch.randint(0, 31, (3, 6), generator=g), torch.randint(0, 31, (1, 6),
                                                                               generator=g)
    R = 0.1

    def update(ids, weights):
        m = copy.deepcopy(model)
        engine = pe.PrivacyEngine(m, batch_size=4, sample_size=40, max_grad_norm=R,
                                  noise_multiplier=0.0, clipping_mode=mode)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        engine.attach(opt)
        before = [p.detach().clone() for p in m.parameters()]
        opt.step(loss=hf_default_lm_loss(m, ids) * weights)
        assert engine.last_norms.max() > 100 * R or weights.numel() == 3
        return torch.cat([(p.detach() - b).double().flatten()
                          for p, b in zip(m.parameters(), before)])

    with_it = update(torch.cat([honest, crafted]), torch.tensor([1.0, 1.0, 1.0, 1e6]))
    without = update(honest, torch.ones(3))
    assert 4 * float((with_it - without).norm()) / R <= 1 + 1e-5


def test_shared_row_of_sample_data_is_still_refused():
    """A layer applied to one row of the batch's data (sample 0's) and broadcast to every
    sample mixes samples: refused, never taken for a shared constant row."""

    class OneRow(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(x + self.lin(x[:1]))

    torch.manual_seed(0)
    model = OneRow().double()
    engine = pe.PrivacyEngine(model, batch_size=4, sample_size=40, max_grad_norm=1.0,
                              noise_multiplier=0.0)
    with pytest.raises(ValueError, match="mix|lin"):
        engine.clipped_grad_sum(model(torch.randn(4, 4, dtype=torch.float64)).sum(1))


@pytest.mark.parametrize("default_positions", [False, True], ids=["positions", "default"])
@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "mixed", "per_sample"])
def test_bert_masked_lm_head_is_exact(mode, default_positions):
    """BERT's decoder shares the word embeddings, and its bias is also an attribute of the
    prediction head (an alias, clipped with the decoder); with Hugging Face's default
    ``position_ids`` (a ``(1, T)`` slice of a buffer) the trainable position embedding sees one
    row shared by the batch."""
    model, [ids, labels], _ = bert_default_positions()

    def loss_fn(m, ids, labels):
        pos = None if default_positions else torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = m(input_ids=ids, position_ids=pos).logits
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)

    check_against_reference(model, [ids, labels], loss_fn, mode=mode, clip="abadi")


# -- the Opacus door ----------------------------------------------------------------------------
def opacus_step(model, batch, loss_fn, R, grad_sample_mode="hooks"):
    """One ``make_private`` step (SGD lr 1, noise 0, the loader's fixed batch, mean loss):
    returns the parameter change."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    B = batch[0].shape[0]
    loader = DataLoader(TensorDataset(*batch), batch_size=B)
    opt = torch.optim.SGD(params, lr=1.0)
    engine = opacus_compat.PrivacyEngine(accountant="rdp")
    module, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                              noise_multiplier=0.0, max_grad_norm=R,
                                              poisson_sampling=False,
                                              grad_sample_mode=grad_sample_mode)
    opt.zero_grad()
    loss_fn(module, *batch).mean().backward()
    opt.step()
    return [p.detach() - b for p, b in zip(params, before)]


def bert_default_positions():
    """A tiny BERT masked LM, its batch and its per-sample loss with the default
    ``position_ids`` (a ``(1, T)`` slice of a buffer; trainable position embeddings)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=23, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=12,
                                  max_position_embeddings=8, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).double()
    g = torch.Generator().manual_seed(4)
    batch = [torch.randint(0, 23, (4, 6), generator=g), torch.randint(0, 23, (4, 6), generator=g)]

    def loss_fn(m, ids, labels):
        logits = m(input_ids=ids).logits
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)

    return model, batch, loss_fn


@pytest.mark.parametrize("case", ["tiny-tied-lm", "gpt2", "gpt2-default-positions",
                                  "bert-default-positions"])
def test_opacus_door_tied_weights_are_exact(case):
    if case.startswith("gpt2"):
        model = gpt2()
        batch = [torch.randint(0, 31, (4, 6), generator=torch.Generator().manual_seed(3))]
        loss_fn = hf_lm_loss if case == "gpt2" else hf_default_lm_loss
    elif case.startswith("bert"):
        model, batch, loss_fn = bert_default_positions()
    else:
        torch.manual_seed(0)
        model, batch, loss_fn = TinyTiedLM().double(), list(tokens()), lm_loss
    _, norms = reference_clipped_sum(model, batch, loss_fn, 1.0,
                                     lambda n, r: torch.ones_like(n))
    R = float(norms.median())
    ref, _ = reference_clipped_sum(model, batch, loss_fn, R,
                                   lambda n, r: torch.clamp(r / (n + 1e-6), max=1.0))
    delta = opacus_step(model, batch, loss_fn, R)
    B = batch[0].shape[0]
    assert_close_rel(delta, [-r / B for r in ref], 1e-9)


@pytest.mark.parametrize("default_positions", [False, True], ids=["positions", "default"])
@pytest.mark.parametrize("mode", ["bk_mixed", "bk", "mixed", "per_sample"])
def test_llama_full_fine_tuning_is_exact(mode, default_positions):
    """A tiny Llama (rotary positions, grouped keys and values, a causal mask with padding, an
    untied head) with explicit per-sample ``position_ids``: exact against the float64 reference,
    the batch flow and the state guard silent. Every parameter is trained, the RMSNorm weights
    included."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    with torch.no_grad():  # RMSNorm weights away from 1, so that mistakes in x̂ show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 29, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 4:] = 0

    def loss(model, ids, mask):
        pos = None if default_positions else torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        keep = mask[:, 1:].to(tok.dtype)
        return (tok * keep).sum(1) / keep.sum(1)

    check_against_reference(model, [ids, mask], loss, mode=mode, clip="abadi")
