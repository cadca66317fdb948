import pytest
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left():
    yield
    stack = _get_current_dispatch_mode_stack()
    if stack:
        print("LEAK", len(stack), [type(m).__name__ for m in stack])
