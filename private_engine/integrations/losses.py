"""Per-sample losses from a model's logits and labels, as Hugging Face models define them.

Each returns one loss per sample, computed from that sample's rows alone, so that the engine can
clip each sample's gradient (a loss averaged over the batch's token count couples samples and is
refused by the batch flow).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: the label Hugging Face's losses ignore (padding, prompt tokens)
IGNORE_INDEX = -100


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> torch.Tensor:
    """Per-sample mean token cross-entropy over that sample's non-ignored tokens.

    ``logits``: ``(B, T, V)``, ``labels``: ``(B, T)`` with ``-100`` where no loss is taken.
    ``shift`` (causal language models): token t predicts label t+1, so logits ``[:, :-1]`` are
    compared with labels ``[:, 1:]``. With ``ℓ_it`` the token losses and ``m_it = [y_it ≠ −100]``::

        L_i = Σ_t m_it·ℓ_it / max(Σ_t m_it, 1)

    (a sample with no labelled token has loss 0). Hugging Face's own loss divides by the
    number of labelled tokens of the whole batch instead, which couples the samples. Computed in
    float32 at least (as Hugging Face upcasts logits)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    tok = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none",
                          ignore_index=IGNORE_INDEX)
    mask = (labels != IGNORE_INDEX).to(tok.dtype)
    return (tok * mask).sum(1) / mask.sum(1).clamp(min=1)


def sequence_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample loss of a sequence-level head: cross-entropy ``−log softmax(z_i)[y_i]`` for
    integer labels ``(B,)``; squared error ``Σ_k (z_ik − y_ik)²`` (mean over outputs) for float
    labels (regression, ``num_labels == 1``); binary cross-entropy with logits, mean over the
    labels, for float multi-label targets of the logits' shape."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if not labels.is_floating_point():
        return F.cross_entropy(logits, labels.reshape(-1), reduction="none")
    if logits.shape[-1] == 1 or labels.dim() == 1:
        return (logits.reshape(labels.shape[0], -1)
                - labels.reshape(labels.shape[0], -1).to(logits.dtype)).pow(2).mean(1)
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype),
                                              reduction="none").flatten(1).mean(1)


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """The per-sample loss for a model's ``logits`` and ``labels``: token-level
    (:func:`token_mean_loss`, shifted by one for a causal language model) when the labels have
    one entry per position, sequence-level (:func:`sequence_loss`) otherwise."""
    if logits.dim() == 3 and labels.dim() == 2 and labels.shape[:2] == logits.shape[:2] and \
            not labels.is_floating_point():
        return token_mean_loss(logits, labels, shift=causal)
    return sequence_loss(logits, labels)
