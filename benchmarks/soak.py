#!/usr/bin/env python
"""Soak test of per-user output rate limiting against a real server.

Sends a bounded number of streamed requests (default 600) from many users
(default 24 named users with random limits, plus anonymous traffic), with
random prompt lengths and ``max_tokens``, about 10% of them cancelled by the
client mid-stream (or before their first token), at bounded concurrency.  Then
checks:

* no errors (every request that was not cancelled by us answered 200);
* no truncation: ``usage.completion_tokens`` == tokens received, and with
  ``ignore_eos`` == ``max_tokens`` with finish_reason ``length``;
* the ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges are
  back to 0 at the end;
* the guarantee, tokens in any window of W s <= (W + 0.1) * N + 1, for every
  user, three ways:

  - jitter-free, over sliding windows [a, b] whose ends are request send and
    request completion times: every token of a request sent at or after ``a``
    and finished by ``b`` was charged inside [a, b] (the "envelope" check);
  - per request, with the server's own first/last token timestamps
    (``--enable-per-request-metrics``): tokens <= (gen + 0.1 + 0.05) * N + 1;
  - over all sliding windows of the client's token receive timestamps, with an
    allowance for delivery jitter: max(--jitter, 2 * the largest difference
    between a request's server-side and client-side first->last interval).
    Under CPU contention tokens reach the client in bunches, so this one
    needs the allowance; the strict (no allowance) excess is reported too.

Churn (preemption cost) is reported from the server's ``/metrics``:
preemptions per finished request (``vllm:num_preemptions_total``) and
recomputed tokens per output token, where recomputed = tokens of re-admitted
preempted requests (prompt + output so far) minus those found in the prefix
cache, exported by the churn stat logger the own server is started with
(``vllm_output_rate_harness.churn``; an external ``--url`` server has no such
counters and gets preemptions only).  Output tokens are vLLM's
``vllm:generation_tokens_total`` over the run.

``--watch-residency S`` reads the server's ``/metrics`` every S seconds while
the load runs and reports, per user, how many of its requests the engine
reported resident (``vllm:output_rate_requests`` active + throttled: a lower
bound, since a request that neither sampled nor was held for quota in the
last step is in neither) and waiting, against the residency cap
K = max(1, floor(rate / P)) of the pace P the server was given
(``--output-rate-min-stream-tokens-per-second``; with 0, the rule off, K of
``--residency-pace`` for comparison).  Residency engages when a user is
seen at its cap with requests waiting; without the rule, when a user is seen
over it.

A request that fails below HTTP (``APIConnectionError``) is reported with
its cause: the exception httpx's transport raised, in which step of the
exchange (httpcore's trace events), whether the connection was new or reused
(how many requests it carried, its local port, the request it carried
before and how long the client had left it idle), and the client's event
loop stalls (> 0.5 s) before it.  Never retried.

By default it starts its own server (``vllm-output-rate serve`` on the tiny
model, 127.0.0.1 only, stopped by PID at the end) with random per-user limits;
``--url`` targets an existing server instead, whose limits must then be given
with ``--default-rate`` and ``--user-rates``.

``--engines 2 --store redis-server`` is the chaos soak: a real redis-server
and two engines sharing it (each model worker on its own CPU, the admin route
on), request i sent to engine i mod 2 (or the other one while it is down).
Once 5 % of the requests are done the second engine is killed (SIGKILL to
its process group) and started again; requests that fail because of that are
sent again to an engine that is up (the failed attempts are counted apart).
Once 50 % are done and the engine is back, Redis is killed and started again,
empty, 5 s later.  The bound is then judged on the engines' own counters, not
on client times (``vllm_output_rate.tools.engine_counters``): every user's
tokens charged, summed over engines and restarts, between every two reads of
the admin route, against the bound across engines widened by the local
fallback while Redis was down; the gauges at the end include the store mode
(no engine left on a fallback).  A store URL instead of ``redis-server``
skips the Redis kill.

Exit status 0 when every check passes, 1 otherwise.  Writes the summary to
``docs/benchmarks/soak.json`` (``--out PREFIX`` elsewhere).  Count-bounded (``--requests``) and time-bounded (``--time-limit``).

Example::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/soak.py --out /tmp/soak
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import random
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND, residency_cap
from vllm_output_rate.tools import measure
from vllm_output_rate.tools.analysis import envelope_worst, guarantee_bound, sliding_excess
from vllm_output_rate.tools.engine_counters import CounterReader, Outage, cumulative, widened_bound, worst_window
from vllm_output_rate.tools.measure import max_in_window
from vllm_output_rate.tools.redisproc import RedisProcess
from vllm_output_rate.tools.serverproc import ADMIN_ROUTE_ENV, DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import RESULTS_DIR
from vllm_output_rate_harness.churn import SERVE_WITH_CHURN, churn_costs, churn_line, recompute_figures

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-soak/1"
#: Tolerance for server-side per-request timestamps (taken after the model
#: step, while the limiter reads its clock before it).
SERVER_TS_TOLERANCE_S = 0.05
VOCAB_LO, VOCAB_HI = 10, 680
ANON = "__anonymous__"


# -- plan ----------------------------------------------------------------------


@dataclass
class Planned:
    idx: int
    user: str  # ANON for requests without identity
    endpoint: str  # "chat" | "completions"
    prompt_len: int
    prompt_key: int  # same key -> same prompt (prefix-cache hits)
    max_tokens: int
    ignore_eos: bool
    cancel_after: int | None  # tokens; 0 = cancel before the first token (by time)
    cancel_delay_s: float = 0.0


@dataclass
class Outcome:
    idx: int
    user: str
    status: int = 0
    error: str = ""
    cancelled: bool = False
    t_sent: float = 0.0
    t_done: float = 0.0
    times: list = field(default_factory=list)
    n_tokens: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    generation_time_s: float | None = None
    engine: int | None = None  # with --engines > 1: which engine served it
    engine_start: int | None = None  # ... and which start of that engine


def make_rates(rng: random.Random, n_users: int, lo: float, hi: float) -> dict[str, float]:
    rates = {}
    for i in range(n_users):
        rate = rng.uniform(lo, hi)
        # Mix whole and fractional rates (fractions are exact in the limiter).
        rate = round(rate) if i % 3 else round(rate * 2) / 2
        rates[f"soak-u{i:02d}"] = max(rate, 1.0)
    return rates


def make_plan(args, rng: random.Random, users: list[str], rates: dict[str, float]) -> list[Planned]:
    # Demand per user proportional to its rate, so that every user stays
    # backlogged for a similar time and the soak does not wait on one slow user.
    weights = [rates[u] for u in users]
    plan = []
    for idx in range(args.requests):
        user = rng.choices(users, weights)[0]
        if rng.random() < 0.2:
            max_tokens = rng.randint(1, 4)  # very short answers
        else:
            max_tokens = rng.randint(5, args.max_tokens)
        prompt_cap = args.max_model_len - max_tokens - 16  # chat template overhead
        r = rng.random()
        if r < 0.1:
            prompt_len = rng.randint(max(prompt_cap - 64, 1), prompt_cap)  # near the limit
        elif r < 0.5:
            prompt_len = rng.randint(1, 32)
        else:
            prompt_len = rng.randint(1, min(prompt_cap, 600))
        # 20% reuse one of a few shared long prompts (prefix-cache hits).
        if rng.random() < 0.2:
            prompt_key = rng.randint(0, 3)
            prompt_len = min(prompt_cap, 700)
        else:
            prompt_key = 1000 + idx
        cancel_after = None
        delay = 0.0
        if rng.random() < args.cancel_fraction:
            if max_tokens >= 2 and rng.random() < 0.7:
                cancel_after = rng.randint(1, max_tokens - 1)
            else:
                cancel_after = 0
                delay = rng.uniform(0.05, 0.6)
        plan.append(
            Planned(
                idx=idx,
                user=user,
                endpoint="chat" if rng.random() < 0.4 else "completions",
                prompt_len=prompt_len,
                prompt_key=prompt_key,
                max_tokens=max_tokens,
                ignore_eos=rng.random() >= 0.1,
                cancel_after=cancel_after,
                cancel_delay_s=delay,
            )
        )
    return plan


def prompt_for(p: Planned):
    rng = random.Random(p.prompt_key * 7919 + p.prompt_len)
    if p.endpoint == "completions":
        return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(p.prompt_len)]
    # Roughly one token per word for this tokenizer; stays below the cap.
    words = ["rivers", "clouds", "tokens", "quick", "fox", "sea", "night", "steps"]
    return " ".join(rng.choice(words) for _ in range(max(1, p.prompt_len // 2)))


# -- client --------------------------------------------------------------------


async def run_one(client, model: str, p: Planned) -> Outcome:
    out = Outcome(idx=p.idx, user=p.user)
    body = measure.stream_body(model, None if p.user == ANON else p.user, p.max_tokens, prompt_for(p))
    if not p.ignore_eos:
        del body["ignore_eos"]
    if p.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    record = measure.RequestRecord(user=p.user)
    request = measure.stream_completion(client, body, record, 0.0, endpoint=p.endpoint,
                                        cancel_after=p.cancel_after or None)
    if p.cancel_after == 0:
        try:
            await asyncio.wait_for(request, timeout=p.cancel_delay_s)
        except asyncio.TimeoutError:
            record.status = measure.CANCELLED
    else:
        await request
    out.status = record.http_status or 0
    out.cancelled = record.status == measure.CANCELLED
    if record.status in measure.ERROR_STATUSES:
        out.error = record.error or record.status
    out.t_sent, out.t_done = record.start, record.end or record.start
    out.times = list(record.token_times)
    out.n_tokens = record.n_tokens
    reasons = list(record.finish_reasons.values())
    out.finish_reason = reasons[0] if reasons else None
    out.completion_tokens = record.completion_tokens
    out.generation_time_s = record.server_generation_s
    return out


def read_gauges(base_url: str) -> dict[str, float]:
    samples = measure.fetch_metrics(base_url)
    return {**measure.gauges(samples),
            measure.PREEMPTIONS: measure.metric_sum(samples, measure.PREEMPTIONS) or 0.0}


# -- diagnostics: residency on the server, client transport failures -----------

PACE_FLAG = "--output-rate-min-stream-tokens-per-second"
USER_REQUESTS = "vllm:output_rate_requests"
KV_USAGE = "vllm:kv_cache_usage_perc"


def server_pace(server_args: list[str]) -> float:
    """The minimum stream pace P among ``server_args`` (the last one given,
    as argparse takes it), or the plugin's default."""
    pace = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
    for i, arg in enumerate(server_args):
        if arg.startswith(PACE_FLAG + "="):
            pace = float(arg.split("=", 1)[1])
        elif arg == PACE_FLAG and i + 1 < len(server_args):
            pace = float(server_args[i + 1])
    return pace


