"""Rule for ``nn.Conv1d/2d/3d``: stride, padding (ints, "same", "valid", every padding mode),
dilation, groups and bias.

The input is padded exactly as the layer pads it and unfolded (im2col, operator U of Bu, Mao & Xu
2022, "Scalable and Efficient Training of Large Convolutional Neural Networks with Differential
Privacy") into ``U(a_i) ∈ R^{T×groups×D}`` with ``T = Π S_out`` and ``D = (C_in/groups)·Π k``.
For each group γ the layer is linear: ``G_i^γ = g_i^γᵀ U(a_i)^γ`` (p/groups × D), so

* ghost norm: ``‖G_i‖² = Σ_γ ⟨U(a_i)^γ U(a_i)^γᵀ, g_i^γ g_i^γᵀ⟩`` (Bu, Mao & Xu 2022, eq. 2.7,
  per group),
* instantiation: ``Σ_γ ‖g_i^γᵀ U(a_i)^γ‖²_F``,
* bias: ``‖Σ_t g_{i,t}‖²``.

Per-sample gradients and clipped sums come from cuDNN / oneDNN weight-gradient kernels or, where
those are slow (the CPU, few output positions: :func:`per_sample_by_unfold`,
:func:`release_by_unfold`), from im2col and matmuls; both sum the same products per entry, so one
rounding bound covers either.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..foundation.dtypes import accumulation_dtype, cast, compute_dtype
from ..foundation.matmul import put_into, scale_samples, weighted_sum_into
from .base import (
    LayerDims,
    LayerRule,
    certified_kept,
    gram_inner,
    gram_unit,
    row_norm_sq,
    trainable,
    zeros_like_batch,
)
from .gram import certified_ghost_sq
from .registry import register_rule
from .rounding import (
    ETA32,
    ETA64,
    certified_ghost,
    certified_instantiated,
    gamma,
    ghost_may_underflow,
    ghost_underflow,
    gram_coefficient,
    gram_eta,
    instantiation_coefficient,
    release_coefficient,
    row_norms64,
    unit_roundoff,
)


def unfold_conv_input(module: nn.modules.conv._ConvNd, a: torch.Tensor) -> torch.Tensor:
    """im2col for any spatial rank: ``(B, C_in, *S) -> (B, T, groups, (C_in/groups)·Πk)``.

    Padding follows the module (``_reversed_padding_repeated_twice`` covers ints, "same" with
    its asymmetric split, and "valid"; the padding mode picks zeros/reflect/replicate/circular),
    so the column order matches ``weight.view(p, -1)`` within each group. A strided view of
    :func:`unfolded_columns` (a copy of the input's windows, nothing computed).
    """
    return unfolded_columns(module, a).permute(0, 3, 1, 2)


def unfolded_columns(module: nn.modules.conv._ConvNd, a: torch.Tensor,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """im2col as ``(B, groups, D, T)`` with ``D = (C_in/groups)·Πk`` (the order of
    ``weight.view(p, -1)`` within a group) and ``T = Π S_out``, in ``dtype`` (default: ``a``'s),
    formed in one of two ways that give the same tensor (:func:`unfold_by_windows` picks):

    * the window view :func:`unfolded_windows` and one copy (a ``reshape``, or a copy that also
      converts to ``dtype``), none where the view already has the layout (a 1×1 convolution of
      stride 1);
    * on the CPU only, for 1-d and 2-d layers with few positions, one ``F.unfold`` kernel (a 1-d
      layer as a 2-d one of height 1) over the batch folded into the channels, ``(B, C, *S) ->
      (1, B·C, *S)``: the kernel loops over samples, each with a parallel region of its own, and on
      a CPU shared with other work every region waits for a time slice (ResNet-18's 128-channel
      layer on an 8×8 map, batch 16, two threads on a loaded 2-core VM: 184 ms for the batch
      against 12 ms folded, the same 2.6 ms on one thread); on CUDA ``F.unfold`` launches one
      kernel per sample.

    Every entry is a copy of an input value or a padding value, converted to ``dtype``: nothing is
    computed, so the choice changes no rounding."""
    nd = a.dim() - 2
    B, C = a.shape[:2]
    dtype = a.dtype if dtype is None else dtype
    if nd <= 2 and not unfold_by_windows(module, a):
        x, padding = _padded(module, cast(a, dtype))
        ks, st, dl = module.kernel_size, module.stride, module.dilation
        if nd == 1:
            x, padding = x.unsqueeze(2), (0,) + tuple(padding)
            ks, st, dl = (1,) + tuple(ks), (1,) + tuple(st), (1,) + tuple(dl)
        # the batch as the channels of one sample: one im2col kernel (one parallel region)
        # instead of one per sample; row (b·C + c)·Πk + κ of its (1, B·C·Πk, T) is row c·Πk + κ
        # of sample b's channel-major columns
        cols = F.unfold(x.reshape(1, B * C, *x.shape[2:]), ks, dl, padding, st)
        return cols.reshape(B, module.groups, -1, cols.shape[-1])
    windows = unfolded_windows(module, a)
    shape = (B, module.groups, (C // module.groups) * math.prod(module.kernel_size),
             math.prod(windows.shape[3 + nd:]))
    if windows.dtype == dtype:
        return windows.reshape(shape)
    out = windows.new_empty(shape, dtype=dtype)
    out.view(windows.shape).copy_(windows)  # gather and conversion in one pass
    return out


def unfolded_windows(module: nn.modules.conv._ConvNd, a: torch.Tensor) -> torch.Tensor:
    """im2col as a strided view ``(B, groups, C_in/groups, *k, *S_out)`` whose entry
    ``[b, γ, c, κ, s]`` is ``x[b, γ·C_in/groups + c, s·stride + κ·dilation]`` for ``x`` the input
    padded as the layer pads it (``Tensor.unfold`` windows of each spatial dimension; a dilated
    kernel's taps picked by a step). No copy, except ``F.pad`` for a padded layer.

    Non-overlapping windows (stride = kernel size, dilation 1, no padding: the patch embeddings
    of ViT, DeiT, ConvNeXt and Swin, a 1×1 convolution of stride 1) are a view of ``a`` itself:
    each spatial size ``S_j`` split as ``(S_j // k_j, k_j)`` after its trailing ``S_j mod k_j``
    positions (which the layer never reads) are dropped, and permuted."""
    nd = a.dim() - 2
    B, C = a.shape[:2]
    pad = list(module._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        a = F.pad(a, pad, mode=mode)
    for i in range(nd):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        a = a.unfold(2 + i, d * (k - 1) + 1, s)
    if any(d != 1 for d in module.dilation):
        index = (slice(None),) * (2 + nd) + tuple(slice(None, None, d) for d in module.dilation)
        a = a[index]
    # (B, C, *S_out, *k) -> (B, groups, C/groups, *k, *S_out): channel-major columns
    a = a.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    return a.unflatten(1, (module.groups, C // module.groups))


#: fewest output positions per sample at which a 1-d or 2-d layer's im2col on the CPU is the
#: strided window copy rather than ``F.unfold`` (:func:`unfold_by_windows`)
WINDOW_COPY_MIN_POSITIONS = 256


def output_positions(module: nn.modules.conv._ConvNd, a: torch.Tensor) -> int:
    """``T = Π_j ⌊(S_j + pad_j − d_j(k_j − 1) − 1) / s_j⌋ + 1`` for the input ``a`` (both sides'
    padding in ``pad_j``)."""
    nd = a.dim() - 2
    pad = module._reversed_padding_repeated_twice
    T = 1
    for j in range(nd):
        total = pad[2 * (nd - 1 - j)] + pad[2 * (nd - 1 - j) + 1]
        k, s, d = module.kernel_size[j], module.stride[j], module.dilation[j]
        T *= (a.shape[2 + j] + total - d * (k - 1) - 1) // s + 1
    return T


def non_overlapping(module: nn.modules.conv._ConvNd) -> bool:
    """Whether the layer's windows tile its input: stride = kernel size, dilation 1, no padding
    (then im2col is a permutation of the input's entries, :func:`unfolded_windows`)."""
    return (tuple(module.stride) == tuple(module.kernel_size)
            and all(d == 1 for d in module.dilation)
            and not any(module._reversed_padding_repeated_twice))


def unfold_by_windows(module: nn.modules.conv._ConvNd, a: torch.Tensor,
                      device: Optional[torch.device] = None) -> bool:
    """im2col by the strided window copy (True) or by ``F.unfold`` (False, 1-d and 2-d layers on
    the CPU only) for the input ``a`` on ``device`` (default: ``a``'s).

    * Off the CPU always: CUDA's ``F.unfold`` loops over the batch, one kernel per sample, where
      the window copy is one kernel (ViT-B/16's patch embedding at batch 128: 128 kernels → 1).
    * Non-overlapping windows (:func:`non_overlapping`): one reshape of the input, faster than
      ``F.unfold`` on the CPU too (ViT's 16×16 patch embedding at 224², batch 16, one core:
      1.7 ms against 5.3 ms).
    * Windows for at least :data:`WINDOW_COPY_MIN_POSITIONS` output positions per sample: the copy
      walks each window offset's positions in order, where ``F.unfold`` on the CPU is several
      times slower (ResNet-18's first layers at 64², batch 16, one core: 2 ms against 20 ms for
      the 7×7 stem, 0.6 ms against 24 ms for a 64-channel 3×3 layer on a 16×16 map); on few
      positions (the 4×4 and 2×2 maps) ``F.unfold`` is the faster of the two on the CPU."""
    device = a.device if device is None else device
    return (device.type != "cpu" or a.dim() > 4 or non_overlapping(module)
            or output_positions(module, a) >= WINDOW_COPY_MIN_POSITIONS)


class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def _views(self, module, calls):
        """Unfolded inputs ``(B·groups, T, D)`` and output grads ``(B·groups, T, p/groups)``:
        strided views of one im2col copy (:func:`unfolded_columns`) and of ``g`` itself (several
        calls: concatenated along T)."""
        Us, Gs = [], []
        for a, g in calls:
            dt = compute_dtype(g)
            cols, G = self._columns(module, a, cast(g, dt), dt)
            Us.append(cols.flatten(0, 1).transpose(1, 2))
            Gs.append(G.flatten(0, 1).transpose(1, 2))
        if len(calls) == 1:
            return Us[0], Gs[0]
        return torch.cat(Us, 1), torch.cat(Gs, 1)

    def _columns(self, module, a, g, dtype):
        """``(U, G)`` of one call: the im2col ``(B, groups, D, T)`` of ``a`` in ``dtype`` (the
        conversion made by the im2col copy itself) and ``g`` viewed as
        ``(B, groups, p/groups, T)``."""
        if a.dim() != len(module.kernel_size) + 2:
            raise ValueError(
                f"{type(module).__name__} expects batched input (B, C, *spatial); got shape "
                f"{tuple(a.shape)}. "
                "Unbatched inputs cannot be clipped per sample: add a batch dimension."
            )
        cols = unfolded_columns(module, a, dtype)
        B, groups, _, T = cols.shape
        G = g.reshape(B, groups, module.out_channels // groups, -1)
        if G.shape[-1] != T:
            raise ValueError(
                f"{type(module).__name__}: unfolded {T} positions but the output has "
                f"{G.shape[-1]}; "
                "a subclass that changes Conv's forward needs its own rule."
            )
        return cols, G

    def dims(self, module, activation, output):
        T = math.prod(output.shape[2:])
        D = (module.in_channels // module.groups) * math.prod(module.kernel_size)
        return LayerDims(T=T, D=D, p=module.out_channels, groups=module.groups)

    def _bias_grad(self, calls):
        return sum(g.flatten(2).sum(2, dtype=accumulation_dtype(g)) for _, g in calls)

    def ghost_norm_sq(self, module, calls):
        g0 = calls[0][1]
        bias = trainable(module, "bias")
        if trainable(module, "weight"):
            U, G = self._views(module, calls)
            # weight and bias together, per group: ⟨U Uᵀ + 11ᵀ, g gᵀ⟩ (the bias of group γ is g^γᵀ1)
            gram = gram_inner(U, G, bias=bias)
            return gram if module.groups == 1 else gram.reshape(g0.shape[0], module.groups).sum(1)
        if bias:
            return row_norm_sq(self._bias_grad(calls))
        return zeros_like_batch(g0)

    def _position_bounds(self, module, calls, bias: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(n², m)``: float64 upper bounds ``(B, groups, Σ T)`` of ``‖(U(a_i)^γ_t, 1)‖²`` (no 1
        without a trained bias) and of ``‖g_{i,t}^γ‖``, the positions of every call concatenated in
        call order (as :meth:`_views` concatenates them).

        ``‖U(a)^γ_t‖²`` — the input window of position t — is the sum of ``Σ_{c ∈ γ} a_c²`` over the
        window (:func:`window_sums`), so no im2col copy is read: ``K = (C_in/groups)·Πk + 2``
        positive terms summed in float32 on the CPU (float64 on CUDA, where cuDNN may pick TF32
        or transform-based kernels), exact to ``(1 + γ_K)``, plus ``K·(2⁻¹²⁶ + 2⁻¹⁰²²)`` for
        squares below float32's normal range; a square that overflows gives ``inf`` (the sample is
        dropped). ``m``: :func:`~private_engine.layers.rounding.row_norms64` of each position's
        output-gradient row."""
        squares, norms = [], []
        groups = module.groups
        for a, g in calls:
            B, C = a.shape[:2]
            acc = torch.float64 if a.is_cuda else accumulation_dtype(a)
            x, padding = _padded(module, a.to(acc).square())
            x = x.reshape(B, groups, C // groups, *x.shape[2:]).sum(2)
            window = window_sums(module, x, padding)
            terms = (C // groups) * math.prod(module.kernel_size) + 2
            window = window.reshape(B, groups, -1).double() * (1 + gamma(terms, unit_roundoff(acc)))
            window = window + terms * (ETA32 + ETA64)
            if bias:
                window = window + 1
            squares.append(window)
            per_group = g.reshape(B, groups, module.out_channels // groups, -1)
            norms.append(row_norms64(per_group.transpose(2, 3)))
        if len(calls) == 1:
            return squares[0], norms[0]
        return torch.cat(squares, 2), torch.cat(norms, 2)

    @staticmethod
    def _mass_of(module, calls, na2: torch.Tensor, ng: torch.Tensor) -> torch.Tensor:
        """``M_i = Σ_{γ,t} √(n²_{i,γ,t})·m_{i,γ,t}`` from :meth:`_position_bounds`: positive terms
        summed in float64, raised by ``γ^{(64)}`` of their count plus the layer's output channels
        and 4 (the square roots, products and sums), and by ``2⁻¹⁰²²`` per position for products
        below the normal range."""
        positions = sum(g[0].numel() // module.out_channels for _, g in calls) * module.groups
        total = (na2.sqrt() * ng).sum((1, 2))
        slack = 1 + gamma(positions + module.out_channels + 4, unit_roundoff(torch.float64))
        return total * slack + positions * ETA64

    def certified_norm_sq(self, module, calls, use_ghost, grads=None):
        """Certified ``‖release_i‖²`` bound at C_i = 1 (:mod:`private_engine.layers.rounding`): the
        weight's release is one weight-gradient kernel over the batch's ``B·T`` positions per call
        (:meth:`weighted_grads`), bounded as for a Linear layer group by group, ``(√(ν̃ + c_ν M²) +
        c_r M)²`` or ``(‖G̃‖ + (c_inst + c_r) M)²``; bias alone: its per-sample sums ``Σ_t g_t`` are
        released as they are."""
        weight, bias = trainable(module, "weight"), trainable(module, "bias")
        g0 = calls[0][1]
        if not weight:
            if not bias:
                return zeros_like_batch(g0)
            return certified_kept([self._bias_grad(calls)], g0)
        B = g0.shape[0]
        T = sum(g[0].numel() // module.out_channels for _, g in calls)
        dt = compute_dtype(g0)
        na2, ng = self._position_bounds(module, calls, bias)
        mass = self._mass_of(module, calls, na2, ng)
        rows = B * T + len(calls)
        c_rel = release_coefficient(accumulation_dtype(g0), g0.device, rows, conv=True)
        if use_ghost:
            U, G = self._views(module, calls)
            D = U.shape[2]
            fast = self._fast_ghost(module, U, G, bias, na2, ng, c_rel)
            if fast is not None:
                return certified_ghost(fast, mass, 0.0, c_rel)
            c_nu = gram_coefficient(D + bias, G.shape[2], T, gram_unit(U))
            nu = gram_inner(U, G, bias=bias)
            unit = gram_unit(U)
            lost = (ghost_underflow(row_norms64(U).sum(1) + (T if bias else 0),
                                    row_norms64(G).sum(1), D + bias, G.shape[2], T,
                                    gram_eta(unit)) if ghost_may_underflow(U, unit) else None)
            if module.groups > 1:  # the groups' terms (each within ±M_γ², Σ M_γ² ≤ M²) summed
                nu = nu.reshape(B, module.groups).sum(1)
                lost = None if lost is None else lost.reshape(B, module.groups).sum(1)
                c_nu += 2 * gamma(module.groups + 1, unit_roundoff(torch.float64))
            return certified_ghost(nu, mass, c_nu, c_rel, lost)
        grads = self.per_sample_grads(module, calls) if grads is None else grads
        norm_sq = sum(row_norm_sq(g) for g in grads.values())
        c_inst = instantiation_coefficient(dt, g0.device, T + len(calls), conv=True)
        terms = module.weight.numel() + module.out_channels
        return certified_instantiated(norm_sq, mass, c_inst, c_rel, terms)

    @staticmethod
    def _fast_ghost(module, U: torch.Tensor, G: torch.Tensor, bias: bool, na2: torch.Tensor,
                    ng: torch.Tensor, c_rel: float = 0.0):
        """Upper bound of the ghost norm per sample from float32 Grams of the unfolded input
        ``U`` and ``G`` (:func:`private_engine.layers.gram.certified_ghost_sq`), the groups'
        non-negative bounds summed in float64 (raised by ``γ^{(64)}_{groups+1}``); None where
        the operands have no fast path. The row-norm bounds it weighs the Grams' rounding with are
        those of the mass (:meth:`_position_bounds`): ``‖(U_t, 1)‖ ≤ √(n²_t)·(1 + 2⁻⁵¹)`` (the
        float64 square root, correctly rounded, raised past its rounding) and ``m_t`` — no pass
        over ``U``, whose rows are ``Πk`` times the input. ``c_rel``: the release coefficient,
        which sets how loose a kept bound may be (each group's row by its own mass). Where the
        per-sample gradients ``g^γᵀ U^γ`` take fewer products than the Grams (a ViT's patch
        embedding: 147 456 against 188 356 per position), they are formed instead of the Grams
        (``gradients_first``)."""
        na = na2.sqrt().mul_(1 + 2.0 ** -51).reshape(U.shape[:2])
        fast = certified_ghost_sq(U, G, bias, na, ng.reshape(G.shape[:2]), c_rel,
                                  gradients_first=True)
        if fast is None or module.groups == 1:
            return fast
        fast = fast.reshape(-1, module.groups).sum(1)
        return fast * (1 + gamma(module.groups + 1, unit_roundoff(torch.float64)))

    def per_sample_grads(self, module, calls) -> Dict[str, torch.Tensor]:
        """Per-sample weight gradients ``G_i = g_iᵀ U(a_i)``, per group, in one of two
        formulations (:func:`per_sample_by_unfold` picks):

        * grouped convolution (Rochette, Manoel & Tramel 2019, "Efficient Per-Example Gradient
          Computations in Convolutional Neural Networks"): the batch folded into the channels,
          ``(B, C, *S) -> (1, B·C, *S)``, makes sample i group i of a convolution with
          ``B·groups`` groups, so one weight-gradient kernel returns every ``G_i`` without an im2col
          copy — fast for large feature maps and few channels;
        * im2col and one batched matmul ``(B·groups, p/groups, T) @ (B·groups, T, D)`` over the
          ``T`` positions of all calls — on the CPU for few positions and many channels, or few
          input channels (an RGB stem), where the grouped kernel is slower than the matmul.

        Either sums ``T`` products per entry (plus one per further call), in the accumulator of
        the operands' dtype, so both meet :func:`~private_engine.layers.rounding.
        instantiation_coefficient` for ``T + calls`` positions."""
        out = {}
        B = calls[0][1].shape[0]
        if trainable(module, "weight"):
            dt = compute_dtype(calls[0][1])
            if per_sample_by_unfold(module, _positions(module, calls), dt, calls[0][1].device):
                U, G = self._views(module, calls)
                W = torch.bmm(G.transpose(1, 2), U)
            else:
                W = None
                for a, g in calls:
                    dt = compute_dtype(g)
                    x, padding = _padded(module, cast(a, dt))
                    w = _conv_weight_grad(module, (x.reshape(1, -1, *x.shape[2:]), padding),
                                          cast(g, dt).reshape(1, -1, *g.shape[2:]),
                                          B * module.groups,
                                          (B * module.out_channels, *module.weight.shape[1:]))
                    W = w if W is None else W + w
            out["weight"] = W.reshape(B, *module.weight.shape)
        if trainable(module, "bias"):
            out["bias"] = self._bias_grad(calls)
        return out

    def weighted_grads(self, module, calls, factors, out=None) -> Dict[str, torch.Tensor]:
        """``Σ_i C_i G_i`` as the ordinary weight gradient of the layer for the input ``diag(C)·a``
        or the output gradient ``diag(C)·g`` — whichever is smaller: the weight gradient is linear
        in each, and padding (any mode) commutes with scaling a sample — no per-sample gradient;
        bias ``Σ_i C_i Σ_t g_{i,t}``; copied into ``out`` when given. Operands in ≥ float32: the
        kernel returns its operands' dtype, and a 16-bit result would round the whole batch's sum.

        One weight-gradient kernel (cuDNN / oneDNN) per call, or, where :func:`release_by_unfold`
        says so (few positions on the CPU), im2col and one matmul per group over the ``B·T``
        positions of all calls, ``(diag(C)·g)ᵀ U``. Both sum ``B·T`` products per entry (and one
        per further call) in any order, and so meet the same
        :func:`~private_engine.layers.rounding.release_coefficient`."""
        out = out or {}
        res = {}
        if trainable(module, "weight"):
            g0 = calls[0][1]
            dt = accumulation_dtype(g0)  # a weight-gradient kernel returns its operands' dtype
            target = out.get("weight")
            if release_by_unfold(module, _positions(module, calls), dt, g0.device):
                W = self._unfold_release(module, calls, factors, dt, target)
            else:
                W = None
                for a, g in calls:
                    a, g = cast(a, dt), cast(g, dt)
                    if a.numel() < g.numel():
                        a = scale_samples(a, factors)
                    else:
                        g = scale_samples(g, factors)
                    w = _conv_weight_grad(module, _padded(module, a), g, module.groups,
                                          module.weight.shape)
                    W = w if W is None else W + w
            res["weight"] = W if W is target else put_into(target, W)
        if trainable(module, "bias"):
            res["bias"] = weighted_sum_into(out.get("bias"), self._bias_grad(calls), factors)
        return res

    def _unfold_release(self, module, calls, factors, dt, target=None) -> torch.Tensor:
        """``Σ_i C_i g_iᵀ U(a_i)`` per group, ``(groups, p/groups, B·T) @ (groups, B·T, D)``: the
        output gradient scaled by ``C`` (factors rounded toward zero) and im2col of the input, the
        positions of every call concatenated; written by the matmul into ``target`` (returned) when
        that is a contiguous tensor of the operands' dtype, else returned as a new tensor."""
        Us, Gs = [], []
        for a, g in calls:
            cols, G = self._columns(module, a, scale_samples(cast(g, dt), factors), dt)
            Us.append(cols)
            Gs.append(G)
        U = Us[0] if len(Us) == 1 else torch.cat(Us, 3)  # (B, groups, D, T)
        G = Gs[0] if len(Gs) == 1 else torch.cat(Gs, 3)  # (B, groups, p/groups, T)
        groups = module.groups
        U = U.permute(1, 0, 3, 2).reshape(groups, -1, U.shape[2])  # (groups, B·T, D)
        G = G.permute(1, 2, 0, 3).reshape(groups, G.shape[2], -1)  # (groups, p/groups, B·T)
        if target is not None and target.dtype == dt and target.is_contiguous():
            torch.bmm(G, U, out=target.view(groups, G.shape[1], U.shape[2]))
            return target
        return torch.bmm(G, U).reshape(module.weight.shape)


#: fewest output positions per sample (all calls) at which the CPU release (``Σ_i C_i G_i``) of a
#: convolution uses oneDNN's weight-gradient kernel; below it, im2col and one matmul (measured on
#: ResNet-18's 2×2 and 4×4 feature maps, where the matmul takes half the kernel's time)
RELEASE_KERNEL_MIN_POSITIONS = 16


def _positions(module: nn.modules.conv._ConvNd, calls) -> int:
    """Output positions per sample over all calls, ``Σ_calls Π S_out``."""
    return sum(g[0].numel() // module.out_channels for _, g in calls)


#: per-sample gradients of a convolution by im2col + bmm on the CPU when its positions per sample
#: are at most this many times its output channels per group (:func:`per_sample_by_unfold`)
PER_SAMPLE_UNFOLD_RATIO = 1

#: per-sample gradients of a convolution by im2col + bmm on the CPU when it has at most this many
#: input channels per group (an image model's stem) (:func:`per_sample_by_unfold`)
PER_SAMPLE_UNFOLD_MAX_CHANNELS = 4


def per_sample_by_unfold(module: nn.modules.conv._ConvNd, positions: int, dtype: torch.dtype,
                         device: torch.device) -> bool:
    """Instantiate ``G_i`` by im2col and a batched matmul (True) or by the grouped-convolution
    kernel (False). The matmul on the CPU, in float32 or float64,

    * when the im2col copy (``B·T·D`` per group) is no larger than the per-sample gradients it
      yields (``B·(p/groups)·D``), i.e. ``T ≤ p/groups`` (:data:`PER_SAMPLE_UNFOLD_RATIO`);
      oneDNN's grouped weight-gradient kernel with ``B·groups`` groups is then several times
      slower than the matmul (ResNet-18 at 64², batch 16, one core: 0.5 s against 0.2 s for a
      512-channel 3×3 layer on a 2×2 map);
    * when the layer has at most :data:`PER_SAMPLE_UNFOLD_MAX_CHANNELS` input channels per group
      (``D`` small, ``T`` large: an RGB stem), where the grouped kernel is slow too (ResNet-18's
      7×7 stem at 64², batch 16, one core: 60 ms against 38 ms, medians of 15 interleaved runs).

    The grouped kernel elsewhere: no im2col copy."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.float64)
            and (positions <= PER_SAMPLE_UNFOLD_RATIO * (module.out_channels // module.groups)
                 or module.in_channels // module.groups <= PER_SAMPLE_UNFOLD_MAX_CHANNELS))


def release_by_unfold(module: nn.modules.conv._ConvNd, positions: int, dtype: torch.dtype,
                      device: torch.device) -> bool:
    """Form the clipped sum ``Σ_i C_i G_i`` by im2col and a matmul (True) or by one
    weight-gradient kernel per call (False): the matmul on the CPU, in float32 or float64, for
    fewer than :data:`RELEASE_KERNEL_MIN_POSITIONS` positions per sample."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.float64)
            and positions < RELEASE_KERNEL_MIN_POSITIONS)


#: most kernel offsets ``Πk`` for which :func:`window_sums` adds shifted slices on the CPU
WINDOW_SUM_MAX_OFFSETS = 49


def window_sums(module: nn.modules.conv._ConvNd, x: torch.Tensor, padding) -> torch.Tensor:
    """``s[b, γ, o] = Σ_κ x[b, γ, o·stride + κ·dilation − padding]`` for ``x: (B, groups, *S)``
    (entries outside ``x`` are zeros): the layer's windows summed, i.e. the convolution of ``x``
    with a kernel of ones (``padding`` as :func:`_padded` returns it: symmetric zeros).

    On the CPU, for at most :data:`WINDOW_SUM_MAX_OFFSETS` kernel offsets and an output below
    torch's grain size, one in-place add of a strided slice of ``x`` per offset ``κ`` (the output
    positions whose window entry ``κ`` lies inside ``x``): element-wise kernels that small run on
    the calling thread, where the convolution opens parallel regions, each of which waits for a
    time slice on a CPU shared with other work (ResNet-18 at 64², batch 16, two threads on a loaded
    2-core VM: ≈ 24 ms per layer for the convolution, under 0.3 ms for the slices; ≈ 50 µs
    against ≈ 55 µs on one thread). Elsewhere the convolution (one kernel on CUDA). Either sums
    the same ``Πk`` non-negative terms per output (in another order), so the same ``(1 + γ)``
    bound covers both."""
    nd = x.dim() - 2
    k, st, dl = module.kernel_size, module.stride, module.dilation
    out_shape = [(x.shape[2 + j] + 2 * padding[j] - dl[j] * (k[j] - 1) - 1) // st[j] + 1
                 for j in range(nd)]
    offsets = math.prod(k)
    if (x.device.type != "cpu" or offsets > WINDOW_SUM_MAX_OFFSETS
            or x.shape[0] * x.shape[1] * math.prod(out_shape) >= _GRAIN_SIZE):
        ones = x.new_ones(x.shape[1], 1, *k)
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        return conv(x, ones, None, st, padding, dl, x.shape[1])
    out = x.new_zeros(*x.shape[:2], *out_shape)
    for kappa in itertools.product(*(range(kj) for kj in k)):
        dst, src = [slice(None)] * 2, [slice(None)] * 2
        for j in range(nd):
            # output o reads input o·s + κ·d − p, inside [0, S) for o in [lo, hi]
            shift = kappa[j] * dl[j] - padding[j]
            lo = max(0, -(shift // st[j]))
            hi = min(out_shape[j] - 1, (x.shape[2 + j] - 1 - shift) // st[j])
            if hi < lo:
                break
            dst.append(slice(lo, hi + 1))
            src.append(slice(lo * st[j] + shift, hi * st[j] + shift + 1, st[j]))
        else:
            out[tuple(dst)].add_(x[tuple(src)])
    return out


#: elements below which torch's CPU element-wise kernels run on the calling thread
#: (``at::internal::GRAIN_SIZE``)
_GRAIN_SIZE = 32768


def _padded(module: nn.modules.conv._ConvNd, a: torch.Tensor):
    """``(input, padding)`` for the kernels below: the input as the layer convolves it, padded by
    the module's own rule (ints, "same" with its asymmetric split, every padding mode) with padding
    0 left to the kernel — or, for symmetric zero padding, the input itself and the layer's padding
    (no copy)."""
    nd = a.dim() - 2
    pad = list(module._reversed_padding_repeated_twice)
    if not any(pad):
        return a, (0,) * nd
    if module.padding_mode == "zeros" and all(pad[2 * i] == pad[2 * i + 1] for i in range(nd)):
        return a, tuple(pad[2 * (nd - 1 - i)] for i in range(nd))
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(a, pad, mode=mode), (0,) * nd


def _conv_weight_grad(module, x, g: torch.Tensor, groups: int, weight_shape) -> torch.Tensor:
    """``∂/∂W`` of ``⟨conv(x, W; stride, dilation, groups), g⟩`` for ``x = (input, padding)`` from
    :func:`_padded` (as ``torch.nn.grad.conv*d_weight``: the weight enters only through its
    shape)."""
    x, padding = x
    nd = x.dim() - 2
    weight = x.new_empty(1).expand(weight_shape)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None, module.stride, padding, module.dilation, False, (0,) * nd, groups,
        (False, True, False))[1]


register_rule(ConvRule())
