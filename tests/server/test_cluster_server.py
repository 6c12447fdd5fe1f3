"""Three real ``vllm-output-rate serve`` engines sharing users' quotas through one real Redis.

One module fixture starts a password-protected redis-server (127.0.0.1,
random port) and three engines on the tiny model (``--enforce-eager``, started
side by side, each model worker bound to its own CPU in turn -- vLLM's own
binding puts all three on one core) pointed at it; everything is stopped by
PID at the end.
Engines 0 and 1 use the default ``local`` fallback, engine 2 uses
``--output-rate-store-fallback closed``, so one Redis outage exercises both
modes (the fallback is not part of the limits fingerprint, so mixing them
logs no mismatch).

Rates and windows are judged on the engines' own counters
(``tokens_charged_total`` and ``throttled_seconds_total`` of ``GET
/v1/output_rate/users``, read from all engines at once every 0.5 s), never on
client receive times.  A counter read happens somewhere between sending the
query and its answer, so the documented bound is checked against the widest
window two reads can span (last answer - first send): a stall of the loaded
box widens it, never narrows it.  Only the guarantee's upper bound is
asserted; how close to N a user gets on this shared box (a throughput
figure) is printed here and measured by ``benchmarks/cluster_shortfall.py``.
How long an engine takes to come back after an outage is printed too, not
judged (the tests wait for it with a generous hang guard).
Two scenarios, each run once by a module fixture and checked by several
tests (the engines start once, side by side, for the whole module):

* ``outage_run`` (first: it needs all three engines): Redis killed (SIGKILL
  by PID) for 4 s mid-run while the heavy user runs on all three engines and
  one probe user per engine (its key in Redis shows when that engine leases
  from the store again).
* ``shared_run``: the heavy user (N = 30 tok/s) with 9 streams over all
  three engines and a light user on engine 0 (MEASURED_S after a warm-up);
  then, without a gap, the heavy user's new requests go to engines 0+1 (the
  two-engine part, MEASURED_S); then it pauses while engine 2 is
  stopped by PID and started again, resumes on engines 0+1 and moves to
  engines 1+2 (the restarted engine serves a user whose debt is in Redis).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from redis_harness import RedisServer
from server_harness import ADMIN_ROUTE_ENV, ConnectionBackoff, engine_env, running_server, while_alive

from vllm_output_rate.tools import top
from vllm_output_rate.tools.analysis import guarantee_bound

pytestmark = [pytest.mark.server, pytest.mark.redis, pytest.mark.cluster]

HEAVY_RATE = 30
PROBE_RATE = 20
DEFAULT_RATE = 1000
LIMITS = {"heavy": HEAVY_RATE, "probe0": PROBE_RATE, "probe1": PROBE_RATE, "probe2": PROBE_RATE}
BURST_S = 0.1  # the default burst: the local fallback's
ENGINES = 3
CLOSED_ENGINE = 2  # the one engine started with --output-rate-store-fallback closed
PREFIX = "cluster-test"
PASSWORD = "s3cret-cluster-pw"
ADMIN_ROUTE = "/v1/output_rate/users"
#: The admin route is closed without a key: the engines take theirs from the
#: environment (``top`` needs none: it reads only /metrics).
ADMIN_KEY_ENV = "VLLM_OUTPUT_RATE_ADMIN_KEY"
ADMIN_KEY = "cluster-admin-key-41d7"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
SAMPLE_EVERY_S = 0.5
#: The light user's requests are long enough that the wait for its first
#: lease after each pause (up to a lease round) stays a small part of the
#: time it has a request running (see check_light).
HEAVY_TOKENS, LIGHT_TOKENS, PROBE_TOKENS = 12, 160, 16


def shared_bound(window_s: float, rate: float = HEAVY_RATE, engines: int = ENGINES) -> float:
    """Documented: over any W s, charged tokens summed over E engines <=
    (W + the store's credit + lease lifetime) * N + 1 + E * lease size."""
    return guarantee_bound(window_s, rate, shared_engines=engines)


def local_bound(window_s: float, rate: float) -> float:
    """One engine in the local fallback enforces N / expected engines on its own."""
    return (window_s + BURST_S) * rate / ENGINES + 1


# -- engines ---------------------------------------------------------------------------


class Engine:
    """One engine that can be stopped (by PID, the whole process group) and started again."""

    def __init__(self, index: int, args: list[str], log_dir, model_dir) -> None:
        self.index = index
        self.args = args
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.server = None
        self.starts = 0
        self._cm = None

    def start(self) -> "Engine":
        # The admin route: the engine-side counters.  A restart keeps the engine's CPUs.
        cm = running_server(self.args, self.log_dir, f"engine{self.index}-start{self.starts}",
                            model=self.model_dir,
                            env=engine_env(self.index, ENGINES, {**ADMIN_ROUTE_ENV, ADMIN_KEY_ENV: ADMIN_KEY}))
        self.starts += 1
        began = time.monotonic()
        self.server = cm.__enter__()
        self._cm = cm
        print(f"\nengine {self.index} healthy after {time.monotonic() - began:.0f} s")
        return self

    def stop(self) -> None:
        cm, self._cm, self.server = self._cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)  # SIGTERM to its process group, then wait

    def log_text(self) -> str:
        """Every log of this engine (all its starts)."""
        return "".join(
            p.read_text(errors="replace")
            for p in sorted(self.log_dir.glob(f"engine{self.index}-start*.log"))
        )


