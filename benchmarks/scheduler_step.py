"""Scheduler step cost: stock vLLM ``Scheduler`` vs ours, in one process.

No model runs.  Both schedulers are vLLM's real classes with a real KV cache
manager; each step is ``schedule()`` plus ``update_from_output()`` with a
fabricated output (one sampled token per request at a sampling position),
and the limiter reads a fake clock advanced 10 ms per step.  Reported: the
median microseconds per step over blocks of steps that alternate between
the two schedulers.

Scenarios, at R resident requests for R in {16, 64, 256, 1024}:

``never_hit``
    Limits configured but never reached (1e9 tok/s), every resident request
    decoding (R requests over 2 users), active cap = R.  Compared with stock vLLM on the same workload;
    target: ours / stock <= 1.05.
``throttled_90``
    90 % of resident requests belong to 14 throttled users (1 tok/s), the rest
    to 2 users whose limit is never hit; active cap 16.
    Target: ours at R=1024 <= 2 x ours at R=64 (the step follows the active
    requests and throttled *users*, not throttled requests).  Stock vLLM
    cannot hold more than the active cap resident, so it has no equivalent;
    for reference the table shows stock with R running requests.

Wall-clock ratios move by several percent from run to run on a shared
2-core machine.  ``--instructions`` adds a repeatable figure: each scheduler
runs the same workload in its own process under valgrind's callgrind, and
only the instructions executed inside ``schedule()`` and
``update_from_output()`` are collected (client requests toggle collection;
their own cost is measured and subtracted; ``PYTHONHASHSEED=0``).

Usage: ``python benchmarks/scheduler_step.py [--instructions]`` (writes
``docs/benchmarks/scheduler_step.json`` and ``.png``; ``--out PREFIX`` elsewhere).  Figures are
CPU-only and machine-dependent.

``--borrowing`` measures what borrowing costs a lone borrower's step: one
user with 3 R streams at active cap R (``--max-num-seqs`` 4 R), so R run and
2 R wait, as in the fair-share benchmark's lone-borrower comparison (R = 4
there); that user ``{rate: 10, ceil: null}`` (always over its rate: every
token borrowed) against the same user with a limit never hit, and stock vLLM
at ``--max-num-seqs`` R; ``--instructions`` adds each side's callgrind count
per step (the borrower's ratio to never hit, free of the machine's load).
Writes ``PREFIX_borrowing.json``.

``--store`` measures only ours with the shared store against ours with the
in-memory limiter (limits never hit; ``--instructions`` adds the callgrind
counts): a real redis-server is started on 127.0.0.1 (stopped by PID), the
scheduler builds its lease limiter from ``additional_config`` as an engine
does, and the lease thread's work (round trips to Redis) runs between
steps, outside the measured calls, because in an engine it runs on its own
thread: the step itself never waits on Redis.  Writes ``PREFIX_store.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402

from vllm_output_rate.tools.render import figure_metadata, sibling_json  # noqa: E402
from vllm_output_rate.tools.redisproc import RedisProcess  # noqa: E402
from vllm_output_rate_harness import benchkit  # noqa: E402
from vllm_output_rate_harness.benchkit import CALIBRATION_TOGGLES, RESULTS_DIR  # noqa: E402
from vllm_output_rate_harness.scheduler_sim import MS, TOKEN, Harness  # noqa: E402

SCHEMA = "vllm-output-rate-scheduler-step/1"
RESIDENT = (16, 64, 256, 1024)
PROMPT_LEN = 8
THROTTLED_USERS = 14  # U = 16 users whatever R is: 14 throttled (1 tok/s) ...
FREE_USERS = 2  # ... and 2 whose limit is never hit
WARMUP_STEPS = 40
MEASURED_TOKENS = 1200  # upper bound on steps measured per build (steps x reps)
LONG = 1_000_000  # max_tokens: nobody finishes during a measurement
#: What each scenario is, and the targets it is judged by (kept in the JSON for the page).
SCENARIOS = {
    "never_hit": "limits never hit, active = R",
    "throttled_90": "90 % throttled, active cap 16 (ours)",
}
TARGETS = {"never_hit_ratio": 1.05, "throttled_90_scaling_1024_over_64": 2.0}


def limits(default, **users):
    return {"default_user_output_tokens_per_second": default, "user_output_tokens_per_second": users}


#: Environment variable naming the Redis of ``--store`` (read by callgrind children too).
STORE_ENV = "SCHEDULER_STEP_STORE_URL"


def pump_leases(h: Harness) -> None:
    """The lease thread's work at the harness clock's now (shared store only)."""
    rounds = getattr(getattr(h.sched, "output_rate_limiter", None), "rounds", None)
    if rounds is not None:
        rounds.pump(h.clock())


def build(scenario: str, resident: int, ours: bool, store_url: str | None = None) -> Harness:
    throttled = scenario == "throttled_90"
    active = 16 if (throttled and ours) else resident
    # Room for every request's whole life in the run: no preemption noise.
    blocks = resident * ((PROMPT_LEN + WARMUP_STEPS + MEASURED_TOKENS) // 16 + 2) + 64
    config = (limits(1e9, **({} if not throttled else {f"t{i}": 1.0 for i in range(THROTTLED_USERS)}))
              if ours else None)
    if store_url is not None:
        config["store"] = {"url": store_url, "prefix": f"step-bench-{os.getpid()}-{time.monotonic_ns()}"}
    h = Harness(
        config,
        max_num_seqs=resident,
        max_num_active_seqs=active,
        num_blocks=blocks,
        max_num_batched_tokens=max(2048, resident * PROMPT_LEN),
        max_model_len=2048,
    )
    n_throttled = int(resident * 0.9) if throttled else 0
    for i in range(resident):
        if i < n_throttled:
            user = f"t{i % THROTTLED_USERS}"
        else:
            user = f"u{i % FREE_USERS}"
        h.add(user, prompt_len=PROMPT_LEN, max_tokens=LONG)
    if store_url is not None:
        # The lease limiter the scheduler built: rounds on the fake clock,
        # run by pump_leases between steps instead of by its thread.
        h.sched.output_rate_limiter.rounds.drive_by_hand(h.clock)
    # Admit and prefill everybody, then let throttled users spend their burst.
    for _ in range(WARMUP_STEPS):
        h.step(10 * MS)
        pump_leases(h)
    return h


def fabricated_output(out) -> ModelRunnerOutput:
    """What the model runner would return: one token per scheduled request."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[TOKEN]] * len(req_ids),
    )


