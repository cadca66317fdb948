"""A crafted sample that cancels in three Linear layers of one shape (130 wide, 3 positions): its
loose fast bounds take one second try together (the blocked Grams of the three layers' rows at
once, then float64 Grams), and the released step moves by at most R."""
from __future__ import annotations

import pytest
from test_red_team_gram import wide_linear_case

from test_privacy_under_attack import Case, R, assert_bounded, run_pair, true_norm

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

D = 130


def three_layer_case() -> Case:
    """``Linear(D, D)`` three times on 3 positions; the crafted sample repeats one input ×10⁴
    (up to 1 + 2⁻¹²ε) with output gradients ±2·10³ alternating over the positions, which every
    layer sees as positions that cancel."""
    return wide_linear_case(D, True, layers=3)


@pytest.mark.parametrize("mode", ["bk_mixed", "bk"])
def test_cancellation_in_layers_of_one_shape_takes_one_second_try(together_rows, mode):
    calls = together_rows
    case = three_layer_case()
    assert true_norm(case.model, *case.crafted) >= 10 * R
    assert_bounded(*run_pair(case, "native", mode), what=f"three layers {mode}")
    assert any(n >= 3 for n in calls), f"no second try over several layers' rows: {calls}"