@contextlib.contextmanager
def server_context(tmp_path_factory, model_dir):
    """One redis-server and the engines; conftest starts them in the background
    once the modules with servers of their own are done (``PRESTARTED_LATE``)."""
    log_dir = tmp_path_factory.mktemp("server-logs")
    redis_srv = RedisServer(password=PASSWORD).start()
    common = [
        "--enforce-eager",
        "--disable-uvicorn-access-log",  # the counters are read twice a second
        "--max-num-seqs", "16",
        "--default-user-output-tokens-per-second", str(DEFAULT_RATE),
        "--user-output-tokens-per-second", json.dumps(LIMITS),
        "--output-rate-store", redis_srv.url,  # password in the URL: must never be logged
        "--output-rate-expected-engines", str(ENGINES),
        "--output-rate-store-prefix", PREFIX,
    ]
    engines = [
        Engine(
            i,
            common + (["--output-rate-store-fallback", "closed"] if i == CLOSED_ENGINE else []),
            log_dir,
            model_dir,
        )
        for i in range(ENGINES)
    ]
    with contextlib.ExitStack() as stack:
        stack.callback(redis_srv.stop)
        for engine in engines:
            stack.callback(engine.stop)
        # Side by side; the first failure is raised once every start is over.
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(Engine.start, engines))
        yield redis_srv, engines


def live_servers(engines) -> list:
    """The engines' servers that should be up (an engine stopped on purpose has none)."""
    return [engine.server for engine in engines if engine.server is not None]


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


# -- load --------------------------------------------------------------------------------


def client_for_engines() -> httpx.AsyncClient:
    # uvicorn closes a keep-alive connection after 5 s idle; reusing one just
    # then fails with "Server disconnected".  Drop idle connections sooner.
    return httpx.AsyncClient(
        timeout=120, trust_env=False, limits=httpx.Limits(keepalive_expiry=2.0)
    )


@dataclass
class Row:
    user: str
    engine: int
    sent: float
    done: float
    tokens: int | None
    finish: str
    max_tokens: int


@dataclass
class Load:
    """Client load: per user, the engines its new requests go to (changed mid-run)."""

    engines: list
    targets: dict = field(default_factory=dict)  # user -> list of engine indexes
    rows: list = field(default_factory=list)
    in_flight: list = field(default_factory=lambda: [0] * ENGINES)
    stop_at: float = float("inf")
    user_stop_at: dict = field(default_factory=dict)  # user -> stop sending at
    paused: set = field(default_factory=set)  # users whose streams send nothing for now
    think_s: dict = field(default_factory=dict)  # user -> pause after each of its requests

    async def stream(self, client, user, stream, max_tokens):
        """One stream: requests one after another, to the stream's engine
        (stream ``s`` of a user goes to ``targets[s % len(targets)]``, read
        before each request, so a change of targets moves new requests)."""
        backoff = ConnectionBackoff()
        while True:
            now = time.monotonic()
            if now >= self.stop_at or now >= self.user_stop_at.get(user, float("inf")):
                return
            if user in self.paused:
                await asyncio.sleep(0.02)
                continue
            targets = self.targets[user]
            index = targets[stream % len(targets)]
            server = self.engines[index].server
            body = {
                "model": server.model,
                "prompt": "The scheduler decides",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "vllm_xargs": {"output_rate_user": user},
            }
            sent = time.monotonic()
            self.in_flight[index] += 1
            try:
                r = await client.post(f"{server.base_url}/v1/completions", json=body)
                r.raise_for_status()
                payload = r.json()
                tokens = payload["usage"]["completion_tokens"]
                finish = payload["choices"][0]["finish_reason"]
            except Exception as exc:  # noqa: BLE001 -- recorded, asserted on by the tests
                tokens, finish = None, repr(exc)
            finally:
                self.in_flight[index] -= 1
            self.rows.append(Row(user, index, sent, time.monotonic(), tokens, finish, max_tokens))
            if tokens is None:
                # An engine being restarted is down on purpose (its server is
                # None by now); one that died ends the load with its log tail.
                await backoff.failed(self.engines[index].server)
            else:
                backoff.succeeded()
            if self.think_s.get(user):
                await asyncio.sleep(self.think_s[user])

    def users(self, client, spec):
        """Tasks for ``spec``: user -> (streams, max_tokens, engine indexes)."""
        tasks = []
        for user, (streams, max_tokens, targets) in spec.items():
            self.targets[user] = list(targets)
            tasks += [
                asyncio.ensure_future(self.stream(client, user, s, max_tokens))
                for s in range(streams)
            ]
        return tasks

    def failures(self):
        """Requests that errored or came back short."""
        return [r for r in self.rows if r.tokens != r.max_tokens or r.finish != "length"]


