"""A tiny GPT-2 and padded token data for the DPTrainer tests (one process and torchrun alike):
random configuration, no download."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 50


def tiny_gpt2(dtype=torch.float64):
    """A one-layer GPT-2 of width 16 without dropout, initialised from seed 0."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def texts(n, seed=1):
    """``n`` token sequences of lengths 3–9 (ids 1..VOCAB-1; 0 is the padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 10, (n,), generator=g)
    return [{"input_ids": torch.randint(1, VOCAB, (int(k),), generator=g).tolist()}
            for k in lengths]


def pad_collator(features):
    """Right padding to the longest sequence (width 1 for an empty batch): ``attention_mask``,
    and ``labels`` = the ids with −100 at the padding (what
    DataCollatorForLanguageModeling(mlm=False) builds)."""
    T = max([len(f["input_ids"]) for f in features], default=1)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    mask = torch.zeros(len(features), T, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sample_loss(model, ids, mask, labels):
    """One padded sample's causal-LM loss written out: the mean over its own labelled next
    tokens, model called with its default position_ids."""
    logits = model(input_ids=ids, attention_mask=mask).logits[0]
    out = [F.cross_entropy(logits[t], labels[0, t + 1]) for t in range(ids.shape[1] - 1)
           if labels[0, t + 1] != -100]
    return torch.stack(out).mean().reshape(1)
