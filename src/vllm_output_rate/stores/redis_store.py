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
   ``debt <= burst`` (exactly what ``k`` single GCRA takes allow), capped by
   the asking engine's fair share (below), ``debt += k * interval``;
4. store it with an expiry of the debt plus a margin (a key that expired had
   no debt left, so it is the same as a user never seen); nothing left to
   remember (no debt, no share debt, no other engine asking lately) -> no key.

It returns ``granted`` and ``wait_ns`` (``max(0, debt - burst)``: when the
next token could be granted by the user's quota).  State survives engine
restarts (it lives in Redis); a Redis restart without persistence forgets it.

Fair shares.  Every call names the asking engine (ARGV), and the user's hash
keeps one more field per engine, ``e:<engine> = "<time us> <share debt ns>
<hungry 0|1>"``: when it last asked for the user, the debt of its own GCRA
at the share's interval, and whether that ask got less than it wanted.  The
share is the user's rate over ``1 + h``, ``h`` the *other* engines that asked
within the engine window (200 ms) and were hungry; its interval is
``interval * (1 + h)`` and its burst twice the user's burst (an engine whose
rounds come late still reaches its share).  While ``h > 0`` and the user's
debt is above a quarter of the burst, a grant is also capped by the engine's
own GCRA (``floor((2 * burst - share_debt) / share_interval) + 1``);
otherwise anyone may take headroom the others do not want, so nothing is
wasted when an engine needs less than its share.  Every grant is charged to
both debts (hand-backs credit both); the user's own GCRA still caps every
grant, so the bound across engines is the same as without shares.  An
engine that stopped asking and has no share debt left is deleted from the
hash by the next call.  Equal demand on engines whose rounds come at
different times then splits the user's tokens about evenly instead of
first come, first served (measured on a fake clock in tests/stores/test_store_fair.py).

Keys: ``{prefix}:user:{<user>}`` -- the ``{...}`` hash tag puts each user in
its own Redis Cluster slot, and the per-engine share fields live in the same
hash, so they are always on the user's node.  ``{prefix}:engines`` holds each
live engine's limits fingerprint.

