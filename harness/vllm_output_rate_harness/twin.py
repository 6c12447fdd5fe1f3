"""A GPU twin: vLLM's real scheduler on a clock that runs at a GPU's pace.

:class:`TwinEngine` is a :class:`~vllm_output_rate_harness.scheduler_sim.Harness`
(vLLM's own ``Scheduler``/``AsyncScheduler`` or ours, a real KV cache
manager, fabricated model-runner outputs) whose fake clock advances, after
each step, by what the step would have taken on the GPU according to a
:class:`GpuCostModel`: a fixed part, a part per decode token and a part per
prefill token.  The scheduler's own CPU time (thread CPU time of
``schedule()`` and ``update_from_output()``, nothing of the harness) is
recorded per step beside it.

:class:`Workload` is what users send, seeded, and identical for every
engine it drives: open-loop requests at fixed times (the long tail of light
users), and closed-loop streams (heavy users) that send their next request
(from a fixed sequence) a think time after the previous one finished.
:func:`run_lockstep` drives several engines through one workload, always
stepping the engine whose clock is furthest behind, so that whatever the
machine does meanwhile falls on all of them alike.

The cost model's constants and their source live in ``benchmarks/gpu_twin.py``;
this module only knows the shape.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from vllm.v1.outputs import ModelRunnerOutput

from vllm_output_rate.policy.fairness import FairnessWindow, jain_index, largest_gap
from vllm_output_rate_harness.scheduler_sim import TOKEN, FakeClock, Harness, max_in_window

S = 1_000_000_000
MS = 1_000_000
VOCAB = 689  # the tiny model's vocabulary: prompts are drawn from it
#: The engine's longest wait with nothing runnable (SPEC §3.4) and stock's busy poll.
IDLE_WAIT_CAP_NS = 50 * MS
STOCK_POLL_NS = 1 * MS


@dataclass(frozen=True)
class GpuCostModel:
    """Modelled time of one engine step on a GPU, in milliseconds."""

    gpu: str
    model: str
    fixed_ms: float
    per_decode_ms: float
    per_prefill_ms: float

    def step_ms(self, decodes: int, prefill_tokens: int) -> float:
        return self.fixed_ms + self.per_decode_ms * decodes + self.per_prefill_ms * prefill_tokens


# -- workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    prompt_len: int
    max_tokens: int
    think_s: float = 0.0  # closed loop: the pause before this request is sent


@dataclass
class Workload:
    """``limits``: the ``output_rate`` section for the plugin (``None``: stock only)."""

    limits: dict | None
    #: (time s, user, prompt_len, max_tokens), sorted by time: sent whatever happens.
    arrivals: list[tuple[float, str, int, int]] = field(default_factory=list)
    #: user -> that user's streams, each a fixed sequence of jobs sent one after another.
    streams: dict[str, list[list[Job]]] = field(default_factory=dict)
    #: users whose output is checked against a cap: user -> tok/s
    capped: dict[str, float] = field(default_factory=dict)
    #: borrowers whose weighted share is measured: user -> weight
    borrowers: dict[str, float] = field(default_factory=dict)
    #: users whose first token is timed (in quota)
    in_quota: set[str] = field(default_factory=set)
    input_token_weight: float = 0.0

    def only_open_arrivals(self) -> "Workload":
        """The same open-loop users alone (no streams): the "alone" baseline."""
        return Workload(self.limits, list(self.arrivals), {}, {}, {}, set(self.in_quota),
                        self.input_token_weight)


# -- one engine ---------------------------------------------------------------------------


@dataclass
class _Req:
    user: str
    arrival_ns: int
    prompt_len: int
    stream: tuple[str, int] | None
    first_ns: int | None = None
    prompt_charged: int = 0  # prompt positions computed at least once (recompute is free)


class TwinEngine(Harness):
    """One scheduler (stock or ours, sync or async) on the GPU's clock."""

    def __init__(self, name: str, limits: dict | None, cost: GpuCostModel, *, async_: bool = False,
                 max_num_seqs: int, num_blocks: int, max_num_active_seqs: int | None = None,
                 max_num_batched_tokens: int = 8192,
                 max_model_len: int = 2048, watch: Iterable[str] = (), fairness_window_s: float = 10.0,
                 borrowers: Mapping[str, float] | None = None, measure_from_s: float = 0.0) -> None:
        super().__init__(limits, async_=async_, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_num_active_seqs=max_num_active_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         clock=FakeClock(0))
        self.name = name
        self.cost = cost
        self.shadow = None  # bounds are checked from the outside, on the token times
        self.ours = limits is not None
        #: What a computed prompt token costs this engine's users (stock: charged as the workload's
        #: limits would, to compare with the same figure).
        self.input_token_weight = None if limits is None else float(limits.get("input_token_weight", 0))
        self._reqs: dict[str, _Req] = {}
        self._open: dict[str, int] = {}  # user -> unfinished requests
        self.finished_streams: list[tuple[str, int, int]] = []  # (user, stream, finish ns)
        self.watch = set(watch)
        self.sample_times: dict[str, list[int]] = {u: [] for u in self.watch}
        self.output_tokens: dict[str, int] = {}
        self.prompt_charged: dict[str, int] = {}
        # The same from measure_from_s on (the warm-up left out): every stream's first prompt
        # arrives at t = 0, and the prefill-bound steps until they are computed give each
        # stream at most one token a step, whatever its user's limit.
        self.measure_from_ns = int(measure_from_s * S)
        self.output_measured: dict[str, int] = {}
        self.prompt_measured: dict[str, int] = {}
        self.first_token_ms: dict[str, list[float]] = {}
        self.borrowers = dict(borrowers or {})
        self.fairness = FairnessWindow(int(fairness_window_s * S))
        for user, weight in self.borrowers.items():
            self.fairness.set_weight(user, weight)
        self.fairness_readings: list[tuple[float, object]] = []
        self._next_reading_ns = int(fairness_window_s * S)
        self._window_ns = int(fairness_window_s * S)
        # per step: scheduler CPU ns (schedule + update), wall ns, modelled GPU ms, decodes, prefill
        self.cpu_ns: list[int] = []
        self.wall_ns: list[int] = []
        self.gpu_ms: list[float] = []
        self.decodes: list[int] = []
        self.prefill: list[int] = []
        # per step, to say where an engine's tokens go: its start instant, the requests it ran and
        # preempted, the requests it held (running) and the KV cache's usage after scheduling
        self.active_cap = max_num_active_seqs or max_num_seqs
        self.started_ns: list[int] = []
        self.scheduled: list[int] = []
        self.preempted: list[int] = []
        self.held: list[int] = []
        self.kv_usage: list[float] = []
        self.idle_steps = 0
        self._update_cpu = 0
        self._update_wall = 0
        self._ids = itertools.count()

    # -- requests ----------------------------------------------------------------------

    def submit(self, user: str, prompt_len: int, max_tokens: int, rng: random.Random,
               stream: tuple[str, int] | None = None) -> None:
        rid = f"{user}#{next(self._ids)}"
        prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]  # no accidental prefix hits
        self.add(user, max_tokens=max_tokens, prompt=prompt, request_id=rid)
        self.records.pop(rid, None)  # the harness's own record grows per token: ours is smaller
        self._reqs[rid] = _Req(user, self.clock.now_ns, prompt_len, stream)
        self._open[user] = self._open.get(user, 0) + 1

    def drain(self) -> None:
        while self._in_flight:
            self._feed(*self._in_flight.popleft())

    def has_work(self) -> bool:
        return bool(self._reqs) or bool(self._in_flight)

    # -- one step -------------------------------------------------------------------------

    def step(self, dt_ns: int | None = None):  # noqa: ARG002 (the cost model decides)
        sched = self.sched
        now = self.clock.now_ns
        if self.borrowers:  # backlogged as the step is decided
            self.fairness.observe([u for u in self.borrowers if self._open.get(u)], now)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        output = sched.schedule()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        decodes = prefill = 0
        sampling = []
        requests = sched.requests
        for rid, n in output.num_scheduled_tokens.items():
            request = requests[rid]
            after = request.num_computed_tokens
            before = after - n
            prompt_len = request.num_prompt_tokens
            if n == 1 and before >= prompt_len:
                decodes += 1
            else:
                prefill += n
                rec = self._reqs[rid]
                reached = min(after, prompt_len)
                if reached > rec.prompt_charged:
                    self.prompt_charged[rec.user] = self.prompt_charged.get(rec.user, 0) + reached - rec.prompt_charged
                    if now >= self.measure_from_ns:
                        self.prompt_measured[rec.user] = (self.prompt_measured.get(rec.user, 0)
                                                          + reached - rec.prompt_charged)
                    rec.prompt_charged = reached
            if not request.is_prefill_chunk:
                sampling.append(rid)
        if output.total_num_scheduled_tokens:
            dt = int(self.cost.step_ms(decodes, prefill) * MS)
        else:
            self.idle_steps += 1
            wait = getattr(sched, "output_rate_idle_wait_s", None) if self.ours else None
            dt = min(IDLE_WAIT_CAP_NS, int(wait * S)) if wait else (IDLE_WAIT_CAP_NS if self.ours else STOCK_POLL_NS)
            dt = max(dt, STOCK_POLL_NS)
        self._in_flight.append((output, sampling, now + dt, now))
        depth = 2 if self.async_ else 1
        self._update_cpu = self._update_wall = 0
        while len(self._in_flight) >= depth:
            self._feed(*self._in_flight.popleft())
        self.cpu_ns.append(c1 - c0 + self._update_cpu)
        self.wall_ns.append(w1 - w0 + self._update_wall)
        self.gpu_ms.append(dt / MS if output.total_num_scheduled_tokens else 0.0)
        self.decodes.append(decodes)
        self.prefill.append(prefill)
        self.started_ns.append(now)
        self.scheduled.append(len(output.num_scheduled_tokens))
        self.preempted.append(len(output.preempted_req_ids or ()))
        self.held.append(len(sched.running))
        self.kv_usage.append(sched.kv_cache_manager.usage)
        self.clock.advance(dt)
        if self.borrowers and self.clock.now_ns >= self._next_reading_ns:
            self.fairness_readings.append((self._next_reading_ns / S, self.fairness.reading(self.clock.now_ns)))
            self._next_reading_ns += self._window_ns
        return output

    def _feed(self, output, sampling: list[str], done_ns: int, dispatched_ns: int) -> None:
        req_ids = list(output.num_scheduled_tokens)
        sampled = set(sampling)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[TOKEN] if rid in sampled else [] for rid in req_ids],
        )
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        engine_outputs = self.sched.update_from_output(output, runner_output)
        self._update_cpu += time.thread_time_ns() - c0
        self._update_wall += time.perf_counter_ns() - w0
        for client_outputs in engine_outputs.values():
            for out in client_outputs.outputs:
                rec = self._reqs.get(out.request_id)
                if rec is None:
                    continue
                n = len(out.new_token_ids)
                if n:
                    user = rec.user
                    self.output_tokens[user] = self.output_tokens.get(user, 0) + n
                    if dispatched_ns >= self.measure_from_ns:
                        self.output_measured[user] = self.output_measured.get(user, 0) + n
                    if user in self.watch:
                        self.sample_times[user].extend([dispatched_ns] * n)  # charged at dispatch
                    if user in self.borrowers:
                        self.fairness.serve(user, n, done_ns)
                    if rec.first_ns is None:
                        rec.first_ns = done_ns
                        self.first_token_ms.setdefault(user, []).append((done_ns - rec.arrival_ns) / MS)
                if out.finish_reason is not None:
                    del self._reqs[out.request_id]
                    self._open[rec.user] -= 1
                    if rec.stream is not None:
                        self.finished_streams.append((*rec.stream, done_ns))


