"""Data parallelism with a store: every rank's scheduler is one more engine on the quota.

vLLM runs one engine core, hence one scheduler, per data-parallel rank.  Two
real schedulers here share one store (the fake store of ``tests/stores``,
which runs the Redis script's GCRA and fair shares on the test's clock), each
with its own leased limiter and engine id, rounds run by hand between steps
on the same fake clock.  One user's streams on both ranks together stay within
the shared-store bound, (W + 0.6) x N + 1 + E x L, and nothing is lost.
"""

from __future__ import annotations


from stores.fake_store import FakeStore

from vllm_output_rate.adapter.scheduler import OutputRateScheduler
from vllm_output_rate.factory import make_limiter
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.tools.analysis import guarantee_bound
from vllm_output_rate_harness.scheduler_sim import MS, FakeClock, Harness, max_in_window

RATE = 40.0
STREAMS = 3
LIMITS = {"default_user_output_tokens_per_second": RATE}


class _StoreClock(FakeClock):
    """The harness clock, readable as the fake store reads its own (``now``)."""

    @property
    def now(self) -> int:
        return self.now_ns


def _rank_class(store, clock, rank: int) -> type:
    def factory(settings):
        return LeasedOutputRateLimiter(
            settings.default_rate, settings.user_rates, store, clock=clock, start=False,
            engine_id=f"dp{rank}",
        )

    return type(f"Rank{rank}", (OutputRateScheduler,), {"output_rate_limiter_factory": staticmethod(factory)})


def test_two_ranks_share_one_quota():
    clock = _StoreClock()
    store = FakeStore(clock)
    ranks = [
        Harness(LIMITS, scheduler_cls=_rank_class(store, clock, i), clock=clock) for i in range(2)
    ]
    for h in ranks:
        h.shadow = None  # a one-engine check: ranks on one store split its credit
    for h in ranks:
        for i in range(STREAMS):
            h.add("heavy", prompt_len=10 + i, max_tokens=40)
        h.add("other", prompt_len=9, max_tokens=40)
    for _ in range(5_000):
        if not any(h.sched.has_requests() for h in ranks):
            break
        for h in ranks:
            h.sched.output_rate_limiter.rounds.pump(clock())
            h.step(0)
        clock.advance(10 * MS)
    for h in ranks:
        h.drain()
        for rid, record in h.records.items():
            assert record.finished and len(record.sample_times) == record.max_tokens, rid
    ids = {h.sched.output_rate_limiter.engine_id for h in ranks}
    assert ids == {"dp0", "dp1"}
    # Leased from the store throughout (not the local fallback).
    assert all(h.sched.output_rate_limiter.stats["outages"] == 0 for h in ranks)
    for user in ("heavy", "other"):
        times = sorted(t for h in ranks for r in h.records.values() if r.user == user for t in r.sample_times)
        served = {i for i, h in enumerate(ranks) for r in h.records.values() if r.user == user}
        assert served == {0, 1}
        for window_s in (0.1, 0.5, 1.0, 2.0):
            bound = guarantee_bound(window_s, RATE, shared_engines=2)
            assert max_in_window(times, int(window_s * 1e9)) <= bound, (user, window_s)
        # Both ranks together, not each: 2 x 120 tokens at 40/s take >= ~6 s.
        span_s = (times[-1] - times[0]) / 1e9
        assert len(times) <= guarantee_bound(span_s, RATE, shared_engines=2)


def test_each_rank_leases_under_its_own_engine_id():
    """Ranks are separate engine-core processes (their own pid); two limiters
    in one process still get distinct ids."""
    settings = OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": 5, "store": {"url": "redis://127.0.0.1:1/0"}}})
    a, b = (make_limiter(settings, start=False) for _ in range(2))
    try:
        assert a.engine_id != b.engine_id
    finally:
        a.close()
        b.close()


def test_charged_counter_is_the_tokens_given_when_requests_come_back():
    """Issue 31: the data-parallel server once counted 243 tokens charged for
    240 delivered.  A rank that emptied ends with a step that ran nothing, so
    the next step repeats it (no plan); a new request whose user holds no
    lease then is admitted cut short of its sampling position, and the
    repeated step's settlement counted it as a stream that sampled: one
    token on the per-user counter that was neither taken nor delivered.

    Rounds of requests, each arriving after both ranks emptied and their
    leases expired: on each rank the counter equals the tokens delivered
    and the leased tokens spent."""
    clock = _StoreClock()
    store = FakeStore(clock)
    limits = {"default_user_output_tokens_per_second": 20.0}
    ranks = [
        Harness(limits, scheduler_cls=_rank_class(store, clock, i), clock=clock) for i in range(2)
    ]
    for h in ranks:
        h.shadow = None  # a one-engine check: ranks on one store split its credit
    for _ in range(3):
        for h in ranks:
            for i in range(3):
                h.add("u", prompt_len=4 + i, max_tokens=10)
        for _ in range(5_000):
            if not any(h.sched.has_requests() for h in ranks):
                break
            for h in ranks:
                h.sched.output_rate_limiter.rounds.pump(clock())
                if h.sched.has_requests():
                    h.step(0)
            clock.advance(10 * MS)
        clock.advance(1_000 * MS)  # every lease expires
    for h in ranks:
        h.drain()
        delivered = sum(len(r.sample_times) for r in h.records.values())
        assert delivered == 3 * 3 * 10
        assert all(r.finished for r in h.records.values())
        assert h.sched.output_rate_gate.ledger.charged_tokens["u"] == delivered
        assert h.sched.output_rate_limiter.book.tally.spent_total == delivered
        assert h.sched.output_rate_limiter.stats["outages"] == 0