def time_steps(h: Harness, steps: int) -> list[float]:
    """Microseconds in ``schedule()`` + ``update_from_output()`` per step.

    Building the fabricated runner output is not counted: it is no part of
    either scheduler.
    """
    sched = h.sched
    clock = time.perf_counter_ns
    samples = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            t0 = clock()
            out = sched.schedule()
            t1 = clock()
            runner = fabricated_output(out)
            t2 = clock()
            sched.update_from_output(out, runner)
            t3 = clock()
            samples.append((t1 - t0 + t3 - t2) / 1000)
            h.clock.advance(10 * MS)
            pump_leases(h)  # not timed: the lease thread's work (shared store only)
    finally:
        gc.enable()
    return samples


def alternating_blocks(harnesses: dict[str, Harness], steps: int, reps: int) -> dict[str, list[list[float]]]:
    """``reps`` timed blocks of ``steps`` steps per harness, the order reversed every other
    round, so a drift of the machine falls on every side alike: each side's blocks."""
    blocks: dict[str, list[list[float]]] = {who: [] for who in harnesses}
    for rep in range(reps):
        order = list(harnesses) if rep % 2 == 0 else list(reversed(harnesses))
        for who in order:
            blocks[who].append(time_steps(harnesses[who], steps))
    return blocks


def _pooled(blocks: list[list[float]]) -> list[float]:
    return [sample for block in blocks for sample in block]


