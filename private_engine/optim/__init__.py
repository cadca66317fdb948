"""The private optimizer: wraps any torch optimizer so that it steps on
``(Σ_i C_i g_i + N(0, σ²R²I)) / B`` (Abadi et al. 2016, "Deep Learning with Differential
Privacy"), with gradient accumulation over physical batches and an accounting object asked per
step; the Gaussian noise (:mod:`.noise`, :mod:`.cpu_noise`); where a step runs — one process,
data-parallel replicas or FSDP2 shards over ``torch.distributed`` (:mod:`.topology`,
:mod:`.distributed`, :mod:`.sharded`)."""
from .distributed import DataParallel, ReplicaMismatchError
from .noise import NoiseSpec, add_gaussian_noise
from .private_step import DPSGD, DPAdam, DPAdamW, PrivateStep, attach, detach, release_gradient
from .topology import Replicated, Sharded, SingleProcess, Topology, choose_topology

__all__ = ["DPSGD", "DPAdam", "DPAdamW", "DataParallel", "NoiseSpec", "PrivateStep",
           "ReplicaMismatchError", "Replicated", "Sharded", "SingleProcess", "Topology",
           "add_gaussian_noise", "attach", "choose_topology", "detach",
           "release_gradient"]