def residency_reading(samples: dict) -> tuple[float, float | None, dict[str, tuple[float, float]]]:
    """One ``/metrics`` read: the engine's running requests, its KV usage and,
    per user, requests active + throttled (resident) and waiting, as the
    engine last reported them (once a second)."""
    per_user: dict[str, list[float]] = {}
    for labels, value in samples.get(USER_REQUESTS, []):
        row = per_user.setdefault(labels.get("user", "?"), [0.0, 0.0])
        if labels.get("state") in ("active", "throttled"):
            row[0] += value
        elif labels.get("state") == "waiting":
            row[1] += value
    return (measure.metric_sum(samples, measure.RUNNING_GAUGE) or 0.0, measure.metric_sum(samples, KV_USAGE),
            {u: (r[0], r[1]) for u, r in per_user.items()})


def residency_summary(watch: benchkit.MetricsPoller, rates_of, pace: float, reference_pace: float,
                      max_num_seqs: int) -> dict:
    """Of the watcher's :func:`residency_reading` readings, per user: its cap
    K, the most resident requests seen, and how many reads saw it over its
    cap, or at it with requests waiting (and of those, how many while the
    engine had a free slot)."""
    cap_pace = pace if pace > 0 else reference_pace
    users: dict[str, dict] = {}
    over = waiting_at_cap = 0
    samples = [value for _, value in watch.readings]
    for running, _, per_user in samples:
        seen_over = seen_waiting = False
        for user, (resident, waiting) in per_user.items():
            if not resident and not waiting and user not in users:
                continue  # listed but never seen with a request (e.g. the overflow series)
            cap = residency_cap(rates_of(user), cap_pace)
            e = users.setdefault(user, {"rate": rates_of(user), "cap": cap, "reads": 0,
                                        "max_resident_seen": 0, "max_waiting_seen": 0,
                                        "reads_over_cap": 0, "reads_waiting_at_cap": 0,
                                        "reads_waiting_at_cap_slot_free": 0})
            e["reads"] += 1
            e["max_resident_seen"] = max(e["max_resident_seen"], int(resident))
            e["max_waiting_seen"] = max(e["max_waiting_seen"], int(waiting))
            if cap is None:
                continue
            if resident > cap:
                e["reads_over_cap"] += 1
                seen_over = True
            if resident >= cap and waiting > 0:
                e["reads_waiting_at_cap"] += 1
                e["reads_waiting_at_cap_slot_free"] += running < max_num_seqs
                seen_waiting = True
        over += seen_over
        waiting_at_cap += seen_waiting
    kv = [s[1] for s in samples if s[1] is not None]
    return {
        "read_every_s": watch.interval_s,
        "reads": len(samples),
        "failed_reads": watch.failed_reads,
        "server_pace": pace,
        "cap_pace": cap_pace,
        "reads_some_user_over_cap": over,
        "reads_some_user_waiting_at_cap": waiting_at_cap,
        "mean_kv_usage": round(sum(kv) / len(kv), 3) if kv else None,
        "per_user": dict(sorted(users.items())),
    }