# -- driving ------------------------------------------------------------------------------


class _Driver:
    """Feeds one engine its workload: the same requests, in the same order, for every engine."""

    def __init__(self, engine: TwinEngine, workload: Workload, seed: int) -> None:
        self.engine = engine
        self.workload = workload
        self.rng = random.Random(seed)  # prompt contents only: lengths come from the workload
        self.next_open = 0
        self.position: dict[tuple[str, int], int] = {}
        self.pending: list[tuple[int, int, str, int]] = []  # (due ns, seq, user, stream)
        self.seq = itertools.count()
        for user, streams in workload.streams.items():
            for i, jobs in enumerate(streams):
                if jobs:
                    self.position[(user, i)] = 0
                    heapq.heappush(self.pending, (int(jobs[0].think_s * S), next(self.seq), user, i))

    def admit_due(self) -> None:
        e = self.engine
        now = e.clock.now_ns
        arrivals = self.workload.arrivals
        while self.next_open < len(arrivals) and int(arrivals[self.next_open][0] * S) <= now:
            _, user, prompt_len, max_tokens = arrivals[self.next_open]
            e.submit(user, prompt_len, max_tokens, self.rng)
            self.next_open += 1
        for user, stream, finished_ns in e.finished_streams:
            jobs = self.workload.streams[user][stream]
            nxt = self.position[(user, stream)] + 1
            self.position[(user, stream)] = nxt
            if nxt < len(jobs):
                heapq.heappush(self.pending, (finished_ns + int(jobs[nxt].think_s * S), next(self.seq), user, stream))
        e.finished_streams.clear()
        while self.pending and self.pending[0][0] <= now:
            _, _, user, stream = heapq.heappop(self.pending)
            job = self.workload.streams[user][stream][self.position[(user, stream)]]
            e.submit(user, job.prompt_len, job.max_tokens, self.rng, stream=(user, stream))

    def next_due_ns(self) -> int | None:
        times = []
        if self.next_open < len(self.workload.arrivals):
            times.append(int(self.workload.arrivals[self.next_open][0] * S))
        if self.pending:
            times.append(self.pending[0][0])
        return min(times) if times else None


