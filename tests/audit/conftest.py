"""The audit's tests run tiny models: one intra-op thread (extra threads only add synchronisation,
seconds per audit on a busy 2-core machine); the thread count is restored afterwards."""
from engine_checks import one_thread  # noqa: F401  (autouse: one intra-op thread)
