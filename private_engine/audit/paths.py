"""Canaries for every clipping path of the engine: one canary head per path, and its canaries.

The engine clips a sample's gradient through several paths — a layer rule per module family
(Linear with and without bias, Conv, Embedding, LayerNorm, GroupNorm), the parameter tracer for
raw parameters, the ``torch.func`` fallback for modules no rule covers, each over one position or
a sequence of T > 1 — in every clipping mode and through both doors. A canary seen only through
one path audits only that path. Here each path has its own **canary head**, a small module of
that kind beside the audited MLP, and its own gradient canaries: a canary row feeds the head an
input ``x_i`` and its loss is ``L_i = w_i·⟨c_i, h(x_i)⟩``. Every head is linear in its trainable
parameters for a fixed input (its other parameters are frozen), so the gradient

    g_i = w_i·∇_θ ⟨c_i, h_θ(x_i)⟩

does not depend on θ, lies in the head's parameters only, and ``w_i`` scales it to
``canary_scale·R``: the engine clips it to exactly ``R·u_i``, ``u_i = g_i/‖g_i‖`` — the gradient
canary of Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run", now
through the rule, tracer or fallback of that path.

Each head is laid out so that every coordinate of a canary's direction is its own: no other
canary of the path touches it (a Linear head's canary owns an output unit, hence its bias entry
and one weight entry; a LayerNorm's canary a feature). The directions of all canaries are
therefore orthonormal, and the auditor reads canary i as ``⟨Δ, u_i⟩``:
``⟨Σ_j b_j R u_j + N(0, σ²R²I), u_i⟩ / R = b_i + N(0, σ²)`` — no cross-talk, the same noise for
every canary of every path. The directions are computed by ``torch.func`` on the head alone —
the plain per-sample gradient, outside the engine — and their supports are checked disjoint.

Paths (:data:`PATHS`) and their heads:

===============  ==============================================================================
``linear``       ``nn.Linear`` without bias, T = 1: the canary head of :mod:`.canaries` (its
                 ``random`` directions, unlike all others here, share coordinates)
``linear_bias``  ``nn.Linear`` with bias, T = 1
``conv``         ``nn.Conv2d`` with bias, 3×3 input, 2×2 kernel (T = 4 output positions)
``embedding``    ``nn.Embedding`` over T = 2 tokens (the canary's token twice)
``layernorm``    ``nn.LayerNorm`` (affine), T = 1
``groupnorm``    ``nn.GroupNorm`` (affine, two channels per group), 2 positions
``traced``       raw parameters: ``x @ proj + shift`` (the tracer's matmul and broadcast-add
                 entries)
``fallback``     ``nn.MultiheadAttention`` over T = 2 through the native door (query and key
                 projections 0, value projection the identity and output bias 0, all frozen;
                 ``out_proj.weight`` trained); through the Opacus door, whose validator refuses
                 ``nn.MultiheadAttention``, a Linear subclass with a ``forward`` of its own (no
                 rule describes it: the fallback clips it)
``sequence``     ``nn.Linear`` with bias over T = 4 positions (the canary at two of them)
===============  ==============================================================================
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PATHS", "PathCanaries", "build_path", "split_canaries", "TracedHead",
           "AttentionHead", "UnruledLinear"]

#: the clipping paths the audit has canaries for, in the order of the data set
PATHS = ("linear", "linear_bias", "conv", "embedding", "layernorm", "groupnorm", "traced",
         "fallback", "sequence")

#: canaries per chunk when their directions are computed (bounds the dense per-sample gradients)
_CHUNK = 256


class TracedHead(nn.Module):
    """Raw parameters: ``x @ proj + shift`` (no rule covers this module: the parameter tracer
    clips ``proj`` as a per-sample matmul weight and ``shift`` as a broadcast addend)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(d_in, d_out))
        self.shift = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj + self.shift


