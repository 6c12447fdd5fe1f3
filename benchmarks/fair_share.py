#!/usr/bin/env python
"""VTC's two synthetic workloads on stock vLLM (FCFS), hard caps and rate/ceil/weight.

What
    The two synthetic workloads of the VTC paper (Sheng et al., OSDI 2024,
    "Fairness in Serving Large Language Models", section 5.2), scaled to a
    2-core testbed and the tiny model, each on three servers (``--mode``):

    * ``stock``: no rate flag, so vLLM's own scheduler (FCFS);
    * ``hard``: every workload client capped at its guaranteed rate (today's
      plain-number limits: rate = ceiling);
    * ``shares``: the same guaranteed rates as ``rate``, no ceiling
      (``ceil: null``) and the workload's weight as ``weight``, in the
      syntax of issue 21 (``--user-output-tokens-per-second
      '{"W1": {"rate": 25, "ceil": null, "weight": 1}, ...}'``).

    Workloads (every client sends open loop: a new request at fixed
    intervals whatever it has in flight, as VTC's "uniform" arrivals; C =
    the server's capacity in output tok/s, measured once, see How):

    * ``overload``: two clients of equal weight, ``B`` sending twice ``A``'s
      request rate (default 1 C and 2 C of output tokens): each at or beyond
      the capacity, so both stay backlogged even when the server does up to
      twice the C measured (on a shared machine the two differ by that
      much: C is measured in 15 s, the load of other processes moves).
    * ``weighted``: four clients ``W1``..``W4`` with weights 1, 2, 3, 4, all
      backlogged: each sends 0.8 C (twice the largest weighted share,
      0.4 C).
      VTC sent in proportion to the weights
      (``--weighted-arrivals weights``); the default sends equally, so that
      FCFS does not hand out the weighted shares by accident.
    * ``equal-rates-1-3`` (``E1``, ``E3``) and ``equal-rates-1-2-3-4``
      (``Q1``..``Q4``): every client has the same small guaranteed rate
      (``--equal-rate``, 5 tok/s) and the weights 1:3 or 1:2:3:4.  In
      ``weighted`` the guaranteed rates are already split by weight, so the
      hard caps alone split 1:2:3:4 and the figure cannot tell whether the
      weights do anything (issue 33); here only the weights can split the
      spare capacity.  Each client offers ``--equal-rates-load`` (default
      1.5 C, twice the largest weight share of the spare capacity, ``E3``'s
      0.75 C, so it stays backlogged even when the server does up to twice
      the C measured) and keeps at most ``--equal-rates-in-flight``
      (default 16, the servers' ``--max-num-seqs``: one client alone could
      fill every resident slot) requests in flight: an arrival while the
      client has that many is skipped and counted, so the backlog a 1.5 C
      client builds (E1's grows by about 1.25 C) stops at the cap instead
      of growing for the whole run.  Until issue 33 these clients offered
      0.8 C each, as ``weighted`` does: ``E3`` (weight share 0.75 of the
      spare capacity, about 0.75 C) was then barely backlogged, and any C
      the machine did above the one measured left it short, so its share
      could not show its weight.  Each client's peak requests in flight,
      its cap and how many windows it was backlogged throughout are in the
      JSON (``users``).  Their figure (``shares`` only): each client's
      share of the *borrowed* tokens, from the engine's per-user
      borrowed-token counter (``vllm:output_rate_borrowed_tokens_total``),
      over the run (from the first ``/metrics`` read to the read nearest
      the end of the load: not the last read, which follows the drain,
      where the heavier client's backlog empties first), over the windows
      after the first and per ``--window``, against its weight share and
      the targets of issue 33: ``E3`` 0.75 +- 0.05 (so ``E1`` 0.25 +- 0.05)
      over the run and in every window after the first; for 1:2:3:4 each
      share within 10 % of its weight share (JSON ``borrowed_shares``:
      ``over_run``, ``per_window``, ``window_deviation``,
      ``windows_missed`` of ``windows_counted``, ``met_over_run``,
      ``met_every_window``, and the counter as read, ``readings``).  The same figure is kept for ``overload`` and
      ``weighted`` in ``shares``, against the relative target.  The other
      workloads keep their loads: their clients already offer at least
      twice their largest weighted share (``weighted``: 0.8 C against W4's
      0.4 C; ``overload``: 1 C and 2 C against 0.5 C each) and keep
      ``--max-outstanding`` as their cap.
    * ``solo``: one user alone, ``--solo-streams`` (12) closed-loop
      streams for ``--solo-s`` (30) s after a warm-up, its tok/s on vLLM's
      own token counter: no limit on ``stock``, a hard cap of
      ``--solo-rate`` on ``hard``, a lone borrower (``--solo-rate``, no
      ceiling) on ``shares``.  On ``shares`` the same streams of a user
      with no entry of its own (``solo-unlimited``: the default rate,
      never hit) run on the same server, ``--solo-rounds`` (2) phases each
      in the order borrower-unlimited, unlimited-borrower, ... so that a
      drift of the machine's speed falls on both (issue 33's target: the
      lone borrower >= 0.95 x an unlimited user's tok/s on the same server;
      JSON ``ratio_to_unlimited`` over the pooled phases, and ``rounds``);
      the ratio to stock vLLM is kept too.
    * ``in-quota`` (``shares`` only; the other modes skip it): a user within
      its rate beside saturating borrowers (issue 33's third target: its
      tok/s >= 0.95 x its limit on the engine's counter, or its unlimited
      solo rate, whichever is lower).  ``carol`` has a hard cap
      (``--in-quota-rate``: the issue's 100 tok/s on the tiny model, 50 on
      the bench model, where one request gets one token per engine step and
      a full batch of 8 steps only 70-90 times a second here, so 100 is out
      of one stream's reach beside the borrowers) and keeps
      ``--in-quota-user-streams`` (1) closed-loop streams of
      ``--in-quota-max-tokens`` (200) token requests in flight (with 2, her
      limit is shared by both, and one stream can be in the engine while
      the other crosses the API server); ``bob``
      (and ``dave``, ``--in-quota-borrowers 2``) borrows with ``{rate:
      --in-quota-borrower-rate (10), ceil: null}`` and keeps
      ``--in-quota-streams`` (12) closed-loop streams.  Three phases on the
      same server, each ``--in-quota-warmup-s`` (10) s of load then
      ``--in-quota-s`` (60) s measured: ``unlimited`` (carol's load from a
      user with no entry of its own, ``carol-unlimited``, with as many
      streams: what they reach, so the limit can be chosen below it),
      ``alone`` (carol), ``beside`` (carol's streams go on, the borrowers'
      streams start).  Carol's streams (and the unlimited ones) run in a
      child process in a session of its own (:class:`StreamsProcess`), at
      the clients' raised priority: driven from the benchmark's own process,
      her client stalled for seconds at a time beside a busy engine, and
      those gaps came out of her rate though neither the engine nor the API
      server held her.
      Carol's tok/s in a phase: the increase of the engine's
      ``vllm:output_rate_output_tokens_charged_total`` from the first to
      the last ``/metrics`` read within the phase, over the poller's stamps
      of those two reads (the plugin reports about once a second, so each
      edge may be up to a second stale; a least-squares slope over every
      read of the phase is kept beside it, ``tok_s_fit``).  The figure:
      ``ratio`` = carol beside / min(limit, carol alone), target >= 0.95
      (``ratio_to_limit_or_unlimited_solo``: against min(limit, the
      unlimited stream) instead).  For the diagnosis, per phase and user:
      borrowed tokens and throttled seconds on the engine's counters, the
      plugin's per-user ``vllm:output_rate_requests`` (active: sampled in
      the last reported step; throttled: held for quota; waiting: no slot
      yet) averaged over the reads, and the requests' own engine stamps
      (queued to first token, first to last token) against the client's
      send-to-end time.  No C needed: a run of ``--workload in-quota``
      alone starts no calibration server and writes no PNG.  Each run is
      one server; ``--in-quota-append`` keeps the output JSON's earlier
      runs (same options) and adds the new one (JSON ``runs``,
      ``ratio_min``, ``ratio_mean``, ``met_every_run``).

    Guaranteed rates (``hard`` and ``shares``): ``--guaranteed`` (default
    0.5) of C, split over a workload's clients by weight; the hard caps are
    what a pure rate limit gives for the same guarantees.

    A light user ``light`` sends one short request (16 prompt tokens,
    ``--light-max-tokens`` 16) every ``--light-interval`` seconds (default 2)
    during both workloads, paced the same way in every mode, and is limited
    to ``--light-rate`` (20 tok/s, a plain number) in ``hard`` and
    ``shares``: a user within its rate beside saturating users.

    Reported per mode and workload:

    * total throughput: the increase of vLLM's own
      ``vllm:generation_tokens_total`` over the measured ``--duration``,
      every user included;
    * each client's service per ``--window`` (10 s) window, in output tokens.
      Where the plugin runs (``hard``, ``shares``) it is read from the
      engine's own per-user counters on ``/metrics``:
      ``vllm:output_rate_output_tokens_charged_total``, plus a per-user
      borrowed-tokens counter (any ``*borrow*_total`` series with a ``user``
      label) when the engine has one and the whole-run totals show that the
      charged counter leaves borrowed tokens out (the set of counters whose
      totals come nearest to the tokens the client received is used, and
      named in the JSON).  The counters reach ``/metrics`` about once a
      second, so each window edge is the ``/metrics`` read nearest to it
      (reads every ``--metrics-interval`` s): every user's window spans the
      same two engine reports, and the edges are uncertain by about a
      second.  A window with an edge farther than ``--max-skew`` (2 s) from
      any read (the API server answered too late) is not measured and is
      left out of every figure; a thread of its own reads them, so a busy client does not
      space the reads out.  On ``stock`` there is no per-user counter: each
      finished request's tokens (exact counts from ``token_ids``) are
      spread evenly over its first-to-last token span as the engine stamped
      it (per-request metrics), the span placed at the request's send time
      plus the engine's queue and first-token time, as VTC attributes
      service; requests cut at the end of the run use their first and last
      receive times.  Counting on plain receive times would move tokens
      between windows whenever the client stalls (seen here: a 10-s window
      with 0 tokens next to one with 3 times the engine's output).  Both
      these span figures and the plain receive-time windows are kept in the
      JSON for every mode, as cross-checks;
    * the **service difference** between backlogged users (VTC's fairness
      metric, output tokens only since prompt tokens are free here; VTC
      counted input + 2 x output): in each window, among the workload's
      clients backlogged throughout it (at every instant at least one of
      its requests sent and not yet ended), each client's service divided
      by its weight; the window's difference is the largest minus the
      smallest (tokens per unit weight per window).  The benchmark reports
      the max and the mean over the windows after the first (warm-up),
      and, per window, the largest deviation of a client's share of the
      backlogged clients' tokens from its weight share (|share / weight
      share - 1|; the issue's target is 10 %);
    * the light user's first-token time (p50, p90, max): from the moment
      the engine queued the request to its first token, as the engine
      stamped it (vLLM's per-request metrics, ``--enable-per-request-metrics``:
      queue time + time to first token), over the light requests sent up to
      one interval before the end that finished; how many got no first
      token before the end is counted.  The client's own send-to-first-token
      figures (which a stalled client stretches) are kept beside them.

    The figure: service over time per client (tok/s in ``--plot-bin`` bins,
    same sources as above), one row per workload, one column per mode.

How
    The model is the bench model (``make bench-model``: 8 layers instead
    of the tiny model's 2).  On the tiny model the engine outruns what the
    API server and the clients can feed it on 2 cores (``--model
    models/tiny-llama`` shows it: a weighted run filled 2.5 of its 8 active
    slots per step), nobody was backlogged at the
    engine, and each client's service was whatever its requests got through
    the API server (equal for all, whatever the weights).  A workload only
    tests a scheduler's sharing when the engine is the bottleneck, so every
    workload reports its output tokens per engine step (vLLM's own
    counters) next to the 8 it may reach.

    One server per mode, started with ``--max-num-seqs 16
    --max-num-active-seqs 8 --max-model-len 1024 --enforce-eager
    --enable-per-request-metrics`` (8 running requests keep the request
    rates, and with them the API server's and the client's work, within
    what this 2-core machine can carry), the
    workloads one after the other on it.

    Slot settings and scheduler classes: ``--slots many`` (the default:
    the bench model, 8 active slots) and ``--slots few`` (the tiny model,
    4 active slots, where the issue's figures were taken); ``--active-seqs``
    and ``--model`` set either by hand (``--active-seqs 4`` alone: few
    active slots on the bench model, where the engine stays the
    bottleneck; ``--capacity`` reuses the 8-slot C instead of measuring
    one).  On the tiny model the engine steps so fast on 2 cores that the
    API server and the client fall behind (see above): its runs report how
    many requests were running and waiting in the engine (vLLM's gauges,
    ``engine_requests``) beside the tokens per step, so a run where the
    engine was not the bottleneck shows as one.  ``--async-scheduling on|off``
    passes vLLM's own flag.  vLLM 0.32's default on GPU is async scheduling
    (the plugin then runs ``OutputRateAsyncScheduler``), but the CPU build
    turns it off in its platform config whatever the flag says
    (``CpuPlatform.check_and_update_config`` sets ``async_scheduling =
    False``), so on this testbed every run uses ``OutputRateScheduler``;
    the class the engine really ran is read from its log and recorded
    (``scheduler_class``).  The asynchronous scheduler's decisions are
    covered on the fake clock (``tests/adapter/test_borrowing_shapes.py``).
    A run with other than the default slots or scheduling writes its own
    JSON and PNG (``fair_share-4active-tiny-llama.json`` and so on), so the
    settings do not overwrite each other.  Before the first workload of the
    run, C is measured on the first server: ``--calibrate-streams`` closed-loop
    streams of the workload's request shape for ``--calibrate-s`` seconds
    after a short warm-up, C = the increase of
    ``vllm:generation_tokens_total`` over that time.  The offered loads and
    the guaranteed rates follow from that one C in every mode; a run that
    adds a mode to an existing JSON reuses its C (``--recalibrate``
    measures again).  Prompts are random token ids (no shared prefix, so the
    prefix cache plays no part): 64 prompt tokens, 512 output tokens
    (``ignore_eos``; VTC used 256 and 256: longer answers halve the request
    rate for the same tokens), streamed 16 tokens per chunk
    (vLLM's per-request ``stream_interval``; the first token comes at once):
    on 2 cores the client's per-chunk work would otherwise starve its own
    event loop.  At the end of ``--duration``
    the client reads ``/metrics`` once more, then cancels everything in
    flight and waits for the server to drain before the next workload.  A
    client never has more than ``--max-outstanding`` requests in flight
    (the equal-rate clients: ``--equal-rates-in-flight``); arrivals beyond
    are skipped and counted.  How late the client sent
    (behind each arrival's planned time) is reported per workload.

    Each mode and each workload record the commit and the uncommitted
    files under ``src/`` its server ran (``code``: the plugin is installed
    editable, so the server runs the working tree).

    Results of modes not run keep their earlier result in the output JSON
    (each mode records its own start time and load); a mode never run is
    shown as not run.  ``shares`` is skipped with a one-line reason when
    this build refuses the rate/ceil/weight syntax.

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/fair_share.py [--mode stock --mode hard ...]

writes ``docs/benchmarks/fair_share.json`` and ``.png`` (``--out PREFIX``
elsewhere); about 6-7 minutes per mode (server startup, four 60-s
workloads and the solo load, the drains; shares about 4 more for in-quota)
plus 20 s of calibration;
``--workload equal-rates-1-3 --mode shares`` runs one alone (C is reused
from the JSON when there is one).  The in-quota figures at the two slot
settings (about 4 minutes a run)::

    .venv/bin/python benchmarks/fair_share.py --mode shares --workload in-quota \\
        --slots few --out docs/benchmarks/fair_share-in-quota-few [--in-quota-append]
    .venv/bin/python benchmarks/fair_share.py --mode shares --workload in-quota \\
        --slots many --out docs/benchmarks/fair_share-in-quota-many [--in-quota-append]

and with two streams of carol's (``--in-quota-user-streams 2``, into
``fair_share-in-quota-few-2streams`` and ``fair_share-in-quota-many-2streams``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from vllm_output_rate.settings import OutputRateConfigError, parse_cli
from vllm_output_rate.tools import analysis, measure, runkit
from vllm_output_rate.tools.render import figure_metadata, sibling_json
from vllm_output_rate.tools.measure import RequestRecord, percentile, run_request
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import RESULTS_DIR, fmt_load, loadavg, machine_line, table

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-fair-share/1"
#: ``make bench-model``: 8 layers, slow enough per step that the engine, not
#: the API server or the clients, is what the workloads saturate.
BENCH_MODEL_DIR = Path("models/bench-llama")
#: --max-num-active-seqs of every server by default (``--active-seqs``): at most this many tokens per step.
ACTIVE_SEQS = 8
STOCK, HARD, SHARES = "stock", "hard", "shares"
MODES = (STOCK, HARD, SHARES)
OVERLOAD, WEIGHTED, SOLO = "overload", "weighted", "solo"
#: Equal guaranteed rates, unequal weights (issue 33): only the weights can split the spare capacity.
EQUAL_13, EQUAL_1234 = "equal-rates-1-3", "equal-rates-1-2-3-4"
EQUAL_RATE_WORKLOADS = (EQUAL_13, EQUAL_1234)
#: A user within its rate beside saturating borrowers (issue 33's third target; ``shares`` only).
IN_QUOTA = "in-quota"
WORKLOADS = (OVERLOAD, WEIGHTED, EQUAL_13, EQUAL_1234, SOLO, IN_QUOTA)
#: The workloads whose loads and guaranteed rates follow from C (the others need no C).
CAPACITY_WORKLOADS = (OVERLOAD, WEIGHTED, EQUAL_13, EQUAL_1234)
#: Two slot settings (``--slots``): few active slots on the tiny model, many on the bench model.
SLOT_SETTINGS = {"few": ("models/tiny-llama", 4), "many": ("models/bench-llama", ACTIVE_SEQS)}
#: The engine log names the plugin's scheduler class (vLLM warns about a custom scheduler class).
SCHEDULER_CLASSES = ("OutputRateAsyncScheduler", "OutputRateScheduler")
LIGHT = "light"
#: The solo load's second user in ``shares``: no entry of its own (the default rate, never hit).
UNLIMITED = "solo-unlimited"
#: The issue's target for one borrower alone: its tok/s >= 0.95 x an unlimited user's on the same server
#: (and the same load on stock vLLM).
TARGET_SOLO_RATIO = 0.95
#: The in-quota workload's users: ``carol`` (a hard cap, ``--in-quota-user-streams`` closed-loop streams) beside the
#: borrowers (``{rate, ceil: null}``, many closed-loop streams each); ``carol-unlimited``:
#: carol's load from a user with no entry of its own (the default rate, never hit).
IN_QUOTA_USER, IN_QUOTA_BORROWERS, IN_QUOTA_UNLIMITED = "carol", ("bob", "dave"), "carol-unlimited"
#: Issue 33: a user within its rate beside saturating borrowers gets >= 0.95 x its limit on the
#: engine's counter (or its unlimited solo rate, whichever is lower).
TARGET_IN_QUOTA_RATIO = 0.95
#: carol's hard cap by default: the issue's 100 tok/s on the tiny model; 50 on the bench model,
#: where one request gets one token per step and a full batch steps 70-90 times a second here.
IN_QUOTA_RATE_TINY, IN_QUOTA_RATE = 100.0, 50.0
#: The plugin's per-user series the in-quota workload reads besides the charged and borrowed tokens.
USER_REQUESTS = "vllm:output_rate_requests"  # labels user, state (active | throttled | waiting)
THROTTLED_SECONDS = "vllm:output_rate_throttled_seconds_total"
CALIBRATE_USER = "calibrate"
#: A stock server started only to measure C (no mode among those asked is stock).
CALIBRATE_ONLY = "stock-calibration"
GENERATED = "vllm:generation_tokens_total"
#: One sample per engine step (vLLM's histogram of tokens per step).
STEPS = "vllm:iteration_tokens_total_count"
#: The issue's target for the weighted workload: each share within 10 % of its weight share.
TARGET_SHARE_DEVIATION = 0.10
#: The issue's target for a user within its rate: first-token p50 with shares <= 1.2 x with hard caps.
TARGET_LIGHT_TTFT_RATIO = 1.2
LIGHT_PROMPT_TOKENS = 16
SERVER_FLAGS = ["--max-num-seqs", "16", "--max-num-active-seqs", str(ACTIVE_SEQS), "--max-model-len", "1024",
                "--enforce-eager", "--disable-uvicorn-access-log", "--enable-per-request-metrics"]
#: The issue's target for equal rates and weights 1:3: the weight-3 client's share of borrowed tokens, +-.
TARGET_BORROWED_SHARE_TOLERANCE = 0.05
NEVER_HIT = 100000.0
#: The options that shape the load: modes compared on one page must share them.
WORKLOAD_OPTIONS = ("duration", "window", "prompt_tokens", "max_tokens", "overload_load", "weighted_load",
                    "weighted_arrivals", "guaranteed", "light_interval", "light_max_tokens", "light_rate",
                    "max_outstanding", "stream_interval", "model", "active_seqs", "async_scheduling",
                    "equal_rate", "equal_rates_load", "equal_rates_in_flight")


def needs_capacity(args: argparse.Namespace) -> bool:
    """Whether a workload asked needs C (solo and in-quota do not)."""
    return any(name in CAPACITY_WORKLOADS for name in args.workload)


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items() if k in WORKLOAD_OPTIONS}


@dataclass(frozen=True)
class Client:
    user: str
    weight: float
    load: float  # offered output tok/s as a fraction of C
    #: requests in flight at most (an arrival beyond is skipped); None: ``--max-outstanding``
    in_flight_cap: int | None = None


def workloads(args: argparse.Namespace) -> dict[str, list[Client]]:
    a, b = args.overload_load
    weights = (1.0, 2.0, 3.0, 4.0)
    if args.weighted_arrivals == "weights":
        loads = [args.weighted_load * 4 * w / sum(weights) for w in weights]
    else:
        loads = [args.weighted_load] * 4
    return {
        OVERLOAD: [Client("A", 1.0, a), Client("B", 1.0, b)],
        WEIGHTED: [Client(f"W{int(w)}", w, load) for w, load in zip(weights, loads)],
        # Each offers --equal-rates-load (1.5 C: twice the largest weight share of the
        # spare capacity, E3's 0.75 C), at most --equal-rates-in-flight requests in
        # flight: every client backlogged for the whole run, the backlog bounded.
        EQUAL_13: [Client(f"E{int(w)}", w, args.equal_rates_load, args.equal_rates_in_flight) for w in (1.0, 3.0)],
        EQUAL_1234: [Client(f"Q{int(w)}", w, args.equal_rates_load, args.equal_rates_in_flight)
                     for w in weights],
    }


def cap(client: Client, args: argparse.Namespace) -> int:
    """The client's requests in flight at most."""
    return client.in_flight_cap if client.in_flight_cap is not None else args.max_outstanding


