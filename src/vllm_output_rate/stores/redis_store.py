"""The shared side of leased quotas: GCRA per user inside Redis (or Valkey).

One Lua script does a whole lease round trip for a batch of users atomically,
on Redis's own clock (``TIME``), so engine clocks never matter.  Per user the
script keeps a hash ``{t: server time in us of the last update, d: debt in
ns}`` where the debt is ``TAT - t`` (the time the user's quota runs ahead of
the server's now).  Keeping the debt relative to a recent instant keeps every
number far below 2**53, so Lua's doubles compute it exactly; the interval
``1 / rate`` is sent in whole ns rounded up, so the store never grants faster
than the rate.  Per user and round trip, in this order:

1. decay: ``debt = max(0, d - elapsed)``;
2. hand-back of unspent tokens: ``debt = max(0, debt - back * interval)``;
3. grant: ``k = min(want, floor((burst - debt) / interval) + 1)`` tokens when
   ``debt <= burst`` (exactly what ``k`` single GCRA takes allow), ``debt +=
   k * interval``;
4. store it with an expiry of the debt plus a margin (a key that expired had
   no debt left, so it is the same as a user never seen); no debt -> no key.

It returns ``granted`` and ``wait_ns`` (``max(0, debt - burst)``: when the
next token could be granted).  State survives engine restarts (it lives in
Redis); a Redis restart without persistence forgets it.

Keys: ``{prefix}:user:{<user>}`` -- the ``{...}`` hash tag puts each user in
its own Redis Cluster slot.  A batched round trip names several users' keys
in one script call, which a standalone Redis / Valkey (or a proxy that
allows cross-slot scripts) accepts; on a sharded Cluster use one prefix per
shard or a proxy.  ``{prefix}:engines`` holds each live engine's limits
fingerprint.

The password comes from the URL (``redis://:PASSWORD@host:port/db``) or, when
the URL has none, from the environment variable ``OUTPUT_RATE_STORE_PASSWORD``;
it is never logged (:meth:`RedisLeaseBackend.describe`).
"""

from __future__ import annotations

import os
from typing import Sequence
from urllib.parse import urlsplit

from vllm_output_rate.stores.config import DEFAULT_PREFIX, PASSWORD_ENV
from vllm_output_rate.stores.lease import LeaseAsk, LeaseGrant
#: Seconds a reply may take before the engine treats the store as down.
DEFAULT_TIMEOUT_S = 0.25
#: Engines that have not published their fingerprint this long are ignored.
ENGINE_LIVE_S = 30
#: Keys outlive their debt by this margin (ms).
IDLE_MARGIN_MS = 10_000

LEASE_SCRIPT = r"""
-- KEYS[i]: user i's state hash.  ARGV[1]: burst (ns); ARGV[2]: idle margin (ms);
-- then per user: want, give_back, interval (ns).  Returns {granted, wait_ns} per user.
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local burst = tonumber(ARGV[1])
local margin = tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS do
  local base = 3 * i
  local want = tonumber(ARGV[base])
  local back = tonumber(ARGV[base + 1])
  local interval = tonumber(ARGV[base + 2])
  local state = redis.call('HMGET', KEYS[i], 't', 'd')
  local debt = 0
  if state[1] and state[2] then
    local elapsed = (now_us - tonumber(state[1])) * 1000
    if elapsed < 0 then elapsed = 0 end
    local d = tonumber(state[2])
    if elapsed < d then debt = d - elapsed end
  end
  if back > 0 then
    debt = debt - back * interval
    if debt < 0 then debt = 0 end
  end
  local granted = 0
  local headroom = burst - debt
  if want > 0 and headroom >= 0 then
    local k = math.floor(headroom / interval)
    if k * interval > headroom then k = k - 1 end
    if (k + 1) * interval <= headroom then k = k + 1 end
    granted = k + 1
    if granted > want then granted = want end
    debt = debt + granted * interval
  end
  local wait = debt - burst
  if wait < 0 then wait = 0 end
  if debt > 0 then
    redis.call('HSET', KEYS[i], 't', string.format('%.0f', now_us), 'd', string.format('%.0f', debt))
    redis.call('PEXPIRE', KEYS[i], string.format('%.0f', math.ceil(debt / 1000000) + margin))
  else
    redis.call('DEL', KEYS[i])
  end
  out[i] = {granted, wait}
end
return out
"""

FINGERPRINT_SCRIPT = r"""
-- KEYS[1]: engines hash.  ARGV: engine id, fingerprint, live seconds.
-- Returns a flat list engine, fingerprint of engines seen within live seconds.
local t = redis.call('TIME')
local now = tonumber(t[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. t[1])
redis.call('EXPIRE', KEYS[1], 4 * tonumber(ARGV[3]))
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local fp, ts = string.match(all[i + 1], '^(%S+) (%d+)$')
  if ts and now - tonumber(ts) <= tonumber(ARGV[3]) then
    table.insert(out, all[i])
    table.insert(out, fp)
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return out
"""


def user_key(prefix: str, user: str) -> str:
    """The Redis key of ``user``'s GCRA state (hash-tagged by user)."""
    return f"{prefix}:user:{{{user}}}"


def redact(url: str) -> str:
    """``url`` without user name and password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisLeaseBackend:
    """:class:`~vllm_output_rate.stores.lease.LeaseBackend` over a Redis server."""

    def __init__(
        self,
        url: str,
        prefix: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        password_env: str = PASSWORD_ENV,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"output-rate store must be a redis://, rediss:// or unix:// URL, got {redact(url)}"
            )
        kwargs = {}
        if not parts.password and os.environ.get(password_env):
            kwargs["password"] = os.environ[password_env]
        self._url = redact(url)
        self.prefix = prefix or DEFAULT_PREFIX
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            **kwargs,
        )
        self._lease = self._client.register_script(LEASE_SCRIPT)
        self._fingerprint = self._client.register_script(FINGERPRINT_SCRIPT)
        self.commands = 0  # round trips sent (one script call each)

    def lease(self, burst_ns: int, asks: Sequence[LeaseAsk]) -> list[LeaseGrant]:
        self.commands += 1
        if not asks:
            self._client.ping()
            return []
        keys = [user_key(self.prefix, a.user) for a in asks]
        args: list[int] = [burst_ns, IDLE_MARGIN_MS]
        for a in asks:
            args += (a.want, a.give_back, a.interval_ns)
        reply = self._lease(keys=keys, args=args)
        return [LeaseGrant(int(g), int(w)) for g, w in reply]

    def publish_fingerprint(self, engine_id: str, fingerprint: str) -> dict[str, str]:
        self.commands += 1
        flat = self._fingerprint(
            keys=[f"{self.prefix}:engines"], args=[engine_id, fingerprint, ENGINE_LIVE_S]
        )
        flat = [x.decode() if isinstance(x, bytes) else x for x in flat]
        return dict(zip(flat[::2], flat[1::2]))

    def describe(self) -> str:
        return self._url

    def close(self) -> None:
        self._client.close()