def measure_pair(scenario: str, resident: int, steps: int, reps: int) -> dict:
    """Stock and ours built side by side, timed in alternating blocks.

    Alternating blocks of ``steps`` steps share whatever the machine is doing
    and the growth of the sequences, so their ratio is fair even when the
    absolute figures drift.
    """
    harnesses = {"stock": build(scenario, resident, False), "ours": build(scenario, resident, True)}
    blocks = alternating_blocks(harnesses, steps, reps)
    row = {
        who: {
            "us_per_step": statistics.median(_pooled(blocks[who])),
            "block_medians_us": [statistics.median(block) for block in blocks[who]],
            "resident": len(harnesses[who].sched.running),
            "waiting": len(harnesses[who].sched.waiting),
        }
        for who in harnesses
    }
    row["ratio"] = row["ours"]["us_per_step"] / row["stock"]["us_per_step"]
    return row


# --------------------------------------------------------------------------
# Instruction counts (callgrind): a repeatable companion to the wall clock
# --------------------------------------------------------------------------

#: Steps counted per build, by R: with every request decoding, the count per
#: step barely moves from step to step.
INSTRUCTION_STEPS = {16: 100, 64: 60, 256: 20, 1024: 8}
#: Ours with 90 % throttled varies from step to step (who gets quota when),
#: and is cheap: count many steps.
THROTTLED_OURS_STEPS = 200


def instruction_steps(scenario: str, resident: int, who: str) -> int:
    if scenario == "throttled_90" and who == "ours":
        return THROTTLED_OURS_STEPS
    return INSTRUCTION_STEPS.get(resident, 20)


def count_child(scenario: str, resident: int, who: str, steps: int, helper: str) -> None:
    """Runs under callgrind: only schedule() and update_from_output() are collected.

    Collection is toggled on around each of the two calls.  The toggles
    themselves (a ctypes call each) are measured separately ("calibrate",
    empty on/off pairs) so that the parent can subtract them.
    """
    if who == "ours-plain":
        disable_fast_paths()
    store_url = os.environ[STORE_ENV] if who == "ours-store" else None
    if scenario == "borrowing":
        h = build_lone_user(who, resident)
    else:
        h = build(scenario, resident, who != "stock", store_url)
    cg = ctypes.CDLL(helper)
    toggle = cg.cg_toggle
    sched = h.sched
    gc.collect()
    gc.disable()
    cg.cg_begin()
    for _ in range(CALIBRATION_TOGGLES):
        toggle()
        toggle()
    cg.cg_dump(b"calibrate")
    for _ in range(steps):
        toggle()
        out = sched.schedule()
        toggle()
        runner = fabricated_output(out)
        toggle()
        sched.update_from_output(out, runner)
        toggle()
        h.clock.advance(10 * MS)
        pump_leases(h)  # not collected (shared store only)
    cg.cg_dump(b"measured")


def disable_fast_paths() -> None:
    """Ours without its two fast paths, for measuring what they earn.

    * the repeated step (``StepGate.steady``): every step is planned;
    * the stock per-request hook in the running loop when every visible
      request is prepaid: every request goes through the charging hook.
    """
    from vllm_output_rate.adapter import scheduler
    from vllm_output_rate.policy.gate import StepGate

    StepGate.steady = lambda self, now_ns, slots: False
    init = scheduler._Step.__init__

    def every_request_checked(self, plan, prepaid, all_visible_paid, running_at_start, **kwargs):
        init(self, plan, prepaid, False, running_at_start, **kwargs)

    scheduler._Step.__init__ = every_request_checked


def count_cells(cells: list[tuple[str, int, str]]) -> dict:
    """Instructions per step of each (scenario, resident, who) cell.

    Counts do not depend on what else the machine runs, so the children run
    side by side, one per core.
    """
    with tempfile.TemporaryDirectory(prefix="cgctl-") as tmp:
        helper = benchkit.build_callgrind_helper(Path(tmp))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return dict(zip(cells, pool.map(
                lambda cell: count_instructions(*cell, instruction_steps(*cell), helper),
                cells,
            )))