def guaranteed_rates(clients: list[Client], capacity: float, fraction: float,
                     equal_rate: float | None = None) -> dict[str, float]:
    """Each client's rate: ``fraction`` of C split by weight (two decimals), or
    ``equal_rate`` tok/s each (the equal-rate workloads)."""
    if equal_rate is not None:
        return {c.user: equal_rate for c in clients}
    total = sum(c.weight for c in clients)
    return {c.user: round(fraction * capacity * c.weight / total, 2) for c in clients}


def workload_rates(name: str, clients: list[Client], capacity: float, args) -> dict[str, float]:
    return guaranteed_rates(clients, capacity, args.guaranteed,
                            args.equal_rate if name in EQUAL_RATE_WORKLOADS else None)


def user_limits(mode: str, loads: dict[str, list[Client]], capacity: float, args) -> dict[str, Any] | None:
    """The per-user JSON of ``--user-output-tokens-per-second`` (None: stock)."""
    if mode == STOCK:
        return None
    borrower = args.in_quota_borrower_rate
    limits: dict[str, Any] = {LIGHT: args.light_rate,
                              SOLO: args.solo_rate if mode == HARD else {"rate": args.solo_rate, "ceil": None},
                              # in-quota: carol a hard cap; the borrowers without a ceiling (hard: capped)
                              IN_QUOTA_USER: args.in_quota_rate,
                              **{b: borrower if mode == HARD else {"rate": borrower, "ceil": None}
                                 for b in IN_QUOTA_BORROWERS}}
    for name, clients in loads.items():
        rates = workload_rates(name, clients, capacity, args)
        for c in clients:
            limits[c.user] = (rates[c.user] if mode == HARD
                              else {"rate": rates[c.user], "ceil": None, "weight": c.weight})
    return limits


