"""Borrowing (rate, ceil, weight) on vLLM's real Scheduler and KV manager.

The harness fabricates each step's sampled tokens and a fake clock drives
both quotas, so every assertion is exact (issue 21, "Tests").
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.monitor import BORROWED
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window, bound, limits

S = 1_000_000_000


def sampled_by(h: Harness, user: str, step: int) -> int:
    return sum(1 for rid in h.sampled_log[step] if h.records[rid].user == user)


def borrowed_of(h: Harness, user: str) -> int:
    return h.sched.output_rate_gate.borrowing.borrowed_tokens.get(user, 0)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_lone_borrower_without_ceiling_fills_the_active_cap_every_step(async_):
    h = Harness(limits(1, b={"rate": 10, "ceil": None}), max_num_seqs=8, async_=async_)
    for _ in range(12):
        h.add("b", max_tokens=400)
    for _ in range(200):
        h.step(10 * MS)
        h.check_resident_consistent()
    # From the second step on (the first one prefills; async: one more),
    # every step samples as many requests as the active cap allows: 80 tok/s, not 10.
    assert all(len(log) == 8 for log in h.sampled_log[2:])
    assert borrowed_of(h, "b") >= 199 * 8 - bound(2, 10)


def _samples_per_step(config: dict | None, async_: bool) -> list[int]:
    """40 equal requests of one user through 8 active slots (16 resident):
    batches of 8 finish together and 8 new ones are admitted at once."""
    h = Harness(config, max_num_seqs=16, max_num_active_seqs=8, async_=async_)
    for _ in range(40):
        h.add("b", prompt_len=40, max_tokens=12)
    h.run_until_done()
    if config is not None:
        h.check_resident_consistent()
    return [len(log) for log in h.sampled_log]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("share", [{"ceil": None}, {"ceil": 1000}], ids=["no-ceiling", "high-ceiling"])
def test_lone_borrower_samples_in_every_slot_when_its_requests_turn_over_together(share, async_):
    # Out of its own quota, a newly admitted request used to be prefilled
    # only up to its second-to-last position and sample a step later, while
    # the slot it took was denied to a resident borrowed stream: steps of 0,
    # 2 or 6 samples of 8 (sync: 66 steps where stock vLLM needs 61).  Its
    # sample now borrows, like a resident stream's.
    stock = _samples_per_step(None, async_)
    shared = _samples_per_step(limits(1, b={"rate": 10, **share}), async_)
    assert sum(shared) == sum(stock) == 40 * 12
    assert len(shared) <= len(stock)
    if not async_:  # async: a finished request's slot waits one step for its output
        assert shared == stock  # 8 samples in every step but the last, as stock


def _closed_loop_samples(config: dict | None, async_: bool) -> list[int]:
    """12 closed-loop clients of one user through 8 active slots (16
    resident): each sends its next request 10 steps after its last one
    finished (the client's and the API server's turnaround)."""
    h = Harness(config, max_num_seqs=16, max_num_active_seqs=8, async_=async_)
    live: set[str] = set()
    sends: list[int] = []  # the step at which each pending client sends again
    for _ in range(12):
        live.add(h.add("b", prompt_len=40, max_tokens=48).request_id)
    for step in range(600):
        h.step(10 * MS)
        for rid in [rid for rid in live if h.records[rid].finished]:
            live.discard(rid)
            sends.append(step + 10)
        while sends and sends[0] <= step:
            sends.pop(0)
            live.add(h.add("b", prompt_len=40, max_tokens=48).request_id)
    if config is not None:
        h.check_resident_consistent()
    return [len(log) for log in h.sampled_log]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_lone_borrower_with_closed_loop_clients_samples_as_stock_does(async_):
    # Stock vLLM runs 8 requests to completion and keeps the other 4 queued:
    # they fill the slots while clients send their next requests.  When the
    # borrower's waiting requests were admitted into the room its own hidden
    # streams could have used, all 12 became resident, progressed in lockstep
    # and finished together, and the engine ran dry for the clients'
    # turnaround: 4,289 tokens where stock samples 4,760 (0.90x; async 0.92x).
    stock = _closed_loop_samples(None, async_)
    shared = _closed_loop_samples(limits(1, b={"rate": 10, "ceil": None}), async_)
    assert shared == stock


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_with_a_ceiling_the_bound_holds_over_every_window(async_):
    h = Harness(limits(1, c={"rate": 10, "ceil": 30}), max_num_seqs=8, async_=async_)
    for _ in range(8):
        h.add("c", max_tokens=800)
    steps = 600  # 6 s at 10 ms
    for _ in range(steps):
        h.step(10 * MS)
    times = h.charges["c"]
    assert len(times) >= 0.95 * 30 * 6  # well above the rate: about the ceiling
    for window_s in (0.01, 0.1, 0.5, 1, 2, 5):
        assert max_in_window(times, int(window_s * S)) <= bound(window_s, 30), window_s


def _backlogged(weights: dict[str, int], steps: int) -> dict[str, int]:
    users = {u: {"rate": 0.01, "ceil": None, "weight": w} for u, w in weights.items()}
    # Room for every stream to stay resident (16) and an active cap of 8:
    # each step, who runs among the resident borrowers is the question.
    h = Harness(limits(0.01, **users), max_num_seqs=32, max_num_active_seqs=8)
    for user in weights:
        for _ in range(8):
            h.add(user, max_tokens=5000)
    for _ in range(steps):
        h.step(10 * MS)
    return {u: len(h.charges[u]) for u in weights}


def test_two_and_four_backlogged_borrowers_share_by_weight_over_1000_steps():
    for weights in ({"x": 1, "y": 2}, {"p": 1, "q": 2, "r": 3, "s": 4}):
        got = _backlogged(weights, 1000)
        total = sum(got.values())
        for user, weight in weights.items():
            expected = total * weight / sum(weights.values())
            # Within one request's worth of the weighted share (the prefill
            # step gives each user one guaranteed token besides).
            assert abs(got[user] - expected) <= 8, (weights, got)


def test_returning_borrower_gets_no_banked_credit():
    users = {u: {"rate": 0.01, "ceil": None, "weight": 1} for u in ("x", "y")}
    h = Harness(limits(0.01, **users), max_num_seqs=16, max_num_active_seqs=8)
    for _ in range(8):
        h.add("x", max_tokens=5000)
    y_reqs = [h.add("y", max_tokens=5000) for _ in range(8)]
    for _ in range(100):
        h.step(10 * MS)
    for request in y_reqs:
        h.abort(request.request_id)
    for _ in range(300):  # x borrows alone
        h.step(10 * MS)
    first = len(h.sampled_log)
    for _ in range(8):
        h.add("y", max_tokens=5000)
    for _ in range(200):
        h.step(10 * MS)
    x = sum(sampled_by(h, "x", i) for i in range(first, len(h.sampled_log)))
    y = sum(sampled_by(h, "y", i) for i in range(first, len(h.sampled_log)))
    # Level from its return: half each, not all of it until y "caught up".
    assert abs(x - y) <= 16, (x, y)


def test_user_within_its_rate_gets_through_borrowers_holding_every_slot():
    h = Harness(limits(1, b={"rate": 1, "ceil": None}, a=50), max_num_seqs=8)
    b_reqs = [h.add("b", max_tokens=2000) for _ in range(8)]
    for _ in range(50):
        h.step(10 * MS)
    assert len(h.sched.running) == 8 and all(len(log) == 8 for log in h.sampled_log[-5:])
    a = h.add("a", prompt_len=8, max_tokens=300)
    arrived = len(h.sampled_log)
    preempted = set()
    for _ in range(2):
        h.step(10 * MS)
        preempted |= h.step_outputs[-1].preempted_req_ids
    first = next(i for i in range(arrived, len(h.sampled_log)) if a.request_id in h.sampled_log[i])
    assert first - arrived < 2  # its first token within 2 steps
    assert len(preempted) <= 1 and preempted <= {r.request_id for r in b_reqs}
    # ... and it keeps its rate beside the borrowers: 2 s at 50 tok/s.
    start = len(h.sampled_log)
    for _ in range(200):
        h.step(10 * MS)
    got = sum(sampled_by(h, "a", i) for i in range(start, len(h.sampled_log)))
    assert got >= 0.95 * 50 * 2, got
    # The borrower runs on what is left.
    assert sum(sampled_by(h, "b", i) for i in range(start, len(h.sampled_log))) >= 200 * 6
    h.check_resident_consistent()


def test_a_ceiling_equal_to_the_rate_decides_exactly_as_a_plain_number():
    def run(config):
        h = Harness(config, max_num_seqs=6)
        for user, n in (("a", 5), ("b", 3)):
            for _ in range(n):
                h.add(user, max_tokens=60)
        for _ in range(150):
            h.step(10 * MS)
        return h.sampled_log

    plain = run(limits(20, a=30))
    shaped = run(limits({"rate": 20, "weight": 7}, a={"rate": 30, "ceil": 30, "weight": 2}))
    assert plain == shaped


def test_reload_changes_ceil_live_and_a_hard_cap_stops_borrowing():
    h = Harness(limits(1, b={"rate": 5, "ceil": None}), max_num_seqs=8)
    for _ in range(8):
        h.add("b", max_tokens=3000)
    for _ in range(100):
        h.step(10 * MS)
    assert all(len(log) == 8 for log in h.sampled_log[-10:])
    sched = h.sched
    new = OutputRateSettings.from_additional_config({"output_rate": limits(1, b=5)})
    sched.apply_output_rate_limits(new)
    assert sched.output_rate_gate.borrowing is None
    assert sched.output_rate_gate.limiter is sched.output_rate_limiter
    start = len(h.charges["b"])
    for _ in range(200):  # 2 s
        h.step(10 * MS)
    assert len(h.charges["b"]) - start <= bound(2, 5)
    again = OutputRateSettings.from_additional_config(
        {"output_rate": limits(1, b={"rate": 5, "ceil": 20})}
    )
    sched.apply_output_rate_limits(again)
    start = len(h.charges["b"])
    for _ in range(300):  # 3 s
        h.step(10 * MS)
    got = len(h.charges["b"]) - start
    assert 0.9 * 20 * 3 <= got <= bound(3, 20)


def test_report_and_admin_rows_show_borrowing():
    h = Harness(limits(2, b={"rate": 1, "ceil": None, "weight": 3}), max_num_seqs=4)
    for _ in range(4):
        h.add("b", max_tokens=500)
    for _ in range(50):
        h.step(10 * MS)
    sched = h.sched
    report = sched.output_rate_report(sched.output_rate_operate_clock())
    assert report["users"]["b"][BORROWED] == borrowed_of(h, "b") > 100
    row = sched.output_rate_users()["users"]["b"]
    assert (row["rate"], row["ceil"], row["weight"]) == (1.0, None, 3.0)
    assert row["tokens_borrowed_total"] == borrowed_of(h, "b")
    assert row["tokens_charged_total"] >= row["tokens_borrowed_total"]


def test_hard_caps_keep_the_report_rows_as_they_were():
    h = Harness(limits(2, b=1), max_num_seqs=4)
    h.add("b", max_tokens=20)
    for _ in range(5):
        h.step(10 * MS)
    sched = h.sched
    assert sched.output_rate_gate.borrowing is None
    report = sched.output_rate_report(sched.output_rate_operate_clock())
    assert len(report["users"]["b"]) == BORROWED  # no borrowed field


def test_borrowers_are_preempted_before_guaranteed_requests_under_kv_pressure():
    # Few KV blocks: growing streams must preempt someone.  Every victim
    # vLLM picks is the borrower's (handed over last), never a's.
    h = Harness(limits(1, b={"rate": 1, "ceil": None}, a=200), max_num_seqs=8, num_blocks=24)
    a_reqs = [h.add("a", prompt_len=8, max_tokens=120) for _ in range(2)]
    for _ in range(6):
        h.add("b", prompt_len=8, max_tokens=120)
    preempted = set()
    for _ in range(300):
        h.step(10 * MS)
        preempted |= h.step_outputs[-1].preempted_req_ids
        h.check_resident_consistent()
    assert preempted  # the pressure was real
    assert not preempted & {r.request_id for r in a_reqs}
    assert all(h.records[r.request_id].finished for r in a_reqs)


def test_settings_survive_the_round_trip_through_additional_config():
    s = OutputRateSettings.from_additional_config(
        {"output_rate": limits({"rate": 3, "ceil": 9}, b={"rate": 1, "ceil": None, "weight": 2})}
    )
    again = OutputRateSettings.from_additional_config({"output_rate": s.to_config()})
    assert dataclasses.asdict(again) == dataclasses.asdict(s)


@settings(max_examples=8, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.sampled_from(["c", "n", "h"]), st.sampled_from(["add", "abort", "steps"]),
                  st.integers(1, 30)),
        min_size=1, max_size=25,
    ),
    num_blocks=st.sampled_from([12, 20, 200]),
)
def test_both_bounds_hold_under_random_arrivals_aborts_and_kv_pressure(plan, num_blocks):
    """c: rate 10, ceil 30; n: rate 5, no ceiling; h: a hard cap at 20."""
    rates = {"c": 10, "n": 5, "h": 20}
    ceils = {"c": 30, "h": 20}
    h = Harness(
        limits(1, c={"rate": 10, "ceil": 30}, n={"rate": 5, "ceil": None, "weight": 2}, h=20),
        max_num_seqs=8, max_num_active_seqs=6, num_blocks=num_blocks, max_model_len=256,
    )
    borrowing = h.sched.output_rate_gate.borrowing
    guaranteed: dict[str, list[int]] = {u: [] for u in rates}
    live: dict[str, list[str]] = {u: [] for u in rates}
    for user, action, n in plan:
        if action == "add":
            for _ in range(min(n, 4)):
                live[user].append(h.add(user, prompt_len=n, max_tokens=8 * n).request_id)
        elif action == "abort":
            for rid in live[user][:1]:
                if not h.records[rid].finished:
                    h.abort(rid)
            live[user] = live[user][1:]
        else:
            for _ in range(n):
                before = dict(borrowing.borrowed_tokens)
                now = h.clock.now_ns
                h.step(10 * MS)
                for u in rates:
                    ran = sum(1 for rid in h.sampled_log[-1] if h.records[rid].user == u)
                    lent = borrowing.borrowed_tokens.get(u, 0) - before.get(u, 0)
                    guaranteed[u].extend([now] * (ran - lent))
                h.check_resident_consistent()
    for user, rate in rates.items():
        for window_s in (0.01, 0.1, 0.5):
            window = int(window_s * S)
            assert max_in_window(guaranteed[user], window) <= bound(window_s, rate), user
            if user in ceils:
                assert max_in_window(h.charges[user], window) <= bound(window_s, ceils[user]), user


def _queued_backlog(weights: dict[str, int], queued: dict[str, int], steps: int,
                    max_tokens: int, async_: bool = False) -> tuple[dict[str, int], Harness]:
    """Every user queues more requests than there are slots, all at once
    (user by user, so the arrival order alone would favour the first);
    every resident request runs every step (max_num_seqs is the active cap),
    so who holds the slots is who gets the tokens."""
    users = {u: {"rate": 0.01, "ceil": None, "weight": w} for u, w in weights.items()}
    h = Harness(limits(0.01, **users), max_num_seqs=8, async_=async_)
    for user, n in queued.items():
        for _ in range(n):
            h.add(user, max_tokens=max_tokens)
    for _ in range(steps):
        h.step(10 * MS)
    h.check_resident_consistent()
    return {u: len(h.charges[u]) for u in weights}, h


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "weights, queued",
    [
        # 8 slots, 20-token requests: about 400 requests finish in 1,000
        # steps, and each user's queue outlasts its share.
        ({"p": 1, "q": 2, "r": 3, "s": 4}, {"p": 300, "q": 190, "r": 200, "s": 250}),
        ({"x": 1, "y": 2}, {"x": 400, "y": 300}),
    ],
    ids=["four", "two"],
)
def test_backlogged_borrowers_with_queues_longer_than_the_slots_share_by_weight(weights, queued, async_):
    # Before admissions followed the counters, the first user in the queue
    # took nearly everything (four: p 5,940 tokens of a 762 share).
    max_tokens = 20
    got, h = _queued_backlog(weights, queued, 1000, max_tokens, async_)
    for user in queued:  # backlogged to the end
        assert any(r.user == user and not r.finished for r in h.records.values())
    total = sum(got.values())
    for user, weight in weights.items():
        expected = total * weight / sum(weights.values())
        # Within one request's worth of the weighted share.
        assert abs(got[user] - expected) <= max_tokens, (got, expected)
    if not async_:  # async: a finished request's slot waits one step for its output
        assert total >= 0.95 * 8 * 1000  # work-conserving: the slots stay busy


def test_user_within_its_rate_is_admitted_ahead_of_borrowers_long_queues():
    users = {u: {"rate": 0.01, "ceil": None, "weight": 1} for u in ("x", "y")}
    h = Harness(limits(0.01, a=50, **users), max_num_seqs=8)
    for user in ("x", "y"):
        for _ in range(100):
            h.add(user, max_tokens=20)
    for _ in range(100):
        h.step(10 * MS)
    a = h.add("a", max_tokens=50)
    arrived = len(h.sampled_log)
    for _ in range(3):
        h.step(10 * MS)
    first = next(i for i in range(arrived, len(h.sampled_log)) if a.request_id in h.sampled_log[i])
    assert first - arrived < 2  # its first token within 2 steps


@pytest.mark.parametrize("weight, u3_rate", [(0, 5), (0.5, 20), (0.5, 50)])
def test_room_is_not_kept_for_a_waiting_request_whose_quota_a_visible_prefill_spends(weight, u3_rate):
    """Borrowers u0, u1 (and u2, or a cap of 5 where prompts cost) at 5 tok/s and u3
    at ``u3_rate``, two 17-token prompts each at one instant; 6 slots, 3 active, a
    budget of 32.  In the third step u3's visible prefill reaches its sampling
    position and takes what its quota holds (its token, and its chunk's prompt cost);
    the borrowing demand counted that quota for u3's waiting request too, kept a slot
    for it from u0's resident stream, and the step left an active slot and 11 tokens
    unused (the state machine's ``work``, found when it drew a burst).  At 50 tok/s
    u3's quota pays its waiting request too, and the demand counted u0's waiting
    request as an admission by borrowing, which the engine's loop refuses (a borrowed
    prompt ahead of a guaranteed request in the queue waits): the same slot lost.
    Now every active slot runs."""
    users = {u: {"rate": 5, "ceil": None, "weight": 1} for u in ("u0", "u1", "u2")}
    if weight:
        users["u2"] = 5
    users["u3"] = {"rate": u3_rate, "ceil": None, "weight": 1}
    config = {"default_user_output_tokens_per_second": 100, "user_output_tokens_per_second": users,
              "input_token_weight": weight}
    h = Harness(config, chunked=True, max_num_seqs=6, max_num_active_seqs=3,
                max_num_batched_tokens=32, max_model_len=512)
    h.shadow = None  # borrowers go beyond their rates
    for index in range(8):  # distinct prompts: no prefix-cache hits
        h.add(("u0", "u1", "u2", "u3")[index // 2], max_tokens=120,
              prompt=[3 + (7 * index + position) % 400 for position in range(17)])
    outputs = [h.step(0) for _ in range(3)]
    third = outputs[-1]
    assert len(third.num_scheduled_tokens) == 3 or third.total_num_scheduled_tokens == 32, (
        dict(third.num_scheduled_tokens))