#: The plan index of the request the current task sends (for TransportWatch).
_REQUEST_IDX: contextvars.ContextVar[int | None] = contextvars.ContextVar("soak_request_idx", default=None)


def _http11_connection(exc: BaseException):
    """httpcore's HTTP/1.1 connection object the exception went through, if any."""
    tb = exc.__traceback__
    while tb is not None:
        conn = tb.tb_frame.f_locals.get("self")
        if type(conn).__name__ == "AsyncHTTP11Connection":
            return conn
        tb = tb.tb_next
    return None


class TransportWatch:
    """Why a request failed below HTTP.  httpx event hooks on the client: each
    request carries httpcore's ``trace`` extension, whose events are kept
    only if one of them fails with an exception (our own cancellations end
    with ``CancelledError`` and are not kept); each response records which
    request its connection (local port) carried last.  Observes only: the
    exception goes on to the client as before."""

    def __init__(self) -> None:
        self.failures: dict[int | None, dict] = {}
        self.last_on_port: dict[int, tuple[int | None, float]] = {}  # port -> (request, headers received)

    def install(self, client) -> bool:
        http = getattr(client, "_client", None)  # AsyncOpenAI's httpx client (no public accessor)
        if http is None or not hasattr(http, "event_hooks"):
            return False
        hooks = http.event_hooks
        http.event_hooks = {"request": [*hooks.get("request", []), self._on_request],
                            "response": [*hooks.get("response", []), self._on_response]}
        return True

    async def _on_request(self, request) -> None:
        idx, t0, events = _REQUEST_IDX.get(), time.monotonic(), []

        async def trace(name: str, info: dict) -> None:
            events.append([round(time.monotonic() - t0, 4), name])
            exc = info.get("exception") if name.endswith(".failed") else None
            if isinstance(exc, Exception) and idx not in self.failures:
                conn = _http11_connection(exc)
                stream = getattr(conn, "_network_stream", None)
                addr = stream.get_extra_info("client_addr") if stream is not None else None
                port = addr[1] if addr else None
                self.failures[idx] = {
                    "request": idx, "t_sent": t0, "t_failed": time.monotonic(), "step": name,
                    "exception": repr(exc)[:300],
                    "chain": [repr(e)[:300] for e in _chain(exc)],
                    "new_connection": any(e[1].startswith("connection.connect_tcp") for e in events),
                    "requests_on_connection": getattr(conn, "_request_count", None),
                    "local_port": port,
                    "previous_on_port": self.last_on_port.get(port) if port else None,
                    "events": events,
                }

        request.extensions["trace"] = trace

    async def _on_response(self, response) -> None:
        stream = response.extensions.get("network_stream")
        addr = stream.get_extra_info("client_addr") if stream is not None else None
        if addr:
            self.last_on_port[addr[1]] = (_REQUEST_IDX.get(), time.monotonic())

    def report(self, outcomes: list, stalls: list[tuple[float, float]]) -> list[dict]:
        """The failures, each with how long its connection had been idle on
        the client (the previous request's end to this one's send) and the
        client loop's stalls in the 10 s before it."""
        done = {o.idx: o.t_done for o in outcomes}
        out = []
        for f in self.failures.values():
            f = dict(f)
            prev = f.pop("previous_on_port")
            if prev is not None:
                f["previous_request_on_port"] = prev[0]
                if done.get(prev[0]):
                    f["connection_idle_s"] = round(f["t_sent"] - done[prev[0]], 3)
            f["loop_stalls_10s_before"] = [[round(t - f["t_sent"], 3), lag] for t, lag in stalls
                                           if f["t_sent"] - 10 <= t <= f["t_failed"]]
            f["failed_after_s"] = round(f.pop("t_failed") - f["t_sent"], 3)
            out.append(f)
        return out


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen and len(seen) < 6:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