def run_lockstep(engines: Sequence[TwinEngine], workload: Workload, duration_s: float, seed: int = 0,
                 progress_every_s: float | None = None) -> None:
    """Drive every engine through ``workload`` for ``duration_s`` on its own clock."""
    drivers = [_Driver(e, workload, seed) for e in engines]
    end = int(duration_s * S)
    live = list(drivers)
    next_progress = progress_every_s
    while live:
        d = min(live, key=lambda x: x.engine.clock.now_ns)
        e = d.engine
        if e.clock.now_ns >= end:
            live.remove(d)
            continue
        d.admit_due()
        if not e.has_work():
            due = d.next_due_ns()
            if due is None or due >= end:
                e.clock.now_ns = end
            else:
                e.clock.now_ns = max(e.clock.now_ns, due)
            continue
        e.step()
        if progress_every_s and e is engines[0] and e.clock.now_ns / S >= next_progress:
            print(f"    {e.name}: {e.clock.now_ns / S:5.1f} s simulated, {len(e.cpu_ns)} steps", flush=True)
            next_progress += progress_every_s
    for e in engines:
        e.drain()


# -- what a run shows --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


#: The span of each of ``step_use``'s segments in a run's summary.
SEGMENT_NS = 5 * S


def step_use(e: TwinEngine, from_ns: int, to_ns: int) -> dict:
    """How the engine's steps that started in [``from_ns``, ``to_ns``) used it: means per step
    that ran a model, the share of those that ran ``active_cap`` requests, preemptions in all."""
    busy = [i for i, t in enumerate(e.started_ns) if from_ns <= t < to_ns and e.gpu_ms[i] > 0]
    if not busy:
        return {"steps": 0}

    def mean(values: Sequence[float]) -> float:
        return sum(values[i] for i in busy) / len(busy)

    return {
        "steps": len(busy),
        "mean_scheduled_requests": mean(e.scheduled),
        "share_with_every_active_slot_used": sum(1 for i in busy if e.scheduled[i] >= e.active_cap) / len(busy),
        "mean_held_requests": mean(e.held),
        "mean_kv_usage": mean(e.kv_usage),
        "mean_decodes": mean(e.decodes),
        "mean_prefill_tokens": mean(e.prefill),
        "mean_gpu_ms": mean(e.gpu_ms),
        "preemptions": sum(e.preempted[i] for i in busy),
    }


