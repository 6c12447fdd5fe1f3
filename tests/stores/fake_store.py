"""Lease backends on a fake clock: a Python model, and the real script told the time.

Per user it runs the project's own GCRA (:class:`~vllm_output_rate.policy.gcra.Gcra`
on whole nanoseconds, as the script keeps time) over a TAT mapping, plus the
script's fair shares between engines (see ``redis_store.LEASE_SCRIPT``):
each engine's own GCRA at the share's interval, consulted when the user's
quota is contended.  ``test_store_lua`` checks that the script and this model
decide alike on a real redis-server.

:func:`redis_on_clock` is the real thing on a fake clock: a
:class:`RedisLeaseBackend` whose script is the lease script unchanged except
that ``TIME`` is answered from the test's clock (passed as the last ARGV,
which the script never reads) -- so a test against a real redis-server can
run on simulated time instead of wall-clock time.
"""

from __future__ import annotations

from vllm_output_rate.policy.gcra import Gcra
from vllm_output_rate.stores.backend import LeaseAsk, LeaseGrant
from vllm_output_rate.stores.redis_store import ENGINE_WINDOW_MS, LEASE_SCRIPT, RedisLeaseBackend

MS = 1_000_000

#: The lease script with ``TIME`` answered from the last ARGV (microseconds):
#: a local ``redis`` table shadows the real one for the script's own text.
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


class Clock:
    """A fake monotonic clock in ns; tests move ``now`` by hand."""

    def __init__(self, now: int = 10_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class FakeStore:
    """GCRA per user on the shared fake clock, fair shares between engines included."""

    def __init__(self, clock: Clock, engine_window_ms: int = ENGINE_WINDOW_MS) -> None:
        self.clock = clock
        self.window_ns = engine_window_ms * MS
        self.tats: dict[str, int] = {}  # user -> TAT (ns); no entry: no debt
        # user -> engine -> (time of its last ask, whether it got less than it wanted)
        self.asked: dict[str, dict[str, tuple[int, bool]]] = {}
        self.share_tats: dict[str, dict[str, int]] = {}  # user -> engine -> its share's TAT
        self.down = False
        self.calls: list[list[LeaseAsk]] = []
        self.fingerprints: dict[str, str] = {}

    def debt(self, user: str) -> int:
        return max(0, self.tats.get(user, 0) - self.clock.now)

    def lease(self, burst_ns, asks, engine=""):
        if self.down:
            raise ConnectionError("store down")
        self.calls.append(list(asks))
        return [self._one(burst_ns, ask, engine) for ask in asks]

    def _one(self, burst_ns: int, a: LeaseAsk, engine: str) -> LeaseGrant:
        now, user = self.clock.now, a.user
        asked = self.asked.setdefault(user, {})
        share_tats = self.share_tats.setdefault(user, {})
        others, keep = 0, False
        for e, (at, short) in list(asked.items()):
            if e == engine:
                continue
            if now - at <= self.window_ns:
                others += short
                keep = True
            elif share_tats.get(e, now) > now:
                keep = True
            else:  # idle and no share debt left: forgotten
                del asked[e]
                share_tats.pop(e, None)
        had = engine in asked
        short = asked.get(engine, (now, False))[1]
        quota = Gcra.on_ns(a.interval_ns, burst_ns)
        # The engine's equal share: the user's rate over the engines asking now.
        share = Gcra.on_ns(a.interval_ns * (others + 1), 2 * burst_ns)
        quota.refund(self.tats, user, now, a.give_back)
        share.refund(share_tats, engine, now, a.give_back)
        granted = 0
        if a.want:
            granted = quota.available(self.tats, user, now)
            if others and 4 * self.debt(user) > burst_ns:
                granted = min(granted, share.available(share_tats, engine, now))
            granted = min(granted, a.want)
            if granted:
                quota.take_up_to(self.tats, user, now, granted)
                share.charge(share_tats, engine, now, granted)
            short = granted < a.want
        mine = share_tats.get(engine, now) > now
        if self.debt(user) or a.want or mine or keep:
            if a.want or had:
                asked[engine] = (now, short)
        else:  # nothing left to remember: the key goes away
            self.tats.pop(user, None)
            asked.clear()
            share_tats.clear()
        return LeaseGrant(granted, quota.ready_at(self.tats, user, now) - now)

    def publish_fingerprint(self, engine_id, fingerprint):
        if self.down:
            raise ConnectionError("store down")
        self.fingerprints[engine_id] = fingerprint
        return dict(self.fingerprints)

    def describe(self):
        return "fake://store"

    def close(self):
        pass


def redis_on_clock(url: str, clock: Clock, prefix: str, **kwargs) -> RedisLeaseBackend:
    """A real Redis lease backend whose script reads ``clock`` (us) instead of Redis's clock."""
    backend = RedisLeaseBackend(url, prefix=prefix, **kwargs)
    script = backend._client.register_script(LEASE_SCRIPT_ON_GIVEN_CLOCK)
    backend._lease = lambda keys, args: script(keys=keys, args=[*args, clock() // 1000])
    return backend