def server_args(limits: dict[str, Any] | None, active_seqs: int = ACTIVE_SEQS,
                async_scheduling: str = "default") -> list[str]:
    flags = [*SERVER_FLAGS]
    flags[flags.index("--max-num-active-seqs") + 1] = str(active_seqs)
    if async_scheduling != "default":
        # vLLM's own flag; the CPU build turns async scheduling off whatever it says (see How).
        flags.append("--async-scheduling" if async_scheduling == "on" else "--no-async-scheduling")
    if limits is None:
        return flags
    return [*flags, "--default-user-output-tokens-per-second", f"{NEVER_HIT:g}",
            "--user-output-tokens-per-second", json.dumps(limits)]


def scheduler_class(log_text: str) -> str | None:
    """The plugin's scheduler class the engine ran, from its log (None: stock, or not logged)."""
    for name in SCHEDULER_CLASSES:
        if f"adapter.scheduler.{name}" in log_text:
            return name
    return None


def refused(limits: dict[str, Any] | None) -> str | None:
    """Why this build would refuse ``limits`` (None: accepted), checked in-process."""
    if limits is None:
        return None
    try:
        parse_cli(f"{NEVER_HIT:g}", json.dumps(limits))
    except OutputRateConfigError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


class Prompts:
    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, length: int) -> list[int]:
        # Ids 3.. avoid pad/bos/eos of the tiny Llama.
        return [self.rng.randrange(3, self.vocab) for _ in range(length)]


def body(model: str, user: str, max_tokens: int, prompt: list[int], stream_interval: int) -> dict[str, Any]:
    """The bench's streaming body; ``stream_interval`` > 1 sends that many tokens per chunk
    (the first token at once), which spares the client most of its per-chunk work."""
    request = measure.stream_body(model, user, max_tokens, prompt)
    if stream_interval > 1:
        request["stream_interval"] = stream_interval
    return request


def engine_reading(samples: measure.Samples) -> dict[str, Any]:
    """vLLM's generated tokens and the plugin's per-user counters from one ``/metrics`` read."""
    borrowed = sorted(name for name in samples if "borrow" in name and name.endswith("_total")
                      and any("user" in labels for labels, _ in samples[name]))
    reading = {"generated": measure.metric_sum(samples, GENERATED) or 0.0,
               "steps": measure.metric_sum(samples, STEPS) or 0.0,
               "charged": measure.per_label(samples, measure.CHARGED_TOKENS, "user"),
               # vLLM's own gauges: requests resident (running) and queued (waiting) in the engine
               **{key: measure.metric_sum(samples, name) for key, name in
                  (("running", measure.RUNNING_GAUGE), ("waiting", measure.WAITING_GAUGE))}}
    if borrowed:
        reading["borrowed"] = {}
        for name in borrowed:
            for user, value in measure.per_label(samples, name, "user").items():
                reading["borrowed"][user] = reading["borrowed"].get(user, 0.0) + value
        reading["borrowed_metrics"] = borrowed
    return reading