def measure_fast_paths(sizes: list[int]) -> dict:
    """Instructions per step, limits never hit: stock, ours, ours without fast paths."""
    whos = ("stock", "ours", "ours-plain")
    cells = [("never_hit", r, who) for r in sizes for who in whos]
    counts = count_cells(cells)
    results = {}
    for r in sizes:
        row = {who: counts[("never_hit", r, who)] for who in whos}
        row["fast_path_saving"] = 1 - row["ours"] / row["ours-plain"]
        results[r] = row
        print(
            f"never_hit R={r:5d}  stock {row['stock'] / 1e6:8.3f} M  ours {row['ours'] / 1e6:8.3f} M  "
            f"plain {row['ours-plain'] / 1e6:8.3f} M  fast paths save {100 * row['fast_path_saving']:.2f} %",
            flush=True,
        )
    return results


def measure_store(sizes: list[int], steps: int, reps: int, instructions: bool) -> dict:
    """Ours with the shared (Redis lease) store vs ours in memory, limits never hit."""
    server = RedisProcess().start()
    os.environ[STORE_ENV] = server.url
    results: dict = {}
    try:
        for r in sizes:
            harnesses = {"ours": build("never_hit", r, True),
                         "ours-store": build("never_hit", r, True, server.url)}
            blocks = alternating_blocks(harnesses, steps, reps)
            lim = harnesses["ours-store"].sched.output_rate_limiter
            row = {who: {"us_per_step": statistics.median(_pooled(b))} for who, b in blocks.items()}
            row["ratio"] = row["ours-store"]["us_per_step"] / row["ours"]["us_per_step"]
            row["lease_stats"] = dict(lim.stats)
            # Same steps, same tokens charged: the store never refused anyone.
            for who, h in harnesses.items():
                row[who]["tokens_charged"] = sum(h.sched.output_rate_gate.ledger.charged_tokens.values())
            # What the lease thread does per round, timed alone (not in a step).
            t0 = time.perf_counter_ns()
            rounds = 20
            for _ in range(rounds):
                harnesses["ours-store"].clock.advance(60 * MS)
                lim.rounds.run(harnesses["ours-store"].clock())
            row["lease_round_us"] = (time.perf_counter_ns() - t0) / rounds / 1000
            results[r] = row
            for h in harnesses.values():
                h.sched.shutdown()
            print(
                f"store never_hit R={r:5d}  in-memory {row['ours']['us_per_step']:9.1f} us  "
                f"redis lease {row['ours-store']['us_per_step']:9.1f} us  ratio {row['ratio']:.3f}  "
                f"(a lease round, off the step: {row['lease_round_us']:.0f} us; tokens charged "
                f"{row['ours']['tokens_charged']} / {row['ours-store']['tokens_charged']})",
                flush=True,
            )
        if instructions:
            cells = [("never_hit", r, who) for r in sizes for who in ("ours", "ours-store")]
            counts = count_cells(cells)
            for r in sizes:
                row = results[r]
                for who in ("ours", "ours-store"):
                    row[who]["instructions_per_step"] = counts[("never_hit", r, who)]
                row["instructions_ratio"] = (
                    row["ours-store"]["instructions_per_step"] / row["ours"]["instructions_per_step"]
                )
                print(
                    f"store never_hit R={r:5d}  in-memory {row['ours']['instructions_per_step'] / 1e6:8.3f} M  "
                    f"redis lease {row['ours-store']['instructions_per_step'] / 1e6:8.3f} M instructions/step  "
                    f"ratio {row['instructions_ratio']:.4f}",
                    flush=True,
                )
    finally:
        server.stop()
    return results


#: ``--borrowing``'s active caps (R): the fair-share benchmark's 4 and 8, then larger batches.
BORROWING_ACTIVE = (4, 8, 16, 64, 256)
#: The lone borrower's own rate: far below what it gets, so every token it samples is borrowed.
BORROWER_RATE = 10.0
BORROWING_SIDES = ("stock", "ours", "ours-borrower")