async def watch_stalls(stalls: list[tuple[float, float]], interval_s: float = 0.1, over_s: float = 0.5) -> None:
    """Record (when, how long) the client's event loop woke up more than
    ``over_s`` late, until cancelled."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        lag = time.monotonic() - before - interval_s
        if lag > over_s:
            stalls.append((round(before, 3), round(lag, 3)))


# -- checks --------------------------------------------------------------------


def envelope_excess(outs: list, rate: float) -> tuple[float, float, int]:
    """The jitter-free check over whole requests (``analysis.envelope_worst``):
    worst (excess, window, tokens) over the requests sent at or after ``a`` and
    done by ``b``, for every a and b."""
    worst = envelope_worst([(o.t_sent, o.t_done, o.n_tokens) for o in outs if o.t_done], rate)
    return worst if worst is not None else (float("-inf"), 0.0, 0)


def check(plan, outcomes, rates_of, args, gauges_end, runtime_s, client_windows: bool = True) -> dict:
    """The single-engine checks; ``client_windows`` False (several engines:
    the bound is judged on the engines' counters instead, see
    :func:`counter_checks`) leaves out those on client times and the
    per-request one (a request's tokens on one engine are bounded only
    by the bound across engines)."""
    failures: list[str] = []
    by_idx = {p.idx: p for p in plan}
    errors = truncated = finished = cancelled = server_side = 0
    for o in outcomes:
        p = by_idx[o.idx]
        if o.error or (o.status and o.status != 200):
            errors += 1
            failures.append(f"request {o.idx} ({o.user}): HTTP {o.status} {o.error}")
            continue
        if o.cancelled:
            cancelled += 1
            continue
        finished += 1
        problems = []
        if o.completion_tokens != o.n_tokens:
            problems.append(f"usage {o.completion_tokens} != received {o.n_tokens}")
        if p.ignore_eos:
            if o.finish_reason != "length" or o.n_tokens != p.max_tokens:
                problems.append(
                    f"finish {o.finish_reason} with {o.n_tokens}/{p.max_tokens} tokens"
                )
        else:
            if o.finish_reason not in ("stop", "length") or (
                o.finish_reason == "length" and o.n_tokens != p.max_tokens
            ) or not 1 <= o.n_tokens <= p.max_tokens:
                problems.append(
                    f"finish {o.finish_reason} with {o.n_tokens}/{p.max_tokens} tokens (no ignore_eos)"
                )
        if client_windows and o.generation_time_s is not None and o.n_tokens > 1:
            rate = rates_of(o.user)
            allowed = guarantee_bound(o.generation_time_s + SERVER_TS_TOLERANCE_S, rate)
            if o.n_tokens > allowed:
                server_side += 1
                problems.append(
                    f"server-side: {o.n_tokens} tokens in {o.generation_time_s:.3f}s > {allowed:.1f}"
                )
        if problems and (len(problems) > 1 or not problems[0].startswith("server-side")):
            truncated += 1
        if problems:
            failures.append(f"request {o.idx} ({o.user}): " + "; ".join(problems))

    # Client delivery jitter, measured: per finished request, the server's
    # first->last output interval minus the client's first->last receive
    # interval.  Two tokens of different requests can be displaced in opposite
    # directions, so the receive-timestamp window check allows the larger of
    # --jitter and twice the largest displacement seen in this run.
    lag_spread = 0.0
    for o in outcomes:
        if o.generation_time_s is not None and len(o.times) > 1 and not o.cancelled:
            lag_spread = max(lag_spread, abs(o.generation_time_s - (o.times[-1] - o.times[0])))
    allowance = max(args.jitter, 2 * lag_spread)

    per_user = {}
    by_user: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_user.setdefault(o.user, []).append(o)
    guarantee_violations = 0
    for user, outs in sorted(by_user.items()):
        rate = rates_of(user)
        times = [t for o in outs for t in o.times]
        if not times:
            continue
        excess, w = sliding_excess(times, rate, allowance)
        strict, ws = sliding_excess(times, rate, 0.0)
        env, env_w, env_n = envelope_excess(outs, rate)
        span = max(times) - min(times)
        entry = {
            "rate": rate,
            "tokens": len(times),
            "requests": len(outs),
            "span_s": round(span, 3),
            "mean_rate": round((len(times) - 1) / span, 2) if span > 0 else None,
            "max_tokens_in_1s": max_in_window(times, 1.0),
            "max_tokens_in_5s": max_in_window(times, 5.0),
            "bound_1s": round(guarantee_bound(1.0, rate), 1),
            "bound_5s": round(guarantee_bound(5.0, rate), 1),
            "worst_excess_sliding": round(excess, 2),
            "worst_window_s": round(w, 3),
            "worst_excess_sliding_strict": round(strict, 2),
            "worst_strict_window_s": round(ws, 3),
            "worst_excess_envelope": round(env, 2),
            "worst_envelope_window_s": round(env_w, 3),
            "worst_envelope_tokens": env_n,
        }
        per_user[user] = entry
        if not client_windows:
            continue
        if env > 1e-9:
            guarantee_violations += 1
            failures.append(
                f"user {user} (N={rate}): requests sent and finished within {env_w:.3f}s "
                f"received {env_n} tokens, {env:.1f} over the bound (jitter-free check)"
            )
        if excess > 1e-9:
            guarantee_violations += 1
            failures.append(
                f"user {user} (N={rate}): {excess:.1f} tokens over the bound in a {w:.3f}s "
                f"window of receive timestamps (jitter allowance {allowance:.2f}s)"
            )
    if any(v for k, v in gauges_end.items() if k != measure.PREEMPTIONS):
        failures.append(f"gauges not back to 0 at the end: {gauges_end}")
    if len(outcomes) < len(plan):
        failures.append(f"only {len(outcomes)} of {len(plan)} requests completed within the time limit")
    return {
        "ok": not failures,
        "runtime_s": round(runtime_s, 1),
        "requests": len(plan),
        "completed_outcomes": len(outcomes),
        "finished": finished,
        "cancelled": cancelled,
        "errors": errors,
        "truncated_or_miscounted": truncated,
        "server_side_request_violations": server_side,
        "guarantee_violations": guarantee_violations,
        "measured_delivery_jitter_s": round(lag_spread, 3),
        "sliding_window_allowance_s": round(allowance, 3),
        "gauges_end": gauges_end,
        "tokens_received": sum(o.n_tokens for o in outcomes),
        "per_user": per_user,
        "failures": failures[:200],
    }


# -- main ------------------------------------------------------------------------


async def drive(args, base_url: str, model: str, plan: list[Planned],
                diagnostics: dict | None = None) -> tuple[list[Outcome], float]:
    """Send the plan; ``diagnostics`` (if given) receives the client's
    transport failures and event-loop stalls (:class:`TransportWatch`)."""
    sem = asyncio.Semaphore(args.concurrency)
    outcomes: list[Outcome] = []
    done = 0
    t0 = time.monotonic()
    transport = TransportWatch()
    stalls: list[tuple[float, float]] = []
    stall_task = asyncio.create_task(watch_stalls(stalls))

    async with measure.openai_client(base_url, max_connections=args.concurrency + 8, timeout=600) as client:
        watching = transport.install(client)

        async def worker(p: Planned):
            nonlocal done
            async with sem:
                _REQUEST_IDX.set(p.idx)  # this task's own context
                o = await run_one(client, model, p)
            outcomes.append(o)
            done += 1
            if done % max(1, len(plan) // 10) == 0:
                print(f"  {done}/{len(plan)} requests done, {time.monotonic() - t0:.0f}s", flush=True)

        tasks = [asyncio.create_task(worker(p)) for p in plan]
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    stall_task.cancel()
    await asyncio.gather(stall_task, return_exceptions=True)
    if diagnostics is not None:
        diagnostics.update({
            "transport_watched": watching,
            "transport_failures": transport.report(outcomes, stalls),
            "loop_stalls_over_0_5s": len(stalls),
            "max_loop_stall_s": max((lag for _, lag in stalls), default=0.0),
        })
    return outcomes, time.monotonic() - t0


def first_token_waits(outcomes) -> dict:
    """Send -> first token received, per request that got one (client clock:
    receive stalls on this machine inflate it, so read it as an upper bound)."""
    waits = sorted(o.times[0] - o.t_sent for o in outcomes if o.times)
    if not waits:
        return {}

    def at(q: float) -> float:
        return round(waits[min(len(waits) - 1, int(q * len(waits)))], 3)

    return {"requests": len(waits), "p50_s": at(0.5), "p90_s": at(0.9), "max_s": round(waits[-1], 3)}


def wait_gauges_zero(base_url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        g = read_gauges(base_url)
        if not g["vllm:num_requests_running"] and not g["vllm:num_requests_waiting"]:
            return g
        if time.monotonic() > deadline:
            return g
        time.sleep(0.25)


# -- several engines sharing a store, with chaos ------------------------------------


#: A request whose engine was killed under it is sent again, at most this often.
MAX_ATTEMPTS = 3
STORE_MODE = "vllm:output_rate_store_mode"


@dataclass
class ChaosMarks:
    """When the chaos happened (``time.monotonic``, the clock every process
    on this machine shares; the engines' counters are read on it too)."""

    redis_kill_sent: float | None = None
    redis_killed: float | None = None
    redis_restart_sent: float | None = None
    redis_answering: float | None = None
    all_shared_again: float | None = None
    engine_last_read: float | None = None
    engine_stop_sent: float | None = None
    engine_stopped: float | None = None
    engine_healthy: float | None = None
    #: Requests done when Redis was killed, when it answered again and when the engine was back.
    done_at_redis_kill: int | None = None
    done_at_redis_answering: int | None = None
    done_at_engine_healthy: int | None = None

    def outages(self) -> list[Outage]:
        if self.redis_killed is None:
            return []
        # Never seen back on the shared store: the fallback's bound to the end.
        return [Outage(self.redis_kill_sent, self.redis_killed, self.redis_restart_sent,
                       self.all_shared_again if self.all_shared_again is not None else float("inf"))]

    def relative(self, t0: float) -> dict:
        """The times as seconds after ``t0`` (the counts as they are)."""
        return {k: (v if v is None or k.startswith("done_at") else round(v - t0, 3))
                for k, v in asdict(self).items()}


def pick_engine(engines, turn: int):
    """Engine ``turn`` mod E, or the next one that is up (None: none is)."""
    for step in range(len(engines)):
        engine = engines[(turn + step) % len(engines)]
        if engine.server is not None:
            return engine
    return None


async def drive_cluster(args, engines, model: str, plan: list[Planned], progress: dict):
    """Send the plan over the engines (request i to engine i mod E, or the
    next one up); a request that fails because its engine was killed under
    it is sent again to an engine that is up, and the failed attempt kept."""
    sem = asyncio.Semaphore(args.concurrency)
    outcomes: list[Outcome] = []
    retried: list[Outcome] = []
    clients: dict[str, object] = {}
    t0 = time.monotonic()

    def client_for(url: str):
        if url not in clients:
            clients[url] = measure.openai_client(url, max_connections=args.concurrency + 8, timeout=600)
        return clients[url]

    async def one(p: Planned) -> Outcome:
        for attempt in range(MAX_ATTEMPTS):
            engine = pick_engine(engines, p.idx + attempt)
            while engine is None:
                await asyncio.sleep(0.1)
                engine = pick_engine(engines, p.idx + attempt)
            start, url = engine.starts, engine.base_url
            if url is None:
                continue
            o = await run_one(client_for(url), model, p)
            o.engine, o.engine_start = engine.index, start
            failed = bool(o.error) or bool(o.status and o.status != 200)
            if failed and attempt + 1 < MAX_ATTEMPTS and (engine.server is None or engine.starts != start):
                retried.append(o)  # its engine was killed under it
                continue
            return o
        return o

    async def worker(p: Planned):
        async with sem:
            o = await one(p)
        outcomes.append(o)
        progress["done"] += 1
        if progress["done"] % max(1, len(plan) // 10) == 0:
            print(f"  {progress['done']}/{len(plan)} requests done, {time.monotonic() - t0:.0f}s", flush=True)

    try:
        tasks = [asyncio.create_task(worker(p)) for p in plan]
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for client in clients.values():
            await client.close()
    return outcomes, retried, time.monotonic() - t0


async def chaos(args, redis_srv, engines, reader: CounterReader, plan_size: int, progress: dict,
                marks: ChaosMarks, log) -> None:
    """Once ``--restart-at`` of the requests are done, kill the last engine
    (SIGKILL to its process group: requests in flight on it fail) and start
    it again; once ``--redis-down-at`` are done (and the step before is
    over), kill Redis (SIGKILL) and start it again ``--redis-down-s`` later
    (same port, empty)."""

    async def until_done(fraction: float) -> None:
        while progress["done"] < fraction * plan_size:
            await asyncio.sleep(0.1)

    async def redis_outage() -> None:
        await until_done(args.redis_down_at)
        marks.redis_kill_sent = time.monotonic()
        await asyncio.to_thread(redis_srv.stop)
        marks.redis_killed = time.monotonic()
        marks.done_at_redis_kill = progress["done"]
        log(f"chaos: redis-server killed after {progress['done']} requests")
        await asyncio.sleep(args.redis_down_s)
        marks.redis_restart_sent = time.monotonic()
        await asyncio.to_thread(redis_srv.start)
        marks.redis_answering = time.monotonic()
        marks.done_at_redis_answering = progress["done"]
        log(f"chaos: redis-server answering again after {marks.redis_answering - marks.redis_killed:.1f} s")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            last = reader.samples[-1] if reader.samples else None
            # No store-mode gauge yet (an engine that has not stepped since its
            # start exports none) is no fallback either.
            if last is not None and last.sent > marks.redis_answering and all(
                    mode in ("shared", None) for mode, charged in zip(last.modes, last.charged)
                    if charged is not None):
                marks.all_shared_again = last.done
                log(f"chaos: every engine on the shared store again "
                    f"{marks.all_shared_again - marks.redis_answering:.1f} s after Redis answered")
                return
            await asyncio.sleep(0.1)

    async def engine_restart() -> None:
        await until_done(args.restart_at)
        engine = engines[-1]
        await asyncio.to_thread(reader.sample_now, "before engine kill")
        marks.engine_last_read = reader.samples[-1].done
        marks.engine_stop_sent = time.monotonic()
        await asyncio.to_thread(engine.kill)
        marks.engine_stopped = time.monotonic()
        log(f"chaos: engine {engine.index + 1} killed after {progress['done']} requests")
        await asyncio.to_thread(engine.start)
        marks.engine_healthy = time.monotonic()
        marks.done_at_engine_healthy = progress["done"]
        log(f"chaos: engine {engine.index + 1} healthy again after "
            f"{marks.engine_healthy - marks.engine_stopped:.0f} s at {engine.base_url}")

    # One after the other, in the order of their thresholds, so that the two never overlap.
    steps = []
    if redis_srv is not None and args.redis_down_s > 0:
        steps.append((args.redis_down_at, redis_outage))
    if args.restart_at < 1 and len(engines) > 1:
        steps.append((args.restart_at, engine_restart))
    for _, step in sorted(steps, key=lambda s: s[0]):
        await step()


def end_gauges(engines, timeout_s: float) -> dict[str, float]:
    """Per engine: requests running / waiting, and its store mode other than
    shared (1 = on a fallback), once all are 0 or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        out: dict[str, float] = {}
        for engine in engines:
            samples = measure.fetch_metrics(engine.base_url)
            name = f"engine{engine.index + 1}"
            for key, value in measure.gauges(samples).items():
                out[f"{name} {key}"] = value
            for mode in ("local", "closed"):
                out[f"{name} {STORE_MODE}{{mode={mode}}}"] = measure.metric_sum(samples, STORE_MODE, mode=mode) or 0.0
            out[f"{name} vllm:output_rate_throttled_requests"] = measure.metric_sum(
                samples, "vllm:output_rate_throttled_requests") or 0.0
        if not any(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def counter_checks(samples, users: dict[str, float], engines: int, marks: ChaosMarks,
                   max_window_s: float) -> dict:
    """Every user's tokens charged on the engines (summed over engines and
    restarts) in every window between two reads, against the documented
    bound widened by the local fallback while the store was down
    (:func:`~vllm_output_rate.tools.engine_counters.widened_bound`)."""
    outages = marks.outages()
    per_user, failures = {}, []
    for user, rate in sorted(users.items()):
        totals = cumulative(samples, user)
        if not totals or totals[-1] == 0:
            continue
        worst = worst_window(samples, totals, lambda a, b: widened_bound(a, b, rate, engines, outages),
                             max_window_s)
        per_user[user] = {"rate": rate, "charged": totals[-1] - totals[0],
                          "worst_excess": round(worst.excess, 2), "worst_tokens": worst.tokens,
                          "worst_bound": round(worst.bound, 1), "worst_window_s": round(worst.window_s, 3)}
        if worst.excess > 1e-9:
            failures.append(f"user {user} (N={rate}): {worst.tokens} tokens charged on the engines within "
                            f"{worst.window_s:.3f} s, bound {worst.bound:.1f}")
    return {"per_user": per_user, "failures": failures,
            "users_over_the_bound": len(failures), "reads": len(samples)}


def serve_args(args, rates: dict[str, float], default_rate: float, store_args: tuple[str, ...] = ()) -> list[str]:
    """The soak's ``vllm-output-rate serve`` options: the users' rates and the
    engine's shape from ``args``, then ``store_args`` (a shared store's
    options), then the operator's ``--server-arg`` extras."""
    return [
        "--default-user-output-tokens-per-second", str(default_rate),
        "--user-output-tokens-per-second", json.dumps(rates),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-active-seqs", str(args.max_num_active_seqs),
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", "512",
        "--enforce-eager",
        "--enable-per-request-metrics",
        *store_args,
        *args.server_arg,
    ]