Round trips.  A standalone Redis / Valkey (``redis://``, ``rediss://``,
``unix://``) gets one script call per round trip, naming every user's key.
A Redis Cluster (``redis+cluster://``) refuses a script whose keys lie in
several hash slots (CROSSSLOT), and each user has its own slot.  So in
cluster mode the batch is split by the node that owns each key (from the
client's slot map), and each node gets one call of the same script marked
``allow-cross-slot-keys`` (Redis >= 7.0 / Valkey), which may touch keys of
several slots as long as the node serves them all: ``KEYS[1]`` routes the
call and every user's key travels in ``ARGV``.  The calls to all nodes go
out in one pipeline (written to every node before any reply is read), so a
round trip still costs one network wait however many nodes there are.
Each node's script is atomic on its own; nothing in the lease arithmetic
needs two users to change together.  A round in which any node fails
(down, timeout, a key that moved to another node) counts as a failed round
(its grants on the other nodes are never spent, which only under-spends),
and the slot map is refreshed before the next one.

The password comes from the URL (``redis://:PASSWORD@host:port/db``) or, when
the URL has none, from the environment variable ``OUTPUT_RATE_STORE_PASSWORD``;
it is never logged (:meth:`RedisLeaseBackend.describe`).

Startup check (:func:`check_store_at_startup`, run by the process that parses
``--output-rate-store`` before any engine starts).  A configuration the
engines could never use -- a refused or missing password, a host name that
does not resolve, TLS on one side only, a cluster URL for a standalone server
or the reverse, a server that is not Redis, a store user without the right
to run scripts -- stops startup with one line naming the flag (the password
never appears in it).  A store that simply does not answer (not started yet,
restarting) is not a configuration error: the engines start in the fallback
mode and share the quota once it answers.  Every step has its own timeout
and the whole check runs under one deadline, so it never hangs.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
import threading
from typing import Any, Sequence
from urllib.parse import urlsplit

from vllm_output_rate.stores.config import (
    CLUSTER_SCHEMES,
    DEFAULT_PREFIX,
    PASSWORD_ENV,
    SCHEMES,
    STORE_FLAG,
    cluster_nodes,
    split_userinfo,
)
from vllm_output_rate.stores.backend import LeaseAsk, LeaseGrant

logger = logging.getLogger(__name__)

#: Seconds a reply may take before the engine treats the store as down.
DEFAULT_TIMEOUT_S = 0.25
#: Seconds each step of the startup check may take (name lookup, connect, a reply).
CHECK_STEP_TIMEOUT_S = 1.0
#: Seconds the whole startup check may take, whatever its steps do.
CHECK_DEADLINE_S = 4.0
#: Engines that have not published their fingerprint this long are ignored.
ENGINE_LIVE_S = 30
#: Keys outlive their debt by this margin (ms).
IDLE_MARGIN_MS = 10_000
#: An engine that asked for a user this recently counts as sharing the user's quota (ms).
ENGINE_WINDOW_MS = 200

LEASE_SCRIPT = r"""
-- KEYS[i]: user i's state hash.  ARGV[1]: burst, the credit kept (ns); ARGV[2]: idle margin (ms);
-- ARGV[3]: engine window (us); ARGV[4]: the asking engine's id;
-- then per user: want, give_back, interval (ns).  Returns {granted, wait_ns} per user.
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local burst = tonumber(ARGV[1])
local margin = tonumber(ARGV[2])
local window_ns = tonumber(ARGV[3]) * 1000
local me = 'e:' .. ARGV[4]
-- How many GCRA takes a headroom of room ns allows at interval iv (exact in doubles).
local function takes(room, iv)
  if room < 0 then return 0 end
  local k = math.floor(room / iv)
  if k * iv > room then k = k - 1 end
  if (k + 1) * iv <= room then k = k + 1 end
  return k + 1
end
local out = {}
for i = 1, #KEYS do
  local base = 3 * i + 2
  local want = tonumber(ARGV[base])
  local back = tonumber(ARGV[base + 1])
  local interval = tonumber(ARGV[base + 2])
  local all = redis.call('HGETALL', KEYS[i])
  local t_us, d_ns
  local others = 0    -- other engines refused part of an ask for this user within the window
  local mine = 0      -- this engine's share debt (ns), decayed
  local had = false   -- this engine has asked for this user before
  local short = 0     -- this ask (or, asking for nothing, its last one) got less than it wanted
  local keep = false  -- another engine's share is still remembered
  for j = 1, #all, 2 do
    local f, v = all[j], all[j + 1]
    if f == 't' then t_us = tonumber(v)
    elseif f == 'd' then d_ns = tonumber(v)
    elseif string.sub(f, 1, 2) == 'e:' then
      local at, d, s = string.match(v, '^(%d+) (%d+) ([01])$')
      local age = 0
      if at then
        age = (now_us - tonumber(at)) * 1000
        if age < 0 then age = 0 end
        d = tonumber(d)
      else
        d = 0
        age = window_ns + 1
      end
      if f == me then
        had = true
        if at and s == '1' then short = 1 end
        if age < d then mine = d - age end
      elseif age <= window_ns then
        if s == '1' then others = others + 1 end
        keep = true
      elseif age < d then
        keep = true
      else
        redis.call('HDEL', KEYS[i], f)  -- idle and no share debt left: forget it
      end
    end
  end
  local debt = 0
  if t_us and d_ns then
    local elapsed = (now_us - t_us) * 1000
    if elapsed < 0 then elapsed = 0 end
    if elapsed < d_ns then debt = d_ns - elapsed end
  end
  -- This engine's equal share: the user's rate over the engines asking now.
  local share = interval * (others + 1)
  if back > 0 then
    debt = debt - back * interval
    if debt < 0 then debt = 0 end
    mine = mine - back * share
    if mine < 0 then mine = 0 end
  end
  local granted = 0
  if want > 0 then
    short = 0
    granted = takes(burst - debt, interval)
    -- Contended (debt above a quarter of the burst, and another engine
    -- lately got less than it asked for): at most this engine's own share,
    -- a GCRA at the share's rate with twice the burst (an engine that asks
    -- less often still reaches its share); otherwise anyone may use the
    -- headroom nobody else wants.
    if others > 0 and 4 * debt > burst then
      local own = takes(2 * burst - mine, share)
      if own < granted then granted = own end
    end
    if granted >= want then granted = want else short = 1 end
    debt = debt + granted * interval
    mine = mine + granted * share
  end
  local wait = debt - burst
  if wait < 0 then wait = 0 end
  if debt > 0 or want > 0 or mine > 0 or keep then
    local now_s, debt_s = string.format('%.0f', now_us), string.format('%.0f', debt)
    if want > 0 or had then
      local share_s = string.format('%.0f %.0f %d', now_us, mine, short)
      redis.call('HSET', KEYS[i], 't', now_s, 'd', debt_s, me, share_s)
    else
      redis.call('HSET', KEYS[i], 't', now_s, 'd', debt_s)
    end
    local longest = debt
    if mine > longest then longest = mine end
    redis.call('PEXPIRE', KEYS[i], string.format('%.0f', math.ceil(longest / 1000000) + margin))
  else
    redis.call('DEL', KEYS[i])
  end
  out[i] = {granted, wait}
end
return out
"""

#: The same script for a Redis Cluster node: KEYS[1] only routes the call
#: (the cluster checks declared keys share one slot); the users' keys follow
#: the per-user numbers in ARGV, so ``#ARGV == 4 + 4 * n``.  The flag lets the
#: script touch keys of several slots served by this node.
CLUSTER_LEASE_SCRIPT = (
    "#!lua flags=allow-cross-slot-keys\n"
    "local n = (#ARGV - 4) / 4\n"
    "local KEYS = {}\n"
    "for i = 1, n do KEYS[i] = ARGV[3 * n + 4 + i] end\n"
    + LEASE_SCRIPT
)

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
    """``url`` without user name and password (every scheme, cluster host lists too)."""
    _, _, stripped = split_userinfo(url)
    parts = urlsplit(stripped)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class RedisLeaseBackend:
    """:class:`~vllm_output_rate.stores.backend.LeaseBackend` over Redis, Valkey or a Redis Cluster."""

    def __init__(
        self,
        url: str,
        prefix: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        password_env: str = PASSWORD_ENV,
        engine_window_ms: int = ENGINE_WINDOW_MS,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                "output-rate store must be a "
                + " / ".join(s + "://" for s in SCHEMES)
                + f" URL, got {redact(url)}"
            )
        user, password = _credentials(url, password_env)
        self._url = redact(url)
        self.prefix = prefix or DEFAULT_PREFIX
        self._window_us = engine_window_ms * 1000
        self.cluster = parts.scheme in CLUSTER_SCHEMES
        self.commands = 0  # script calls (and pings) sent; several per round trip on a cluster
        common = _bounded(timeout_s)
        self._client = None
        if self.cluster:
            # Connecting reads the slot map, which needs a live node: done on
            # first use, in the lease thread, so an unreachable cluster at
            # startup is an outage like any other instead of a failed start.
            self._cluster_seeds = cluster_nodes(url)
            self._cluster_kwargs = dict(
                common,
                username=user,
                password=password,
                ssl=parts.scheme == "rediss+cluster",
                connection_class=_bounded_connection_class(parts.scheme == "rediss+cluster"),
                require_full_coverage=True,
            )
            self._cluster_refresh = False
        else:
            self._client = _standalone_client(url, password, timeout_s)
            self._lease = self._client.register_script(LEASE_SCRIPT)
            self._fingerprint = self._client.register_script(FINGERPRINT_SCRIPT)

    # -- standalone --------------------------------------------------------

    def lease(
        self, burst_ns: int, asks: Sequence[LeaseAsk], engine: str = ""
    ) -> list[LeaseGrant]:
        if self.cluster:
            return self._lease_cluster(burst_ns, asks, engine)
        self.commands += 1
        if not asks:
            assert self._client is not None  # made in __init__ outside cluster mode
            self._client.ping()
            return []
        keys = [user_key(self.prefix, a.user) for a in asks]
        args: list[Any] = [burst_ns, IDLE_MARGIN_MS, self._window_us, engine]
        for a in asks:
            args += (a.want, a.give_back, a.interval_ns)
        reply = self._lease(keys=keys, args=args)
        return [LeaseGrant(int(g), int(w)) for g, w in reply]

    def publish_fingerprint(self, engine_id: str, fingerprint: str) -> dict[str, str]:
        self.commands += 1
        keys = [f"{self.prefix}:engines"]
        args = [engine_id, fingerprint, ENGINE_LIVE_S]
        if self.cluster:
            client = self._cluster_client()
            try:
                flat = client.execute_command("EVALSHA", _sha1(FINGERPRINT_SCRIPT), 1, *keys, *args)
            except Exception as exc:
                if not _is_noscript(exc):
                    raise
                flat = client.execute_command("EVAL", FINGERPRINT_SCRIPT, 1, *keys, *args)
        else:
            flat = self._fingerprint(keys=keys, args=args)
        flat = [x.decode() if isinstance(x, bytes) else x for x in flat]
        return dict(zip(flat[::2], flat[1::2]))

    # -- Redis Cluster -----------------------------------------------------

    def _cluster_client(self) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        if self._client is None:
            nodes = [ClusterNode(host, port) for host, port in self._cluster_seeds]
            self._client = RedisCluster(startup_nodes=nodes, **self._cluster_kwargs)
            self._cluster_refresh = False
        elif self._cluster_refresh:
            self._client.nodes_manager.initialize()  # re-read the slot map
            self._cluster_refresh = False
        return self._client

    def _lease_cluster(
        self, burst_ns: int, asks: Sequence[LeaseAsk], engine: str
    ) -> list[LeaseGrant]:
        try:
            return self._lease_cluster_round(burst_ns, asks, engine)
        except Exception:
            self._cluster_refresh = self._client is not None
            raise

    def _lease_cluster_round(
        self, burst_ns: int, asks: Sequence[LeaseAsk], engine: str
    ) -> list[LeaseGrant]:
        from redis.cluster import RedisCluster

        client = self._cluster_client()
        if not asks:
            # Probe (during an outage): every primary must say the cluster
            # serves.  A PING would answer while a restarted node still
            # refuses scripts (CLUSTERDOWN), and the engine would flap.
            self.commands += 1
            info = client.cluster_info(target_nodes=RedisCluster.PRIMARIES)
            per_node = info.values() if all(isinstance(v, dict) for v in info.values()) else [info]
            bad = [i.get("cluster_state") for i in per_node if i.get("cluster_state") != "ok"]
            if bad:
                raise RuntimeError(f"cluster_state {bad[0]}")
            return []
        keys = [user_key(self.prefix, a.user) for a in asks]
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_node.setdefault(client.get_node_from_key(key).name, []).append(i)
        calls: list[tuple[list[int], list[Any]]] = []
        for members in by_node.values():
            args: list[Any] = [burst_ns, IDLE_MARGIN_MS, self._window_us, engine]
            for i in members:
                args += (asks[i].want, asks[i].give_back, asks[i].interval_ns)
            args += [keys[i] for i in members]
            calls.append((members, [keys[members[0]], *args]))
        replies = self._pipeline(client, "EVALSHA", _sha1(CLUSTER_LEASE_SCRIPT), calls)
        unknown = [j for j, r in enumerate(replies) if _is_noscript(r)]
        if unknown:  # a node that has not seen the script yet (new, restarted, failed over)
            again = self._pipeline(client, "EVAL", CLUSTER_LEASE_SCRIPT, [calls[j] for j in unknown])
            for j, reply in zip(unknown, again):
                replies[j] = reply
        grants: list[LeaseGrant | None] = [None] * len(asks)
        for (members, _), reply in zip(calls, replies):
            if isinstance(reply, Exception):
                raise reply
            for i, (g, w) in zip(members, reply):
                grants[i] = LeaseGrant(int(g), int(w))
        return grants  # type: ignore[return-value]

    def _pipeline(
        self, client: Any, command: str, script: str, calls: Sequence[tuple[list[int], list[Any]]]
    ) -> list[Any]:
        """One script call per node group, all in one pipeline; replies or exceptions."""
        pipe = client.pipeline()
        for _, argv in calls:
            pipe.execute_command(command, script, 1, *argv)
        self.commands += len(calls)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    # -- both ----------------------------------------------------------------

    def describe(self) -> str:
        return self._url

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _credentials(url: str, password_env: str) -> tuple[str | None, str | None]:
    """The user and password: the URL's, else the password in ``password_env``."""
    user, password, _ = split_userinfo(url)
    if not password and os.environ.get(password_env):
        password = os.environ[password_env]
    return user, password


def _bounded(timeout_s: float) -> dict[str, Any]:
    """Client options under which no call waits longer than ``timeout_s`` per
    step (connect, each reply) and a failure is reported, never retried."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def _standalone_client(url: str, password: str | None, timeout_s: float) -> Any:
    import redis

    extra: dict[str, Any] = {} if split_userinfo(url)[1] or not password else {"password": password}
    scheme = urlsplit(url).scheme
    if scheme != "unix":
        extra["connection_class"] = _bounded_connection_class(scheme == "rediss")
    return redis.Redis.from_url(url, retry_on_timeout=False, **_bounded(timeout_s), **extra)


# -- name lookups with a deadline ----------------------------------------------------

# One lookup thread per (host, port) at a time: while a resolver hangs, later
# connection attempts wait on the same lookup instead of piling up threads.
_lookups: dict[tuple[str, int], tuple[threading.Thread, list[BaseException]]] = {}
_lookups_lock = threading.Lock()


def _bounded_lookup(host: str, port: int, timeout_s: float) -> BaseException | None:
    """Resolve ``host`` within ``timeout_s``: None, the lookup's error, or a TimeoutError."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None  # an address: nothing to look up
    except ValueError:
        pass
    with _lookups_lock:
        key = (host, port)
        running = _lookups.get(key)
        if running is None or not running[0].is_alive():
            failure: list[BaseException] = []

            def lookup() -> None:
                try:
                    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except BaseException as exc:
                    failure.append(exc)

            thread = threading.Thread(target=lookup, name="output-rate-store-lookup", daemon=True)
            thread.start()
            running = _lookups[key] = (thread, failure)
    thread, failure = running
    thread.join(timeout_s)
    if thread.is_alive():
        return TimeoutError(f"name lookup of {host!r} did not answer within {timeout_s:g} s")
    return failure[0] if failure else None


@functools.lru_cache(maxsize=None)
def _bounded_connection_class(tls: bool) -> Any:
    """redis-py's TCP (or TLS) connection whose name lookup has the connect timeout.

    redis-py bounds the connect and every reply but not the lookup of the
    host name; a lease thread stuck there would neither get an answer nor
    report a failure, so the engine would stay in ``shared`` mode without
    any quota instead of falling back.
    """
    from redis.connection import Connection, SSLConnection

    class BoundedLookupConnection(SSLConnection if tls else Connection):  # type: ignore[misc]
        def _connect(self) -> Any:
            timeout_s = self.socket_connect_timeout or DEFAULT_TIMEOUT_S
            if isinstance(_bounded_lookup(self.host, self.port, timeout_s), TimeoutError):
                raise socket.timeout(f"name lookup of {self.host!r} did not answer")
            return super()._connect()

    return BoundedLookupConnection


def _is_noscript(reply: object) -> bool:
    from redis.exceptions import NoScriptError

    return isinstance(reply, NoScriptError)


# -- startup check ----------------------------------------------------------------


class StoreConfigError(ValueError):
    """The store's answer (or the name lookup's) means the engines could never use it."""


class StoreSilent(Exception):
    """The store gave no answer at all: down or not started yet, not misconfigured."""


def check_store_at_startup(
    url: str,
    password_env: str = PASSWORD_ENV,
    step_timeout_s: float = CHECK_STEP_TIMEOUT_S,
    deadline_s: float = CHECK_DEADLINE_S,
    warn_when_silent: bool = True,
) -> None:
    """Refuse a store the engines could never use, in one line naming the flag.

    Raises :class:`StoreConfigError` (``--output-rate-store URL: cause``,
    password left out).  A store that does not answer only logs a warning
    (unless ``warn_when_silent`` is false: a pre-check whose caller checks
    again later): the engines start in their fallback mode and share the
    quota once it answers.  Returns within ``deadline_s`` whatever the
    network does.
    """
    _, password = _credentials(url, password_env)
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            _probe_store(url, password, step_timeout_s)
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=probe, name="output-rate-store-check", daemon=True)
    thread.start()
    thread.join(deadline_s)
    failure = outcome[0] if outcome else StoreSilent(f"no answer within {deadline_s:g} s")
    if failure is None:
        return
    where = f"{STORE_FLAG} {redact(url)}"
    if isinstance(failure, StoreConfigError):
        raise StoreConfigError(_one_line(f"{where}: {failure}", password))
    if not warn_when_silent:
        return
    # Anything else is no verdict on the configuration (the engines will
    # tell): startup goes on, with a line that does not blame the store.
    what = "does not answer" if isinstance(failure, StoreSilent) else "could not be checked"
    logger.warning(
        "vllm-output-rate: %s %s (%s); the engines start in their fallback "
        "mode and share the quota once it answers",
        where,
        what,
        _one_line(f"{type(failure).__name__}: {failure}", password),
    )


def _one_line(text: str, password: str | None) -> str:
    if password:
        text = text.replace(password, "***")
    return " ".join(text.split())


def _probe_store(url: str, password: str | None, timeout_s: float) -> None:
    import redis

    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        seeds = cluster_nodes(url)
        for host, port in seeds:
            _resolve(host, port, timeout_s)
        user, _ = _credentials(url, PASSWORD_ENV)
        silent = []
        for host, port in seeds:  # one seed that answers is enough, as for the client
            pool = redis.ConnectionPool(
                connection_class=_bounded_connection_class(parts.scheme == "rediss+cluster"),
                host=host, port=port, username=user, password=password, **_bounded(timeout_s),
            )
            client = redis.Redis(connection_pool=pool)
            try:
                _probe_node(client, (host, port), parts.scheme, password, timeout_s)
                return
            except StoreSilent as exc:
                silent.append(f"{host}:{port}: {exc}")
            finally:
                client.close()
                pool.disconnect()
        raise StoreSilent("; ".join(silent))
    address = None
    if parts.scheme != "unix":
        address = (parts.hostname or "localhost", parts.port or 6379)
        _resolve(*address, timeout_s)
    client = _standalone_client(url, password, timeout_s)
    try:
        _probe_node(client, address, parts.scheme, password, timeout_s)
    finally:
        client.close()


def _resolve(host: str, port: int, timeout_s: float) -> None:
    """Look the host name up, bounded: a resolver that never answers must not hang startup."""
    failure = _bounded_lookup(host, port, timeout_s)
    if isinstance(failure, TimeoutError):
        raise StoreConfigError(f"the name lookup of host {host!r} did not answer within {timeout_s:g} s")
    if failure is not None:
        reason = getattr(failure, "strerror", None) or failure
        raise StoreConfigError(f"unknown host {host!r} ({reason})")


def _probe_node(
    client: Any, address: tuple[str, int] | None, scheme: str, password: str | None, timeout_s: float
) -> None:
    """PING, the server's cluster mode and a script call: what every lease round needs."""
    from redis import exceptions as rx

    try:
        client.ping()
        cluster_enabled = _cluster_enabled(client)
        client.eval("return 1", 0)
    except rx.AuthenticationError as exc:
        raise StoreConfigError(_refused_auth(password, exc)) from None
    except rx.NoPermissionError as exc:
        raise StoreConfigError(f"the store user may not run the commands the engines need ({exc})") from None
    except rx.ResponseError as exc:
        if str(exc).startswith(("NOAUTH", "WRONGPASS")):
            raise StoreConfigError(_refused_auth(password, exc)) from None
        raise StoreConfigError(f"the store refused a command ({exc})") from None
    except (rx.TimeoutError, rx.ConnectionError) as exc:
        tls = scheme.startswith("rediss")
        mismatch = _tls_mismatch(address, tls, timeout_s) if address else None
        if mismatch:
            raise StoreConfigError(mismatch) from None
        if tls and any(word in str(exc) for word in ("SSL", "certificate", "TLS")):
            raise StoreConfigError(f"the TLS handshake failed ({exc})") from None
        raise StoreSilent(str(exc)) from None
    except rx.RedisError as exc:  # a reply that is not Redis's protocol
        raise StoreConfigError(f"the server does not answer like Redis ({type(exc).__name__}: {exc})") from None
    cluster = scheme in CLUSTER_SCHEMES
    if cluster_enabled is None:
        return  # a store user without INFO: the lease rounds tell
    if cluster and not cluster_enabled:
        plain = "rediss://" if scheme == "rediss+cluster" else "redis://"
        raise StoreConfigError(f"the server is not a Redis Cluster (cluster mode is off): use {plain}")
    if not cluster and cluster_enabled:
        meant = "rediss+cluster://" if scheme == "rediss" else "redis+cluster://"
        raise StoreConfigError(f"the server is a Redis Cluster node: use {meant}")


def _cluster_enabled(client: Any) -> bool | None:
    """Whether the server runs in cluster mode; None when the store user may not ask
    (the engines themselves never need INFO)."""
    from redis.exceptions import NoPermissionError

    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except NoPermissionError:
        return None


def _refused_auth(password: str | None, exc: BaseException) -> str:
    if password:
        return f"the store refused the password ({exc})"
    return f"the store needs a password: give it in the URL or in ${PASSWORD_ENV}"


def _tls_mismatch(address: tuple[str, int], tls: bool, timeout_s: float) -> str | None:
    """Why TLS on one side only stops the client, or None when that is not the cause."""
    try:
        with socket.create_connection(address, timeout=timeout_s) as sock:
            if tls:
                sock.sendall(b"PING\r\n")
                if sock.recv(64)[:1] in (b"+", b"-"):
                    return "the server does not use TLS: use redis:// (or redis+cluster://)"
                return None
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            with context.wrap_socket(sock):  # the handshake: only a TLS server completes it
                return "the server expects TLS: use rediss:// (or rediss+cluster://)"
    except (OSError, ValueError):
        return None