def build_lone_user(who: str, active: int) -> Harness:
    """One user with 3 x ``active`` streams that never finish: ``active`` run, the rest wait.

    ``stock``: vLLM's own scheduler with ``max_num_seqs`` = ``active``.  Ours
    (``--max-num-seqs`` 4 x ``active``, ``--max-num-active-seqs`` ``active``, as
    the fair-share servers): ``ours`` with that user's limit never hit,
    ``ours-borrower`` with it ``{rate: BORROWER_RATE, ceil: null}``.
    """
    streams = 3 * active
    config = None
    if who != "stock":
        config = limits(1e9, **({"lone": {"rate": BORROWER_RATE, "ceil": None}} if who == "ours-borrower" else {}))
    h = Harness(
        config,
        max_num_seqs=active if who == "stock" else 4 * active,
        max_num_active_seqs=None if who == "stock" else active,
        num_blocks=active * ((PROMPT_LEN + WARMUP_STEPS + MEASURED_TOKENS) // 16 + 2) + 64,
        max_num_batched_tokens=max(2048, streams * PROMPT_LEN),
        max_model_len=2048,
    )
    for _ in range(streams):
        h.add("lone", prompt_len=PROMPT_LEN, max_tokens=LONG)
    for _ in range(WARMUP_STEPS):  # admit and prefill; the borrower spends its burst
        h.step(10 * MS)
    return h


def measure_borrowing(sizes: list[int], steps: int, reps: int) -> dict:
    """µs per step of a lone borrower, the same user unlimited, and stock, in alternating blocks."""
    results: dict = {}
    for active in sizes:
        harnesses = {who: build_lone_user(who, active) for who in BORROWING_SIDES}
        blocks = alternating_blocks(harnesses, steps, reps)
        row: dict = {}
        for who, h in harnesses.items():
            row[who] = {"us_per_step": statistics.median(_pooled(blocks[who])), "running": len(h.sched.running),
                        "waiting": len(h.sched.waiting)}
        borrower = harnesses["ours-borrower"].sched
        # The borrower's side really borrowed: every token of the timed steps past its rate.
        row["ours-borrower"]["borrowed_tokens"] = int(sum(borrower.output_rate_gate.borrowing.borrowed_tokens.values()))
        row["borrower_over_unlimited"] = row["ours-borrower"]["us_per_step"] / row["ours"]["us_per_step"]
        row["borrower_extra_us"] = row["ours-borrower"]["us_per_step"] - row["ours"]["us_per_step"]
        results[active] = row
        print(
            f"borrowing R={active:4d}  stock {row['stock']['us_per_step']:8.1f} us  ours (never hit) "
            f"{row['ours']['us_per_step']:8.1f} us  ours (borrower) {row['ours-borrower']['us_per_step']:8.1f} us  "
            f"borrower / unlimited {row['borrower_over_unlimited']:.3f} (+{row['borrower_extra_us']:.0f} us)",
            flush=True,
        )
    return results


def measure_borrowing_instructions(sizes: list[int]) -> dict:
    """Instructions per step of each side of the lone-borrower scenario
    (callgrind, as ``--instructions``): unlike its wall clock, a figure a
    loaded machine does not move."""
    cells = [("borrowing", r, who) for r in sizes for who in BORROWING_SIDES]
    counts = count_cells(cells)
    results: dict = {}
    for r in sizes:
        row: dict = {who: {"instructions_per_step": counts[("borrowing", r, who)]} for who in BORROWING_SIDES}
        row["steps"] = instruction_steps("borrowing", r, "ours")
        row["borrower_over_unlimited"] = (
            row["ours-borrower"]["instructions_per_step"] / row["ours"]["instructions_per_step"])
        results[r] = row
        print(
            f"borrowing R={r:4d}  instructions/step: stock {row['stock']['instructions_per_step'] / 1e6:8.3f} M  "
            f"ours (never hit) {row['ours']['instructions_per_step'] / 1e6:8.3f} M  ours (borrower) "
            f"{row['ours-borrower']['instructions_per_step'] / 1e6:8.3f} M  "
            f"borrower / unlimited {row['borrower_over_unlimited']:.3f}",
            flush=True,
        )
    return results


def count_instructions(scenario: str, resident: int, who: str, steps: int, helper: Path) -> float:
    """Instructions per step, from one child process under callgrind."""
    with tempfile.TemporaryDirectory(prefix="cg-") as tmp:
        out_dir = Path(tmp)
        cmd = [
            *benchkit.callgrind_command(out_dir),
            sys.executable, __file__, "--count-child", scenario, str(resident), who,
            str(steps), str(helper),
        ]
        env = dict(os.environ, PYTHONHASHSEED="0")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"callgrind child failed:\n{done.stderr[-3000:]}")
        calibrate = benchkit.dumped_instructions(out_dir, "calibrate")
        measured = benchkit.dumped_instructions(out_dir, "measured")
    per_toggle_pair = calibrate / CALIBRATION_TOGGLES
    return (measured - 2 * steps * per_toggle_pair) / steps