async def wait_drained(http, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = measure.gauges(await measure.fetch_metrics_async(http))
        if not g[measure.RUNNING_GAUGE] and not g[measure.WAITING_GAUGE]:
            return True
        await asyncio.sleep(0.5)
    return False


def closed_loop(http: Any, model: str, user: str, streams: int, prompts: Prompts, args,
                max_tokens: int | None = None, records: list[RequestRecord] | None = None,
                t0: float | None = None) -> list[asyncio.Task]:
    """``streams`` tasks that each send ``user``'s requests (``max_tokens`` output tokens,
    default ``--max-tokens``) one after another until cancelled; each request's record
    (times from ``t0``, default now) goes to ``records`` when given."""
    t0 = time.monotonic() if t0 is None else t0

    async def stream() -> None:
        while True:
            record = RequestRecord(user=user)
            if records is not None:
                records.append(record)
            request_body = body(model, user, max_tokens or args.max_tokens, prompts(args.prompt_tokens),
                                args.stream_interval)
            await run_request(http, request_body, record, t0)

    return [asyncio.create_task(stream()) for _ in range(streams)]


async def calibrate(base_url: str, model: str, prompts: Prompts, args) -> dict[str, Any]:
    """C: output tok/s of closed-loop streams of the workload's request shape."""
    async with benchkit.async_http(base_url, connections=args.calibrate_streams + 4) as http:
        tasks = closed_loop(http, model, CALIBRATE_USER, args.calibrate_streams, prompts, args)
        await asyncio.sleep(args.calibrate_warmup_s)
        before = engine_reading(await measure.fetch_metrics_async(http))
        began = time.monotonic()
        await asyncio.sleep(args.calibrate_s)
        after = engine_reading(await measure.fetch_metrics_async(http))
        elapsed = time.monotonic() - began
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_drained(http)
    tokens = after["generated"] - before["generated"]
    return {"tok_s": round(tokens / elapsed, 1), "tokens": tokens, "seconds": round(elapsed, 2),
            "streams": args.calibrate_streams, "load": loadavg()}


async def run_solo(base_url: str, model: str, prompts: Prompts, args, server_pid: int,
                   user: str = SOLO) -> dict[str, Any]:
    """One user alone: ``--solo-streams`` closed-loop streams for ``--solo-s`` seconds
    after a warm-up; its tok/s from vLLM's own counter (every token is the user's),
    and the CPU each server process used per engine step."""
    async with benchkit.async_http(base_url, connections=args.solo_streams + 4) as http:
        load_before = loadavg()
        tasks = closed_loop(http, model, user, args.solo_streams, prompts, args)
        await asyncio.sleep(args.calibrate_warmup_s)
        meter = benchkit.CpuMeter([server_pid])
        before = engine_reading(await measure.fetch_metrics_async(http))
        meter.start()
        began = time.monotonic()
        await asyncio.sleep(args.solo_s)
        after = engine_reading(await measure.fetch_metrics_async(http))
        elapsed = time.monotonic() - began
        cpu = meter.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        drained = await wait_drained(http)
    tokens = after["generated"] - before["generated"]
    charged = after["charged"].get(user, 0.0) - before["charged"].get(user, 0.0)
    borrowed = (after.get("borrowed") or {}).get(user, 0.0) - (before.get("borrowed") or {}).get(user, 0.0)
    return solo_figures({"tokens": tokens, "seconds": elapsed, "steps": after["steps"] - before["steps"],
                         "user_charged_tokens": charged, "user_borrowed_tokens": borrowed,
                         "cpu_s": cpu["servers"][0], "foreign_core_s": cpu["foreign"], "cpu_wall_s": cpu["wall_s"],
                         "streams": args.solo_streams, "rate": args.solo_rate,
                         "load_before": load_before, "load_after": loadavg(), "drained": drained})


def solo_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """A solo phase's (or several phases' pooled) figures from its counts."""
    steps = raw["steps"]
    return dict(raw, tok_s=round(raw["tokens"] / raw["seconds"], 1), seconds=round(raw["seconds"], 2),
                tokens_per_step=round(raw["tokens"] / steps, 2) if steps else None,
                engine_steps_per_s=round(steps / raw["seconds"], 1),
                cpu_ms_per_step={role: round(1000 * sec / max(steps, 1), 3) for role, sec in raw["cpu_s"].items()},
                cpu_foreign_cores=round(raw["foreign_core_s"] / raw["cpu_wall_s"], 2),
                clock="the client's monotonic clock between two /metrics reads")


def pooled_solo(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Several solo phases of one user as one: counts summed, figures from the sums."""
    if len(phases) == 1:
        return phases[0]
    summed = {key: sum(p[key] for p in phases) for key in
              ("tokens", "seconds", "steps", "user_charged_tokens", "user_borrowed_tokens", "foreign_core_s",
               "cpu_wall_s")}
    cpu_s = {role: sum(p["cpu_s"].get(role, 0.0) for p in phases) for role in phases[0]["cpu_s"]}
    return dict(solo_figures(dict(phases[0], **summed, cpu_s=cpu_s)), load_before=phases[0]["load_before"],
                load_after=phases[-1]["load_after"], drained=all(p["drained"] for p in phases),
                phases=len(phases))


def solo_rounds(run: Callable[[str], dict[str, Any]], rounds: int) -> tuple[dict, dict, list[dict]]:
    """The lone borrower and the unlimited user, ``rounds`` phases each on one server, in the
    order borrower-unlimited, then unlimited-borrower, and so on: a drift of the machine's
    speed over the run falls on both alike.  Both pooled, and each round's ratio."""
    borrower: list[dict[str, Any]] = []
    unlimited: list[dict[str, Any]] = []
    per_round = []
    for i in range(rounds):
        order = (SOLO, UNLIMITED) if i % 2 == 0 else (UNLIMITED, SOLO)
        got = {user: run(user) for user in order}
        borrower.append(got[SOLO])
        unlimited.append(got[UNLIMITED])
        per_round.append({"order": list(order), "borrower_tok_s": got[SOLO]["tok_s"],
                          "unlimited_tok_s": got[UNLIMITED]["tok_s"],
                          "ratio": round(got[SOLO]["tok_s"] / got[UNLIMITED]["tok_s"], 3)
                          if got[UNLIMITED]["tok_s"] else None})
    return pooled_solo(borrower), pooled_solo(unlimited), per_round


def in_quota_reading(samples: measure.Samples) -> dict[str, Any]:
    """:func:`engine_reading` plus each user's throttled seconds and requests by state
    (``active``: sampled in the engine's last reported step; ``throttled``: resident and
    held for quota in it; ``waiting``: queued in the engine, no slot yet)."""
    reading = engine_reading(samples)
    reading["throttled_s"] = measure.per_label(samples, THROTTLED_SECONDS, "user")
    requests: dict[str, dict[str, float]] = {}
    for labels, value in samples.get(USER_REQUESTS, []):
        if "user" in labels and "state" in labels:
            requests.setdefault(labels["user"], {})[labels["state"]] = value
    reading["requests"] = requests
    return reading


#: The in-quota workload's phases, in order: carol's load from a user with no limit, carol
#: (hard cap) alone, carol beside the borrowers.
IN_QUOTA_PHASES = ("unlimited", "alone", "beside")


def _streams_process_main(base_url: str, model: str, user: str, n: int, max_tokens: int, prompt_tokens: int,
                          stream_interval: int, seed: int, vocab: int, t0: float, conn: Any) -> None:
    """A child process's own event loop: ``n`` closed-loop streams of ``user`` until the parent
    sends on ``conn``; then the records go back over it (times from ``t0``: ``time.monotonic()``
    is one clock for every process of the machine).  In a session of its own, apart from the
    driver's too, at the clients' raised priority (why: :func:`benchkit.in_own_session`)."""
    import os

    os.setsid()
    benchkit.raise_client_priority()

    async def run() -> list[RequestRecord]:
        shape = argparse.Namespace(max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                                   stream_interval=stream_interval)
        records: list[RequestRecord] = []
        async with benchkit.async_http(base_url, connections=n + 2) as http:
            tasks = closed_loop(http, model, user, n, Prompts(seed, vocab), shape, max_tokens, records, t0)
            await asyncio.to_thread(conn.recv)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return records

    conn.send([record.to_dict() for record in asyncio.run(run())])


class StreamsProcess:
    """One user's closed-loop streams driven from a process (and session) of their own.

    Driven from the benchmark's process in its caller's shell session, the in-quota user's
    requests spent a median ~1.4 s each between the engine's last token and her client's end of
    stream while the client process was not running; those gaps came out of her rate though
    neither the engine nor the API server held her."""

    def __init__(self, base_url: str, model: str, user: str, n: int, max_tokens: int, args,
                 seed: int, vocab: int, t0: float) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_streams_process_main, daemon=True,
                                 args=(base_url, model, user, n, max_tokens, args.prompt_tokens,
                                       args.stream_interval, seed, vocab, t0, child))
        self._proc.start()

    async def stop(self) -> list[RequestRecord]:
        """Cancel the streams; their records (the cancelled ones included)."""
        self._conn.send("stop")
        data = await asyncio.to_thread(self._conn.recv)
        await asyncio.to_thread(self._proc.join, 30)
        return [RequestRecord.from_dict(d) for d in data]


async def run_in_quota(base_url: str, model: str, prompts: Prompts, args) -> dict[str, Any]:
    """Issue 33's user within its rate beside saturating borrowers, on one server, in three
    phases (:data:`IN_QUOTA_PHASES`), each ``--in-quota-warmup-s`` then ``--in-quota-s``
    measured: ``unlimited``: ``--in-quota-user-streams`` closed-loop streams of
    ``--in-quota-max-tokens`` requests from a user with no entry of its own (what they reach);
    ``alone``: the same streams from ``carol`` (hard cap ``--in-quota-rate``, shared by her
    streams); ``beside``: carol's streams go on, and
    each of ``--in-quota-borrowers`` borrowers keeps ``--in-quota-streams`` closed-loop
    streams.  ``/metrics`` is read all along by a thread of its own; each phase's measured
    span is on the same clock (seconds since the start)."""
    borrowers = IN_QUOTA_BORROWERS[:args.in_quota_borrowers]
    records: list[RequestRecord] = []
    spans: dict[str, tuple[float, float]] = {}
    drained: dict[str, bool] = {}
    lag: list[float] = []
    connections = args.in_quota_user_streams + args.in_quota_streams * len(borrowers) + 8

    async def stop(tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async with benchkit.async_http(base_url, connections=connections) as http, \
            benchkit.async_http(base_url, connections=2) as probe:
        t0 = time.monotonic()

        def streams(user: str, n: int, max_tokens: int) -> list[asyncio.Task]:
            return closed_loop(http, model, user, n, prompts, args, max_tokens, records, t0)

        def own_process(user: str, seed: int) -> StreamsProcess:
            # The measured user's streams: a process and event loop of their own.
            return StreamsProcess(base_url, model, user, args.in_quota_user_streams, args.in_quota_max_tokens,
                                  args, seed, prompts.vocab, t0)

        async def measured(phase: str) -> None:
            await asyncio.sleep(args.in_quota_warmup_s)
            began = time.monotonic() - t0
            await asyncio.sleep(args.in_quota_s)
            spans[phase] = (began, time.monotonic() - t0)
            print(f"  in-quota: {phase} measured from {began:.1f} s to {spans[phase][1]:.1f} s", flush=True)

        poller = benchkit.MetricsPoller(base_url, args.metrics_interval, in_quota_reading, t0)
        poller.start()
        watcher = asyncio.create_task(measure.watch_loop_lag(lag))
        load = {"unlimited": loadavg()}
        unlimited = own_process(IN_QUOTA_UNLIMITED, args.seed + 1)
        await measured("unlimited")
        records.extend(await unlimited.stop())
        drained["unlimited"] = await wait_drained(probe)
        load["alone"] = loadavg()
        carol = own_process(IN_QUOTA_USER, args.seed + 2)
        await measured("alone")
        load["beside"] = loadavg()
        heavy = [task for b in borrowers for task in streams(b, args.in_quota_streams, args.in_quota_borrower_max_tokens)]
        await measured("beside")
        readings = await asyncio.to_thread(poller.stop)
        await stop(heavy)
        records.extend(await carol.stop())
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        drained["beside"] = await wait_drained(probe)
    return {"readings": readings, "spans": spans, "records": records, "loop_lag": lag, "drained": drained,
            "failed_reads": poller.failed_reads, "load_at_phase_start": load}


async def run_workload(base_url: str, model: str, clients: list[Client], capacity: float,
                       prompts: Prompts, args) -> dict[str, Any]:
    """Drive one workload for ``--duration`` s; the records and ``/metrics`` readings."""
    records: list[RequestRecord] = []
    skipped = {c.user: 0 for c in clients}
    in_flight = {c.user: 0 for c in clients} | {LIGHT: 0}
    peak = dict(in_flight)
    tasks: set[asyncio.Task] = set()
    lag: list[float] = []
    late: list[float] = []  # seconds each arrival was sent behind its planned time
    connections = sum(cap(c, args) for c in clients) + 64
    async with benchkit.async_http(base_url, connections=connections) as http, \
            benchkit.async_http(base_url, connections=2) as probe:
        t0 = time.monotonic()
        poller = benchkit.MetricsPoller(base_url, args.metrics_interval, engine_reading, t0)

        async def request(user: str, prompt_len: int, max_tokens: int, stream_interval: int) -> None:
            record = RequestRecord(user=user)
            records.append(record)
            in_flight[user] += 1
            peak[user] = max(peak[user], in_flight[user])
            try:
                await run_request(http, body(model, user, max_tokens, prompts(prompt_len), stream_interval), record, t0)
            finally:
                in_flight[user] -= 1

        async def sender(user: str, interval: float, phase: float, prompt_len: int, max_tokens: int,
                         cap: int | None, stream_interval: int) -> None:
            k = 0
            while (at := (k + phase) * interval) < args.duration:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                late.append(time.monotonic() - t0 - at)
                if cap is not None and in_flight[user] >= cap:
                    skipped[user] += 1
                else:
                    task = asyncio.create_task(request(user, prompt_len, max_tokens, stream_interval))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                k += 1

        poller.start()
        watcher = asyncio.create_task(measure.watch_loop_lag(lag))
        senders = [asyncio.create_task(sender(
            c.user, args.max_tokens / (c.load * capacity), (i + 1) / (len(clients) + 1),
            args.prompt_tokens, args.max_tokens, cap(c, args), args.stream_interval))
            for i, c in enumerate(clients)]
        senders.append(asyncio.create_task(sender(
            LIGHT, args.light_interval, 0.5, LIGHT_PROMPT_TOKENS, args.light_max_tokens, None, 1)))
        await asyncio.gather(*senders)
        await asyncio.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        readings = await asyncio.to_thread(poller.stop)
        cancelled_in_flight = dict(in_flight)
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        drained = await wait_drained(probe)
    return {"records": records, "readings": readings, "skipped": skipped, "loop_lag": lag, "send_late": late,
            "in_flight_at_end": cancelled_in_flight, "peak_in_flight": peak, "drained": drained}


# --------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------


def counter_series(readings: list[tuple[float, dict[str, Any]]], key: str) -> list[tuple[float, dict[str, float]]]:
    return [(t, dict(r.get(key) or {})) for t, r in readings]


def summed(a: list[tuple[float, dict[str, float]]], b: list[tuple[float, dict[str, float]]]):
    return [(t, {u: x.get(u, 0.0) + y.get(u, 0.0) for u in {*x, *y}}) for (t, x), (_, y) in zip(a, b)]


def client_windows(records: list[RequestRecord], users: list[str], bin_s: float, n: int) -> dict[str, list[float]]:
    """Tokens received per bin of ``bin_s`` from t = 0, the first ``n`` bins."""
    rates = analysis.rate_series([r for r in records if r.user in users], bin_s=bin_s, end_s=n * bin_s)
    return {u: [x * bin_s for x in rates.get(u, [0.0] * n)[:n]] for u in users}


def engine_service(readings, users: list[str], client_totals: dict[str, float], window_s: float,
                   n: int, max_skew_s: float) -> tuple[dict[str, list[float | None]], list[str], dict[str, float]]:
    """Per-user tokens per window from the engine's counters (None: no reading within
    ``max_skew_s`` of an edge), the counters used, and their totals from the first to
    the last reading (see the module docstring for the choice)."""
    charged = counter_series(readings, "charged")
    options = [(["charged"], charged)]
    if any("borrowed" in r for _, r in readings):
        options.append((["charged", "borrowed"], summed(charged, counter_series(readings, "borrowed"))))
    best = None
    for names, series in options:
        first, last = series[0][1], series[-1][1]
        totals = {u: last.get(u, 0.0) - first.get(u, 0.0) for u in users}
        miss = sum(abs(totals[u] - client_totals[u]) for u in users)
        if best is None or miss < best[0]:
            best = (miss, names, series, totals)
    _, names, series, totals = best
    windows = analysis.counter_windows(series, window_s, n, max_skew_s)
    counters = [measure.CHARGED_TOKENS] + (
        sorted({m for _, r in readings for m in r.get("borrowed_metrics", [])}) if "borrowed" in names else [])
    return {u: windows.get(u, [0.0] * n) for u in users}, counters, totals


def rounded(values: list[float | None], scale: float = 1.0) -> list[float | None]:
    return [None if x is None else round(x / scale, 1) for x in values]


def measured_mean(values: list[float | None], window_s: float) -> float | None:
    """tok/s over the measured windows."""
    known = [x for x in values if x is not None]
    return round(sum(known) / (window_s * len(known)), 1) if known else None


#: How stock vLLM's per-user service is counted (it has no per-user counter).
SPAN_SOURCE = ("request spans: each request's tokens spread over its first-to-last token span as the "
               "engine stamped it (per-request metrics), placed at send time + the engine's queue and "
               "first-token time; requests cut at the end: their first and last receive times")


def request_spans(records: list[RequestRecord], users: list[str]) -> tuple[list[tuple[str, float, float, float]], int]:
    """``(user, begin, end, tokens)`` per request with tokens, and how many were engine-stamped.

    A request that finished carries the engine's own timing (``--enable-per-request-metrics``):
    its first token at send + queue + first-token time, its last one generation time later,
    so a stalled client does not move its tokens.  A request cut at the end has none: its
    first and last receive times stand in.
    """
    spans, stamped = [], 0
    for r in records:
        if r.user not in users or not r.n_tokens:
            continue
        if r.server_first_token_s is not None and r.server_generation_s is not None:
            begin = r.start + r.server_first_token_s
            spans.append((r.user, begin, begin + r.server_generation_s, float(r.n_tokens)))
            stamped += 1
        else:
            spans.append((r.user, r.token_times[0], r.token_times[-1], float(r.n_tokens)))
    return spans, stamped


def spread(spans, users: list[str], bin_s: float, n: int) -> dict[str, list[float]]:
    per_user = analysis.spread_service(spans, bin_s, n)
    return {u: per_user.get(u, [0.0] * n) for u in users}


def light_summary(records: list[RequestRecord], duration: float, interval: float) -> dict[str, Any]:
    """The light user's requests sent at least one interval before the end (the
    last one is cancelled at the end, maybe before its first token).

    ``ttft_*``: the engine's own stamps of the requests that finished (queued in
    the engine to first token; a stalled client cannot stretch them);
    ``client_ttft_*``: send to first token received, on the client's clock.
    """
    light = [r for r in records if r.user == LIGHT and r.start <= duration - interval]
    client = [x for x in (analysis.time_to_first_token(r) for r in light) if x is not None]
    engine = [r.server_first_token_s for r in light if r.server_first_token_s is not None]
    return {
        "requests": len(light),
        "with_first_token": len(client),
        "engine_stamped": len(engine),
        "ttft_p50_s": percentile(engine, 50),
        "ttft_p90_s": percentile(engine, 90),
        "ttft_max_s": max(engine) if engine else None,
        "client_ttft_p50_s": percentile(client, 50),
        "client_ttft_p90_s": percentile(client, 90),
        "tokens": sum(r.n_tokens for r in light),
    }


def share_target(name: str) -> dict[str, Any]:
    """The issue's target for a workload's shares of borrowed tokens: weights 1:3 each
    share within 0.05 of its weight share (E3 0.75 +- 0.05), otherwise each within
    10 % of its weight share."""
    if name == EQUAL_13:
        return {"kind": "absolute", "tolerance": TARGET_BORROWED_SHARE_TOLERANCE}
    return {"kind": "relative", "tolerance": TARGET_SHARE_DEVIATION}


def _deviation(share: float, weight_share: float, kind: str) -> float:
    return abs(share - weight_share) if kind == "absolute" else abs(share / weight_share - 1)


def borrowed_shares(readings, clients: list[Client], window_s: float, n: int, max_skew: float,
                    name: str = WEIGHTED) -> dict[str, Any]:
    """Each client's share of the borrowed tokens (the engine's borrowed-token
    counter) over the run (first to last ``/metrics`` read), over the windows
    after the first and per window, against its weight share and the issue's
    target (:func:`share_target`; the equal-rate workloads' figure: only the
    weights split what is borrowed).  A window is counted when both its edges
    had a read within ``max_skew`` and someone borrowed in it; a client absent
    from the counter borrowed 0."""
    users = [c.user for c in clients]
    weight_total = sum(c.weight for c in clients)
    weight_share = {c.user: c.weight / weight_total for c in clients}
    target = share_target(name)
    kind, tolerance = target["kind"], target["tolerance"]
    series = counter_series(readings, "borrowed")
    windows = analysis.counter_windows(series, window_s, n, max_skew)
    # counter_windows gives None to every key alike when an edge had no read.
    measured = [bool(windows) and all(v[k] is not None for v in windows.values()) for k in range(n)]
    per_window: dict[str, list[float | None]] = {u: [] for u in users}
    window_deviation: list[float | None] = []
    relative: list[float] = []
    for k in range(n):
        got = {u: (windows.get(u) or [0.0] * n)[k] or 0.0 for u in users}
        total = sum(got.values())
        if not measured[k] or total <= 0:
            for u in users:
                per_window[u].append(None)
            window_deviation.append(None)
            continue
        for u in users:
            per_window[u].append(round(got[u] / total, 3))
        window_deviation.append(round(max(_deviation(got[u] / total, weight_share[u], kind) for u in users), 3))
        if k > 0:
            relative += [abs(got[u] / total / weight_share[u] - 1) for u in users]
    after = {u: sum(v for v in (windows.get(u) or [])[1:] if v is not None) for u in users}
    total_after = sum(after.values())
    # Over the run: from the first read to the read nearest to the end of the load
    # (n windows), not the last read, which comes after the senders stopped: the
    # clients' backlogs drain then, the heavier client's first, and the rest of the
    # borrowed tokens go to whoever still has requests.
    end_s = n * window_s
    i_end = min(range(len(series)), key=lambda i: abs(series[i][0] - end_s)) if series else None
    first, last = (series[0][1], series[i_end][1]) if series else ({}, {})
    run = {u: last.get(u, 0.0) - first.get(u, 0.0) for u in users}
    total_run = sum(run.values())
    over_run = {u: round(run[u] / total_run, 3) if total_run else None for u in users}
    counted = [d for d in window_deviation[1:] if d is not None]
    run_deviation = (None if not total_run
                     else round(max(_deviation(run[u] / total_run, weight_share[u], kind) for u in users), 3))
    return {
        "target": target,
        "weight_share": {u: round(weight_share[u], 3) for u in users},
        "over_run": over_run,
        "borrowed_tokens_over_run": {u: round(v) for u, v in run.items()},
        "run_span_s": [round(series[0][0], 2), round(series[i_end][0], 2)] if series else None,
        # how far the end read was from the end of the load (a stalled API server answers late)
        "run_end_skew_s": round(abs(series[i_end][0] - end_s), 2) if series else None,
        # the counter as read: [seconds since the start, {user: borrowed tokens}], to recompute any figure
        "readings": [[round(t, 2), {u: v.get(u, 0.0) for u in users}] for t, v in series],
        "run_deviation": run_deviation,
        "met_over_run": None if run_deviation is None else run_deviation <= tolerance,
        "after_first_window": {u: round(after[u] / total_after, 3) if total_after else None for u in users},
        "borrowed_tokens_after_first_window": {u: round(v) for u, v in after.items()},
        "per_window": per_window,
        "window_deviation": window_deviation,
        "windows_counted": len(counted),
        "windows_not_counted": n - 1 - len(counted),
        "worst_window_deviation": max(counted) if counted else None,
        "windows_missed": sum(1 for d in counted if d > tolerance),
        "met_every_window": (None if not counted else
                             all(d <= tolerance for d in counted) and len(counted) == n - 1),
        # |share / weight share - 1|, the largest in a counted window after the first
        "max_share_deviation": round(max(relative), 3) if relative else None,
    }


def analyse(raw: dict[str, Any], clients: list[Client], mode: str, capacity: float, args,
            name: str = WEIGHTED) -> dict[str, Any]:
    w, duration = args.window, args.duration
    n = int(round(duration / w))
    users = [c.user for c in clients]
    records, readings = raw["records"], raw["readings"]
    client_service = client_windows(records, users, w, n)
    client_totals = {u: sum(client_service[u]) for u in users}
    spans, stamped = request_spans(records, users)
    span_service = spread(spans, users, w, n)
    if mode == STOCK:
        service, source, counters = span_service, "engine-stamped request spans", []
        engine_totals = None
    else:
        service, counters, engine_totals = engine_service(readings, users, client_totals, w, n, args.max_skew)
        source = "engine counters"
    backlogged = {c.user: [analysis.covers([(r.start, r.end if r.end is not None else duration)
                                            for r in records if r.user == c.user], k * w, (k + 1) * w)
                           for k in range(n)] for c in clients}
    fairness = analysis.service_difference(service, {c.user: c.weight for c in clients}, backlogged)
    generated = analysis.counter_windows([(t, {"all": r["generated"]}) for t, r in readings], w, n,
                                         args.max_skew).get("all", [None] * n)
    (t_first, first), (t_last, last) = readings[0], readings[-1]
    bin_s = args.plot_bin
    n_bins = int(round(duration / bin_s))
    if mode == STOCK:
        plot_series = spread(spans, users, bin_s, n_bins)
    else:
        plot_series = engine_service(readings, users, client_totals, bin_s, n_bins, args.max_skew)[0]
    by_status: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in records:
        by_status[r.status] = by_status.get(r.status, 0) + 1
        if r.error and r.status in measure.ERROR_STATUSES:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    rates = workload_rates(name, clients, capacity, args)
    per_user = {}
    for c in clients:
        per_user[c.user] = {
            "weight": c.weight,
            "offered_tok_s": round(c.load * capacity, 1),
            "offered_req_s": round(c.load * capacity / args.max_tokens, 3),
            "guaranteed_tok_s": None if mode == STOCK else rates[c.user],
            "ceil": None if mode == STOCK else (rates[c.user] if mode == HARD else "none"),
            "tok_s_after_first_window": measured_mean(service[c.user][1:], w),
            "of_guaranteed": None if mode == STOCK or not measured_mean(service[c.user][1:], w) else round(
                measured_mean(service[c.user][1:], w) / rates[c.user], 3),
            "requests_sent": sum(1 for r in records if r.user == c.user),
            "arrivals_skipped": raw["skipped"][c.user],
            "in_flight_cap": cap(c, args),
            "peak_in_flight": (raw.get("peak_in_flight") or {}).get(c.user),
            "backlogged_windows": sum(backlogged[c.user]),
            "client_tokens": client_totals[c.user],
            "engine_tokens": None if engine_totals is None else engine_totals[c.user],
        }
    return {
        "window_s": w,
        "service_source": source,
        "service_source_detail": SPAN_SOURCE if mode == STOCK else "the engine's per-user counters on /metrics",
        "service_counters": counters,
        "service": {u: rounded(service[u]) for u in users},
        "span_service": {u: [round(x, 1) for x in span_service[u]] for u in users},
        "requests_server_stamped": stamped,
        "client_receive_service": {u: [round(x, 1) for x in client_service[u]] for u in users},
        "backlogged": backlogged,
        "fairness": fairness,
        # vLLM's own counter from the first to the last reading (about 0 to the end).
        "throughput_tok_s": round((last["generated"] - first["generated"]) / (t_last - t_first), 1),
        "throughput_span_s": [round(t_first, 2), round(t_last, 2)],
        "engine_steps_per_s": round((last.get("steps", 0.0) - first.get("steps", 0.0)) / (t_last - t_first), 1),
        # Below ACTIVE_SEQS the engine had idle slots: nobody was backlogged at the engine.
        "tokens_per_step": _per_step(first, last),
        "throughput_tok_s_after_first_window": measured_mean(generated[1:], w),
        "generated_per_window": rounded(generated),
        "windows_measured": sum(1 for x in generated if x is not None),
        "users": per_user,
        "light": light_summary(records, duration, args.light_interval),
        "requests_by_status": by_status,
        "errors": errors,
        "in_flight_at_end": raw["in_flight_at_end"],
        "drained": raw["drained"],
        "metrics_reads": len(readings),
        **analysis.loop_lag_summary(raw["loop_lag"]),
        "send_late_p50_s": percentile(raw["send_late"], 50),
        "send_late_max_s": max(raw["send_late"], default=None),
        "plot_bin_s": bin_s,
        "plot_series": {u: rounded(plot_series[u], bin_s) for u in users},
        "active_seqs": args.active_seqs,
        # vLLM's gauges over the /metrics reads within the run: were requests queued at the engine?
        "engine_requests": {key: _gauge_summary([r.get(key) for t, r in readings if t <= duration])
                            for key in ("running", "waiting")},
        **({"borrowed_shares": borrowed_shares(readings, clients, w, n, args.max_skew, name)}
           if mode == SHARES and any(r.get("borrowed") for _, r in readings) else {}),
    }


def _fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t, value)`` points (None: fewer than two times)."""
    if len(points) < 2:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return None if var <= 0 else sum((t - mt) * (v - mv) for t, v in points) / var


def _requests_in_span(records: list[RequestRecord], user: str, span: tuple[float, float]) -> dict[str, Any]:
    """The user's requests sent and finished within ``span``: how many, and the engine's own
    stamps (queued to first token; first to last token) against the client's send-to-end time."""
    mine = [r for r in records if r.user == user and r.status == measure.FINISHED and r.end is not None
            and span[0] <= r.start and r.end <= span[1]]
    stamped = [r for r in mine if r.server_first_token_s is not None and r.server_generation_s is not None]
    first = [r.server_first_token_s for r in stamped]
    generation = [r.server_generation_s for r in stamped]
    outside = [(r.end - r.start) - r.server_first_token_s - r.server_generation_s for r in stamped]
    seconds = span[1] - span[0]
    return {
        "finished": len(mine),
        "engine_stamped": len(stamped),
        "tokens": sum(r.n_tokens for r in mine),
        "first_token_p50_s": percentile(first, 50),
        "first_token_max_s": max(first, default=None),
        "generation_p50_s": percentile(generation, 50),
        "generation_max_s": max(generation, default=None),
        # send to end on the client's clock, less the engine's queue-to-last-token span:
        # the API server's and the client's part, when no request of this stream was in the engine
        "outside_engine_p50_s": percentile(outside, 50),
        "outside_engine_total_s": round(sum(outside), 2),
        # shares of the span spent, summed over these requests, queued to first token / first to last token
        "first_token_share": round(sum(first) / seconds, 3) if seconds > 0 else None,
        "generation_share": round(sum(generation) / seconds, 3) if seconds > 0 else None,
        # the stream's tok/s while one of these requests was in the engine (queued to last token)
        "tok_s_in_engine": (round(sum(r.n_tokens for r in stamped) / (sum(first) + sum(generation)), 1)
                            if stamped and sum(first) + sum(generation) > 0 else None),
    }


def in_quota_phase(readings, span: tuple[float, float], users: list[str], records: list[RequestRecord],
                   limits: dict[str, Any]) -> dict[str, Any]:
    """One phase: each user's tok/s on the engine's charged counter from the first to the last
    ``/metrics`` read within ``span`` (poller stamps: when each answer was in), its borrowed
    tokens and throttled seconds over the same reads, a least-squares slope of the counter over
    every read of the span (a cross-check: the plugin reports about once a second, so either
    edge may be up to a second stale), its requests by state over the reads, and its requests'
    engine stamps."""
    inside = [(t, r) for t, r in readings if span[0] <= t <= span[1]]
    phase: dict[str, Any] = {"span_s": [round(span[0], 2), round(span[1], 2)], "reads": len(inside)}
    if len(inside) < 2:
        return phase
    (t_a, a), (t_b, b) = inside[0], inside[-1]
    seconds = t_b - t_a

    def growth(key: str, user: str) -> float:
        return (b.get(key) or {}).get(user, 0.0) - (a.get(key) or {}).get(user, 0.0)

    per_user = {}
    for user in users:
        states = [(r.get("requests") or {}).get(user) or {} for _, r in inside]
        slope = _fit_slope([(t, (r.get("charged") or {}).get(user, 0.0)) for t, r in inside])
        per_user[user] = {
            "limit": limits.get(user),
            "tok_s": round(growth("charged", user) / seconds, 1),
            "charged_tokens": growth("charged", user),
            "borrowed_tokens": growth("borrowed", user),
            "throttled_s": round(growth("throttled_s", user), 2),
            "tok_s_fit": None if slope is None else round(slope, 1),
            # mean over the reads of the plugin's per-user gauge (the last reported step)
            "requests_mean": {state: round(sum(x.get(state, 0.0) for x in states) / len(states), 2)
                              for state in ("active", "throttled", "waiting")},
            "reads_with_no_request": sum(1 for x in states if not sum(x.values())),
            "client_requests": _requests_in_span(records, user, span),
        }
    return {
        **phase,
        "read_span_s": [round(t_a, 2), round(t_b, 2)],
        "seconds": round(seconds, 2),
        "generated_tok_s": round((b["generated"] - a["generated"]) / seconds, 1),
        "tokens_per_step": _per_step(a, b),
        "engine_steps_per_s": round((b.get("steps", 0.0) - a.get("steps", 0.0)) / seconds, 1),
        "engine_requests": {key: _gauge_summary([r.get(key) for _, r in inside]) for key in ("running", "waiting")},
        "users": per_user,
    }


def in_quota_options(args) -> dict[str, Any]:
    """What shapes the in-quota load: runs kept together (``--in-quota-append``) share it."""
    return {"model": args.model, "active_seqs": args.active_seqs, "rate": args.in_quota_rate,
            "borrower_rate": args.in_quota_borrower_rate, "borrowers": args.in_quota_borrowers,
            "borrower_streams": args.in_quota_streams, "max_tokens": args.in_quota_max_tokens,
            "borrower_max_tokens": args.in_quota_borrower_max_tokens, "prompt_tokens": args.prompt_tokens,
            "stream_interval": args.stream_interval, "measured_s": args.in_quota_s,
            "warmup_s": args.in_quota_warmup_s, "streams": args.in_quota_user_streams}


def analyse_in_quota(raw: dict[str, Any], args) -> dict[str, Any]:
    """One run of the in-quota workload: each phase's figures and the issue's ratio, carol's
    tok/s beside the borrowers / min(its limit, its tok/s alone) (and, beside it, against
    min(limit, the unlimited stream's tok/s): the issue's wording)."""
    borrowers = list(IN_QUOTA_BORROWERS[:args.in_quota_borrowers])
    limits = {IN_QUOTA_USER: args.in_quota_rate, IN_QUOTA_UNLIMITED: None,
              **{b: {"rate": args.in_quota_borrower_rate, "ceil": None} for b in borrowers}}
    users = {"unlimited": [IN_QUOTA_UNLIMITED], "alone": [IN_QUOTA_USER], "beside": [IN_QUOTA_USER, *borrowers]}
    phases = {name: in_quota_phase(raw["readings"], raw["spans"][name], users[name], raw["records"], limits)
              for name in IN_QUOTA_PHASES if name in raw["spans"]}

    def carol(name: str, user: str = IN_QUOTA_USER) -> float | None:
        return ((phases.get(name) or {}).get("users") or {}).get(user, {}).get("tok_s")

    tok_s = {"unlimited": carol("unlimited", IN_QUOTA_UNLIMITED), "alone": carol("alone"),
             "beside": carol("beside")}
    reference = None if tok_s["alone"] is None else min(args.in_quota_rate, tok_s["alone"])
    ratio = None if not reference or tok_s["beside"] is None else round(tok_s["beside"] / reference, 3)
    solo_ref = None if tok_s["unlimited"] is None else min(args.in_quota_rate, tok_s["unlimited"])
    by_status: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in raw["records"]:
        by_status[r.status] = by_status.get(r.status, 0) + 1
        if r.error and r.status in measure.ERROR_STATUSES:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "carol_tok_s": tok_s,
        "reference_tok_s": reference,
        "ratio": ratio,
        "met": None if ratio is None else ratio >= TARGET_IN_QUOTA_RATIO,
        "ratio_to_limit_or_unlimited_solo": (None if not solo_ref or tok_s["beside"] is None
                                             else round(tok_s["beside"] / solo_ref, 3)),
        "phases": phases,
        "requests_by_status": by_status,
        "errors": errors,
        "metrics_reads": len(raw["readings"]),
        "failed_metrics_reads": raw["failed_reads"],
        "drained": raw["drained"],
        "load_at_phase_start": raw["load_at_phase_start"],
        **analysis.loop_lag_summary(raw["loop_lag"]),
        "clock": "the poller's stamps (the client's monotonic clock when each /metrics answer was in), "
                 "first to last read within each phase",
    }