def run_cluster(args, plan, rates, default_rate, config, doc) -> dict:
    """``--engines E`` engines sharing one store, with the chaos; the bound
    judged on the engines' counters."""
    all_rates = {**rates, ANON: default_rate}
    log_dir = benchkit.log_dir_for("soak", args.log_dir)
    marks = ChaosMarks()
    with ExitStack() as stack:
        redis_srv = None
        store_url = args.store
        if args.store == "redis-server":
            redis_srv = stack.enter_context(RedisProcess())
            store_url = redis_srv.url
            print(f"redis-server on 127.0.0.1:{redis_srv.port} (pid {redis_srv.pid})", flush=True)
        server_args = serve_args(args, rates, default_rate, (
            "--output-rate-store", store_url,
            "--output-rate-expected-engines", str(args.engines),
            "--output-rate-store-prefix", "soak",
            "--output-rate-admin-open",  # loopback engines; the soak reads their counters
        ))
        doc["server_args"] = server_args
        engines = stack.enter_context(benchkit.restartable_engines(
            [(f"soak-engine{i + 1}", server_args) for i in range(args.engines)], log_dir,
            model=args.model, env=ADMIN_ROUTE_ENV))
        doc["startup_s"] = max(e.startup_s[0] for e in engines)
        doc["worker_cpus"] = [benchkit.worker_cpus(e.server.pid) for e in engines]
        print("engines up: " + ", ".join(f"{e.base_url} (pid {e.server.pid}, model worker on CPUs "
                                         f"{doc['worker_cpus'][e.index]})" for e in engines), flush=True)
        model = engines[0].server.model
        reader = stack.enter_context(CounterReader(
            lambda: [(e.base_url, e.starts) for e in engines], period_s=args.read_every, read_modes=True))
        t0 = time.monotonic()
        progress = {"done": 0}

        async def scenario():
            chaos_task = asyncio.create_task(chaos(args, redis_srv, engines, reader, len(plan), progress,
                                                   marks, lambda m: print(f"  {m}", flush=True)))
            result = await drive_cluster(args, engines, model, plan, progress)
            await chaos_task  # re-raises a failed chaos step
            return result

        outcomes, retried, runtime = asyncio.run(scenario())
        gauges_end = end_gauges(engines, 30.0)
        reader.sample_now("end")
        samples = reader.stop()
        summary = check(plan, outcomes, lambda u: all_rates.get(u, default_rate), args, gauges_end, runtime,
                        client_windows=False)
        counters = counter_checks(samples, all_rates, args.engines, marks, args.max_window)
        logs = [e.log_text() for e in engines]
    summary["failures"] = counters["failures"] + summary["failures"]
    summary["ok"] = summary["ok"] and not counters["failures"] and (
        redis_srv is None or marks.all_shared_again is not None)
    stopped_engine = len(engines) - 1
    retried_on_restarted = [o for o in retried if o.engine == stopped_engine]
    summary.update({
        "engines": args.engines,
        "guarantee_violations": counters["users_over_the_bound"],
        "retried_requests": len(retried),
        "retried_not_on_the_restarted_engine": len(retried) - len(retried_on_restarted),
        "retried_errors": sorted({o.error[:120] for o in retried})[:5],
        "counter_checks": counters,
        "counter_read_failures": reader.failed_reads,
        "chaos": marks.relative(t0),
        "engine_startup_s": [e.startup_s for e in engines],
        "store_outages_logged": [text.count("unreachable") for text in logs],
        "store_back_logged": [text.count("answers again") for text in logs],
        "requests_per_engine": {f"engine{i + 1}": sum(1 for o in outcomes if o.engine == i)
                                for i in range(args.engines)},
        # When each read was taken (s after the load began) and what it saw of
        # the engines' starts and store modes (the charged totals are in the checks).
        "counter_reads": [[round(s.sent - t0, 3), round(s.done - t0, 3), s.starts, s.modes] for s in samples],
        "first_token_wait_client": first_token_waits(outcomes),
    })
    if redis_srv is not None and marks.all_shared_again is None:
        summary["failures"].insert(0, "the engines were not all back on the shared store within 60 s")
    # The chaos counts only while requests are still coming: say so when it came too late.
    for what, done in (("Redis answered again", marks.done_at_redis_answering),
                       ("the killed engine was back", marks.done_at_engine_healthy)):
        if done is not None and done >= len(plan):
            summary["failures"].append(f"{what} only after every request was done (the chaos came too late)")
    summary["ok"] = summary["ok"] and not summary["failures"]
    return summary, outcomes



