#!/usr/bin/env python
"""Single-stream inter-token latency: limits never hit vs the feature off.

What
    One client, one streaming completion at a time (``ignore_eos``,
    ``--max-tokens`` tokens each), against two servers on the same model:

    * ``stock``:  ``vllm-output-rate serve MODEL`` (plugin off: vLLM's own
      scheduler, engine loop and 1 s worker spin);
    * ``plugin``: the same plus ``--default-user-output-tokens-per-second
      100000`` (every token goes through the limiter and the shortened
      worker spin of ``adapter/worker_idle.py``; nobody is ever throttled).

    The figure is measured on the server, not on client receive times (a
    streaming client on this 2-core box stalls up to ~1 s under load and
    delivers tokens in bunches): requests run strictly one after another, and
    around each one the script reads ``vllm:inter_token_latency_seconds``
    ``_sum`` and ``_count`` from ``/metrics``.  Their deltas are that
    request's exact mean inter-token latency on the engine core's own output
    timestamps (vLLM stamps ``EngineCoreOutputs.timestamp`` in the engine
    process; the histogram's sum and count are not bucketed).  Per side the
    headline is the median over all requests of these per-request means
    ("ITL p50"), compared plugin / stock (target: within 3 %).  The client's
    own receive-gap p50 is reported beside it for reference only.

How
    Both servers are started first and stay up; then blocks of
    ``--requests`` requests alternate between them (S P, P S, S P, ...), so
    that the shared machine's load, which drifts by tens of percent within
    minutes here, hits both sides alike and only two server startups are
    paid.  The server not being measured is idle (a stock worker stops
    spinning 1 s after its last step; each block starts after a 1.5 s pause).
    The first ``--warmup-requests`` requests of every block are discarded.
    Per block: load averages and the CPU used by both servers' process trees
    and by other processes ("foreign"); compare them before trusting a small
    difference.  Servers are stopped by PID at the end.

Engine-side instructions (``--instructions``)
    The wall-clock figure above moves with the shared machine's load by more
    than the 3 % it is judged against.  ``--instructions`` adds what the
    plugin costs the engine per token of one stream, independent of load:
    one engine per side (``vllm.LLM`` in this process's child, in-process
    engine core and executor, ``enforce_eager``, stats on as in a server)
    runs one request under valgrind's callgrind, and only the engine's own
    work is collected -- every ``EngineCore.step()`` and the front end's
    output processing (``LLMEngine.step()``), with the model's
    ``execute_model``/``sample_tokens`` switched off -- then ``schedule()``
    alone and ``update_from_output()`` alone.  The plugin's once-a-second
    work (per-user report, charge history) is not counted: its clock is
    pinned, because under valgrind a second is a few steps, not ~500 (it is
    a few hundred thousand instructions once a second in real time).
    Writes ``PREFIX_instructions.json``; about 10 minutes (vLLM starts under
    valgrind), both children side by side.

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/itl_single.py [--instructions]

writes ``docs/benchmarks/itl_single.json`` (``--out PREFIX`` elsewhere); two server
startups (~1-2 min each) plus ``--blocks`` x 2 blocks of ~10-20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from vllm_output_rate.tools import measure
from vllm_output_rate.tools.measure import DEFAULT_PROMPT, RequestRecord, run_request
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import (
    CALIBRATION_TOGGLES,
    RESULTS_DIR,
    fmt_load,
    loadavg,
    machine_line,
    table,
)

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-itl-single/1"
TARGET_RATIO = 1.03
ITL_METRIC = "vllm:inter_token_latency_seconds"
PLUGIN_ARGS = ["--default-user-output-tokens-per-second", "100000"]


def itl_totals(base_url: str) -> tuple[float, float]:
    """(sum seconds, count) of the server's inter-token latency histogram."""
    samples = measure.fetch_metrics(base_url, timeout=30)
    total = measure.metric_sum(samples, ITL_METRIC + "_sum") or 0.0
    count = measure.metric_sum(samples, ITL_METRIC + "_count") or 0.0
    return total, count


