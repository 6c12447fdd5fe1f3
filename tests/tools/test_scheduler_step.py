"""benchmarks/scheduler_step.py's lone-borrower scenario (``--borrowing``): the three
sides it times really have the shape it reports, and the borrower's side borrows."""

from __future__ import annotations

import pytest

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def step_script():
    return load_benchmark("scheduler_step")


def test_each_side_runs_the_active_cap_and_queues_the_rest(step_script):
    for who in step_script.BORROWING_SIDES:
        h = step_script.build_lone_user(who, 4)
        step_script.time_steps(h, 5)
        assert (len(h.sched.running), len(h.sched.waiting)) == (4, 8), who
        assert len(h.step().num_scheduled_tokens) == 4, who  # every running stream decodes


def test_the_borrower_side_borrows_nearly_every_token(step_script):
    doc = step_script.measure_borrowing([4], steps=20, reps=2)
    row = doc[4]
    assert set(row) >= {"stock", "ours", "ours-borrower", "borrower_over_unlimited", "borrower_extra_us"}
    # 40 warm-up steps and 2 x 3 blocks of 20 timed steps at 10 ms each, 4 streams: about 2.4 s of
    # fake time, of which the rate (10 tok/s) pays a few dozen tokens; the rest were borrowed.
    assert row["ours-borrower"]["borrowed_tokens"] > 0.8 * 4 * (40 + 2 * 20)
    assert row["borrower_extra_us"] == pytest.approx(
        row["ours-borrower"]["us_per_step"] - row["ours"]["us_per_step"])