class AttentionHead(nn.Module):
    """Self-attention ``nn.MultiheadAttention(x, x, x)`` (batch first, one head), clipped by the
    ``torch.func`` fallback. The input projection is frozen at query = key = 0 (uniform
    attention) and value = identity, and the output bias at 0, so the output at every position
    is ``W_o·mean_t(x_t)``: linear in the trained ``out_proj.weight``."""

    def __init__(self, dim: int):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, 1, batch_first=True)
        with torch.no_grad():
            self.mha.in_proj_weight.zero_()
            self.mha.in_proj_weight[2 * dim:] = torch.eye(dim)
            self.mha.in_proj_bias.zero_()
            self.mha.out_proj.weight.zero_()
            self.mha.out_proj.bias.zero_()
        self.mha.in_proj_weight.requires_grad_(False)
        self.mha.in_proj_bias.requires_grad_(False)
        self.mha.out_proj.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # need_weights: the explicit softmax(QKᵀ)V path, which torch.func batches (the fused
        # CPU attention kernel has no batching rule: the fallback would loop over samples). The
        # weights (rows of 1/2, 1/2: they sum to 1 exactly) enter as Σ_s w − 1 = 0, so that both
        # outputs carry a gradient for the engine's separability probe; no trained parameter
        # reaches them
        out, weights = self.mha(x, x, x, need_weights=True)
        return out + (weights.sum(-1, keepdim=True) - 1)


class UnruledLinear(nn.Linear):
    """A Linear subclass with a ``forward`` of its own: no layer rule describes it, so the engine
    clips it by the ``torch.func`` fallback (in both doors)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class PathCanaries:
    """The m_p canaries of one path.

    ``head``: the canary head; ``inputs`` (m_p + 1, *shape): the canaries' head inputs, then the
    blank input of every other row; ``coefs`` (m_p + 1, *out_shape): their ``c_i``, then 0;
    ``included`` (bool, m_p); ``norms``: ``‖∇_θ⟨c_i, h(x_i)⟩‖`` (the loss weight is
    ``canary_scale·R / norm``); ``directions``: the sparse (m_p × n_p) matrix of the unit
    ``u_i`` over the head's trainable parameters flattened in order (:meth:`params`), with
    disjoint supports.
    """

    name: str
    head: nn.Module
    inputs: torch.Tensor
    coefs: torch.Tensor
    included: torch.Tensor
    norms: torch.Tensor = None
    directions: torch.Tensor = None

    @property
    def m(self) -> int:
        return int(self.included.shape[0])

    def params(self) -> List[nn.Parameter]:
        """The head's trainable parameters, in the order of the flattened directions."""
        return [p for p in self.head.parameters() if p.requires_grad]

    def snapshot(self) -> torch.Tensor:
        """The trainable parameters flattened (float64, detached)."""
        return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in self.params()])

    def project(self, update: torch.Tensor) -> torch.Tensor:
        """``⟨update, u_i⟩`` for every canary (update: the flattened parameter change)."""
        return torch.sparse.mm(self.directions, update.reshape(-1, 1)).reshape(-1)


def split_canaries(m: int, paths: Sequence[str]) -> Dict[str, int]:
    """m canaries split evenly over ``paths`` (the first ``m mod P`` get one more)."""
    base, extra = divmod(m, len(paths))
    return {p: base + (1 if k < extra else 0) for k, p in enumerate(paths)}


def _side(m: int, lo: int = 2) -> int:
    return max(lo, math.ceil(math.sqrt(m)))


def _pairs(m: int, rows: int, cols: int, generator: torch.Generator):
    """m distinct cells ``(r, c)`` of a rows × cols grid, in random order."""
    idx = torch.randperm(rows * cols, generator=generator)[:m]
    return idx // cols, idx % cols


def _eye_rows(idx: torch.Tensor, width: int, dtype) -> torch.Tensor:
    out = torch.zeros(idx.shape[0], width, dtype=dtype)
    out[torch.arange(idx.shape[0]), idx] = 1
    return out