def in_quota_summary(runs: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
    """The workload's entry: its options, every run, and the ratio over the runs."""
    ratios = [r["ratio"] for r in runs if r.get("ratio") is not None]
    return {
        "options": options,
        "target_ratio": TARGET_IN_QUOTA_RATIO,
        "runs": runs,
        "n_runs": len(runs),
        "ratios": ratios,
        "ratio_min": min(ratios, default=None),
        "ratio_mean": round(sum(ratios) / len(ratios), 3) if ratios else None,
        "met_every_run": (None if not ratios else
                          all(x >= TARGET_IN_QUOTA_RATIO for x in ratios) and len(ratios) == len(runs)),
    }


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------


async def served(base_url: str) -> str:
    async with benchkit.async_http(base_url, connections=2) as http:
        return (await http.get("/v1/models")).json()["data"][0]["id"]


def code_state() -> dict[str, Any]:
    """The commit and the uncommitted changes under src/ the server runs (an editable
    install runs the working tree)."""
    import subprocess

    def git(*argv: str) -> str | None:
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=30,
                                  cwd=Path(__file__).resolve().parents[1]).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--short", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_changes": [x.strip() for x in (status or "").splitlines()]}


def run_mode(mode: str, args, doc: dict[str, Any], loads: dict[str, list[Client]], prompts: Prompts,
             log_dir: Path) -> dict[str, Any]:
    """One server for ``mode``: C first when nobody measured it yet (stock only),
    then each workload."""
    result: dict[str, Any] = {"status": "ran", "load_before": loadavg(), "workload_config": workload_config(args),
                              "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "code": code_state(), "client_priority": runkit.client_priority}
    print(f"[{mode}] code: {result['code']}", flush=True)
    began = time.monotonic()
    capacity = doc["capacity"]["tok_s"] if doc.get("capacity") else None
    if capacity is None and needs_capacity(args) and mode not in (STOCK, CALIBRATE_ONLY):
        raise RuntimeError("C must be measured on a stock server first")
    # Without C (only solo and in-quota asked) the VTC workloads' clients get no entry.
    limits = None if mode == CALIBRATE_ONLY else user_limits(mode, loads if capacity else {}, capacity, args)
    result["server_args"] = server_args(limits, args.active_seqs, args.async_scheduling)
    print(f"[{mode}] starting server: {shlex.join(result['server_args'])}", flush=True)
    with benchkit.running_engines([(f"fair-share-{mode}", result["server_args"])], log_dir,
                                  model=args.model) as (server,):
        result["startup_s"] = server.startup_s
        model = asyncio.run(served(server.base_url))
        if capacity is None and (needs_capacity(args) or mode == CALIBRATE_ONLY):
            print(f"[{mode}] measuring C: {args.calibrate_streams} streams for {args.calibrate_s:g} s",
                  flush=True)
            doc["capacity"] = dict(asyncio.run(calibrate(server.base_url, model, prompts, args)),
                                   measured_in_mode=mode)
            capacity = doc["capacity"]["tok_s"]
            print(f"[{mode}] C = {capacity:g} tok/s", flush=True)
        if mode == CALIBRATE_ONLY:
            return result
        result["workloads"] = {}
        if SOLO in args.workload:
            print(f"[{mode}] solo: {args.solo_streams} closed-loop streams of one user "
                  f"({'no limit' if mode == STOCK else f'rate {args.solo_rate:g}'}"
                  f"{', no ceiling' if mode == SHARES else ''}) for {args.solo_s:g} s", flush=True)
            if mode == SHARES:
                # Issue 33's comparison: the lone borrower against an unlimited user on the
                # same server (no entry of its own: the default rate, never hit).
                print(f"[{mode}] solo: beside it, the same streams of a user with no limit of its own "
                      f"(default {NEVER_HIT:g} tok/s) on the same server, {args.solo_rounds} rounds",
                      flush=True)
                solo, unlimited, per_round = solo_rounds(
                    lambda user: asyncio.run(run_solo(server.base_url, model, prompts, args, server.pid, user)),
                    args.solo_rounds)
                solo.update(unlimited_same_server=unlimited, rounds=per_round,
                            ratio_to_unlimited=(round(solo["tok_s"] / unlimited["tok_s"], 3)
                                                if unlimited["tok_s"] else None))
            else:
                solo = asyncio.run(run_solo(server.base_url, model, prompts, args, server.pid))
            solo.update(started_at=result["started_at"], code=result["code"],
                        client_priority=result["client_priority"])
            result["workloads"][SOLO] = solo
            if mode == SHARES:
                print(f"[{mode}] solo: unlimited user {unlimited['tok_s']:g} tok/s, "
                      f"{_f(unlimited['tokens_per_step'], '.1f')} tokens per step; the borrower "
                      f"{_f(solo['ratio_to_unlimited'], '.3f')} x that", flush=True)
            print(f"[{mode}] solo: {solo['tok_s']:g} tok/s (vllm:generation_tokens_total), "
                  f"{solo['engine_steps_per_s']:g} engine steps/s, {_f(solo['tokens_per_step'], '.1f')} "
                  f"tokens per step, CPU ms per step {solo['cpu_ms_per_step']}, other processes "
                  f"{solo['cpu_foreign_cores']:g} cores, load "
                  f"{fmt_load(solo['load_before'])} -> {fmt_load(solo['load_after'])}", flush=True)
        if IN_QUOTA in args.workload and mode != SHARES:
            print(f"[{mode}] {IN_QUOTA}: not run (its borrowers need {SHARES})", flush=True)
        elif IN_QUOTA in args.workload:
            print(f"[{mode}] {IN_QUOTA}: {IN_QUOTA_USER} (hard cap {args.in_quota_rate:g}, "
                  f"{args.in_quota_user_streams} closed-loop stream(s) "
                  f"of {args.in_quota_max_tokens}-token requests) alone, then beside "
                  + ", ".join(IN_QUOTA_BORROWERS[:args.in_quota_borrowers])
                  + f" ({{rate {args.in_quota_borrower_rate:g}, ceil null}}, {args.in_quota_streams} streams each); "
                  f"first the same stream(s) unlimited; {args.in_quota_warmup_s:g} s warm-up + {args.in_quota_s:g} s "
                  "measured per phase", flush=True)
            raw = asyncio.run(run_in_quota(server.base_url, model, prompts, args))
            run = dict(analyse_in_quota(raw, args), started_at=result["started_at"], code=result["code"],
                       client_priority=result["client_priority"],
                       load_before=raw["load_at_phase_start"]["unlimited"], load_after=loadavg(),
                       server_args=result["server_args"])
            result["workloads"][IN_QUOTA] = in_quota_summary([run], in_quota_options(args))
            print(in_quota_report(result["workloads"][IN_QUOTA]), flush=True)
        for name, clients in loads.items():
            if name not in args.workload:
                continue
            print(f"[{mode}] {name}: " + ", ".join(
                f"{c.user} {c.load * capacity / args.max_tokens:.2f} req/s (weight {c.weight:g})" for c in clients)
                + f"; {args.duration:g} s", flush=True)
            load_before = loadavg()
            raw = asyncio.run(run_workload(server.base_url, model, clients, capacity, prompts, args))
            result["workloads"][name] = analyse(raw, clients, mode, capacity, args, name)
            result["workloads"][name].update(started_at=result["started_at"], load_before=load_before,
                                             load_after=loadavg(), code=result["code"],
                                             client_priority=result["client_priority"])
            print(workload_report(name, mode, result["workloads"][name]), flush=True)
        result["server_log_tail"] = server.log_tail(20)
        log_path = getattr(server, "log_path", None)
        # On the CPU build this is OutputRateScheduler whatever --async-scheduling says.
        result["scheduler_class"] = (scheduler_class(Path(log_path).read_text(errors="replace"))
                                     if log_path and Path(log_path).is_file() else None)
    result["load_after"] = loadavg()
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _gauge_summary(values: list[float | None]) -> dict[str, Any] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"mean": round(sum(known) / len(known), 1), "min": min(known), "max": max(known), "reads": len(known)}


