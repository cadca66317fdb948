"""Small linear algebra of the DP heads: eigen-decompositions and solves of the (batched)
symmetric systems they release, run single-threaded on small CPU matrices.

Positive definiteness is restored by post-processing only: eigenvalues of the noisy symmetric
system matrix are floored at ``eig_floor`` (default 0: projection onto the PSD cone) before the
ridge ``λI`` is added, so every matrix that is inverted has eigenvalues ≥ λ > 0.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch

__all__ = ["small_lapack", "sym_eigh", "solve", "psd_floor"]


@contextlib.contextmanager
def small_lapack(t: torch.Tensor, max_dim: int = 1024):
    """Run CPU LAPACK calls on matrices of size ≤ ``max_dim`` single-threaded.

    Multi-threaded MKL gains nothing on such matrices and, on a busy machine, its spinning
    threads made 192×192 eigendecompositions take seconds instead of milliseconds (and print
    spurious "DLASWP" errors). The previous thread count is restored on exit.
    """
    if t.device.type != "cpu" or t.shape[-1] > max_dim:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sym_eigh(M: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of the symmetric part of ``M`` (batched), see :func:`small_lapack`."""
    M = 0.5 * (M + M.transpose(-1, -2))
    with small_lapack(M):
        return torch.linalg.eigh(M)


def solve(M: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.solve(M, rhs)`` (batched), see :func:`small_lapack`."""
    with small_lapack(M):
        return torch.linalg.solve(M, rhs)


def psd_floor(M: torch.Tensor, floor: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of symmetric ``M`` (batched) with eigenvalues floored at ``floor``.

    Returns ``(eigvals, eigvecs)`` with ``M_psd = V diag(max(Λ, floor)) Vᵀ``. Post-processing of
    an already-released matrix: it costs no privacy.
    """
    evals, evecs = sym_eigh(M)
    return torch.clamp(evals, min=floor), evecs