def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="existing server (needs --default-rate and --user-rates)")
    ap.add_argument("--default-rate", type=float, default=None,
                    help="server's default tok/s (anonymous users); own server: default 60")
    ap.add_argument("--user-rates", default=None,
                    help="JSON user -> tok/s; own server: random limits when omitted")
    ap.add_argument("--users", type=int, default=24, help="named users (random limits)")
    ap.add_argument("--min-rate", type=float, default=10.0)
    ap.add_argument("--max-rate", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens drawn")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--cancel-fraction", type=float, default=0.1)
    ap.add_argument("--anonymous-share", type=float, default=0.05,
                    help="weight of anonymous traffic relative to one named user's")
    ap.add_argument("--jitter", type=float, default=0.5,
                    help="client delivery-jitter allowance (s) in the sliding-window check")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the request phase")
    ap.add_argument("--max-num-seqs", type=int, default=48)
    ap.add_argument("--max-num-active-seqs", type=int, default=16)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra vllm serve argument for the own server (repeatable), "
                    "e.g. --server-arg=--num-gpu-blocks-override=40")
    ap.add_argument("--log-dir", default=None, help="server log folder (own server)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "soak"), metavar="PREFIX",
                    help="writes the summary to PREFIX.json (default: %(default)s)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="own server's model (default: tiny model)")
    ap.add_argument("--engines", type=int, default=1,
                    help="engines sharing one store (needs --store); > 1 runs the chaos below")
    ap.add_argument("--store", default=None, metavar="URL|redis-server",
                    help="the engines' --output-rate-store; 'redis-server' starts a real one on 127.0.0.1 "
                    "that the chaos kills and starts again")
    ap.add_argument("--redis-down-at", type=float, default=0.5,
                    help="kill Redis once this fraction of the requests is done (own redis-server)")
    ap.add_argument("--redis-down-s", type=float, default=5.0, help="seconds Redis stays down (0: no kill)")
    ap.add_argument("--restart-at", type=float, default=0.05,
                    help="kill and start again the last engine once this fraction is done (1: never); "
                    "early, so that it serves again while the load runs (a restart took 45-95 s here)")
    ap.add_argument("--read-every", type=float, default=0.5, help="seconds between reads of the engines' counters")
    ap.add_argument("--max-window", type=float, default=60.0,
                    help="longest window of the counter check (s)")
    ap.add_argument("--watch-residency", type=float, default=0.0, metavar="S",
                    help="read the server's /metrics every S seconds during the load and report each "
                    "user's resident and waiting requests against its residency cap (0: off; the pace is "
                    "taken from --server-arg, the plugin's default with --url)")
    ap.add_argument("--residency-pace", type=float, default=DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
                    help="pace the reported caps use when the server's is 0 (residency off), for "
                    "comparison (default: %(default)s, the plugin's default)")
    ap.add_argument("--dump-requests", default=None,
                    help="write every request's plan and outcome (JSON lines) here")
    args = ap.parse_args(argv)
    if args.url and (args.default_rate is None or args.user_rates is None):
        ap.error("--url needs --default-rate and --user-rates matching the server")
    if args.engines > 1 and (args.store is None or args.url):
        ap.error("--engines > 1 needs --store and its own servers (no --url)")
    if args.watch_residency and args.store:
        ap.error("--watch-residency reads one engine's /metrics (not with --store)")
    if args.users < 1 or args.requests < 1 or args.concurrency < 1:
        ap.error("--users, --requests and --concurrency must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    default_rate = args.default_rate if args.default_rate is not None else 60.0
    if args.user_rates is not None:
        rates = {k: float(v) for k, v in json.loads(args.user_rates).items()}
    else:
        rates = make_rates(rng, args.users, args.min_rate, args.max_rate)
    users = list(rates)
    all_rates = dict(rates)
    all_rates[ANON] = default_rate
    plan_rates = dict(rates)
    plan_rates[ANON] = args.anonymous_share * (sum(rates.values()) / len(rates))
    plan = make_plan(args, rng, users + [ANON], plan_rates)

    def rates_of(user: str) -> float:
        return rates.get(user, default_rate)

    demand = sum(p.max_tokens for p in plan)
    est = max(
        sum(p.max_tokens for p in plan if p.user == u) / all_rates[u] for u in all_rates
        if any(p.user == u for p in plan)
    )
    print(
        f"soak: {len(plan)} requests, {len(users)} named users + anonymous, "
        f"rates {min(rates.values())}..{max(rates.values())} tok/s (default {default_rate}), "
        f"{sum(1 for p in plan if p.cancel_after is not None)} to cancel, "
        f"{demand} tokens requested, slowest user needs >= {est:.0f}s",
        flush=True,
    )

    config = {k: v for k, v in vars(args).items() if k != "out"} | {
        "default_rate": default_rate, "user_rates": rates}
    doc = benchkit.start_report(SCHEMA)
    if args.store:
        summary, outcomes = run_cluster(args, plan, rates, default_rate, config, doc)
        summary["config"] = config
    else:
        with ExitStack() as stack:
            if args.url:
                base_url = args.url.rstrip("/")
                model = benchkit.served_model(base_url)
                server = None
            else:
                log_dir = benchkit.log_dir_for("soak", args.log_dir)
                server_args = serve_args(args, rates, default_rate)
                doc["server_args"] = server_args
                (server,) = stack.enter_context(benchkit.running_engines(
                    [("soak", server_args)], log_dir, model=args.model, command=SERVE_WITH_CHURN))
                base_url, model = server.base_url, server.model
                doc["startup_s"] = server.startup_s
                print(f"server pid {server.pid} at {base_url} up in {server.startup_s:.0f}s; "
                      f"log {server.log_path}", flush=True)

            m0 = measure.fetch_metrics(base_url)
            diagnostics: dict = {}
            with ExitStack() as watching:
                watch = (watching.enter_context(
                    benchkit.MetricsPoller(base_url, args.watch_residency, residency_reading))
                    if args.watch_residency > 0 else None)
                outcomes, runtime = asyncio.run(drive(args, base_url, model, plan, diagnostics))
            gauges_end = wait_gauges_zero(base_url, 15.0)
            summary = check(plan, outcomes, rates_of, args, gauges_end, runtime)
            summary["client_diagnostics"] = diagnostics
            if watch is not None:
                pace = server_pace(args.server_arg)
                summary["residency"] = residency_summary(watch, rates_of, pace, args.residency_pace,
                                                        args.max_num_seqs)
            churn = recompute_figures(m0, measure.fetch_metrics(base_url))
            summary["preemptions"] = churn["preemptions"] or 0.0
            summary["churn"] = churn_costs(churn, summary["finished"], summary["tokens_received"])
            summary["first_token_wait_client"] = first_token_waits(outcomes)
            summary["config"] = config
            if server is not None:
                summary["server_log"] = str(server.log_path)
                if not summary["ok"]:
                    summary["server_log_tail"] = server.log_tail(40)

    # -- report --
    print(f"\nruntime {summary['runtime_s']}s: {summary['finished']} finished, "
          f"{summary['cancelled']} cancelled, {summary['errors']} errors, "
          f"{summary['truncated_or_miscounted']} truncated/miscounted, "
          f"{summary['server_side_request_violations']} over the bound per request (server-side), "
          f"{summary['guarantee_violations']} users over the bound, "
          f"{summary['tokens_received']} tokens, {summary.get('preemptions') or 0:.0f} preemptions; "
          f"gauges at end {summary['gauges_end']}")
    if "churn" in summary:
        print(churn_line(summary["churn"]))
    if "counter_checks" in summary:
        print(f"{summary['engines']} engines: {summary['retried_requests']} requests retried "
              f"({summary['retried_not_on_the_restarted_engine']} not on the restarted engine); chaos "
              f"(s after the load began): {summary['chaos']}; outages logged per engine "
              f"{summary['store_outages_logged']}, back {summary['store_back_logged']}")
        print("on the engines' counters (worst window between two reads vs the bound widened by the "
              "fallback while Redis was down):")
        print(f"{'user':<16}{'N':>7}{'charged':>9}{'worst W s':>11}{'tokens':>8}{'bound':>8}{'excess':>8}")
        for user, e in summary["counter_checks"]["per_user"].items():
            print(f"{user:<16}{e['rate']:>7}{e['charged']:>9}{e['worst_window_s']:>11}{e['worst_tokens']:>8}"
                  f"{e['worst_bound']:>8}{e['worst_excess']:>8}")
    res = summary.get("residency")
    if res:
        print(f"residency (server's /metrics every {res['read_every_s']}s, {res['reads']} reads; "
              f"caps K = max(1, floor(rate / {res['cap_pace']:g})), server pace {res['server_pace']:g}): "
              f"{res['reads_some_user_waiting_at_cap']} reads with a user at its cap and requests waiting, "
              f"{res['reads_some_user_over_cap']} with a user over its cap; mean KV usage {res['mean_kv_usage']}")
        print(f"{'user':<16}{'N':>7}{'K':>4}{'reads':>7}{'max res':>9}{'max wait':>10}{'over K':>8}"
              f"{'wait at K':>11}{'.. slot free':>13}")
        for user, e in res["per_user"].items():
            print(f"{user:<16}{e['rate']:>7}{str(e['cap']):>4}{e['reads']:>7}{e['max_resident_seen']:>9}"
                  f"{e['max_waiting_seen']:>10}{e['reads_over_cap']:>8}{e['reads_waiting_at_cap']:>11}"
                  f"{e['reads_waiting_at_cap_slot_free']:>13}")
    diag = summary.get("client_diagnostics") or {}
    for f in diag.get("transport_failures", []):
        print(f"transport failure of request {f['request']} after {f['failed_after_s']}s in {f['step']}: "
              f"{f['exception']}; new connection {f['new_connection']}, requests on it "
              f"{f['requests_on_connection']}, port {f['local_port']}, idle before "
              f"{f.get('connection_idle_s')}s; loop stalls in the 10 s before {f['loop_stalls_10s_before']}")
    ttft = summary["first_token_wait_client"]
    if ttft:
        print(f"first token after send (client clock, upper bound): p50 {ttft['p50_s']}s, "
              f"p90 {ttft['p90_s']}s, max {ttft['max_s']}s over {ttft['requests']} requests")
    if "counter_checks" not in summary:
        print(f"delivery jitter measured {summary['measured_delivery_jitter_s']}s; sliding-window "
              f"allowance {summary['sliding_window_allowance_s']}s.  Excess = tokens over "
              f"(W + 0.1 [+ allowance]) * N + 1 in the worst window (<= 0 is within the guarantee)")
        print(f"{'user':<16}{'N':>7}{'reqs':>6}{'tokens':>8}{'mean':>8}{'max1s':>7}{'bnd1s':>7}"
              f"{'envelope':>10}{'sliding':>9}{'strict':>8}")
    for user, e in ({} if "counter_checks" in summary else summary["per_user"]).items():
        print(f"{user:<16}{e['rate']:>7}{e['requests']:>6}{e['tokens']:>8}{str(e['mean_rate']):>8}"
              f"{e['max_tokens_in_1s']:>7}{e['bound_1s']:>7}{e['worst_excess_envelope']:>10}"
              f"{e['worst_excess_sliding']:>9}{e['worst_excess_sliding_strict']:>8}")
    for line in summary["failures"][:30]:
        print("FAIL:", line)
    if summary.get("server_log_tail"):
        print("server log tail:\n" + summary["server_log_tail"])
    print("RESULT:", "PASS" if summary["ok"] else "FAIL")
    if args.dump_requests:
        by_idx = {o.idx: o for o in outcomes}
        with open(args.dump_requests, "w") as fh:
            for p in plan:
                o = by_idx.get(p.idx)
                fh.write(json.dumps({"plan": asdict(p), "outcome": asdict(o) if o else None}) + "\n")
    doc.update(summary)
    benchkit.write_outputs(benchkit.finish_report(doc), args.out)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
