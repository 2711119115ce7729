"""The one SLO judgment shared by the router, the autoscaler and the simulator."""

from __future__ import annotations

import pytest

from kvpilot.api.slo import SloTargets, judge, request_tpot


def test_ttft_target_grows_with_the_prompts_own_prefill() -> None:
    t = SloTargets(ttft_s=1.0, tpot_s=0.05, ttft_prefill_factor=2.0, prefill_s_per_token=1e-4)
    assert t.ttft_target(0) == pytest.approx(1.0)
    assert t.ttft_target(10_000) == pytest.approx(1.0 + 2.0 * 1.0)
    assert judge(t, 2.5, 0.01, 10_000) == "met"
    assert judge(t, 2.5, 0.01, 100) == "missed_ttft"


def test_outcomes_in_order_ttft_then_tpot_and_no_first_token_fails() -> None:
    t = SloTargets(ttft_s=1.0, tpot_s=0.05, ttft_prefill_factor=0.0)
    assert judge(t, None, None, 10) == "failed"
    assert judge(t, 2.0, 0.5, 10) == "missed_ttft"
    assert judge(t, 0.5, 0.06, 10) == "missed_tpot"
    assert judge(t, 0.5, None, 10) == "met"  # one output token: no TPOT to miss


def test_request_tpot_and_bad_targets() -> None:
    assert request_tpot(1.0, 2.0, 11) == pytest.approx(0.1)
    assert request_tpot(1.0, 2.0, 1) is None
    with pytest.raises(ValueError, match="ttft_s"):
        SloTargets(ttft_s=0.0)
    with pytest.raises(ValueError, match="prefill"):
        SloTargets(prefill_s_per_token=-1.0)
