"""The audit's tests run tiny models: one intra-op thread (extra threads only add synchronisation,
seconds per audit on a busy 2-core machine); the thread count is restored afterwards."""
import pytest


@pytest.fixture(autouse=True)
def _audit_one_thread(one_thread):
    """Every test of the audit runs with the ``one_thread`` fixture of tests/conftest.py."""
    yield
