"""Parameter entries: exact per-sample gradients of parameters used outside Linear/Conv/norm layers.

timm ViTs own parameters that enter the computation by a few elementwise ops: ``cls_token``
(``cat(cls.expand(B, -1, -1), x)``), ``pos_embed`` (``x + pos_embed``), LayerScale gammas
(``x * gamma``), XCiT's ``temperature``, ConViT's ``sigmoid(gating_param)``, relative position
bias tables (``table[index].view(N, N, H).permute(2, 0, 1)`` added to the attention logits or
passed as ``attn_mask`` to ``F.scaled_dot_product_attention``).

While the model runs its forward, a ``TorchFunctionMode`` follows two kinds of tensors:

* *derived* tensors ``D``: computed from the tracked parameters and constants only (a batch-free
  chain: index, view, permute, expand, sigmoid, …);
* *batched* tensors: computed from the model's inputs.

At the op where a derived ``D`` meets batched data (an *entry*: add/sub/mul/div/where with
broadcasting, cat/stack of a batch-expanded token, the ``attn_mask`` of SDPA), ``D`` is replaced
by the batch-expanded view ``D_b = D.expand(n, …)`` (n = leading size of the batched operand, a
multiple k·B of the batch size, sample-major). Forward values are unchanged. The gradient of the
loss w.r.t. ``D_b`` holds one cotangent per row; summing the k rows of each sample gives the
per-sample cotangent ``c_i``, and the per-sample gradient of each parameter P follows by a
batched vjp through the small batch-free chain::

    ∂L_i/∂P = (∂D/∂P)ᵀ c_i      (torch.autograd.grad(D, P, c, is_grads_batched=True))

(direct reshape when D is P itself). Such gradients are at most one activation in size, so they are
always instantiated (``ghost_capable=False``); their squared norms add into the same ``‖g_i‖²`` as
the layer rules, and their clipped sum is ``Σ_i C_i·∂L_i/∂P`` of these very per-sample gradients
(kept until the clip factors are known, in every mode). A tracked parameter reaching batched data
through any other op raises an error naming it (never silently unclipped), and each entry is
registered as a call for the engine's graph walk (``params_reached_outside_calls``).

The package's parts:

* :mod:`.mode` — :class:`ParamTracer`: the ``TorchFunctionMode`` and its hooks on the model,
  the maps of tracked, derived and batched tensors, the hand-over of layer calls;
* :mod:`.rewrite` — the entry rules: how an op where derived data meets batched data is
  rewritten with ``D_b`` (elementwise, cat/stack, SDPA's ``attn_mask``, ``x @ W``,
  ``F.linear``);
* :mod:`.entries` — what is known about derived tensors and entries, and the
  :class:`~.entries.EntryLedger` of one step: the entries, the switch of the norm pass and the
  per-sample gradients it accumulates;
* :mod:`.batch_dim` — where the batch dimension goes through an op;
* :mod:`.ops` — the op families the tracer tells apart;
* :mod:`.refusals` — :class:`UnsupportedEntryError` and its messages.
"""
from .entries import Derived, Entry, EntryLedger
from .mode import ParamTracer
from .refusals import UnsupportedEntryError, reparametrization_message

__all__ = ["Derived", "Entry", "EntryLedger", "ParamTracer", "UnsupportedEntryError",
           "reparametrization_message"]
