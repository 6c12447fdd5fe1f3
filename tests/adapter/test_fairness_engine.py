"""Fairness in the report of vLLM's real scheduler (fake clock, no model).

Borrowers without a ceiling compete for spare slots: more streams than the
engine holds, so each has requests waiting.  The report the engine sends
once a second (``output_rate_report``) carries the fairness over the last
10 s, and its gap is the difference of the same report's per-user charge
increments over the window's reports.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.policy.monitor import CHARGED
from vllm_output_rate_harness.scheduler_sim import MS, Harness

S = 1000 * MS
LIMITS = {
    "default_user_output_tokens_per_second": 1000,
    "user_output_tokens_per_second": {
        "a": {"rate": 5, "ceil": None, "weight": 1},
        "b": {"rate": 5, "ceil": None, "weight": 1},
        "capped": 20,  # a hard cap, held by it: not a borrower
    },
}


def test_equal_weight_borrowers_competing_on_the_real_scheduler_read_fair():
    h = Harness(LIMITS, max_num_seqs=6, max_model_len=2048)
    h.shadow = None  # borrowers run beyond their rates
    h.sched.output_rate_operate_clock = h.clock
    for user, streams in (("a", 4), ("b", 4), ("capped", 2)):
        for _ in range(streams):
            h.add(user, max_tokens=2000)
    reports = []
    for _ in range(14):
        for _ in range(100):
            h.step(10 * MS)
        reports.append(h.sched.output_rate_report(h.clock.now_ns))
    fairness = reports[-1]["fairness"]
    assert fairness["backlogged_users"] == 2  # a and b; capped is no borrower
    # The window holds the reports of the last 10 s and the one at its start.
    window = reports[-11:]
    served = {u: sum(r["users"][u][CHARGED] for r in window) for u in ("a", "b")}
    assert min(served.values()) > 0
    assert fairness["service_gap_tokens"] == pytest.approx(abs(served["a"] - served["b"]))
    assert fairness["jain_index"] >= 0.99  # the twin's target for equal weights
    # Every report since the backlog began carries it.
    assert all(r["fairness"]["window_s"] == 10.0 for r in reports)