def _per_step(first: dict, last: dict) -> float | None:
    """Output tokens per engine step between two readings."""
    steps = last.get("steps", 0.0) - first.get("steps", 0.0)
    return None if steps <= 0 else round((last["generated"] - first["generated"]) / steps, 2)


def _f(x, fmt=".0f") -> str:
    return "-" if x is None else format(x, fmt)


def borrowed_report(b: dict[str, Any]) -> str:
    """The shares of borrowed tokens against the target, in a few lines."""
    t = b.get("target") or {"kind": "relative", "tolerance": TARGET_SHARE_DEVIATION}
    tol = f"+-{t['tolerance']:g}" if t["kind"] == "absolute" else f"+-{t['tolerance']:.0%} of it"
    lines = [f"share of borrowed tokens (engine counter; target: weight share {tol}):"]
    for u, ws in b["weight_share"].items():
        lines.append(f"  {u}: weight share {ws:.3f}, over the run {_f((b.get('over_run') or {}).get(u), '.3f')}, "
                     f"after the 1st window {_f(b['after_first_window'].get(u), '.3f')}, per window "
                     + " ".join(_f(x, ".2f") for x in b["per_window"][u]))
    if "windows_missed" in b:
        lines.append(f"  over the run: {'met' if b['met_over_run'] else 'MISSED'} (deviation "
                     f"{_f(b['run_deviation'], '.3f')}); windows after the 1st: {b['windows_missed']} of "
                     f"{b['windows_counted']} counted missed, worst {_f(b['worst_window_deviation'], '.3f')}, "
                     f"{b['windows_not_counted']} not counted")
    return "\n".join(lines)


