"""The Lua script and the Python GCRA decide alike, on a REAL redis-server.

The script reads the time from Redis (``TIME``), which a test cannot move.
So here the script's text is run unchanged except for one thing: a local
``redis`` table placed before it answers ``TIME`` with a time passed as the
last ARGV (which the script never reads) and hands every other command to
the real server.  The calls go through :class:`RedisLeaseBackend` itself
(its arguments, its reply parsing), so for random sequences of asks at
random times every grant and every wait can be compared exactly with
``fake_store.FakeStore``, the Python model built on
:class:`~vllm_output_rate.policy.gcra.Gcra`.
"""

from __future__ import annotations

import itertools

import pytest
from fake_store import Clock, FakeStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_harness import RedisServer

from vllm_output_rate.stores.backend import LeaseAsk
from vllm_output_rate.stores.redis_store import LEASE_SCRIPT, RedisLeaseBackend

pytest.importorskip("redis")
pytestmark = pytest.mark.redis

MS = 1_000_000
START_US = 1_700_000_000_000_000  # a realistic Unix time in us, far below 2**53

#: The lease script with ``TIME`` answered from the last ARGV (microseconds).
LEASE_SCRIPT_ON_GIVEN_CLOCK = (
    "local server = redis\n"
    "local redis = {call = function(command, ...)\n"
    "  if command == 'TIME' then\n"
    "    local us = tonumber(ARGV[#ARGV])\n"
    "    return {math.floor(us / 1000000), us % 1000000}\n"
    "  end\n"
    "  return server.call(command, ...)\n"
    "end}\n" + LEASE_SCRIPT
)

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop()


class GivenClockBackend:
    """A :class:`RedisLeaseBackend` whose script reads ``now_us`` instead of Redis's clock."""

    def __init__(self, url: str) -> None:
        self.backend = RedisLeaseBackend(url, prefix=f"lua-model-{next(_prefixes)}")
        script = self.backend._client.register_script(LEASE_SCRIPT_ON_GIVEN_CLOCK)
        self.now_us = START_US
        self.backend._lease = lambda keys, args: script(keys=keys, args=[*args, self.now_us])

    def lease(self, burst_ns, asks, engine):
        return self.backend.lease(burst_ns, asks, engine)


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
    lua = GivenClockBackend(server.url)
    clock = Clock(START_US * 1000)
    model = FakeStore(clock)
    for i, (gap_us, user, engine, want, back, interval_ns) in enumerate(steps):
        lua.now_us += gap_us
        clock.now = lua.now_us * 1000
        ask = LeaseAsk(user, want, back, interval_ns)
        (got,) = lua.lease(burst_ns, [ask], engine)
        (expected,) = model.lease(burst_ns, [ask], engine)
        assert got == expected, (i, ask, engine)
    lua.backend.close()


def test_batched_asks_agree_too(server):
    """Several users in one call: the same decisions as one at a time in the model."""
    lua = GivenClockBackend(server.url)
    clock = Clock(START_US * 1000)
    model = FakeStore(clock)
    asks = [LeaseAsk(f"user{i}", 1 + i % 5, 0, (i + 1) * 5 * MS) for i in range(12)]
    for gap_us in (0, 3_000, 50_000, 0, 400_000):
        lua.now_us += gap_us
        clock.now = lua.now_us * 1000
        assert lua.lease(100 * MS, asks, "a") == model.lease(100 * MS, asks, "a")
    lua.backend.close()