# -- engine-side counters ---------------------------------------------------------------------


@dataclass
class Sample:
    sent: float
    done: float
    users: list  # per engine: {user: its row of the admin route} (None: engine down)
    label: str = ""
    # Per engine: which start of it answered (Engine.starts; None: down), and
    # the last rows read from each earlier start ({(engine, start): rows},
    # shared by every sample of one Counters).
    starts: list = field(default_factory=list)
    finals: dict = field(default_factory=dict)

    def charged(self, engine: int) -> dict[str, int]:
        rows = self.users[engine] or {}
        return {u: row["tokens_charged_total"] for u, row in rows.items()}


class Counters:
    """Reads every engine's per-user charge counters at once."""

    def __init__(self, client, engines) -> None:
        self.client = client
        self.engines = engines
        self.samples: list[Sample] = []

        self.finals: dict = {}

    async def _one(self, engine):
        server = engine.server
        if server is None:
            return None
        try:
            r = await self.client.get(f"{server.base_url}{ADMIN_ROUTE}", headers=ADMIN_HEADERS,
                                      timeout=30)
            r.raise_for_status()
        except httpx.HTTPError:
            if engine.server is not server:
                return None  # stopped while we asked: counts as down
            raise
        return r.json()["users"]

    async def sample(self, label: str = "") -> Sample:
        sent = time.monotonic()
        starts = [e.starts if e.server is not None else None for e in self.engines]
        users = await asyncio.gather(*(self._one(e) for e in self.engines))
        s = Sample(sent, time.monotonic(), list(users), label, starts, self.finals)
        for i, rows in enumerate(users):
            if rows is not None:
                self.finals[(i, starts[i])] = rows
        self.samples.append(s)
        return s

    async def every(self, period_s: float, until: float) -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            await self.sample()
            await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))


def per_engine(a: Sample, b: Sample, user: str, key: str = "tokens_charged_total") -> list:
    """How much each engine's counter ``key`` of ``user`` grew between two
    samples.  An engine down at ``a`` counts from zero (it was started again
    in between); an engine restarted between ``a`` and ``b`` counts its old
    process from ``a`` to that process's last read (taken after it was
    drained, before it was stopped) plus its new process from zero."""
    def value(rows) -> int:
        return 0 if rows is None else rows.get(user, {}).get(key, 0)

    out = []
    for i, (before, after) in enumerate(zip(a.users, b.users)):
        grew = 0
        if before is not None and (after is None or a.starts[i] != b.starts[i]):
            grew = value(a.finals[(i, a.starts[i])]) - value(before)  # the process stopped since
            before = None
        if after is not None:
            start, end = value(before), value(after)
            assert end >= start, f"{user}'s {key} went back ({start} -> {end}): engine forgot the user?"
            grew += end - start
        out.append(grew)
    return out


#: The lease totals each engine keeps per user (the admin route's ``store`` row).
STORE_FIELDS = ("asks", "refused", "leased", "spent", "returned", "expired")


def store_split(a: Sample, b: Sample, user: str) -> str:
    """Per engine, how ``user``'s lease totals grew between two reads (for
    printing: they explain the charged split, see docs/design.md)."""
    parts = []
    for i, (before, after) in enumerate(zip(a.users, b.users)):
        if after is None or a.starts[i] != b.starts[i]:
            parts.append(f"engine {i}: restarted or down")
            continue
        old = ((before or {}).get(user) or {}).get("store", {})
        new = (after.get(user) or {}).get("store", {})
        parts.append(f"engine {i}: " + " ".join(
            f"{k} {new.get(k, 0) - old.get(k, 0)}" for k in STORE_FIELDS))
    return "; ".join(parts)


def tokens_between(a: Sample, b: Sample, user: str) -> int:
    return sum(per_engine(a, b, user))


def widest(a: Sample, b: Sample) -> float:
    """A window that surely contains both counter reads' interval."""
    return b.done - a.sent


def narrowest(a: Sample, b: Sample) -> float:
    """A window that surely lies inside the two reads' interval."""
    return b.sent - a.done


def middle(a: Sample, b: Sample) -> float:
    """The window between the middles of the two reads (for printed rates)."""
    return (b.sent + b.done) / 2 - (a.sent + a.done) / 2


def worst_window(samples: list[Sample], user: str, rate: float = HEAVY_RATE):
    """Every pair of samples read one after the other: (largest tokens - bound,
    tokens, bound, window)."""
    worst = None
    for i, a in enumerate(samples):
        for b in samples[i + 1:]:
            if b.sent < a.done:
                # The two reads overlap (a periodic sample and a labelled one
                # taken together): neither is surely first, and an engine's
                # counter may be read later in ``a`` than in ``b``.
                continue
            w = widest(a, b)
            tokens = tokens_between(a, b, user)
            excess = tokens - shared_bound(w, rate)
            if worst is None or excess > worst[0]:
                worst = (excess, tokens, shared_bound(w, rate), w)
    return worst


