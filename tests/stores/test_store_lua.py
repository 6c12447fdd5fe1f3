"""The Lua script and the Python GCRA decide alike, on a REAL redis-server.

The script reads the time from Redis (``TIME``), which a test cannot move.
So here the script's text runs unchanged except that ``TIME`` is answered
from the test's clock (``fake_store.redis_on_clock``); every other command
goes to the real server.  The calls go through :class:`RedisLeaseBackend`
itself (its arguments, its reply parsing), so for random sequences of asks
at random times every grant and every wait can be compared exactly with
``fake_store.FakeStore``, the Python model built on
:class:`~vllm_output_rate.policy.gcra.Gcra`.
"""

from __future__ import annotations

import itertools

import pytest
from fake_store import Clock, FakeStore, redis_on_clock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_harness import RedisServer

from vllm_output_rate.stores.backend import LeaseAsk
from vllm_output_rate.stores.redis_store import RedisLeaseBackend

pytest.importorskip("redis")
pytestmark = pytest.mark.redis

MS = 1_000_000
START_US = 1_700_000_000_000_000  # a realistic Unix time in us, far below 2**53

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop()


def script_and_model(url: str) -> tuple[Clock, RedisLeaseBackend, FakeStore]:
    clock = Clock(START_US * 1000)
    return clock, redis_on_clock(url, clock, f"lua-model-{next(_prefixes)}"), FakeStore(clock)


INTERVALS = [MS, 7 * MS, 33_333_334, 250 * MS, 1_000_000_000]

asks_at_times = st.lists(
    st.tuples(
        st.one_of(st.just(0), st.integers(0, 400_000), st.integers(0, 5_000_000)),  # gap (us)
        st.sampled_from(["u", "v"]),
        st.sampled_from(["a", "b", "c"]),  # the asking engine
        st.integers(0, 12),  # want
        st.sampled_from([0, 0, 0, 1, 3, 8]),  # give back
        st.sampled_from(INTERVALS),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(burst_ns=st.sampled_from([10 * MS, 100 * MS, 1_000 * MS]), steps=asks_at_times)
def test_script_and_python_gcra_agree_on_every_decision(server, burst_ns, steps):
    clock, lua, model = script_and_model(server.url)
    for i, (gap_us, user, engine, want, back, interval_ns) in enumerate(steps):
        clock.now += gap_us * 1000
        ask = LeaseAsk(user, want, back, interval_ns)
        (got,) = lua.lease(burst_ns, [ask], engine)
        (expected,) = model.lease(burst_ns, [ask], engine)
        assert got == expected, (i, ask, engine)
    lua.close()


def test_batched_asks_agree_too(server):
    """Several users in one call: the same decisions as one at a time in the model."""
    clock, lua, model = script_and_model(server.url)
    asks = [LeaseAsk(f"user{i}", 1 + i % 5, 0, (i + 1) * 5 * MS) for i in range(12)]
    for gap_us in (0, 3_000, 50_000, 0, 400_000):
        clock.now += gap_us * 1000
        assert lua.lease(100 * MS, asks, "a") == model.lease(100 * MS, asks, "a")
    lua.close()
