"""The audit's tests run tiny models: one intra-op thread (extra threads only add synchronisation,
seconds per audit on a busy 2-core machine); the thread count is restored afterwards."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