def after(samples: list[Sample], t: float) -> list[Sample]:
    return [s for s in samples if s.sent >= t]


def labelled(samples: list[Sample], label: str) -> Sample:
    return next(s for s in samples if s.label == label)


# -- scenario 1: Redis outage (first: it needs all three engines, and engine 2 is restarted later)


DOWN_AFTER_S, DOWN_FOR_S, AFTER_UP_S = 2.0, 4.0, 3.0
SETTLED_S = 0.5  # after the kill no lease is valid any more (lifetime 0.3 s)
#: How long the test waits, after Redis answers again, for every engine to
#: lease from it and for the closed engine to charge again: a hang guard,
#: not a latency figure (that one is printed).
BACK_GUARD_S = 30.0


def probe_key(i: int) -> str:
    return f"{PREFIX}:user:{{probe{i}}}"


@pytest.fixture(scope="module")
def outage_run(cluster):
    redis_srv, engines = cluster
    load = Load(engines)
    marks: dict[str, float] = {}
    back_in_store: dict[int, float] = {}  # engine -> s after Redis answered until its probe leased
    seen_at: dict[int, float] = {}
    closed_resumed: dict[str, float] = {}  # user -> s after Redis answered until engine 2 charged it
    closed_users = ("heavy", f"probe{CLOSED_ENGINE}")

    def watch_store(deadline):
        # Redis comes back empty (no persistence): probe i's key appears when
        # engine i -- the only one serving probe i -- leases from it again.
        # Polled every 10 ms from a thread of its own, started while Redis is
        # still down, so neither a busy event loop nor a first connection
        # delays the reading.
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        rc = redis.Redis.from_url(  # no retries with backoff while it is down
            redis_srv.url, socket_connect_timeout=0.1, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        try:
            while len(seen_at) < ENGINES and time.monotonic() < deadline:
                try:
                    for i in range(ENGINES):
                        if i not in seen_at and rc.exists(probe_key(i)):
                            seen_at[i] = time.monotonic()
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # still down
                time.sleep(0.01)
        finally:
            rc.close()

    async def watch_closed(counters, base, up):
        while len(closed_resumed) < len(closed_users) and time.monotonic() < up + BACK_GUARD_S:
            rows = await counters._one(engines[CLOSED_ENGINE])
            for user in closed_users:
                charged = rows.get(user, {}).get("tokens_charged_total", 0)
                if user not in closed_resumed and charged > base.get(user, 0):
                    closed_resumed[user] = time.monotonic() - up
            await asyncio.sleep(0.05)

    async def scenario():
        async with client_for_engines() as client:
            counters = Counters(client, engines)
            tasks = load.users(client, {
                "heavy": (9, HEAVY_TOKENS, [0, 1, 2]),
                **{f"probe{i}": (1, PROBE_TOKENS, [i]) for i in range(ENGINES)},
            })
            await counters.sample("start")
            await asyncio.sleep(DOWN_AFTER_S)
            await asyncio.to_thread(redis_srv.stop)  # SIGKILL by PID: an abrupt outage
            marks["down"] = time.monotonic()
            await asyncio.sleep(SETTLED_S)
            await counters.sample("down")
            await asyncio.sleep(marks["down"] + DOWN_FOR_S - time.monotonic())
            before_up = await counters.sample("before_up")
            watcher = threading.Thread(
                target=watch_store, args=(time.monotonic() + 5.0 + BACK_GUARD_S,), daemon=True
            )
            watcher.start()
            await asyncio.to_thread(redis_srv.start)
            up = marks["up"] = time.monotonic()  # Redis answers PING from here on
            await asyncio.gather(
                watch_closed(counters, before_up.charged(CLOSED_ENGINE), up),
                asyncio.sleep(AFTER_UP_S),
            )
            await asyncio.to_thread(watcher.join)
            back_in_store.update({i: t - up for i, t in seen_at.items()})
            load.stop_at = time.monotonic()
            await asyncio.gather(*tasks)
            await counters.sample("end")
            return counters.samples

    samples = asyncio.run(while_alive(scenario(), lambda: live_servers(engines)))
    return load, samples, marks, back_in_store, closed_resumed


def test_outage_no_request_errors_nothing_truncated(outage_run, cluster):
    load, *_ = outage_run
    _, engines = cluster
    # Requests in flight on every engine while Redis was down (paused on the
    # closed one) all came back whole; none failed.
    assert load.rows and not load.failures(), load.failures()[:3]
    for engine in engines:
        text = engine.log_text()
        ours = [line for line in text.splitlines() if "output-rate" in line]
        print(f"\nengine {engine.index}: " + " | ".join(
            line[line.index("answers again"):] for line in ours if "answers again" in line))
        # One line when the outage started, one when it ended (a stall of the
        # loaded box longer than 0.3 s can add an outage of its own).
        assert text.count("unreachable") >= 1, (engine.index, ours[-10:])
        assert text.count("answers again") == text.count("unreachable"), (engine.index, ours[-10:])
        # The password came in the store URL: no log line shows it (vLLM's
        # argument log included); nor does the admin key.
        assert PASSWORD not in text and ADMIN_KEY not in text


def test_outage_local_fallback_enforces_rate_over_expected_engines(outage_run):
    _, samples, *_ = outage_run
    a, b = labelled(samples, "down"), labelled(samples, "before_up")
    w = widest(a, b)
    for user, rate in (("heavy", HEAVY_RATE), ("probe0", PROBE_RATE), ("probe1", PROBE_RATE)):
        split = per_engine(a, b, user)
        print(f"\n{user} while Redis was down ({w:.2f} s): per engine {split}, "
              f"local bound per engine {local_bound(w, rate):.1f}")
        for i in range(ENGINES):
            if i == CLOSED_ENGINE:
                continue
            # Each local engine on its own at N / 3: not at N ...
            assert split[i] <= local_bound(w, rate), (user, i, split)
            if user in ("heavy", f"probe{i}"):
                # ... and it kept serving (how much depends on how soon the
                # loaded box declares the outage: printed above, not judged).
                assert split[i] > 0, (user, i, split)
    # Over the whole run: the shared bound plus each local engine's own bound.
    first, last = samples[0], samples[-1]
    w = widest(first, last)
    tokens = tokens_between(first, last, "heavy")
    assert tokens <= shared_bound(w) + (ENGINES - 1) * local_bound(w, HEAVY_RATE), tokens


def test_outage_closed_fallback_pauses_every_limited_user(outage_run):
    load, samples, _, _, closed_resumed = outage_run
    a, b = labelled(samples, "down"), labelled(samples, "before_up")
    for user in ("heavy", f"probe{CLOSED_ENGINE}"):
        # Engine 2 (closed) charged nobody while Redis was down, though both
        # users had a request waiting on it all along ...
        assert per_engine(a, b, user)[CLOSED_ENGINE] == 0, user
        assert any(
            r.user == user and r.engine == CLOSED_ENGINE and r.sent < a.sent and r.done > b.done
            for r in load.rows
        ), f"{user} had no request waiting on engine {CLOSED_ENGINE} through the outage"
    print(f"\nclosed engine charged again (s after Redis answered): {closed_resumed}")
    # ... and charged both again once Redis answered.
    assert sorted(closed_resumed) == sorted(("heavy", f"probe{CLOSED_ENGINE}")), closed_resumed


def test_outage_every_engine_back_on_shared_quota(outage_run):
    *_, back_in_store, _ = outage_run
    print(f"\nprobe user leased from Redis again (s after it answered): {back_in_store}")
    assert sorted(back_in_store) == list(range(ENGINES)), back_in_store


# -- scenario 2: three engines, two engines, a restart, the streams moved ---------------------


#: MEASURED_S: long enough for every engine of a part to serve the heavy
#: user and for the light user to send a few requests; the rate itself is
#: not judged against a floor here, so the parts need not be long.
WARM_S, MEASURED_S, RESUMED_S, AFTER_RESTART_S = 3.0, 10.0, 2.0, 5.0
#: The light user's pause after each request (see check_light): at full speed
#: it kept a core of this 2-core box busy and starved the other engines,
#: whose lease threads then stalled past a lease's lifetime.
LIGHT_THINK_S = 2.0
#: The issue's range for a user's total rate over several engines, printed
#: for the reader; the asserted bound is the guarantee's (``shared_bound``).
RATE_RANGE = (0.9, 1.05)


def check_rate(a: Sample, b: Sample, what: str) -> list[int]:
    """The heavy user's tokens between two reads, summed over the engines,
    within the documented bound over the widest window the reads can span.

    The rate is printed (as a multiple of N, against the issue's range):
    how close to N the engines get on a loaded box is a throughput figure
    for the benchmarks, not a pass/fail point."""
    split = per_engine(a, b, "heavy")
    tokens = sum(split)
    share = tokens / middle(a, b) / HEAVY_RATE
    print(f"\n{what}: {tokens / middle(a, b):.1f} tok/s = {share:.2f} x N "
          f"(issue's range {RATE_RANGE[0]}-{RATE_RANGE[1]}) over {middle(a, b):.1f} s "
          f"({tokens} tokens, per engine {split}; counter reads took "
          f"{a.done - a.sent:.2f} / {b.done - b.sent:.2f} s)")
    print(f"  leases: {store_split(a, b, 'heavy')}")
    assert tokens <= shared_bound(widest(a, b)), (tokens, widest(a, b), split)
    return split


def busy_s(load: Load, user: str, start: float, end: float) -> float:
    """How long, within [start, end], ``user`` had a request in flight
    (client side: an upper bound on the time it had runnable requests)."""
    spans = sorted((max(r.sent, start), min(r.done, end)) for r in load.rows if r.user == user)
    total, reach = 0.0, start
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def check_light(load: Load, a: Sample, b: Sample) -> None:
    """The light user (one engine) is not held back by the heavy user's quota.

    Judged on the engine's own account of the time a user had runnable
    requests and no quota (``throttled_seconds_total``), against the time
    the light user had a request in flight: the heavy user on the same
    engine is throttled most of the time, the light user (limit 1000 tok/s)
    at most half as much as the heavy user.  It is not zero: the light user's quota also comes in leases,
    which run out while it pauses, so each request first waits for a lease
    round; and when the loaded box stalls an engine's lease thread past a
    lease's lifetime the user waits for the next one (measured up to 13 % of
    the window here while the third engine was starting, with requests a
    third as long as now).  The light user
    pauses LIGHT_THINK_S after each request: at full speed it kept a core
    busy and starved the other engines on this 2-core box.  Its token rate
    is the engine's speed on the loaded box: printed, not asserted."""
    tokens = per_engine(a, b, "light")
    busy = busy_s(load, "light", a.done, b.sent)
    light = per_engine(a, b, "light", "throttled_seconds_total")[0] / busy
    heavy = per_engine(a, b, "heavy", "throttled_seconds_total")[0] / narrowest(a, b)
    print(f"light on engine 0: {tokens[0] / busy:.0f} tok/s while busy ({busy:.1f} of "
          f"{narrowest(a, b):.1f} s), throttled {light:.0%} of its busy time (heavy on the "
          f"same engine: {heavy:.0%} of the window)")
    # Enough requests for the fraction to mean something (counted, not timed:
    # a faster engine makes each request shorter).
    sent = [r for r in load.rows if r.user == "light" and a.done <= r.sent and r.done <= b.sent]
    assert len(sent) >= 2, (len(sent), busy)
    assert tokens[1:] == [0] * (ENGINES - 1) and tokens[0] > 0, tokens
    # Relative to the heavy user on the same engine, never an absolute
    # fraction: lease timing on a loaded box moves both (one CI run: 27 %).
    assert light <= 0.5 * heavy, (light, heavy)


#: The engines the heavy user streams on in the two-engine part, as top reads them.
TOP_ENGINES = [0, 1]
#: How long top's /metrics counters may take to catch up with the admin
#: route's once the engines are idle (vLLM sends its stats with a step's
#: output): a hang guard, not a latency figure.
TOP_SETTLE_GUARD_S = 20.0


class ClusterTop:
    """``vllm-output-rate top --url E0,E1`` without its terminal: its reads
    (:func:`top.read_sources`) fed to its model, the view kept per label."""

    def __init__(self, engines) -> None:
        self.engines = engines
        self.model = top.TopModel(window_s=MEASURED_S)
        self.views: dict[str, top.ClusterView] = {}
        self.reads: dict[str, tuple[float, float]] = {}  # label -> (sent, done)
        self.admin: dict[str, list] = {}  # label -> the admin route's counters top should match
        self.settle_reads = 0  # reads until they matched (printed: how far /metrics lagged)
        self.client = httpx.Client(timeout=30, trust_env=False)

    def sources(self) -> top.Sources:
        return top.parse_sources([",".join(self.engines[i].server.base_url for i in TOP_ENGINES)], None)

    def _read(self) -> tuple[float, float, dict, dict]:
        sent = time.monotonic()
        t, snaps, errors = top.read_sources(self.sources(), self.client)
        return sent, t, snaps, errors

    async def read(self, label: str, after: str | None = None) -> top.ClusterView:
        """Read every engine once; ``after``: no sooner than MEASURED_S after
        that read ended (top's window is what it divides by)."""
        if after is not None:
            await asyncio.sleep(max(0.0, self.reads[after][1] + MEASURED_S - time.monotonic()))
        sent, t, snaps, errors = await asyncio.to_thread(self._read)
        assert not errors, errors
        self.model.update_engines(t, snaps, errors)
        self.reads[label] = (sent, t)
        self.views[label] = top.cluster_view(self.model)
        return self.views[label]

    async def settle(self, label: str, admin: Sample) -> None:
        """Read (into a model of its own) until top's per-engine counters of
        the heavy user match the admin route's read ``admin`` (both taken
        with the user idle on those engines), or the guard runs out."""
        want = [admin.charged(i).get("heavy", 0) for i in TOP_ENGINES]
        deadline = time.monotonic() + TOP_SETTLE_GUARD_S
        while True:
            _, t, snaps, errors = await asyncio.to_thread(self._read)
            self.settle_reads += 1
            model = top.TopModel()
            model.update_engines(t, snaps, errors)
            view = self.views[label] = top.cluster_view(model)
            self.admin[label] = want
            heavy = next((r for r in view.rows if r.user == "heavy"), None)
            seen = [heavy.charged_by_engine.get(self.sources().urls[k]) if heavy else None
                    for k in range(len(TOP_ENGINES))]
            if seen == want or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def shared_run(cluster):
    """Phases, one after another without a gap:

    1. the heavy user over all three engines, the light user on engine 0
       (the three-engine part: MEASURED_S after a warm-up);
    2. engine 2 leaves the rotation: the heavy user's new requests go to
       engines 0+1, the light user stops (the two-engine part: MEASURED_S
       once engine 2 is drained);
    3. the heavy user pauses (sends nothing new; its requests still running
       on engines 0+1 finish in the first seconds); engine 2 is stopped by
       PID and started again (a restart under that load took 100-220 s on
       this box, 33 s this way: engines serving even 30 tok/s keep about a
       core busy between them);
    4. the heavy user resumes on engines 0+1 (its debt is back in Redis
       within a fraction of a second), then its new requests go to engines
       1+2: the restarted engine serves a user whose debt lives in Redis.
    """
    _, engines = cluster
    load = Load(engines)
    marks: dict[str, float] = {}
    restarted = engines[CLOSED_ENGINE]

    async def idle(engine_indexes, what):
        deadline = time.monotonic() + 60
        while any(load.in_flight[i] for i in engine_indexes) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not any(load.in_flight[i] for i in engine_indexes), what

    async def scenario():
        async with client_for_engines() as client:
            counters = Counters(client, engines)
            cluster_top = ClusterTop(engines)
            tasks = load.users(client, {
                "heavy": (9, HEAVY_TOKENS, [0, 1, 2]),
                "light": (1, LIGHT_TOKENS, [0]),
            })
            load.think_s["light"] = LIGHT_THINK_S
            sampler = asyncio.ensure_future(counters.every(SAMPLE_EVERY_S, float("inf")))
            await asyncio.sleep(WARM_S)
            warm = await counters.sample("warm")
            await asyncio.sleep(warm.done + MEASURED_S / 2 - time.monotonic())
            await counters.sample("mid3")
            await asyncio.sleep(warm.done + MEASURED_S + 0.05 - time.monotonic())
            await counters.sample("move_01")
            marks["move_01"] = time.monotonic()
            load.targets["heavy"] = [0, 1]
            load.user_stop_at["light"] = marks["move_01"]
            await idle([CLOSED_ENGINE], "engine 2 not drained")
            two_from = await counters.sample("two_from")
            await cluster_top.read("two_from")
            await asyncio.sleep(two_from.done + MEASURED_S / 2 - time.monotonic())
            await counters.sample("mid2")
            await asyncio.sleep(two_from.done + MEASURED_S + 0.05 - time.monotonic())
            await counters.sample("two_to")
            await cluster_top.read("two_to", after="two_from")
            # Engine 2 has served nothing since it was drained: its last read
            # stands for the stopped process.  Requests still running on
            # engines 0+1 finish during the restart.
            load.paused.add("heavy")
            await counters.sample("paused")
            await asyncio.to_thread(restarted.stop)
            marks["stopped"] = time.monotonic()
            await asyncio.to_thread(restarted.start)
            marks["ready"] = time.monotonic()
            await idle(TOP_ENGINES, "heavy's requests on engines 0+1 not finished")
            ready = await counters.sample("ready")
            await cluster_top.settle("idle", ready)
            load.paused.discard("heavy")
            await asyncio.sleep(RESUMED_S)
            await counters.sample("resumed")
            marks["move_12"] = time.monotonic()
            load.targets["heavy"] = [1, 2]
            await asyncio.sleep(AFTER_RESTART_S)
            await counters.sample("stop")  # the clients stop sending now
            load.stop_at = time.monotonic()
            await asyncio.gather(*tasks)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await counters.sample("end")  # after the last requests finished
            cluster_top.close()
            return counters.samples, cluster_top

    samples, cluster_top = asyncio.run(while_alive(scenario(), lambda: live_servers(engines)))
    return load, samples, marks, cluster_top


def test_three_engines_share_one_users_quota(shared_run):
    load, samples, marks, _ = shared_run
    assert not load.failures(), load.failures()[:3]
    a, b = labelled(samples, "warm"), labelled(samples, "move_01")
    # Not 3 x 30: one quota over three engines.
    split = check_rate(a, b, "heavy over 3 engines")
    # Every engine served the user (how the quota splits is not promised).
    assert min(split) > 0, split
    # Every window between two counter reads of the whole run (the later
    # parts and the restart included) within the documented bound.
    excess, worst_tokens, bound, window = worst_window(samples, "heavy")
    print(f"worst window: {worst_tokens} tokens in {window:.2f} s (bound {bound:.1f})")
    assert excess <= 0, (worst_tokens, bound, window)


def test_light_user_on_one_engine_is_not_held_back(shared_run):
    load, samples, _, _ = shared_run
    print()
    check_light(load, labelled(samples, "warm"), labelled(samples, "move_01"))


def test_two_engines_share_one_users_quota(shared_run):
    _, samples, _, _ = shared_run
    # Engine 2 out of the rotation and drained: the heavy user on engines 0 + 1 only.
    a, b = labelled(samples, "two_from"), labelled(samples, "two_to")
    split = check_rate(a, b, "heavy over 2 engines")
    assert split[2] == 0 and min(split[:2]) > 0, split


def test_streams_moving_between_engines_keep_one_quota(shared_run):
    load, samples, marks, _ = shared_run
    # Across the first move (0+1+2 -> 0+1): from the middle of the
    # three-engine part to the middle of the two-engine part.
    check_rate(labelled(samples, "mid3"), labelled(samples, "mid2"),
               "heavy moving 0+1+2 -> 0+1")
    first = per_engine(labelled(samples, "move_01"), labelled(samples, "two_to"), "heavy")
    second = per_engine(labelled(samples, "resumed"), labelled(samples, "stop"), "heavy")
    print(f"per engine {first} (0+1) then, after the restart, {second} (1+2)")
    print(f"  leases after the restart: "
          f"{store_split(labelled(samples, 'resumed'), labelled(samples, 'stop'), 'heavy')}")
    # The moves really happened (new requests went only to the phase's
    # engines) and each phase's engines served the user.
    for r in load.rows:
        if r.user == "heavy" and r.sent >= marks["move_01"]:
            assert r.engine in ((0, 1) if r.sent < marks["move_12"] else (1, 2)), r
    assert min(first[:2]) > 0 and min(second[1:]) > 0, (first, second)
    # No fresh burst when the streams land on an engine: every window from
    # the first move on (across both moves and the restart) within the
    # documented bound.
    excess, worst_tokens, bound, window = worst_window(
        after(samples, labelled(samples, "move_01").sent), "heavy"
    )
    print(f"worst window: {worst_tokens} tokens in {window:.2f} s (bound {bound:.1f})")
    assert excess <= 0, (worst_tokens, bound, window)


def test_restarted_engine_gives_no_fresh_burst(shared_run):
    _, samples, marks, _ = shared_run
    print(f"\nengine 2 took {marks['ready'] - marks['stopped']:.0f} s to start again")
    resumed, end = labelled(samples, "resumed"), labelled(samples, "end")
    split = per_engine(resumed, end, "heavy")
    w = widest(resumed, end)
    print(f"engines 1+2 after the restart ({w:.1f} s): per engine {split}, total {sum(split)} "
          f"(bound {shared_bound(w):.1f}; a fresh quota on the restarted engine would "
          f"allow about {HEAVY_RATE * w:.0f} more)")
    # The restarted engine served the user again (from a new counter) ...
    assert split[CLOSED_ENGINE] > 0, split
    # ... out of the same quota: the user's debt lives in Redis.  Every window
    # from the stop on -- the user resumed on engines 0+1 first, so its debt
    # was there when engine 2 took its first requests -- within the
    # documented bound.
    excess, worst_tokens, bound, window = worst_window(after(samples, marks["stopped"]), "heavy")
    print(f"worst window since the stop: {worst_tokens} tokens in {window:.2f} s "
          f"(bound {bound:.1f})")
    assert excess <= 0, (worst_tokens, bound, window)


def test_top_shows_the_cluster_rate_within_the_shared_quota(shared_run):
    """``top`` over engines 0 and 1 (the heavy user streams on both): one
    quota, shown once because the engines share it through the store; the
    user's cluster rate, the sum of both engines' counter rates over the
    two-engine part (>= MEASURED_S), within the documented bound of that
    quota; and with the user idle, its counters per engine are the admin
    route's and the cluster figure their sum."""
    *_, cluster_top = shared_run
    first, last = cluster_top.views["two_from"], cluster_top.views["two_to"]
    for view in (first, last):
        assert view.shared_store and len(view.answering) == len(TOP_ENGINES), view
        assert set(view.store_modes.values()) == {"shared"}, view.store_modes
    heavy = next(r for r in last.rows if r.user == "heavy")
    before = next(r for r in first.rows if r.user == "heavy")
    assert (heavy.quota, heavy.quota_text) == (HEAVY_RATE, str(HEAVY_RATE))
    (sent_a, done_a), (sent_b, done_b) = cluster_top.reads["two_from"], cluster_top.reads["two_to"]
    span = done_b - done_a  # what top divides by
    assert span >= MEASURED_S
    grew = {url: heavy.charged_by_engine[url] - before.charged_by_engine.get(url, 0)
            for url in heavy.charged_by_engine}
    tokens = sum(grew.values())
    print(f"\ntop over engines 0+1: heavy {heavy.rate:.1f} tok/s (quota {heavy.quota_text}, "
          f"shared) over {span:.1f} s; per engine {list(grew.values())}")
    # The cluster rate is the engines' counters summed over top's own window ...
    assert abs(heavy.rate * span - tokens) < 1e-6 * max(1, tokens), (heavy.rate, span, tokens)
    # ... both engines served the user ...
    assert len(grew) == len(TOP_ENGINES) and min(grew.values()) > 0, grew
    # ... and together they stayed within the one quota (the documented
    # bound over the widest window top's two reads can span).
    assert tokens <= shared_bound(done_b - sent_a), (tokens, shared_bound(done_b - sent_a))

    idle = cluster_top.views["idle"]
    heavy = next(r for r in idle.rows if r.user == "heavy")
    urls = cluster_top.sources().urls
    admin = cluster_top.admin["idle"]
    print(f"idle: top's counters per engine {heavy.charged_by_engine} after "
          f"{cluster_top.settle_reads} read(s); admin route {admin}")
    assert [heavy.charged_by_engine.get(url) for url in urls] == admin, (heavy.charged_by_engine, admin)
    assert heavy.charged == sum(admin) > 0