async def drive(base_url: str, model: str, args) -> list[dict]:
    body = measure.stream_body(model, "single", args.max_tokens)
    out = []
    async with benchkit.async_http(base_url, connections=4, read_timeout=60.0) as client:
        for i in range(args.warmup_requests + args.requests):
            s0, c0 = itl_totals(base_url)
            record = RequestRecord(user="single", stream=0, start=0.0)
            t0 = time.monotonic()
            await run_request(client, body, record, t0)
            await asyncio.sleep(0.05)  # let the front end record the last iteration
            s1, c1 = itl_totals(base_url)
            if record.error:
                raise RuntimeError(f"request failed: {record.error}")
            if i < args.warmup_requests:
                continue
            gaps = [b - a for a, b in zip(record.token_times, record.token_times[1:])]
            out.append({
                "tokens": record.n_tokens,
                "server_itl_count": c1 - c0,
                "server_itl_mean_ms": 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None,
                "client_gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                "client_wall_s": (record.end or 0.0) - record.start,
            })
    return out


def measure_block(side: str, server, model: str, args, index: int) -> dict:
    time.sleep(1.5)  # the other server's worker (stock: 1 s spin) is idle by now
    load_start = loadavg()
    meter = benchkit.CpuMeter([server.pid])
    meter.start()
    requests = asyncio.run(drive(server.base_url, model, args))
    cpu = meter.stop()
    means = [r["server_itl_mean_ms"] for r in requests if r["server_itl_mean_ms"] is not None]
    client = [r["client_gap_p50_ms"] for r in requests if r["client_gap_p50_ms"] is not None]
    block = {
        "block": index,
        "side": side,
        "requests": requests,
        "server_itl_p50_ms": statistics.median(means),
        "client_gap_p50_ms": statistics.median(client) if client else None,
        "server_tree_percent": benchkit.as_share(sum(cpu["servers"][0].values()), cpu["wall_s"], 100, 1),
        # Everything but this server, the client included (as before the harness).
        "foreign_percent": benchkit.as_share(cpu["foreign"] + cpu["client"], cpu["wall_s"], 100, 1),
        "load_start": load_start,
        "load_end": loadavg(),
    }
    print(f"  block {index:2d} {side:6s} server ITL p50 {block['server_itl_p50_ms']:.3f} ms  client gap p50 "
          f"{block['client_gap_p50_ms']:.3f} ms  server {block['server_tree_percent']:.0f} %  "
          f"foreign {block['foreign_percent']:.0f} %  load {fmt_load(load_start)}", flush=True)
    return block


def analyse(blocks: list[dict]) -> dict:
    """``blocks``: the measured blocks in order (pairs of one stock, one plugin)."""
    out: dict = {"target_ratio": TARGET_RATIO}
    for side in ("stock", "plugin"):
        mine = [r for r in blocks if r["side"] == side]
        means = [q["server_itl_mean_ms"] for r in mine for q in r["requests"]
                 if q["server_itl_mean_ms"] is not None]
        out[side] = {
            "blocks": len(mine),
            "requests": len(means),
            "server_itl_p50_ms": statistics.median(means) if means else None,
            "server_itl_block_p50s_ms": [r["server_itl_p50_ms"] for r in mine],
            "client_gap_p50s_ms": [r["client_gap_p50_ms"] for r in mine],
        }
    s, p = out["stock"]["server_itl_p50_ms"], out["plugin"]["server_itl_p50_ms"]
    out["ratio"] = p / s if s and p else None
    pairs = []
    for i in range(0, len(blocks) - 1, 2):
        a, b = blocks[i], blocks[i + 1]
        by = {a["side"]: a, b["side"]: b}
        if set(by) == {"stock", "plugin"}:
            pairs.append(by["plugin"]["server_itl_p50_ms"] / by["stock"]["server_itl_p50_ms"])
    out["pair_ratios"] = pairs
    out["meets_target"] = None if out["ratio"] is None else out["ratio"] <= TARGET_RATIO
    return out


