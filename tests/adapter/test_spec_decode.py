"""Speculative decoding on vLLM's real Scheduler / AsyncScheduler, limits binding.

The harness configures ngram speculative decoding (K drafts per step); each
step's fabricated output holds the accepted drafts plus one token, with the
number of drafts proposed and accepted varying per request and position.
A step is charged 1 + its drafts at dispatch (drafts only as far as the
user's quota goes now: the rest are not scheduled) and the rejected drafts
are refunded when its output arrives.  Checked on the fake clock:

* the bound on emitted tokens, (W + 0.1) x N + 1 + K x (requests of the user
  in flight: one step each under sync scheduling, two under async);
* nothing lost or truncated: every request ends with all its tokens;
* charges settle: with sync scheduling what stays charged is exactly what
  was emitted; with async at most one step's tokens more per request (the
  look-ahead step after a request's end, as without drafts);
* drafts are cut, not the request: a user short of quota gets steps with
  fewer drafts than proposed;
* a user with quota to spare beside a throttled one is served every step.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.policy.monitor import CHARGED
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

K = 3
RATE = 40.0
STREAMS = 4


def _run(async_: bool, num_blocks: int = 2000):
    limits = {
        "default_user_output_tokens_per_second": RATE,
        "user_output_tokens_per_second": {"light": 1e6},
    }
    h = Harness(limits, async_=async_, spec_tokens=K, num_blocks=num_blocks)
    heavy = [h.add("heavy", prompt_len=20 + i, max_tokens=50) for i in range(STREAMS)]
    light = h.add("light", prompt_len=12, max_tokens=200)
    proposed_vs_scheduled = []
    light_missed = 0
    for _ in range(5_000):
        if not h.sched.has_requests():
            break
        before = {r.request_id: len(r.spec_token_ids) for r in h.sched.running}
        out = h.step(10 * MS)
        for rid, n in before.items():
            if rid in out.num_scheduled_tokens and h.records[rid].user == "heavy" and n:
                proposed_vs_scheduled.append((n, len(out.scheduled_spec_decode_tokens.get(rid, ()))))
        if not light.is_finished() and light.request_id not in out.num_scheduled_tokens:
            light_missed += 1
    h.drain()
    return h, heavy, light, proposed_vs_scheduled, light_missed


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_bound_holds_and_nothing_is_lost_with_drafts(async_):
    h, heavy, light, pairs, light_missed = _run(async_)
    # Nothing lost or truncated.
    for rid, record in h.records.items():
        assert record.finished, rid
        assert len(record.sample_times) == record.max_tokens, rid
    # The bound on what heavy's steps emitted, at their dispatch times.
    times = sorted(t for r in h.records.values() if r.user == "heavy" for t in r.sample_times)
    in_flight = 2 if async_ else 1
    for window_s in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0):
        bound = (window_s + 0.1) * RATE + 1 + K * STREAMS * in_flight
        worst = max_in_window(times, int(window_s * 1e9))
        assert worst <= bound, (window_s, worst, bound)
    # Over the whole run heavy was held to its rate (200 tokens at 40/s).
    span_s = (times[-1] - times[0]) / 1e9
    assert len(times) <= (span_s + 0.1) * RATE + 1 + K * STREAMS * in_flight
    # Drafts were cut for lack of quota, and the light user never waited.
    assert any(scheduled < proposed for proposed, scheduled in pairs)
    assert light_missed == 0


def test_sync_charges_settle_to_exactly_what_was_emitted():
    h, *_ = _run(async_=False)
    charged = h.sched.output_rate_gate.ledger.charged_tokens
    account = h.sched._draft_account
    assert account.in_flight() == 0
    assert account.rejected_total > 0
    for user in ("heavy", "light"):
        emitted = sum(len(r.sample_times) for r in h.records.values() if r.user == user)
        assert charged[user] == emitted, user


def test_async_charges_settle_within_one_step_per_request():
    h, *_ = _run(async_=True)
    charged = h.sched.output_rate_gate.ledger.charged_tokens
    assert h.sched._draft_account.in_flight() == 0
    for user, requests in (("heavy", STREAMS), ("light", 1)):
        emitted = sum(len(r.sample_times) for r in h.records.values() if r.user == user)
        assert emitted <= charged[user] <= emitted + (K + 1) * requests, user


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_kv_pressure_with_drafts_loses_nothing(async_):
    """A KV cache too small for every stream: preemptions refund the drafts
    of requests that did not run, and every request still ends whole."""
    h, *_ = _run(async_, num_blocks=24)
    for rid, record in h.records.items():
        assert record.finished and len(record.sample_times) == record.max_tokens, rid
    assert h.sched._draft_account.in_flight() == 0
    if not async_:
        charged = h.sched.output_rate_gate.ledger.charged_tokens
        emitted = sum(len(r.sample_times) for r in h.records.values() if r.user == "heavy")
        assert charged["heavy"] == emitted


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_published_counters_never_go_down_nor_count_rejected_drafts_twice(async_):
    """The order of events that inflated the per-user counters.

    vLLM calls ``make_stats`` inside ``update_from_output``, before our
    override settles the step's drafts.  A user's last request dispatches K
    drafts in its last step; the model rejects them all and the one token it
    samples is a stop token, so the request ends in that step, the engine
    empties, and the report goes out at once -- with the K drafts about to
    be refunded still counted.  Then they were refunded and the user's
    total went down, and the next report (another user's step, seconds
    later) took the decrease for a restart and counted the whole total
    again.  (A request that ends on its length never rejects drafts in its
    last step: drafts are paid only up to max_tokens, so reaching it means
    every draft was accepted; a user that keeps running charges more between
    two reports than one step's rejected drafts.)

    Every report is read as metrics read it: the increments published for
    the user add up to its final charged total (under sync scheduling,
    exactly the tokens it received), and the total never goes down."""
    h = Harness({"default_user_output_tokens_per_second": 1000}, async_=async_, spec_tokens=K)
    sched = h.sched
    sched.log_stats = True  # vLLM only builds stats (and our report) when asked to
    sched.output_rate_operate_clock = h.clock
    charged = sched.output_rate_gate.ledger.charged_tokens
    seen: list[tuple[int, int]] = []  # (u's total when read, increment published)
    build = sched.output_rate_report

    def report(now_ns):
        rep = build(now_ns)
        if "u" in rep["users"]:
            seen.append((charged.get("u", 0), rep["users"]["u"][CHARGED]))
        return rep

    sched.output_rate_report = report
    h.draft_len = lambda rid, produced, k: k
    last = 9  # output index of the stop token
    h.accepted_of = lambda rid, produced, drafts: 0 if produced + drafts >= last else drafts
    request = h.add("u", prompt_len=12, max_tokens=40)
    h.stop_at[request.request_id] = last
    h.run_until_done()
    assert sched._draft_account.rejected_total >= K  # the last step's drafts
    h.clock.advance(2_000_000_000)
    h.add("v", prompt_len=12, max_tokens=8)
    h.run_until_done()
    delivered = len(h.records[request.request_id].sample_times)
    assert delivered == last + 1
    totals = [total for total, _ in seen]
    assert totals == sorted(totals), seen
    assert sum(inc for _, inc in seen) == charged["u"], seen
    if not async_:
        assert charged["u"] == delivered