def workload_report(name: str, mode: str, w: dict[str, Any]) -> str:
    f = w["fairness"]
    rows = [[u, _f(s["weight"], "g"), _f(s["offered_tok_s"]), _f(s["guaranteed_tok_s"], "g"),
             " ".join(_f(x) for x in w["service"][u]), _f(s["tok_s_after_first_window"], ".1f"),
             str(s["arrivals_skipped"]), f"{_f(s.get('peak_in_flight'), 'd')}/{_f(s.get('in_flight_cap'), 'd')}",
             f"{_f(s.get('backlogged_windows'), 'd')}/{len(w['service'][u])}"] for u, s in w["users"].items()]
    light = w["light"]
    return "\n".join([
        f"[{mode}] {name}: total {w['throughput_tok_s']:.1f} tok/s (vllm:generation_tokens_total), "
        f"{w.get('engine_steps_per_s', 0):.0f} engine steps/s, "
        f"{_f(w.get('tokens_per_step'), '.1f')} tokens per step of {w.get('active_seqs', ACTIVE_SEQS)}; "
        + "".join(f"{key} requests mean {g['mean']:g} (min {g['min']:g}, max {g['max']:g}); "
                  for key, g in (w.get("engine_requests") or {}).items() if g)
        + f"service per {w['window_s']:g} s window from {w['service_source']}",
        table(["user", "weight", "offered tok/s", "guaranteed", "tokens per window", "tok/s after 1st", "skipped",
               "peak/cap in flight", "backlogged windows"], rows),
        f"service difference (tokens per unit weight per window, windows after the first): "
        f"max {_f(f['max'])}, mean {_f(f['mean'])}; largest share deviation {_f(f['max_share_deviation'], '.1%')}",
        *([] if not w.get("borrowed_shares") else [borrowed_report(w["borrowed_shares"])]),
        f"client sent up to {_f(w.get('send_late_max_s'), '.1f')} s late; "
        f"light: {light['with_first_token']}/{light['requests']} requests, first token p50 "
        f"{_f(light['ttft_p50_s'] and light['ttft_p50_s'] * 1000)} ms, p90 "
        f"{_f(light['ttft_p90_s'] and light['ttft_p90_s'] * 1000)} ms",
    ])


def in_quota_report(w: dict[str, Any]) -> str:
    """The in-quota workload: carol's tok/s per phase and run, the ratio against the target."""
    o = w["options"]
    lines = [f"in-quota: {IN_QUOTA_USER} hard cap {o['rate']:g} tok/s, {o.get('streams', 1)} stream(s) of "
             f"{o['max_tokens']}-token "
             f"requests; {o['borrowers']} borrower(s) {{rate {o['borrower_rate']:g}, ceil null}} x "
             f"{o['borrower_streams']} streams; {o['measured_s']:g} s measured per phase; tok/s on the engine's "
             f"charged counter (target: beside / min(limit, alone) >= {w['target_ratio']:g})"]
    for i, run in enumerate(w["runs"], 1):
        t = run["carol_tok_s"]
        beside = (run["phases"].get("beside") or {})
        who = ", ".join(f"{u} {_f(s['tok_s'], '.1f')} tok/s (borrowed {s['borrowed_tokens']:.0f}, throttled "
                        f"{s['throttled_s']:g} s, active/throttled/waiting {s['requests_mean']['active']:g}/"
                        f"{s['requests_mean']['throttled']:g}/{s['requests_mean']['waiting']:g})"
                        for u, s in (beside.get("users") or {}).items())
        lines.append(f"  run {i} ({run['started_at']}, load {fmt_load(run['load_before'])}): unlimited stream "
                     f"{_f(t['unlimited'], '.1f')}, carol alone {_f(t['alone'], '.1f')}, beside {_f(t['beside'], '.1f')} "
                     f"tok/s: ratio {_f(run['ratio'], '.3f')} ({'met' if run['met'] else 'MISSED'}); "
                     f"{_f(beside.get('tokens_per_step'), '.2f')} tokens per step; beside: {who}")
    lines.append(f"  over {w['n_runs']} run(s): ratio min {_f(w['ratio_min'], '.3f')}, mean "
                 f"{_f(w['ratio_mean'], '.3f')}, {'met in every run' if w['met_every_run'] else 'MISSED'}")
    return "\n".join(lines)


def report(doc: dict[str, Any]) -> str:
    parts = [f"capacity C = {doc['capacity']['tok_s']:g} tok/s (measured in {doc['capacity']['measured_in_mode']})"
             if doc.get("capacity") else "capacity C: not needed (no workload asked uses it)"]
    for mode in MODES:
        result = doc["modes"].get(mode) or {"status": "not run"}
        if result.get("status") != "ran":
            parts.append(f"[{mode}] {result['status']}" + (f": {result['reason']}" if result.get("reason") else ""))
            continue
        for name, w in result["workloads"].items():
            if name == IN_QUOTA:
                parts.append(f"[{mode}] " + in_quota_report(w))
                continue
            if name == SOLO:
                parts.append(f"[{mode}] solo: {w['tok_s']:g} tok/s, {w['streams']} streams of one user "
                             f"(load {fmt_load(w['load_before'])}, started {w['started_at']})"
                             + ("" if not w.get("unlimited_same_server") else
                                f"; an unlimited user on the same server {w['unlimited_same_server']['tok_s']:g} "
                                f"tok/s, ratio {_f(w.get('ratio_to_unlimited'), '.3f')}"))
                continue
            parts.append(workload_report(name, mode, w))
        parts.append(f"[{mode}] load avg before {fmt_load(result['load_before'])}, after "
                     f"{fmt_load(result.get('load_after'))}; startup {result['startup_s']:.0f} s")
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def plot(doc: dict[str, Any], path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ran = {name for r in doc["modes"].values() for name in ((r or {}).get("workloads") or {})}
    # The workloads some mode ran (a run at another slot setting may run only some).
    names = [name for name in (OVERLOAD, WEIGHTED, *EQUAL_RATE_WORKLOADS) if name in ran] or [OVERLOAD, WEIGHTED]
    fig = Figure(figsize=(12, 3.25 * len(names)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), len(MODES), sharex=True, sharey="row", squeeze=False)
    for col, mode in enumerate(MODES):
        result = doc["modes"].get(mode) or {}
        for row, name in enumerate(names):
            ax = axes[row][col]
            w = (result.get("workloads") or {}).get(name)
            ax.set_title(f"{name}, {mode}" + ("" if w else " (not run)"), fontsize="medium")
            if not w:
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="0.5")
                continue
            for i, (user, ys) in enumerate(w["plot_series"].items()):
                values = [math.nan if y is None else y for y in ys]  # a gap: not measured
                ax.stairs(values, [k * w["plot_bin_s"] for k in range(len(ys) + 1)], color=f"C{i}",
                          label=f"{user} (w {w['users'][user]['weight']:g})")
                guaranteed = w["users"][user]["guaranteed_tok_s"]
                if guaranteed:
                    ax.axhline(guaranteed, color=f"C{i}", linestyle=":", linewidth=0.8)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("service (output tok/s)")
            if row == len(names) - 1:
                ax.set_xlabel("time (s)")
            ax.legend(fontsize="x-small", loc="upper right")
    # One y scale per row, from every mode's series (a set_ylim per panel froze the
    # shared scale at the first panel's data and clipped the others).
    for row, name in enumerate(names):
        top = max([y for r in doc["modes"].values() for u, ys in
                   ((((r or {}).get("workloads") or {}).get(name) or {}).get("plot_series") or {}).items()
                   for y in ys if y is not None and math.isfinite(y)], default=1.0)
        axes[row][0].set_ylim(0, max(top, 1.0) * 1.08)
    fig.suptitle("Service per user over time: stock vLLM (FCFS; engine-stamped request spans) vs hard caps vs "
                 "rate/ceil/weight (engine per-user counters); dotted: guaranteed rate", fontsize="medium")
    fig.tight_layout()
    fig.savefig(str(path), metadata=figure_metadata(source or sibling_json(path)))