def report(doc: dict) -> str:
    a = doc["analysis"]
    rows = [[str(i), r["side"], f"{r['server_itl_p50_ms']:.3f}", f"{r['client_gap_p50_ms']:.3f}",
             f"{r['server_tree_percent']:.0f}", f"{r['foreign_percent']:.0f}", fmt_load(r["load_start"])]
            for i, r in enumerate(doc["blocks"])]
    parts = [table(["block", "side", "server ITL p50 ms", "client gap p50 ms", "server %", "foreign %",
                    "load 1/5/15"], rows)]
    if a["ratio"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        parts.append(
            f"server-side ITL p50 (median of per-request means): stock {a['stock']['server_itl_p50_ms']:.3f} ms, "
            f"plugin {a['plugin']['server_itl_p50_ms']:.3f} ms; ratio {a['ratio']:.3f} "
            f"({verdict} target <= {TARGET_RATIO}); per pair: "
            + ", ".join(f"{x:.3f}" for x in a["pair_ratios"]))
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------
# Engine-side instructions per step of one stream (callgrind)
# --------------------------------------------------------------------------

INSTRUCTION_STEPS = 40  # steps counted per phase
PHASES = ("step", "full", "schedule", "update")


def count_child(side: str, steps: int, helper: str, model: str) -> None:
    """Runs under callgrind (collection off until ``cg_begin``): one engine, one request.

    Dumps ``calibrate`` (empty toggle pairs), then one dump per phase:
    ``step`` (``LLMEngine.step()`` with the executor's calls excluded),
    ``schedule`` and ``update``.  Prints the number of toggles of each phase.
    """
    import ctypes
    import gc
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and model in this process
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"output_rate": {"default_user_output_tokens_per_second": 100000}}}
    llm = LLM(model, max_model_len=512, max_num_seqs=16, enforce_eager=True, disable_log_stats=False,
              **(extra if side == "plugin" else {}))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    sched = core.scheduler
    executor = core.model_executor
    cg = ctypes.CDLL(helper)
    toggles = [0]

    def toggle() -> None:
        toggles[0] += 1
        cg.cg_toggle()

    collecting = [False]

    def toggled(fn, only_while_collecting: bool):
        """``fn`` with collection flipped around each call: on for an
        ``included`` call, off inside a collected step for an ``excluded`` one."""

        def call(*args, **kwargs):
            if only_while_collecting and not collecting[0]:
                return fn(*args, **kwargs)
            toggle()
            try:
                return fn(*args, **kwargs)
            finally:
                toggle()

        return call

    def excluded(fn):  # collection off during fn while a whole step is collected
        return toggled(fn, only_while_collecting=True)

    def included(fn):  # collection on during fn only
        return toggled(fn, only_while_collecting=False)

    executor.execute_model = excluded(executor.execute_model)
    executor.sample_tokens = excluded(executor.sample_tokens)

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, ignore_eos=True, extra_args={"output_rate_user": "single"})

    for i in range(2):  # warm-up requests
        engine.add_request(f"warm-{i}", DEFAULT_PROMPT, params(64))
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request("measured", DEFAULT_PROMPT, params(len(PHASES) * steps + 40))
    for _ in range(10):  # prefill and the first decodes
        engine.step()
    if hasattr(sched, "output_rate_operate_clock"):
        # No once-a-second work (see the module doc).  Set on the class: a new
        # key in the instance's dict would cost every later attribute access
        # CPython's attribute caches and inflate the count.
        type(sched).output_rate_operate_clock = staticmethod(lambda: 0)
        sched._operate.next_tick = sched._operate.next_report = 1

    gc.collect()
    gc.disable()
    cg.cg_begin()
    for _ in range(CALIBRATION_TOGGLES):
        cg.cg_toggle()
        cg.cg_toggle()
    cg.cg_dump(b"calibrate")
    counts = {}
    toggles[0] = 0
    for _ in range(steps):
        collecting[0] = True
        toggle()
        engine.step()
        toggle()
        collecting[0] = False
    cg.cg_dump(b"step")
    counts["step"] = toggles[0]
    toggles[0] = 0
    for _ in range(steps):  # the same with the model: the whole work of one token
        toggle()
        engine.step()
        toggle()
    cg.cg_dump(b"full")
    counts["full"] = toggles[0]
    for phase, name in (("schedule", "schedule"), ("update", "update_from_output")):
        cls = type(sched)  # wrapped on the class, for the same reason as the clock
        own = cls.__dict__.get(name)
        setattr(cls, name, included(getattr(cls, name)))
        toggles[0] = 0
        for _ in range(steps):
            engine.step()
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)
        cg.cg_dump(phase.encode())
        counts[phase] = toggles[0]
    assert engine.has_unfinished_requests()  # every counted step ran the one request
    print("TOGGLES " + json.dumps(counts), flush=True)