def summary(e: TwinEngine, workload: Workload, duration_s: float, decode_step_ms: float) -> dict:
    """Figures of one engine's run (JSON-ready).  ``measured``: throughput and the capped
    users' charged tokens from the engine's ``measure_from_s`` to ``duration_s`` only."""
    busy = [i for i, g in enumerate(e.gpu_ms) if g > 0]
    cpu_us = [e.cpu_ns[i] / 1000 for i in busy]
    gpu_ms = [e.gpu_ms[i] for i in busy]
    total_out = sum(e.output_tokens.values())
    row: dict = {
        "engine": e.name,
        "steps": len(e.cpu_ns),
        "idle_steps": e.idle_steps,
        "simulated_s": duration_s,
        "output_tokens": total_out,
        "throughput_tok_s": total_out / duration_s,
        "scheduler_cpu_us_per_step": {
            "mean": sum(cpu_us) / len(cpu_us) if cpu_us else None,
            "p50": percentile(cpu_us, 0.5),
            "p99": percentile(cpu_us, 0.99),
        },
        "scheduler_wall_us_per_step_mean": (sum(e.wall_ns[i] for i in busy) / 1000 / len(busy)) if busy else None,
        "gpu_ms_per_step_mean": sum(gpu_ms) / len(gpu_ms) if gpu_ms else None,
        "cpu_fraction_of_gpu_step": (sum(cpu_us) / 1000 / sum(gpu_ms)) if gpu_ms else None,
        "cpu_fraction_of_decode_step": ((sum(cpu_us) / len(cpu_us)) / 1000 / decode_step_ms) if cpu_us else None,
        "mean_decodes_per_step": sum(e.decodes[i] for i in busy) / len(busy) if busy else 0,
        "mean_prefill_tokens_per_step": sum(e.prefill[i] for i in busy) / len(busy) if busy else 0,
    }
    capped = {}
    for user, limit in workload.capped.items():
        out = e.output_tokens.get(user, 0)
        charged = out + workload.input_token_weight * e.prompt_charged.get(user, 0)
        times = e.sample_times.get(user, [])
        worst_1s = max_in_window(times, S) if times else 0
        capped[user] = {
            "limit_tok_s": limit,
            "output_tokens": out,
            "prompt_tokens_charged": e.prompt_charged.get(user, 0),
            "charged_tokens": charged,
            "achieved_over_limit": charged / (limit * duration_s),
            "max_output_in_any_1s": worst_1s,
            "bound_1s": (1 + 0.1) * limit + 1,
        }
    row["capped"] = capped
    if capped:
        ratios = [c["achieved_over_limit"] for c in capped.values()]
        row["capped_worst_ratio"] = max(ratios, key=lambda r: abs(r - 1))
    span = duration_s - e.measure_from_ns / S
    if span > 0:
        measured: dict = {"from_s": e.measure_from_ns / S, "to_s": duration_s,
                          "output_tokens": sum(e.output_measured.values()),
                          "throughput_tok_s": sum(e.output_measured.values()) / span, "capped": {}}
        for user, limit in workload.capped.items():
            weight = workload.input_token_weight if e.input_token_weight is None else e.input_token_weight
            charged = e.output_measured.get(user, 0) + weight * e.prompt_measured.get(user, 0)
            measured["capped"][user] = charged / (limit * span)
        if measured["capped"]:
            measured["capped_worst_ratio"] = max(measured["capped"].values(), key=lambda r: abs(r - 1))
        measured["steps"] = step_use(e, e.measure_from_ns, int(duration_s * S))
        measured["in_quota_prompt_tokens"] = sum(e.prompt_measured.get(u, 0) for u in workload.in_quota)
        measured["segments"] = [
            {"from_s": a / S, **step_use(e, a, min(a + SEGMENT_NS, int(duration_s * S)))}
            for a in range(e.measure_from_ns, int(duration_s * S), SEGMENT_NS)
        ]
        row["measured"] = measured
    windows = []
    equal = sorted(u for u, w in workload.borrowers.items() if w == 1)
    for t, reading in e.fairness_readings:
        ws = reading.weighted_service
        eq = [ws[u] for u in equal if u in ws]
        windows.append({
            "end_s": t,
            "backlogged_borrowers": reading.backlogged_users,
            "jain_equal_weight": jain_index(eq),
            "equal_weight_counted": len(eq),
            "gap_equal_weight_tokens": largest_gap(eq),
            "jain_weighted_all": reading.jain,
            "gap_weighted_all_tokens": reading.gap_tokens,
            "weighted_service": dict(ws),
        })
    row["fairness_windows"] = windows
    firsts = [ms for user in workload.in_quota for ms in e.first_token_ms.get(user, [])]
    row["in_quota_first_token_ms"] = {
        "requests": len(firsts),
        "p50": percentile(firsts, 0.5),
        "p99": percentile(firsts, 0.99),
    }
    return row