def plotted(doc: dict[str, Any]) -> bool:
    """Whether some mode ran a workload :func:`plot` draws."""
    return any(name in ((r or {}).get("workloads") or {}) for r in doc["modes"].values()
               for name in (OVERLOAD, WEIGHTED, *EQUAL_RATE_WORKLOADS))


def appended_in_quota(earlier: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``--in-quota-append``: the earlier runs (when their options are the same) and the new one."""
    if not earlier:
        return new
    # Runs written before --in-quota-user-streams had one stream of carol's.
    if {"streams": 1, **(earlier.get("options") or {})} != new["options"]:
        print("warning: the earlier in-quota runs had other options: not kept", flush=True)
        return new
    return in_quota_summary([*earlier["runs"], *new["runs"]], new["options"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", action="append", choices=MODES,
                   help="stock, hard or shares; repeatable (default: all three)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="writes PREFIX.json and PREFIX.png (default: docs/benchmarks/fair_share, with the "
                        "slot setting and scheduling appended when they are not the defaults)")
    p.add_argument("--model", default=None,
                   help="model path (default: the bench model, `make bench-model`, or the --slots setting's)")
    p.add_argument("--slots", choices=sorted(SLOT_SETTINGS),
                   help="few: the tiny model with 4 active slots; many: the bench model with 8 "
                        "(--model and --active-seqs override either)")
    p.add_argument("--active-seqs", type=int, default=None,
                   help=f"--max-num-active-seqs of every server (default {ACTIVE_SEQS}, or the --slots setting's)")
    p.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default",
                   help="vLLM's --async-scheduling / --no-async-scheduling (default: vLLM's choice; the CPU "
                        "build runs the synchronous scheduler whatever this says, see How)")
    p.add_argument("--equal-rate", type=float, default=5.0,
                   help="each client's guaranteed rate in the equal-rate workloads, tok/s (default 5)")
    p.add_argument("--equal-rates-load", type=float, default=1.5,
                   help="offered output of each equal-rate client as a fraction of C (default 1.5: twice "
                        "the largest weight share of the spare capacity, so every client stays backlogged)")
    p.add_argument("--equal-rates-in-flight", type=int, default=16,
                   help="requests in flight per equal-rate client at most; an arrival beyond is skipped "
                        "(default 16, the servers' --max-num-seqs: one client alone could fill every "
                        "resident slot)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per workload (default 60)")
    p.add_argument("--window", type=float, default=10.0, help="service window, s (default 10)")
    p.add_argument("--plot-bin", type=float, default=5.0, help="bin of the figure's series, s (default 5)")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics reads")
    p.add_argument("--max-skew", type=float, default=2.0,
                   help="a counter window whose edge has no /metrics read within this many seconds is "
                        "not measured (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512, help="output tokens of every workload request")
    p.add_argument("--overload-load", type=float, nargs=2, default=(1.0, 2.0), metavar=("A", "B"),
                   help="offered output of A and B as fractions of C (default 1 2)")
    p.add_argument("--weighted-load", type=float, default=0.8,
                   help="offered output of each weighted client as a fraction of C (default 0.8)")
    p.add_argument("--weighted-arrivals", choices=("equal", "weights"), default="equal",
                   help="weighted clients send equally (default) or in proportion to their weights (VTC)")
    p.add_argument("--guaranteed", type=float, default=0.5,
                   help="fraction of C guaranteed to a workload's clients, split by weight (default 0.5)")
    p.add_argument("--light-interval", type=float, default=2.0)
    p.add_argument("--light-max-tokens", type=int, default=16)
    p.add_argument("--light-rate", type=float, default=20.0, help="the light user's limit in hard and shares")
    p.add_argument("--max-outstanding", type=int, default=500, help="requests in flight per client at most")
    p.add_argument("--stream-interval", type=int, default=16,
                   help="tokens per streamed chunk of the workload requests (vLLM's per-request "
                        "stream_interval; the light user's requests stream every token)")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help="overload, weighted, equal-rates-1-3, equal-rates-1-2-3-4, solo or in-quota (shares "
                        "only); repeatable (default: all six). A mode's other "
                        "workloads keep their earlier result in the JSON")
    p.add_argument("--solo-streams", type=int, default=12, help="streams of the solo user (default 12)")
    p.add_argument("--solo-rate", type=float, default=10.0,
                   help="the solo user's rate in hard and shares (shares: no ceiling; default 10)")
    p.add_argument("--solo-s", type=float, default=30.0, help="seconds the solo load is measured (default 30)")
    p.add_argument("--solo-rounds", type=int, default=2,
                   help="shares: rounds of the lone borrower beside the unlimited user, in alternating "
                        "order (default 2)")
    p.add_argument("--in-quota-rate", type=float, default=None,
                   help="in-quota: carol's hard cap, tok/s (default 100 on the tiny model, 50 on the others: "
                        "within what one stream reaches beside a full batch; the unlimited phase and the "
                        "engine steps/s beside show it)")
    p.add_argument("--in-quota-user-streams", type=int, default=1,
                   help="in-quota: closed-loop streams of carol's (and of the unlimited phase's user), "
                        "sharing her limit (default 1)")
    p.add_argument("--in-quota-borrower-rate", type=float, default=10.0,
                   help="in-quota: each borrower's rate (no ceiling; default 10)")
    p.add_argument("--in-quota-borrowers", type=int, choices=(1, 2), default=1,
                   help="in-quota: borrowers beside carol, bob (and dave) (default 1)")
    p.add_argument("--in-quota-streams", type=int, default=12,
                   help="in-quota: closed-loop streams of each borrower (default 12)")
    p.add_argument("--in-quota-max-tokens", type=int, default=200,
                   help="in-quota: output tokens of carol's requests (default 200)")
    p.add_argument("--in-quota-borrower-max-tokens", type=int, default=200,
                   help="in-quota: output tokens of the borrowers' requests (default 200)")
    p.add_argument("--in-quota-s", type=float, default=60.0,
                   help="in-quota: seconds measured per phase (default 60)")
    p.add_argument("--in-quota-warmup-s", type=float, default=10.0,
                   help="in-quota: seconds of load before each phase is measured (default 10)")
    p.add_argument("--in-quota-append", action="store_true",
                   help="in-quota: keep the output JSON's earlier runs of this workload (same options) and "
                        "add this one (n runs, each on its own server)")
    p.add_argument("--capacity", type=float, help="C in output tok/s (default: measured, or the output JSON's)")
    p.add_argument("--recalibrate", action="store_true", help="measure C even if the output JSON has one")
    p.add_argument("--calibrate-streams", type=int, default=24)
    p.add_argument("--calibrate-s", type=float, default=15.0)
    p.add_argument("--calibrate-warmup-s", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    p.add_argument("--replot", action="store_true", help="only draw PREFIX.png again from PREFIX.json")
    args = p.parse_args(argv)
    if args.solo_rounds < 1:
        p.error("--solo-rounds must be at least 1")
    slot_model, slot_active = SLOT_SETTINGS[args.slots] if args.slots else (str(BENCH_MODEL_DIR), ACTIVE_SEQS)
    args.model = args.model or slot_model
    args.active_seqs = args.active_seqs or slot_active
    if args.in_quota_rate is None:
        # The bench model makes about 100 steps/s with one request and 70-90 with a full
        # batch, one token per request per step: a 100 tok/s cap is out of one stream's reach.
        args.in_quota_rate = IN_QUOTA_RATE_TINY if Path(args.model).name == "tiny-llama" else IN_QUOTA_RATE
    if args.out is None:
        suffix = ""
        if args.active_seqs != ACTIVE_SEQS or Path(args.model) != BENCH_MODEL_DIR:
            suffix += f"-{args.active_seqs}active-{Path(args.model).name}"
        if args.async_scheduling != "default":
            suffix += f"-async-{args.async_scheduling}"
        args.out = str(RESULTS_DIR / f"fair_share{suffix}")
    # Stock first: when C is not known yet, the stock server measures it.
    args.mode = sorted(dict.fromkeys(args.mode or MODES), key=MODES.index)
    args.workload = sorted(dict.fromkeys(args.workload or WORKLOADS), key=WORKLOADS.index)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path = benchkit.output_path(args.out, ".json")
    earlier = json.loads(json_path.read_text()) if json_path.is_file() else {}
    if args.replot:
        plot(earlier, benchkit.output_path(args.out, ".png"))
        return 0
    doc = benchkit.start_report(SCHEMA, args)
    doc["target_share_deviation"] = TARGET_SHARE_DEVIATION
    doc["target_light_ttft_ratio"] = TARGET_LIGHT_TTFT_RATIO
    doc["target_solo_ratio"] = TARGET_SOLO_RATIO
    doc["target_in_quota_ratio"] = TARGET_IN_QUOTA_RATIO
    earlier_modes = {m: r for m, r in (earlier.get("modes") or {}).items() if r.get("status") == "ran"}
    doc["modes"] = {m: r for m, r in earlier_modes.items() if m not in args.mode}
    for mode, result in doc["modes"].items():
        result["config_differs"] = result.get("workload_config") != workload_config(args)
        if result["config_differs"]:
            print(f"warning: the kept {mode} result was run with other workload options", flush=True)
    if args.capacity:
        doc["capacity"] = {"tok_s": args.capacity, "measured_in_mode": "given (--capacity)"}
    elif earlier.get("capacity") and not args.recalibrate and (earlier.get("config") or {}).get("model") == args.model:
        doc["capacity"] = dict(earlier["capacity"], reused_from=earlier.get("started_at"))
        print(f"reusing C = {doc['capacity']['tok_s']:g} tok/s from {json_path}", flush=True)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: no model at {args.model}: run `make bench-model` (or pass --model)", file=sys.stderr)
        return 2
    loads = workloads(args)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    prompts = Prompts(args.seed, vocab)
    log_dir = benchkit.log_dir_for("fair-share", args.log_dir)
    failed = False
    if not doc.get("capacity") and STOCK not in args.mode and needs_capacity(args):
        # C comes from a stock server: one started for that alone.
        run_mode(CALIBRATE_ONLY, args, doc, loads, prompts, log_dir)
    for mode in args.mode:
        probe = user_limits(mode, loads, 100.0, args)
        reason = refused(probe)
        if reason:
            print(f"[{mode}] not run: this build refuses the limits: {reason}", flush=True)
            doc["modes"][mode] = {"status": "not run", "reason": f"this build refuses the limits: {reason}"}
            continue
        try:
            result = run_mode(mode, args, doc, loads, prompts, log_dir)
        except Exception as exc:  # a failed mode is reported; the others still run
            failed = True
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"[{mode}] FAILED: {result['reason']}", flush=True)
        kept = {name: w for name, w in ((earlier_modes.get(mode) or {}).get("workloads") or {}).items()
                if name not in args.workload}
        if result.get("status") == "ran" and kept:
            # Workloads not run now keep their earlier result (each names its own start and load).
            for w in kept.values():
                w.setdefault("started_at", earlier_modes[mode].get("started_at"))
                w.setdefault("load_before", earlier_modes[mode].get("load_before"))
                w.setdefault("code", earlier_modes[mode].get("code"))
            result["workloads"] = {name: result["workloads"].get(name) or kept[name]
                                   for name in WORKLOADS if name in result["workloads"] or name in kept}
            result["kept_workloads"] = sorted(kept)
        if result.get("status") == "ran" and IN_QUOTA in result.get("workloads", {}) and args.in_quota_append:
            result["workloads"][IN_QUOTA] = appended_in_quota(
                ((earlier_modes.get(mode) or {}).get("workloads") or {}).get(IN_QUOTA), result["workloads"][IN_QUOTA])
        doc["modes"][mode] = result
    for mode in MODES:
        doc["modes"].setdefault(mode, {"status": "not run"})
    benchkit.finish_report(doc)
    if doc.get("capacity") or not needs_capacity(args):
        print("\n" + report(doc))
    # No figure when no workload with service over time ran (solo and in-quota alone).
    benchkit.write_outputs(doc, args.out, plot=plot if plotted(doc) else None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(benchkit.in_own_session(main))