def _with_blank(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, torch.zeros_like(t[:1])])


def _codes(m: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """m codes in ``range(k)``, each drawn uniformly."""
    return torch.randint(0, k, (m,), generator=generator)


def _linear_bias(m, gen, dtype, door):
    # canary i owns output unit i (a permutation): its weight entry (i, a_i) and bias entry i
    k, a = torch.randperm(m, generator=gen), _codes(m, 2, gen)
    return nn.Linear(2, m).to(dtype), _eye_rows(a, 2, dtype), _eye_rows(k, m, dtype)


def _conv(m, gen, dtype, door):
    # canary i owns output channel k_i: one kernel entry (k_i, 0, kh, kw) and bias k_i, through
    # one of the 4 output positions of a 2×2 kernel over a 3×3 input
    k = torch.randperm(m, generator=gen)
    kh, kw, pr, pc = (_codes(m, 2, gen) for _ in range(4))
    rows = torch.arange(m)
    x = torch.zeros(m, 1, 3, 3, dtype=dtype)
    x[rows, 0, pr + kh, pc + kw] = 1
    coef = torch.zeros(m, m, 2, 2, dtype=dtype)
    coef[rows, k, pr, pc] = 1
    return nn.Conv2d(1, m, 2).to(dtype), x, coef


def _embedding(m, gen, dtype, door):
    # canary i owns the entry (v_i, j_i) of the table, through its token v_i at both positions
    side = _side(m)
    v, j = _pairs(m, side, side, gen)
    head = nn.Embedding(side, side).to(dtype)
    tokens = torch.stack([v, v], 1)
    coef = _eye_rows(j, side, dtype)[:, None, :].expand(m, 2, side).clone()
    return head, tokens, coef


def _layernorm(m, gen, dtype, door):
    # canary i owns feature k_i: its weight and bias entries
    width = max(m, 2)
    k = torch.randperm(width, generator=gen)[:m]
    return nn.LayerNorm(width).to(dtype), _eye_rows(k, width, dtype), _eye_rows(k, width, dtype)


def _groupnorm(m, gen, dtype, door):
    # canary i owns channel k_i (two channels per group, two positions): weight and bias entries
    channels = 2 * math.ceil(m / 2)
    k = torch.randperm(channels, generator=gen)[:m]
    x = torch.zeros(m, channels, 2, dtype=dtype)
    x[torch.arange(m), k, 0] = 1
    return nn.GroupNorm(channels // 2, channels).to(dtype), x, x.clone()


def _traced(m, gen, dtype, door):
    # canary i owns output k_i: the matmul entry (a_i, k_i) and the addend entry k_i
    k, a = torch.randperm(m, generator=gen), _codes(m, 2, gen)
    return TracedHead(2, m).to(dtype), _eye_rows(a, 2, dtype), _eye_rows(k, m, dtype)


def _fallback(m, gen, dtype, door):
    # canary i owns the entry (k_i, a_i) of the trained output weight: input e_{a_i} at the
    # first of two positions, output vector e_{k_i} there
    side = _side(m)
    k, a = _pairs(m, side, side, gen)
    head = UnruledLinear(side, side, bias=False) if door == "opacus" else AttentionHead(side)
    head = head.to(dtype)
    x = torch.zeros(m, 2, side, dtype=dtype)
    x[torch.arange(m), 0, a] = 1
    coef = torch.zeros(m, 2, side, dtype=dtype)
    coef[torch.arange(m), 0, k] = 1
    return head, x, coef


def _sequence(m, gen, dtype, door, positions: int = 4):
    # canary i owns output unit k_i: the weight entry (k_i, a_i) and bias entry k_i, through
    # the same input at two of the T positions (its gradient is the sum over positions)
    k, a = torch.randperm(m, generator=gen), _codes(m, 2, gen)
    at = torch.argsort(torch.rand(m, positions, generator=gen), dim=1)[:, :2]
    rows = torch.arange(m)[:, None]
    x = torch.zeros(m, positions, 2, dtype=dtype)
    x[rows, at, a[:, None]] = 1
    coef = torch.zeros(m, positions, m, dtype=dtype)
    coef[rows, at, k[:, None]] = 1
    return nn.Linear(2, m).to(dtype), x, coef


_BUILDERS: Dict[str, Callable] = {
    "linear_bias": _linear_bias, "conv": _conv, "embedding": _embedding,
    "layernorm": _layernorm, "groupnorm": _groupnorm, "traced": _traced,
    "fallback": _fallback, "sequence": _sequence,
}


def build_path(name: str, m: int, generator: torch.Generator, dtype=torch.float64,
               door: str = "native") -> PathCanaries:
    """The head and the m canaries of path ``name`` (not ``linear``: :mod:`.canaries`), their
    inclusion bits (each 1 with probability 1/2) and dual vectors, from ``generator``."""
    if name not in _BUILDERS:
        raise ValueError(f"no canary head for path {name!r}; paths: {PATHS}.")
    included = torch.rand(m, generator=generator, dtype=torch.float64) < 0.5
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):  # the heads' initialisation, away from torch's RNG
        torch.manual_seed(seed)
        head, inputs, coefs = _BUILDERS[name](m, generator, dtype, door)
    path = PathCanaries(name, head, _with_blank(inputs), _with_blank(coefs), included)
    _set_directions(path)
    return path


def _per_sample_grads(head: nn.Module, inputs: torch.Tensor, coefs: torch.Tensor):
    """``∇_θ⟨c_i, h_θ(x_i)⟩`` for every row, flattened over the trainable parameters (dense,
    float64): the plain per-sample gradient by ``torch.func``, outside the engine."""
    from torch.func import functional_call, grad, vmap

    trained = {n: p.detach() for n, p in head.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in head.named_parameters() if not p.requires_grad}
    fixed.update({n: b for n, b in head.named_buffers()})

    def inner(params, x, c):
        out = functional_call(head, {**params, **fixed}, (x[None],))
        return (out[0] * c).sum()

    with warnings.catch_warnings():  # vmap over attention: no batching rule for SDPA on CPU
        warnings.filterwarnings("ignore", message="There is a performance drop")
        grads = vmap(grad(inner), in_dims=(None, 0, 0))(trained, inputs, coefs)
    return torch.cat([grads[n].reshape(inputs.shape[0], -1).to(torch.float64) for n in trained],
                     1)


def _set_directions(path: PathCanaries) -> None:
    """``norms`` and the sparse unit ``directions``; every coordinate of a canary's direction must
    be its own (no other canary of the path touches it), so the directions are orthonormal."""
    m = path.m
    rows, cols, vals, norms = [], [], [], []
    for lo in range(0, m, _CHUNK):
        hi = min(m, lo + _CHUNK)
        g = _per_sample_grads(path.head, path.inputs[lo:hi], path.coefs[lo:hi])
        norm = g.norm(dim=1)
        if not bool((norm > 0).all()):
            raise RuntimeError(f"internal error: a {path.name} canary has no gradient.")
        nz = (g != 0).nonzero()
        rows.append(nz[:, 0] + lo)
        cols.append(nz[:, 1])
        vals.append(g[nz[:, 0], nz[:, 1]] / norm[nz[:, 0]])
        norms.append(norm)
    n_p = sum(p.numel() for p in path.params())
    rows, cols, vals = torch.cat(rows), torch.cat(cols), torch.cat(vals)
    if bool((torch.bincount(cols, minlength=n_p) > 1).any()):
        raise RuntimeError(f"internal error: {path.name} canaries share a coordinate.")
    path.norms = torch.cat(norms)
    path.directions = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (m, n_p),
                                              check_invariants=False).coalesce()