def measure_instructions(model: str, steps: int) -> dict:
    """Instructions per step, stock and plugin side by side (one callgrind child each)."""
    import os
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    def run(side: str, helper: Path, tmp: Path) -> dict:
        out_dir = tmp / side
        out_dir.mkdir()
        cmd = [*benchkit.callgrind_command(out_dir), sys.executable, __file__, "--count-child",
               side, str(steps), str(helper), model]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_WAIT_POLICY="PASSIVE")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("TOGGLES ")), None)
        if done.returncode != 0 or line is None:
            raise RuntimeError(f"callgrind child ({side}) failed:\n{done.stderr[-3000:]}")
        toggles = json.loads(line.split(" ", 1)[1])
        per_toggle = benchkit.dumped_instructions(out_dir, "calibrate") / (2 * CALIBRATION_TOGGLES)
        return {phase: (benchkit.dumped_instructions(out_dir, phase) - toggles[phase] * per_toggle) / steps
                for phase in PHASES}

    with tempfile.TemporaryDirectory(prefix="itl-cg-") as tmp_name:
        tmp = Path(tmp_name)
        helper = benchkit.build_callgrind_helper(tmp)
        with ThreadPoolExecutor(max_workers=2) as pool:
            stock, plugin = pool.map(lambda side: run(side, helper, tmp), ("stock", "plugin"))
    return {
        "steps": steps,
        "stock": stock,
        "plugin": plugin,
        "ratio": {phase: plugin[phase] / stock[phase] for phase in PHASES},
        "extra_per_step": {phase: plugin[phase] - stock[phase] for phase in PHASES},
        # The plugin's engine-side extra against all the work of one token
        # (engine, model and output processing in one process).
        "extra_share_of_token": (plugin["step"] - stock["step"]) / stock["full"],
        "target_extra_share_of_token": TARGET_RATIO - 1,
    }


def instructions_report(doc: dict) -> str:
    rows = [[phase, f"{doc['stock'][phase] / 1e3:.1f}", f"{doc['plugin'][phase] / 1e3:.1f}",
             f"{doc['extra_per_step'][phase] / 1e3:+.1f}", f"{doc['ratio'][phase]:.3f}"] for phase in PHASES]
    return (table(["counted", "stock k instr/step", "plugin k instr/step", "plugin - stock", "ratio"], rows)
            + f"\nplugin's engine-side extra / stock's whole work per token: {100 * doc['extra_share_of_token']:.2f} %")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--count-child":
        side, steps, helper, model = sys.argv[2:6]
        count_child(side, int(steps), helper, model)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS_DIR / "itl_single"), metavar="PREFIX",
                        help="writes PREFIX.json (default: %(default)s)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model path (default: tiny model)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="block pairs, one stock and one plugin block each (default 4)")
    parser.add_argument("--requests", type=int, default=12, help="measured requests per block (default 12)")
    parser.add_argument("--warmup-requests", type=int, default=2, help="discarded per block (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra vllm serve argument for both sides, repeatable")
    parser.add_argument("--time-budget", type=float, default=900.0,
                        help="seconds; no new run starts after this (default 900)")
    parser.add_argument("--instructions", action="store_true",
                        help="only count the engine's instructions per step of one stream under "
                        "callgrind (load-independent); writes PREFIX_instructions.json")
    args = parser.parse_args(argv)

    if args.instructions:
        doc = benchkit.start_report(SCHEMA + "-instructions", args, PLUGIN_ARGS)
        doc.update(measure_instructions(str(Path(args.model).resolve()), INSTRUCTION_STEPS))
        benchkit.finish_report(doc)
        print(instructions_report(doc))
        benchkit.write_outputs(doc, args.out, suffix="_instructions")
        return 0
    log_dir = benchkit.log_dir_for("itl-single", args.log_dir)
    doc = benchkit.start_report(SCHEMA, args, PLUGIN_ARGS)
    t_begin = time.monotonic()
    blocks: list[dict] = []
    skipped = 0
    specs = [(f"itl-{side}", [*(PLUGIN_ARGS if side == "plugin" else []), *args.server_arg])
             for side in ("stock", "plugin")]
    with benchkit.running_engines(specs, log_dir, model=args.model) as started:
        servers = dict(zip(("stock", "plugin"), started))
        for (side, server), (_, server_args) in zip(servers.items(), specs):
            doc[f"{side}_startup_s"] = server.startup_s
            doc[f"{side}_server_args"] = server_args
            print(f"{side} server up in {server.startup_s:.0f} s", flush=True)
        model = benchkit.served_model(servers["stock"].base_url)
        for server in servers.values():
            itl_totals(server.base_url)  # the first /metrics request is slow
        for pair in range(args.blocks):
            if time.monotonic() - t_begin > args.time_budget:
                skipped += 1
                continue
            for side in (("stock", "plugin") if pair % 2 == 0 else ("plugin", "stock")):
                blocks.append(measure_block(side, servers[side], model, args, len(blocks)))
    doc["blocks"] = blocks
    doc["skipped_block_pairs"] = skipped
    benchkit.finish_report(doc)
    doc["analysis"] = analyse(blocks)
    print("\n" + report(doc))
    benchkit.write_outputs(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