def measure_instructions(sizes: list[int]) -> dict:
    """Instructions per step for every scenario, size and scheduler."""
    cells = [(scenario, r, who) for scenario in ("never_hit", "throttled_90")
             for r in sizes for who in ("stock", "ours")]
    counts = count_cells(cells)
    results: dict = {"never_hit": {}, "throttled_90": {}}
    for scenario in results:
        for r in sizes:
            row = {who: {"instructions_per_step": counts[(scenario, r, who)]} for who in ("stock", "ours")}
            row["steps"] = {who: instruction_steps(scenario, r, who) for who in ("stock", "ours")}
            row["ratio"] = row["ours"]["instructions_per_step"] / row["stock"]["instructions_per_step"]
            results[scenario][r] = row
            print(
                f"{scenario:13s} R={r:5d}  stock {row['stock']['instructions_per_step'] / 1e6:8.3f} M  "
                f"ours {row['ours']['instructions_per_step'] / 1e6:8.3f} M instructions/step  "
                f"ratio {row['ratio']:.3f}",
                flush=True,
            )
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--count-child":
        scenario, resident, who, steps, helper = sys.argv[2:7]
        count_child(scenario, int(resident), who, int(steps), helper)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "scheduler_step"), metavar="PREFIX",
                    help="writes PREFIX.json and PREFIX.png; --fast-paths PREFIX_fast_paths.json, "
                    "--store PREFIX_store.json (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=10, help="timed blocks per scheduler")
    ap.add_argument("--resident", default=",".join(map(str, RESIDENT)))
    ap.add_argument(
        "--instructions", action="store_true",
        help="also count instructions per step under callgrind (repeatable; "
        "needs valgrind and gcc; adds a few minutes)",
    )
    ap.add_argument(
        "--fast-paths", action="store_true",
        help="only count instructions per step (never hit) for stock, ours and ours "
        "without its fast paths; writes PREFIX_fast_paths.json",
    )
    ap.add_argument(
        "--borrowing", action="store_true",
        help="only a lone borrower's step against the same user unlimited and stock, at active caps "
        f"{','.join(map(str, BORROWING_ACTIVE))} (or --resident); writes PREFIX_borrowing.json",
    )
    ap.add_argument(
        "--store", action="store_true",
        help="only ours with the shared Redis lease store vs ours in memory (limits never "
        "hit; starts a redis-server); with --instructions also by callgrind; writes PREFIX_store.json",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.resident.split(",")]
    if args.borrowing:
        if args.resident == ap.get_default("resident"):
            sizes = list(BORROWING_ACTIVE)
        doc = benchkit.start_report(SCHEMA + "-borrowing", args)
        doc.update({"steps": args.steps, "reps": args.reps, "borrower_rate": BORROWER_RATE,
                    "results": measure_borrowing(sizes, args.steps, args.reps)})
        if args.instructions:
            doc["instructions"] = measure_borrowing_instructions(sizes)
        benchkit.write_outputs(benchkit.finish_report(doc), args.out, suffix="_borrowing")
        return
    if args.store:
        doc = benchkit.start_report(SCHEMA + "-store", args)
        doc.update({"targets": {"ratio": TARGETS["never_hit_ratio"]}, "steps": args.steps,
                    "reps": args.reps,
                    "results": measure_store(sizes, args.steps, args.reps, args.instructions)})
        rows = doc["results"].values()
        doc["worst_ratio"] = max(row["ratio"] for row in rows)
        if args.instructions:
            doc["instructions_worst_ratio"] = max(row["instructions_ratio"] for row in rows)
        benchkit.write_outputs(benchkit.finish_report(doc), args.out, suffix="_store")
        return
    if args.fast_paths:
        doc = benchkit.start_report(SCHEMA + "-fast-paths", args)
        doc["results"] = measure_fast_paths(sizes)
        # The fast paths stay while they save at least this much at every size.
        doc["targets"] = {"fast_path_saving": 0.01}
        benchkit.write_outputs(benchkit.finish_report(doc), args.out, suffix="_fast_paths")
        return
    doc = benchkit.start_report(SCHEMA, args)
    results: dict = {"never_hit": {}, "throttled_90": {}}
    for scenario in results:
        for r in sizes:
            row = measure_pair(scenario, r, args.steps, args.reps)
            results[scenario][r] = row
            print(
                f"{scenario:13s} R={r:5d}  stock {row['stock']['us_per_step']:9.1f} us  "
                f"ours {row['ours']['us_per_step']:9.1f} us  ratio {row['ratio']:.3f}  "
                f"(ours resident {row['ours']['resident']}, waiting {row['ours']['waiting']})",
                flush=True,
            )
    t90 = results["throttled_90"]
    scaling = None
    if 64 in t90 and 1024 in t90:
        scaling = t90[1024]["ours"]["us_per_step"] / t90[64]["ours"]["us_per_step"]
        print(f"throttled_90: ours R=1024 / R=64 = {scaling:.2f} (target <= 2)")
    worst = max(row["ratio"] for row in results["never_hit"].values())
    print(f"never_hit: worst ours/stock = {worst:.3f} (target <= 1.05)")
    doc.update({
        "scenarios": SCENARIOS,
        "targets": TARGETS,
        "steps": args.steps,
        "reps": args.reps,
        "results": results,
        "never_hit_worst_ratio": worst,
        "throttled_90_scaling_1024_over_64": scaling,
    })
    if args.instructions:
        counted = measure_instructions(sizes)
        doc["instructions"] = counted
        doc["instructions_never_hit_worst_ratio"] = max(
            row["ratio"] for row in counted["never_hit"].values()
        )
        c90 = counted["throttled_90"]
        if 64 in c90 and 1024 in c90:
            doc["instructions_throttled_90_scaling_1024_over_64"] = (
                c90[1024]["ours"]["instructions_per_step"] / c90[64]["ours"]["instructions_per_step"]
            )
        print(f"instructions, never_hit: worst ours/stock = "
              f"{doc['instructions_never_hit_worst_ratio']:.3f} (target <= 1.05)")
    benchkit.write_outputs(benchkit.finish_report(doc), args.out, plot=plot)


def plot(doc: dict, path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, scenario, title in (
        (axes[0], "never_hit", "limits never hit (active = R)"),
        (axes[1], "throttled_90", "90% throttled (ours: active cap 16)"),
    ):
        rows = doc["results"][scenario]
        rs = sorted(int(r) for r in rows)
        for who, style in (("stock", "o--"), ("ours", "s-")):
            ax.plot(rs, [rows[r][who]["us_per_step"] for r in rs], style, label=who)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("resident requests R")
        ax.set_ylabel("µs per step (schedule + update)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=figure_metadata(source or sibling_json(path)))


if __name__ == "__main__":
    main()
