"""The entry rules of the parameter-entry tracer: how an op where a derived (batch-free) tensor
meets batched data is rewritten with the batch-expanded ``D_b = D.expand(n, …)`` — elementwise
ops with broadcasting (also a one-row tensor spread over the rows of a constant first), cat/stack
of a batch-expanded token, the ``attn_mask`` of ``F.scaled_dot_product_attention``, ``x @ W`` and
``F.linear`` with a tracked weight, bias or input — and the refusal of any other meeting.

:class:`EntryRewriting` holds no state of its own: it is the half of
:class:`~.mode.ParamTracer` that reads and extends the tracer's maps (tracked, derived, batched
tensors) and its ledger of entries.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .entries import Derived, Entry
from .ops import CONCAT, ELEMENTWISE, EXPANDS, MATMULS, ROWWISE, output_tensors, tensor_args
from .refusals import unsupported_entry


class EntryRewriting:
    """The entry rules of :class:`~.mode.ParamTracer` (a mixin: the tracer's state, its rules)."""

    def _pending_rows(self, func, args, kwargs, tracked, tensors):
        """An elementwise op that spreads a one-row derived tensor over the n rows of a constant:
        substitute the row-expanded ``D_b`` now (rows stay aligned through elementwise ops) and
        finish the entry when the result meets n batched rows. Returns the op's output, or None when
        the op is not such a case."""
        has_pending = any(self._info(t).pending for t in tracked)
        if func not in ELEMENTWISE:
            if has_pending:
                self._fail(func, tracked, "a tensor whose rows are already aligned with the batch "
                                          "went through an op other than an elementwise one")
            return None
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        if not shape or shape[0] <= 1:
            return None
        aligned = lambda t: (1,) * (len(shape) - t.dim()) + tuple(t.shape)
        if not has_pending and not any(aligned(t)[0] == 1 for t in tracked):
            return None  # nothing is spread over rows
        n = shape[0]
        entries = []

        def sub(t):
            if not (isinstance(t, torch.Tensor) and self.is_tracked(t)):
                return t
            info = self._info(t)
            if info.pending and aligned(t)[0] == n:
                entries.extend(info.pending)
                return t
            d_b, e = self._substitute(t, shape, func, check_batch=False)
            entries.append(e)
            return d_b

        args = tuple(sub(a) for a in args)
        kwargs = {k: sub(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        ids = tuple(sorted({i for t in tracked for i in self._param_ids(t)}))
        for t in output_tensors(out):
            if t.requires_grad and t.is_floating_point():
                self.derived[t] = Derived(ids, None, tuple(entries))
        return out


    def _row_base(self, func, args, kwargs, tracked, out):
        """``T`` (one row) when ``out`` is ``n`` identical rows ``T.expand(n, …)``, else None.

        Recognised: ``expand``/``repeat`` of a one-row tensor, and shape ops (reshape, permute, …)
        of such a tensor that keep the rows, verified by recomputing the op on the row and
        comparing.
        """
        # (0 rows: an empty Poisson batch)
        if len(tracked) != 1 or out.dim() == 0 or out.shape[0] == 1:
            return None
        src = tracked[0]
        n = out.shape[0]
        if func in EXPANDS:
            return src if src.dim() == out.dim() and src.shape[0] == 1 else None
        info = self.derived.get(src) if id(src) not in self.tracked else None
        if func is torch.Tensor.repeat and src.dim() == out.dim() and src.shape[0] == 1:
            row_src = src
        elif (func in ROWWISE and info is not None and info.row_base is not None
              and src.shape[0] == n):
            row_src = info.row_base
        else:
            return None

        def one(a):
            if a is src:
                return row_src
            if isinstance(a, (tuple, list, torch.Size)) and a and a[0] == n:
                return (1,) + tuple(a[1:])
            return a

        new_args = [one(a) for a in args]
        if len(new_args) > 1 and isinstance(new_args[1], int) and new_args[1] == n and \
                func in (torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.repeat):
            new_args[1] = 1
        try:
            cand = func(*new_args, **kwargs)
        except Exception:
            return None
        if not isinstance(cand, torch.Tensor) or tuple(cand.shape) != (1, *out.shape[1:]):
            return None
        with torch.no_grad():
            if not torch.equal(cand.expand_as(out), out):
                return None
        return cand


    def _fail(self, func, tracked, why):
        """Raise :class:`~.refusals.UnsupportedEntryError` for the parameters behind ``tracked``
        meeting the batch in ``func``."""
        names = sorted({self.names[i] for t in tracked for i in self._param_ids(t)})
        raise unsupported_entry(func, names, why)

    def _substitute(self, t, shape, func, check_batch=True, rows_ok=True, moved=False):
        """``D_b``: ``t`` (aligned to the broadcast ``shape``) expanded to ``shape[0]`` rows, and
        its entry. ``rows_ok``: the batched operands are known sample-major in dim 0 (needed for k·B
        rows); ``moved``: one is known to have its batch in another dimension (refused even with B
        rows: a sequence-first layout)."""
        B = self.batch_size
        n = shape[0]
        if check_batch and moved:
            self._fail(func, [t], f"the batched operand has {n} rows but its batch dimension was "
                                  "moved from dim 0 (e.g. a sequence-first layout), so rows cannot "
                                  "be assigned to samples")
        if check_batch and not rows_ok:
            self._fail(func, [t], "the tracer could not follow the batch dimension of the batched "
                                  "operand through the ops before this one (it follows "
                                  "elementwise and shape ops, permute/transpose, basic indexing, "
                                  "reductions over other dims, cat/stack along other dims, "
                                  "embedding), so its rows cannot be assigned to samples")
        if check_batch and (n % B if B else n):  # an empty batch has 0 rows: nothing to assign
            self._fail(func, [t], f"the batched operand has {n} rows, not a multiple of the batch "
                                  f"size {B} (inputs must be batch-first)")
        if t.dim() < len(shape):
            base = t.reshape((1,) * (len(shape) - t.dim()) + tuple(t.shape))
        elif t.shape[0] == 1:
            base = t
        else:
            info = self.derived.get(t)
            if info is None or info.row_base is None or t.shape[0] != n:
                self._fail(func, [t], f"a batch-free tensor of shape {tuple(t.shape)} is aligned "
                                      "with the batch dimension but is not an expand of a one-row "
                                      "tensor")
            base = info.row_base
        if base.shape[0] != 1:
            self._fail(func, [t], f"cannot align shape {tuple(t.shape)} with the batch dimension")
        d_b = base.expand(n, *base.shape[1:])
        ids = self._param_ids(t)
        entry = Entry(name=", ".join(self.names[i] for i in ids), base=base,
                      params=[self.tracked[i][1] for i in ids], edge=get_gradient_edge(d_b),
                      out_node=None, batched_nodes=[])
        d_b.register_hook(self._make_hook(entry, n))
        return d_b, entry

    def _entry(self, func, args, kwargs, tracked):
        tensors = tensor_args(args, kwargs)
        batched_nodes = [get_gradient_edge(t).node for t in tensors
                         if not self.is_tracked(t) and t.requires_grad]
        new_entries = []
        rows_ok = self._rows_ok(tensors)
        moved = self._moved(tensors)

        def sub(t, shape):
            if self.is_tracked(t) and self._info(t).pending:
                if (t.dim() != len(shape) or t.shape[0] != shape[0] or shape[0] % self.batch_size
                        or not rows_ok):
                    self._fail(func, [t], f"its {t.shape[0]} rows do not line up with the "
                                          f"{shape[0]} batched rows")
                new_entries.extend(self._info(t).pending)
                return t
            if self.is_tracked(t):
                d_b, e = self._substitute(t, shape, func, rows_ok=rows_ok, moved=moved)
                new_entries.append(e)
                return d_b
            return t

        if func in ELEMENTWISE:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            args = tuple(sub(a, shape) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: sub(v, shape) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
        elif func in CONCAT:
            seq = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            ref = next(t for t in seq if not self.is_tracked(t))
            if func is not torch.stack and dim % ref.dim() == 0:
                self._fail(func, tracked, "concatenation along the batch dimension")
            shape = ref.shape
            seq = [sub(t, (shape[0],) + tuple(t.shape[1:])) if t.dim() == ref.dim() else t
                   for t in seq]
            if any(self.is_tracked(t) for t in seq):
                self._fail(func, tracked,
                           "a tracked tensor with another rank than the batched ones")
            args = (seq,) + tuple(args[1:]) if args else args
            if not args:
                kwargs = dict(kwargs, tensors=seq)
        elif func is F.scaled_dot_product_attention:
            q = args[0]
            k = args[1]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if not (isinstance(mask, torch.Tensor) and self.is_tracked(mask)) or \
                    any(self.is_tracked(t) for t in args[:3]):
                self._fail(func, tracked, "only attn_mask may be a tracked tensor")
            shape = tuple(q.shape[:-1]) + (k.shape[-2],)
            d_b = sub(mask, shape)
            if len(args) > 3:
                args = tuple(args[:3]) + (d_b,) + tuple(args[4:])
            else:
                kwargs = dict(kwargs, attn_mask=d_b)
        elif func in MATMULS:
            x = args[0] if args else kwargs.get("input")
            W = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
            if not (isinstance(W, torch.Tensor) and self.is_tracked(W) and W.dim() == 2) or \
                    self.is_tracked(x) or x.dim() < 2:
                self._fail(func, tracked, "only x @ W with a batched x and a tracked 2-D W is "
                                          "supported")
            out = self._weight_entry(func, x, W, False, new_entries, rows_ok, moved)
        elif func is F.linear:
            out, is_entry = self._linear_entry(args, kwargs, tracked, new_entries)
            if not is_entry:  # F.linear on a batch-free input: a chain op after all
                return out
            # bias entry: its data is F.linear(x, W); input entry: the recorded call covers W, b
            if new_entries:
                batched_nodes = new_entries[-1].batched_nodes
        else:
            self._fail(func, tracked, "this op is not a supported entry")
        if func is not F.linear and func not in MATMULS:
            out = func(*args, **kwargs)
        for t in output_tensors(out):
            self.batched[t] = 0 if rows_ok else -1
        first = output_tensors(out)[0]
        node = first.grad_fn
        for e in new_entries:
            e.out_node = node
            e.batched_nodes = list(batched_nodes)
        self.ledger.entries.extend(new_entries)
        return out

    def _linear_entry(self, args, kwargs, tracked, new_entries):
        """``F.linear(x, W, b)`` with a tracked ``x`` or ``b``; returns ``(output, is_entry)``.

        * ``b`` derived from tracked parameters (timm BEiT/EVA/SwinV2 attention:
          ``F.linear(x, self.qkv.weight, cat(q_bias, zeros, v_bias))``): computed as
          ``F.linear(x, W) + b_b``, an entry for ``b``; when ``W`` is the weight of a recorded
          Linear whose forward is never called, the call ``(x, F.linear(x, W))`` is recorded for
          that Linear, so its weight is clipped by the Linear rule (ghost or instantiated) at rule
          speed.
        * ``x`` a row-expanded tracked tensor with B rows (timm's attention-pool
          ``latent.expand(B, …)`` fed to a Linear): its rows are the samples; ``x`` becomes an entry
          and the output is batched.
        """
        names = ("input", "weight", "bias")
        vals = list(args) + [None] * (3 - len(args))
        for k, n in enumerate(names):
            if n in kwargs:
                vals[k] = kwargs[n]
        x, W, b = vals
        tr = [isinstance(t, torch.Tensor) and self.is_tracked(t) for t in (x, W, b)]
        if tr[1]:
            if tr[0] or W.dim() != 2 or x.dim() < 2 or id(W) in self.linear_layers:
                self._fail(F.linear, tracked, "a tracked tensor used as the weight of a "
                                              "batch-free input or of a recorded Linear")
            tensors = [t for t in (x, W, b) if isinstance(t, torch.Tensor)]
            y = self._weight_entry(F.linear, x, W, True, new_entries, self._rows_ok(tensors),
                                   self._moved(tensors))
            if b is None:
                return y, True
            if tr[2]:
                b_b, e = self._substitute(b, tuple(y.shape), F.linear)
                new_entries.append(e)
                return y + b_b.to(y.dtype), True
            if isinstance(b, nn.Parameter) and b.requires_grad:
                self._fail(F.linear, tracked, "the bias is a trainable parameter of no recorded "
                                              "Linear")
            return y + b.to(y.dtype), True
        if tr[0]:
            info = self._info(x)
            layer = self.linear_layers.get(id(W))
            if (x.dim() >= 2 and x.shape[0] == self.batch_size and info.row_base is not None
                    and not tr[2]):
                # rows are the samples: an entry for x; the Linear's own call is recorded here
                if layer is not None and not (b is None or b is layer.module.bias):
                    self._fail(F.linear, tracked,
                               f"the bias is not the own bias of the Linear {layer.name} owning "
                               "the weight (the recorded call would clip the wrong bias)")
                own = (layer.module.weight, layer.module.bias) if layer is not None else ()
                x, e = self._substitute(x, tuple(x.shape), F.linear)
                # W/b that are not the Linear's own parameters: the graph walk must look behind them
                e.batched_nodes = [get_gradient_edge(t).node for t in (W, b)
                                   if isinstance(t, torch.Tensor) and t.requires_grad
                                   and not any(t is o for o in own)]
                new_entries.append(e)
                y = F.linear(x, W, b)
                if layer is not None:
                    self.recorder.record(layer, layer.module, x, y, covered=True)
                    self.recorded[y] = True
                elif any(isinstance(t, nn.Parameter) and t.requires_grad for t in (W, b)):
                    self._fail(F.linear, tracked,
                               "the weight is a trainable parameter of no recorded Linear")
                return y, True
            # a batch-free input (SwinV2's continuous position bias MLP on a fixed grid): a chain
            # op; the Linear's parameters are followed by the tracer (the recorder hands the call
            # over)
            y = F.linear(x, W, b)
            ids = set(self._param_ids(x)) | (set(self._param_ids(b)) if tr[2] else set())
            for t in (W, b):
                if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in self.tracked:
                    if layer is None:
                        self._fail(F.linear, tracked,
                                   "the weight is a trainable parameter of no recorded Linear")
                    n = f"{layer.name}.{'weight' if t is W else 'bias'}"
                    self.tracked[id(t)] = (n, t)
                    self.names[id(t)] = n
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    ids.add(id(t))
            self.derived[y] = Derived(tuple(sorted(ids)))
            return y, False
        if not tr[2]:
            return F.linear(x, W, b), True
        y = F.linear(x, W, None)
        layer = self.linear_layers.get(id(W))
        if layer is not None:
            from ...layers.base import trainable

            if trainable(layer.module, "bias"):
                self._fail(F.linear, tracked, f"the Linear {layer.name} owning the weight has a "
                                              "trainable bias that this call does not use")
            self.recorder.record(layer, layer.module, x, y)
        elif isinstance(W, nn.Parameter) and W.requires_grad:
            self._fail(F.linear, tracked,
                       "the weight is a trainable parameter of no recorded Linear")
        b_b, e = self._substitute(b, tuple(y.shape), F.linear)
        e.batched_nodes = [get_gradient_edge(y).node] if y.requires_grad else []
        new_entries.append(e)
        return y + b_b.to(y.dtype), True  # F.linear's dtype under autocast (its bias is cast too)

    def _weight_entry(self, func, x, W, transposed: bool, new_entries, rows_ok, moved):
        """``x @ W`` (``transposed``: ``x @ Wᵀ``, F.linear) for a batched ``x: (n, …, d)`` and a
        tracked 2-D ``W``: computed as ``x_i @ W_b[i]`` with ``W_b`` the weight expanded to one
        copy per sample, so that the gradient reaching ``W_b`` is the per-sample gradient
        ``∂L_i/∂W = Σ_t x_{i,t}ᵀ g_{i,t}`` (instantiated, as every traced parameter's). The rows of
        ``x`` must be the samples (or k consecutive rows per sample)."""
        B, n, d = self.batch_size, x.shape[0], x.shape[-1]
        if (n % B if B else n):
            self._fail(func, [W], f"the batched operand has {n} rows, not a multiple of the "
                                  f"batch size {B} (inputs must be batch-first)")
        W_b, e = self._substitute(W, (B,) + tuple(W.shape), func, rows_ok=rows_ok, moved=moved)
        new_entries.append(e)
        inner = math.prod(x.shape[1:-1])
        per_sample = (n // B) * inner if B else inner
        Wm = W_b.transpose(1, 2) if transposed else W_b
        y = torch.matmul(x.reshape(B, per_sample, d), Wm)
        return y.reshape(*x.shape[:-1], Wm.shape[-1])
