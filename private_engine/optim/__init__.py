"""The private optimizer: wraps any torch optimizer so that it steps on
``(Σ_i C_i g_i + N(0, σ²R²I)) / B`` (Abadi et al. 2016, "Deep Learning with Differential
Privacy"), with gradient accumulation over physical batches and an accounting hook per step; the
Gaussian noise (:mod:`.noise`, :mod:`.cpu_noise`); data-parallel steps over ``torch.distributed``
(:mod:`.distributed`)."""
from .distributed import DataParallel, ReplicaMismatchError, data_parallel
from .noise import add_gaussian_noise
from .private_step import DPSGD, DPAdam, DPAdamW, NoiseSpec, PrivateStep, attach, detach

__all__ = ["DPSGD", "DPAdam", "DPAdamW", "DataParallel", "NoiseSpec", "PrivateStep",
           "ReplicaMismatchError", "add_gaussian_noise", "attach", "data_parallel", "detach"]
