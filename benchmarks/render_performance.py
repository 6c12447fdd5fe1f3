"""Write ``docs/performance.md`` from the benchmarks' JSON in ``docs/benchmarks/``.

Every benchmark writes ``docs/benchmarks/NAME.json`` (and, for most, ``NAME.png``)
by default; ``vllm-output-rate demo`` / ``demo-cluster`` runs are kept there by
``python -m vllm_output_rate.tools.report``.  This script renders whatever of
them exists into one page and lists each missing result by name with the
command that makes it.  Each figure whose data is in its JSON is drawn again
from that JSON, by the benchmark's own ``plot`` (``docs/NAME.png``); the demos'
figures come from raw requests their kept JSON leaves out, so they are copied
from ``docs/benchmarks/NAME.png`` when there is one.  Every PNG carries the
sha256 of the JSON it belongs to (``render.DIGEST_KEY``); a figure that does
not is shown with a warning, and ``tests/tools/test_record.py`` fails.  The
page is written whole: nothing in it is typed by hand, so a change of text
belongs here and a change of figure belongs to a benchmark run.

Usage: ``python benchmarks/render_performance.py [--results docs/benchmarks] [--page docs/performance.md]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_output_rate.tools import demo_cluster, report
from vllm_output_rate.tools.analysis import BURST_S, shared_slack_s
from vllm_output_rate.tools.render import record_mismatch
from vllm_output_rate_harness.benchkit import RESULTS_DIR

COMMAND = "python benchmarks/render_performance.py"
Doc = dict[str, Any]

#: The command that writes each result file (stem under docs/benchmarks/).
MAKES = {
    "demo": "vllm-output-rate demo --out results/demo && python -m vllm_output_rate.tools.report "
            "--demo results/demo.json --png results/demo.png --out docs/benchmarks/demo",
    "demo-cluster": "vllm-output-rate demo-cluster --runs 3 --out results/demo-cluster && python -m "
                    "vllm_output_rate.tools.report --demo-cluster results/demo-cluster.json "
                    "--png results/demo-cluster.png --out docs/benchmarks/demo-cluster",
    "scheduler_step": "python benchmarks/scheduler_step.py --instructions",
    "scheduler_step_fast_paths": "python benchmarks/scheduler_step.py --fast-paths",
    "scheduler_step_store": "python benchmarks/scheduler_step.py --store --instructions",
    "scheduler_step_borrowing": "python benchmarks/scheduler_step.py --borrowing --instructions",
    "throughput_ratio": "make bench-model && python benchmarks/throughput_ratio.py",
    "offline_throughput": "python benchmarks/offline_throughput.py",
    "idle_cpu": "python benchmarks/idle_cpu.py",
    "idle_cpu_spin_off": "python benchmarks/idle_cpu.py --worker-spin-ms off --out docs/benchmarks/idle_cpu_spin_off",
    "idle_cpu_store": "python benchmarks/idle_cpu.py --store --out docs/benchmarks/idle_cpu_store",
    "idle_cpu_50u_2e": "python benchmarks/idle_cpu.py --users 50 --streams 1 --engines 2 --rate 10 "
                       "--out docs/benchmarks/idle_cpu_50u_2e",
    "idle_cpu_store_50u_2e": "python benchmarks/idle_cpu.py --users 50 --streams 1 --engines 2 --store --rate 10 "
                             "--out docs/benchmarks/idle_cpu_store_50u_2e",
    "itl_single": "python benchmarks/itl_single.py",
    "itl_single_instructions": "python benchmarks/itl_single.py --instructions",
    "kv_pressure": "python benchmarks/kv_pressure.py",
    "prompt_flood": "python benchmarks/prompt_flood.py",
    "soak": "python benchmarks/soak.py",
    "soak_cluster": "python benchmarks/soak.py --engines 2 --store redis-server --max-tokens 256 --out docs/benchmarks/soak_cluster",
    "shared_store": "python benchmarks/shared_store.py --cluster",
    "fair_share": "python benchmarks/fair_share.py",
    "fair_share-4active-tiny-llama": "python benchmarks/fair_share.py --slots few",
    "fair_share-4active-bench-llama": "python benchmarks/fair_share.py --active-seqs 4",
    "fair_share-in-quota-few": "python benchmarks/fair_share.py --mode shares --workload in-quota --slots few "
                               "--out docs/benchmarks/fair_share-in-quota-few",
    "fair_share-in-quota-many": "python benchmarks/fair_share.py --mode shares --workload in-quota --slots many "
                                "--out docs/benchmarks/fair_share-in-quota-many",
    "fair_share-in-quota-few-2streams": "python benchmarks/fair_share.py --mode shares --workload in-quota --slots few "
                                        "--in-quota-user-streams 2 --out docs/benchmarks/fair_share-in-quota-few-2streams",
    "fair_share-in-quota-many-2streams": "python benchmarks/fair_share.py --mode shares --workload in-quota "
                                         "--slots many --in-quota-user-streams 2 "
                                         "--out docs/benchmarks/fair_share-in-quota-many-2streams",
    "gateway_compare": "make bench-gateway",
    "gpu_twin": "make bench-twin",
}


#: Results whose figure is drawn from the JSON alone, by ``benchmarks/NAME.py``'s ``plot``.
DRAWN_FROM_JSON = ("scheduler_step", "throughput_ratio", "idle_cpu", "kv_pressure", "prompt_flood",
                   "fair_share", "gateway_compare", "gpu_twin")
BENCHMARKS = Path(__file__).resolve().parent


def draw_figure(name: str, source: Path, png: Path) -> None:
    """``benchmarks/NAME.py``'s ``plot`` on the committed JSON, into ``png``."""
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    doc = json.loads(source.read_text())
    module.plot(FROM_JSON.get(name, lambda d: d)(doc), png, source=source)


def _int_keyed_results(doc: Doc) -> Doc:
    """scheduler_step's ``plot`` reads R as int keys (JSON made them strings)."""
    return {**doc, "results": {scenario: {int(r): row for r, row in rows.items()}
                               for scenario, rows in doc["results"].items()}}


#: What a benchmark's ``plot`` needs done to its document once it went through JSON.
FROM_JSON: dict[str, Callable[[Doc], Doc]] = {"scheduler_step": _int_keyed_results}


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _rows(results: dict) -> list[tuple[int, Any]]:
    """A result table keyed by R (int in memory, str once through JSON), by R."""
    return sorted(((int(r), row) for r, row in results.items()), key=lambda item: item[0])


def _verdict(value: float, target: float | None, at_most: bool = True, unit: str = "",
             failed: str | None = None) -> str:
    """`` (target ≤ T, met)``.  A target whose runs hold any failure is not met,
    whatever its figure: ``failed`` says what failed (None: nothing did)."""
    if target is None:
        return ""
    met = value <= target if at_most else value >= target
    if failed:
        figure = "the figure alone would meet it" if met else "the figure misses it too"
        return f" (target {'≤' if at_most else '≥'} {target:g}{unit}, **not met**: {failed}; {figure})"
    return f" (target {'≤' if at_most else '≥'} {target:g}{unit}, {'met' if met else '**missed**'})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _client_errors(errors: dict | None) -> tuple[int, int]:
    """(client timeouts, other client errors) of a ``{"Kind: message": count}`` map."""
    errors = errors or {}
    timeouts = sum(n for kind, n in errors.items() if "Timeout" in kind)
    return timeouts, sum(errors.values()) - timeouts


# --------------------------------------------------------------------------
# Sections: each takes its result and its companions' (None when missing)
# --------------------------------------------------------------------------


def demo_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    lines = [report.render_demo_section(doc, image, dated=False)]
    totals = [(side, (doc.get(side) or {}).get("totals")) for side in ("stock", "plugin")]
    if all(t for _, t in totals):
        lines += ["", "Sample: " + "; ".join(
            f"{side} {t['requests']} requests ({t['finished']} finished, {t['cancelled']} cancelled, "
            f"{_plural(t['errors'], 'error')})" for side, t in totals) + ", one run each."]
    return lines


def demo_cluster_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    runs = doc["cluster"].get("runs") or []
    last_only = {**doc, "cluster": {**doc["cluster"], "runs": []}}
    lines = [demo_cluster.markdown(last_only, dated=False)]
    totals = doc.get("totals") or {}
    if totals:
        lines += ["", f"Sample of the run in the tables: {totals['requests']} requests ({totals['finished']} "
                  f"finished, {totals['cancelled']} cancelled, {_plural(totals['errors'], 'error')}); "
                  f"{_plural(doc['cluster'].get('counter_read_failures', 0), 'failed counter read')}."]
    if runs:
        limit = doc["cluster"]["heavy_limit"]
        lines += [
            "",
            f"Each of {len(runs)} consecutive runs (fresh Redis and engines each; the tables above show the "
            f"last), judged on the engines' own counters (admin route read every {demo_cluster.READ_EVERY_S:g} "
            f"s): `{demo_cluster.HEAVY}`'s charged tokens summed over the engines from "
            f"{demo_cluster.RATE_WARMUP_S:g} s into the load to its end (target ≥ {demo_cluster.TARGET_SHARE:g} × "
            f"{limit:g} tok/s), and each engine's longest time with no token charged while the load ran "
            f"(target ≤ {demo_cluster.TARGET_SILENCE_S:g} s).",
            "",
            "| run | counter reads | heavy charged tok/s | of the limit | longest engine silence s | "
            "longest gap between reads s | targets |",
            "| ---: | ---: | ---: | ---: | --- | ---: | --- |",
        ]
        for i, run in enumerate(runs, 1):
            c = run["counters"]
            share = c.get("share_of_limit")
            lines.append(
                f"| {i} | {c.get('reads', '-')} | {_num(c.get('heavy_charged_rate'), '.1f')} | "
                f"{_num(share, '.2f')} | {' / '.join(f'{x:.2f}' for x in c['longest_silence_s'])} | "
                f"{_num(c.get('longest_read_gap_s'), '.1f')} | {'met' if c['meets_targets'] else '**missed**'} |")
        lines += ["", _runs_line([r["started_at"] for r in runs],
                                 [x for r in runs for x in (r["load_before"], r["load_after"])])]
    if image:
        lines += ["", f"![One quota over several engines sharing one Redis]({image})"]
    return lines


def _runs_line(started: list[str], loads: list[list[float] | None]) -> str:
    """The one line of a section that states when its runs started and the machine's load."""
    started = sorted(t for t in started if t)
    ones = [load[0] for load in loads if load]
    when = (f"Runs started {started[0]}" + (f" to {started[-1]}" if started[-1] != started[0] else "") + " (UTC)"
            if started else "Runs")
    load = (f"; 1-min load average {min(ones):.1f}–{max(ones):.1f} around them" if ones else "")
    return when + load + " (per run in the JSON)."


def _step_table(doc: Doc, results: dict, unit: str, value: Callable[[dict], str]) -> list[str]:
    lines = [
        f"| scenario | R resident | stock {unit} | ours {unit} | ours / stock |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for scenario, label in doc.get("scenarios", {}).items():
        for r, row in _rows(results.get(scenario, {})):
            lines.append(f"| {label} | {r} | {value(row['stock'])} | {value(row['ours'])} | {row['ratio']:.3f} |")
    return lines


def scheduler_step_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    targets = doc.get("targets", {})
    lines = [
        "µs per step (`schedule()` + `update_from_output()`, no model), median over blocks of "
        f"{doc['steps']} steps alternating between stock vLLM and ours, {doc['reps']} blocks each. "
        "Wall-clock ratios move with the machine's load; the instruction counts below do not.",
        "",
        *_step_table(doc, doc["results"], "µs", lambda side: f"{side['us_per_step']:.0f}"),
        "",
        f"- Limits never hit: worst ours/stock **{doc['never_hit_worst_ratio']:.3f}**"
        + _verdict(doc["never_hit_worst_ratio"], targets.get("never_hit_ratio")) + ".",
    ]
    scaling = doc.get("throttled_90_scaling_1024_over_64")
    if scaling is not None:
        lines.append(f"- 90 % throttled: ours at R=1024 / ours at R=64 **{scaling:.2f}**"
                     + _verdict(scaling, targets.get("throttled_90_scaling_1024_over_64")) + ".")
    short = [(r, row["ours"]) for scenario in doc.get("scenarios", {})
             for r, row in _rows(doc["results"].get(scenario, {})) if row["ours"].get("resident", r) < r]
    if short:
        lines.append("- Not every request stayed resident in ours at the end of the timed steps: "
                     + "; ".join(f"R={r}: {ours['resident']} resident, {ours.get('waiting', 0)} waiting"
                                 for r, ours in short) + ".")
    counted = doc.get("instructions")
    if counted:
        lines += [
            "",
            "Instructions per step under callgrind (`--instructions`; one process per scheduler, only "
            "`schedule()` and `update_from_output()` collected):",
            "",
            *_step_table(doc, counted, "M instr", lambda side: f"{side['instructions_per_step'] / 1e6:.3f}"),
            "",
            f"- Limits never hit, by instructions: worst ours/stock "
            f"**{doc['instructions_never_hit_worst_ratio']:.3f}**"
            + _verdict(doc["instructions_never_hit_worst_ratio"], targets.get("never_hit_ratio")) + ".",
        ]
        scaling_i = doc.get("instructions_throttled_90_scaling_1024_over_64")
        if scaling_i is not None:
            lines.append(f"- 90 % throttled, by instructions: ours at R=1024 / R=64 **{scaling_i:.2f}**"
                         + _verdict(scaling_i, targets.get("throttled_90_scaling_1024_over_64")) + ".")
    if extra.get("scheduler_step_fast_paths"):
        lines += fast_path_lines(extra["scheduler_step_fast_paths"])
    if extra.get("scheduler_step_store"):
        lines += store_step_lines(extra["scheduler_step_store"])
    if extra.get("scheduler_step_borrowing"):
        lines += borrowing_step_lines(extra["scheduler_step_borrowing"])
    if image:
        lines += ["", f"![scheduler step cost]({image})"]
    return lines


def fast_path_lines(doc: Doc) -> list[str]:
    rows = _rows(doc["results"])
    floor = doc.get("targets", {}).get("fast_path_saving")
    lines = [
        "",
        "Fast paths against the plain path (`--fast-paths`): instructions per step, limits never hit, "
        "for ours with both fast paths off (every step planned; every request through the charging hook).",
        "",
        "| R resident | stock M instr | ours M instr | ours, fast paths off | ours / stock | saved by the fast paths |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, row in rows:
        lines.append(
            f"| {r} | {row['stock'] / 1e6:.3f} | {row['ours'] / 1e6:.3f} | {row['ours-plain'] / 1e6:.3f} | "
            f"{row['ours'] / row['stock']:.3f} | {100 * row['fast_path_saving']:.1f} % |")
    if floor is not None:
        kept = all(row["fast_path_saving"] >= floor for _, row in rows)
        lines += ["", f"- The fast paths stay while they save at least {100 * floor:g} % at every size measured"
                  + (" (they do)." if kept else "; **here they do not everywhere**.")]
    return lines


def store_step_lines(doc: Doc) -> list[str]:
    target = doc.get("targets", {}).get("ratio")
    counted = "instructions_ratio" in next(iter(doc["results"].values()), {})
    lines = [
        "",
        "With the shared Redis store (`--store`): ours with the lease limiter against a real redis-server "
        "vs ours in memory, limits never hit; the lease rounds run between steps and are not counted, "
        "as in an engine where the lease thread runs them.",
        "",
        "| R resident | in memory µs | Redis lease µs | ratio |"
        + (" in memory M instr | Redis lease M instr | ratio |" if counted else "")
        + " a lease round µs (off the step) |",
        "| ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if counted else "") + " ---: |",
    ]
    for r, row in _rows(doc["results"]):
        cells = [str(r), f"{row['ours']['us_per_step']:.0f}", f"{row['ours-store']['us_per_step']:.0f}",
                 f"{row['ratio']:.3f}"]
        if counted:
            cells += [f"{row['ours']['instructions_per_step'] / 1e6:.3f}",
                      f"{row['ours-store']['instructions_per_step'] / 1e6:.3f}", f"{row['instructions_ratio']:.3f}"]
        cells.append(f"{row['lease_round_us']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    worst = doc.get("instructions_worst_ratio", doc.get("worst_ratio"))
    if worst is not None:
        lines += ["", f"- Worst ratio{' by instructions' if counted else ''}: **{worst:.3f}**"
                  + _verdict(worst, target) + "."]
    return lines


def borrowing_step_lines(doc: Doc) -> list[str]:
    lines = [
        "",
        "A lone borrower's step (`--borrowing`): one user with 3 R streams at active cap R, so R run and 2 R "
        f"wait, its limit `{{rate: {doc['borrower_rate']:g}, ceil: null}}` (every token borrowed) against the "
        "same user with a limit never hit, and stock vLLM with R slots; µs per step, median over blocks of "
        f"{doc['steps']} steps alternating between the three, {doc['reps']} blocks each.",
        "",
        "| R running | waiting | stock µs | ours, never hit µs | ours, borrower µs | borrower / never hit | "
        "borrower's extra µs |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, row in _rows(doc["results"]):
        borrower = row["ours-borrower"]
        lines.append(
            f"| {r} | {borrower['waiting']} | {row['stock']['us_per_step']:.0f} | {row['ours']['us_per_step']:.0f} | "
            f"{borrower['us_per_step']:.0f} | {row['borrower_over_unlimited']:.2f} | {row['borrower_extra_us']:.0f} |")
    counted = doc.get("instructions")
    if counted:
        lines += ["", "The same three sides by instructions per step (`--instructions`: callgrind, a figure the "
                  "machine's load does not move):", "",
                  "| R running | stock M | ours, never hit M | ours, borrower M | borrower / never hit |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for r, row in _rows(counted):
            per = {who: row[who]["instructions_per_step"] / 1e6 for who in ("stock", "ours", "ours-borrower")}
            lines.append(f"| {r} | {per['stock']:.3f} | {per['ours']:.3f} | {per['ours-borrower']:.3f} | "
                         f"{per['ours-borrower'] / per['ours']:.3f} |")
    lines += ["", "- What a lone borrower's tok/s can lose to this is its extra µs over the engine's whole step "
              "(the model's time included): see the fair-share section's lone borrower."]
    return lines


def throughput_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    a, cfg = doc["analysis"], doc["config"]
    lines = [
        f"Model `{cfg['model']}`, {cfg['users']} users × {cfg['streams']} streaming requests for "
        f"{cfg['max_num_seqs']} slots (`--max-num-seqs`), max_tokens {cfg['max_tokens']}, "
        f"{cfg['duration']:g} s measured per run; "
        + ("a stock and a plugin server both up, runs alternating between them."
           if doc.get("mode") == "live servers" else "a fresh server per run, stock and plugin runs alternating."),
        "",
        "| server | runs | mean tok/s | min | max | stdev |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, key in (("stock (feature off)", "stock"), ("plugin, limits never hit", "plugin")):
        side = a["per_side"][key]
        if side.get("n"):
            lines.append(f"| {name} | {side['n']} | {side['mean']:.0f} | {side['min']:.0f} | {side['max']:.0f} | "
                         f"{side['stdev']:.0f} |")
    if a.get("ratio_of_means") is not None:
        lines += ["", f"Ratio of means: **{a['ratio_of_means']:.3f}**"
                  + _verdict(a["ratio_of_means"], a.get("target_ratio"), at_most=False)
                  + "; per pair: " + ", ".join(f"{x:.3f}" for x in a["pair_ratios"])
                  + (f" (median {a['pair_ratio_median']:.3f})." if a.get("pair_ratio_median") else ".")]
    steps = [r["tokens_per_engine_step"] for r in doc["runs"] if r.get("tokens_per_engine_step") is not None]
    if steps:
        lines.append(f"Output tokens per engine step: {min(steps):.1f}–{max(steps):.1f}.")
    if a.get("tokens_per_server_cpu_s_ratio") is not None:
        pc, sc = a["tokens_per_server_cpu_s"], a["server_cores"]
        lines.append(
            f"Output tokens per CPU-second of the server's processes: stock {pc['stock']['mean']:.0f}, "
            f"plugin {pc['plugin']['mean']:.0f} (ratio {a['tokens_per_server_cpu_s_ratio']:.3f}); CPU the "
            f"server got: stock {sc['stock']['mean']:.2f}, plugin {sc['plugin']['mean']:.2f} cores on average.")
    foreign = [r["cpu_during_window"]["foreign_cores"] for r in doc["runs"] if r.get("cpu_during_window")]
    if foreign:
        lines.append(f"Other processes during the measured windows: {min(foreign):.2f}–{max(foreign):.2f} cores.")
    if image:
        lines += ["", f"![throughput, limits never hit vs feature off]({image})"]
    return lines


def offline_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    summ, cfg = doc["summary"], doc["config"]
    return [
        f"Both engines in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), model `{cfg['model']}`, "
        f"{cfg['requests']} requests × {cfg['max_tokens']} tokens over {cfg['users']} users per "
        f"`generate()`, calls alternating, {cfg['reps']} each.",
        "",
        "| engine | mean tok/s | min | max | stdev |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(f"| {name} | {summ[key]['mean']:.0f} | {summ[key]['min']:.0f} | {summ[key]['max']:.0f} | "
          f"{summ[key]['stdev']:.0f} |"
          for name, key in (("stock", "stock"), ("plugin, limits never hit", "plugin"))),
        "",
        f"Ratio of means: **{doc['ratio_of_means']:.3f}**.",
    ]


def idle_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    a, cfg = doc["analysis"], doc["config"]
    off_doc = extra.get("idle_cpu_spin_off")
    off = off_doc["analysis"]["throttled"] if off_doc else None

    def cell(side: dict, key: str) -> str:
        s = side[key]
        return f"{s['mean']:.1f} % ({s['min']:.1f}–{s['max']:.1f})"

    rows = (("engine core", "engine_core"), ("model worker", "worker"),
            ("API server", "api_server"), ("**whole server (process tree)**", "server_total"))
    thr = a["throttled"]
    errors = sum(len(w.get("errors") or []) for w in doc.get("windows", []))
    failed = f"{_plural(errors, 'request error')} in the throttled windows" if errors else None
    lines = [
        f"User `{cfg['user']}` limited to {cfg['rate']:g} tok/s with {cfg['streams']} streams; % of one core, "
        f"mean (min–max) of {len(thr['engine_core']['values'])} windows of {cfg['window']:g} s, idle and "
        "throttled windows alternating on one server."
        + (" Last column: the same with `VLLM_OUTPUT_RATE_WORKER_SPIN_MS=off` (vLLM's own worker spin)."
           if off else ""),
        "",
        "| process | idle server | every user throttled |" + (" throttled, worker patch off |" if off else ""),
        "| --- | ---: | ---: |" + (" ---: |" if off else ""),
        *(f"| {label} | {cell(a['idle'], key)} | {cell(thr, key)} |" + (f" {cell(off, key)} |" if off else "")
          for label, key in rows),
        "",
        f"- Whole server while throttled: {thr['server_total']['mean']:.1f} % of a core"
        + _verdict(thr["server_total"]["mean"], a.get("target_server_total_percent"), unit=" %", failed=failed) + ".",
        f"- Engine core while throttled: {thr['engine_core']['mean']:.1f} % of a core"
        + _verdict(thr["engine_core"]["mean"], a.get("target_engine_core_percent"), unit=" %", failed=failed) + ".",
        f"- Other processes during the throttled windows: {thr['foreign']['mean']:.0f} % of a core on average.",
    ]
    variants = [(name, extra.get(name)) for name in IDLE_VARIANTS]
    if any(v for _, v in variants):
        lines += ["", *idle_variant_lines([("idle_cpu", doc), *variants])]
    if image:
        lines += ["", f"![server CPU, idle vs throttled]({image})"]
    return lines


#: The same throttled load with more users, more engines and a shared store.
IDLE_VARIANTS = ("idle_cpu_store", "idle_cpu_50u_2e", "idle_cpu_store_50u_2e")


def idle_variant_lines(docs: list[tuple[str, Doc | None]]) -> list[str]:
    """One row per variant run: the whole server's CPU per engine while every
    user is throttled, and the engines' own wake-up and round-trip counters."""
    lines = [
        "With more users, more engines and a shared store (the total rate split evenly over the "
        "users; CPU summed over every server and the store's redis-server, then per engine):",
        "",
        "| result | users | tok/s per user | engines | store | per engine, throttled "
        "| idle steps/s (all engines) | store round trips/s | other processes |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, doc in docs:
        if doc is None:
            continue
        cfg, thr = doc["config"], doc["analysis"]["throttled"]

        def mean(key: str) -> str:
            spread = thr.get(key)
            return "–" if not spread or spread["mean"] is None else f"{spread['mean']:.1f}"

        lines.append(
            f"| `{name}` | {cfg.get('users', 1)} | {cfg['rate'] / cfg.get('users', 1):g} | {cfg.get('engines', 1)} | "
            f"{'yes' if cfg.get('store') else 'no'} | {mean('per_engine_total')} % | {mean('idle_steps_per_s')} | "
            f"{mean('store_round_trips_per_s') if cfg.get('store') else '–'} | {mean('foreign')} % |"
        )
    target = docs[0][1]["analysis"].get("target_server_total_percent") if docs[0][1] else None
    if target is not None:
        worst = max(d["analysis"]["throttled"]["per_engine_total"]["mean"] for _, d in docs if d)
        lines += ["", f"- Worst per-engine figure above: {worst:.1f} % of a core"
                  + _verdict(worst, target, unit=" %") + "."]
    return lines


def itl_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    a, cfg = doc["analysis"], doc["config"]
    lines = [
        f"Model `{cfg['model']}`, one streaming request at a time, {cfg['max_tokens']} tokens each; "
        f"{a['stock']['blocks']} blocks of {cfg['requests']} requests per side, alternating between a stock "
        "and a plugin server that both stay up. Each request's mean inter-token latency comes from the "
        "server's `vllm:inter_token_latency_seconds` `_sum`/`_count` around it (engine-core output "
        "timestamps, not client receive times); the figure is the median over requests.",
        "",
        "| server | requests | ITL p50 (server) | per-block p50s ms |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, key in (("stock (feature off)", "stock"), ("plugin, limits never hit", "plugin")):
        side = a[key]
        lines.append(f"| {name} | {side['requests']} | {_num(side['server_itl_p50_ms'])} ms | "
                     + ", ".join(f"{x:.2f}" for x in side["server_itl_block_p50s_ms"]) + " |")
    if a.get("ratio") is not None:
        lines += ["", f"Ratio plugin / stock: **{a['ratio']:.3f}**" + _verdict(a["ratio"], a.get("target_ratio"))
                  + "; per block pair: " + ", ".join(f"{x:.3f}" for x in a["pair_ratios"]) + "."]
        spread = max(max(a[k]["server_itl_block_p50s_ms"]) - min(a[k]["server_itl_block_p50s_ms"])
                     for k in ("stock", "plugin"))
        diff = abs(a["plugin"]["server_itl_p50_ms"] - a["stock"]["server_itl_p50_ms"])
        if spread > diff:
            lines.append(f"The block-to-block spread within one side ({spread:.2f} ms) is larger than the "
                         f"difference between the sides ({diff:.2f} ms).")
    foreign = [b["foreign_percent"] for b in doc["blocks"]]
    if foreign:
        lines.append(f"Other processes during the blocks: {min(foreign):.0f}–{max(foreign):.0f} % of a core.")
    if extra.get("itl_single_instructions"):
        lines += itl_instruction_lines(extra["itl_single_instructions"])
    return lines


def itl_instruction_lines(doc: Doc) -> list[str]:
    labels = (
        ("step", "engine step without the model (`EngineCore.step()` + output processing)"),
        ("full", "the same with the model (all the work of one token)"),
    )
    lines = [
        "",
        "What the plugin costs the engine per token of this one stream, by instruction count "
        f"(`--instructions`: callgrind, in-process engine, {doc['steps']} steps per row, the plugin's "
        "once-a-second report not counted):",
        "",
        "| counted | stock k instr/step | plugin k instr/step | plugin − stock | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in labels:
        lines.append(f"| {label} | {doc['stock'][key] / 1e3:.1f} | {doc['plugin'][key] / 1e3:.1f} | "
                     f"{doc['extra_per_step'][key] / 1e3:+.1f} | {doc['ratio'][key]:.3f} |")
    share = doc["extra_share_of_token"]
    target = doc.get("target_extra_share_of_token")
    lines += ["", f"- The plugin's engine-side extra per token (first row) is **{100 * share:.1f} %** of all the "
              "work stock vLLM does for that token (second row, stock)"
              + ("" if target is None else f" (target ≤ {100 * target:g} %, {'met' if share <= target else '**missed**'})")
              + "."]
    return lines


def kv_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    a, cfg = doc["analysis"], doc["config"]
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f} ms"  # noqa: E731
    kv_used = 100 * (a["pressure"]["kv_usage_before_b_median"] or 0)
    a_figures = a.get("a")  # schema 2 (residency follows the rate): A's own figures
    if a_figures is None:
        setting = (f"long streams holds most KV blocks (median KV usage {kv_used:.0f} % when B arrives); "
                   "B, unlimited, needs more blocks than are free.")
    else:
        setting = (f"long streams; residency follows the rate, so at most {a_figures['bound']} of them may be "
                   f"resident (median KV usage {kv_used:.0f} % when B arrives; B, unlimited, needs more "
                   "blocks than A's streams would leave free if all of them were resident).")
    lines = [
        f"`--num-gpu-blocks-override {cfg['blocks']}`; user A at {cfg['a_rate']:g} tok/s with {cfg['a_streams']} "
        + setting,
        "",
        f"| B's first token | trials | median | p90 | B failures (no first token within {cfg['b_timeout']:g} s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| B alone | {a['alone']['n']} | {ms(a['alone']['ttft_median_s'])} | {ms(a['alone']['ttft_p90_s'])} | "
        f"{a['alone']['b_failures']} |",
        f"| B beside throttled A | {a['pressure']['n']} | {ms(a['pressure']['ttft_median_s'])} | "
        f"{ms(a['pressure']['ttft_p90_s'])} | {a['pressure']['b_failures']} |",
    ]
    if a.get("ratio_median_ttft") is not None:
        failures = a["alone"]["b_failures"] + a["pressure"]["b_failures"]
        failed = (f"{failures} of {a['alone']['n'] + a['pressure']['n']} B requests got no first token "
                  f"within {cfg['b_timeout']:g} s" if failures else None)
        lines += ["", f"Ratio of medians: **{a['ratio_median_ttft']:.2f}**"
                  + _verdict(a["ratio_median_ttft"], a.get("target_ratio"), failed=failed) + "."]
    if a_figures is not None:
        targets = a.get("targets") or {}
        lines += [
            "",
            "| A (throttled) | figure | target |",
            "| --- | ---: | --- |",
            f"| tok/s per pressure trial, min / median (client clock) | {a_figures['tokens_per_s_min']:.2f} / "
            f"{a_figures['tokens_per_s_median']:.2f} | ≥ 0.95 × {a_figures['limit']:g}: "
            f"{'met' if targets.get('a_rate_at_limit') else '**missed**'} |",
            f"| resident requests, max over {a_figures['resident_samples']} samples | "
            f"{a_figures['resident_max']:.0f} | ≤ {a_figures['bound']}: "
            f"{'met' if targets.get('a_resident_within_bound') else '**missed**'} |",
            f"| its own first token, p50 / p90 / max ({a_figures['ttft_n']} streams) | "
            f"{ms(a_figures['ttft_p50_s'])} / {ms(a_figures['ttft_p90_s'])} / {ms(a_figures['ttft_max_s'])} | "
            f"the price of waiting un-admitted; {a_figures['streams_without_token']} of "
            f"{a_figures['streams']} streams had no token yet when their trial ended |",
        ]
        if a.get("ratio_p90_ttft") is not None:
            lines += ["", f"B's p90 beside A / alone: **{a['ratio_p90_ttft']:.2f}**"
                      + _verdict(a["ratio_p90_ttft"], a.get("target_ratio"),
                                 failed=None if targets.get("b_zero_failures") else "B failures") + "."]
    churn = doc.get("churn") or {}
    if churn.get("preemptions_per_finished_request") is not None:
        lines.append(f"Churn over all trials: {churn['preemptions_per_finished_request']} preemptions per "
                     f"finished request, {_num(churn.get('recomputed_tokens_per_output_token'))} recomputed "
                     "tokens per output token.")
    if image:
        lines += ["", f"![B's time to first token, alone vs under KV pressure]({image})"]
    return lines


def prompt_flood_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    cfg, phases = doc["config"], doc["phases"]
    alone = phases[0]["light_tok_per_s"]
    lines = [
        f"User `flood` at {cfg['flood_rate']:g} output tok/s keeps {cfg['flood_streams']} requests of "
        f"{cfg['flood_prompt_tokens']}-token distinct prompts with `max_tokens` 1 in flight; user `light` "
        f"(never limited) streams one request after another. `--max-num-batched-tokens "
        f"{cfg['max_num_batched_tokens']}` (the chunk size C); {cfg['reps']} rounds of three {cfg['duration']:g} s "
        "phases on one server, the weight changed by rewriting the limits file (reloaded live).",
        "",
        "| phase | runs | light tok/s (median; each run) | × alone | flood prompt tok/s (median) | "
        "worst flood cost − bound |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for phase in phases:
        ratio = phase["light_tok_per_s"] / alone if alone else None
        runs = ", ".join(f"{v:.0f}" for v in phase["light_tok_per_s_all"])
        worst = phase["worst_cost_over_bound"]
        verdict = "-" if worst is None else f"{worst:.0f}" + ("" if worst <= 0 else " **over**")
        lines.append(f"| {phase['phase']} | {phase['n']} | {phase['light_tok_per_s']:.1f} ({runs}) | "
                     f"{_num(ratio, '.2f')} | {phase['flood_prompt_tok_per_s']:.0f} | {verdict} |")
    lines += ["", "Flood cost = output + weight × prompt tokens the engine charged it in a run; bound = "
              "(W + 0.1) × N + 1 + ⌈weight × C⌉ over the run (≤ 0: held). At weight 0 prompt tokens are "
              "free, so only output tokens count. Light-user rates are wall-clock figures on a shared "
              "machine: 1-min load average "
              f"{min(t['load'][0] for t in doc['trials']):.0f}–{max(t['load'][0] for t in doc['trials']):.0f} "
              f"on {doc['machine']['nproc']} cores during the runs."]
    light_errors = sum(len(t.get("light_errors") or []) for t in doc["trials"])
    flood_errors = sum(len(t.get("flood_errors") or []) for t in doc["trials"])
    lines += ["", f"Sample: {cfg['reps']} rounds × 3 phases of {cfg['duration']:g} s; client errors: light "
              f"{light_errors}, flood {flood_errors}"
              + ("." if not light_errors + flood_errors else " (**the figures above rest on failed requests**).")]
    if "steps_per_s" in phases[0]:
        lines += [
            "",
            "Where the light user's rate goes (medians per phase): engine steps per second (vLLM's "
            "`vllm:iteration_tokens_total` count over the phase, wall clock), the light user's tokens "
            "per step (vLLM's generated tokens less the flood's, per step), the light rate over the same "
            "round's alone phase, and CPU in cores by process (CPU seconds over the phase's wall seconds; "
            "\"rest\" is everything else on the machine).",
            "",
            "| phase | steps/s | light tok/step | × alone (same round) | prompt + output tokens/step | "
            "engine core ms CPU/step | engine core | model worker | API server | client | rest |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for phase in phases:
            cpu = phase["cpu"]
            lines.append(
                f"| {phase['phase']} | {phase['steps_per_s']:.0f} | {phase['light_tokens_per_step']:.2f} | "
                f"{phase['x_alone_per_round']:.2f} | {phase['tokens_per_step']:.0f} | "
                f"{phase['engine_core_ms_per_step']:.2f} | {cpu['engine_core']:.2f} | {cpu['worker']:.2f} | "
                f"{cpu['api_server']:.2f} | {cpu['client']:.2f} | {cpu['foreign']:.2f} |")
        lines += [
            "",
            "Each run: steps/s = the engine core's CPU share ÷ its CPU per step, so the step rate follows "
            "what the rest of the machine leaves the engine core.",
            "",
            "| round | phase | light tok/s | × alone (same round) | steps/s | light tok/step | "
            "engine core ms CPU/step | engine core | rest |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in doc["trials"]:
            lines.append(
                f"| {t['rep']} | {t['phase']} | {t['light_tok_per_s']:.0f} | {_num(t['x_alone_same_round'], '.2f')} | "
                f"{t['steps_per_s']:.0f} | {t['light_tokens_per_step']:.2f} | "
                f"{_num(t['engine_core_ms_per_step'], '.2f')} | {t['cpu']['engine_core']:.2f} | "
                f"{t['cpu']['foreign']:.2f} |")
    if image:
        lines += ["", f"![The light user's rate beside a prompt flood, weight 0 and {cfg['weight']:g}]({image})"]
    return lines


def soak_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    cfg, churn = doc["config"], doc.get("churn") or {}
    users = doc.get("per_user", {})
    worst = max((u["worst_excess_envelope"] for u in users.values()), default=None)
    ttft = doc.get("first_token_wait_client") or {}
    lines = [
        f"{doc['requests']} streamed requests from {len(cfg.get('user_rates', {}))} named users with limits "
        f"{cfg['min_rate']:g}–{cfg['max_rate']:g} tok/s plus anonymous traffic, "
        f"{100 * cfg['cancel_fraction']:g} % planned as client cancellations, {cfg['concurrency']} at a time, "
        f"`--max-num-seqs {cfg['max_num_seqs']} --max-num-active-seqs {cfg['max_num_active_seqs']}`.",
        "",
        "| result | finished | cancelled | errors | truncated or miscounted | users over the bound | "
        "preemptions per finished request | recomputed tokens per output token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {'PASS' if doc['ok'] else '**FAIL**'} | {doc['finished']} | {doc['cancelled']} | {doc['errors']} | "
        f"{doc['truncated_or_miscounted']} | {doc['guarantee_violations']} | "
        f"{_num(churn.get('preemptions_per_finished_request'))} | "
        f"{_num(churn.get('recomputed_tokens_per_output_token'))} |",
    ]
    if worst is not None:
        lines += ["", f"- Worst excess over the bound in any user's send/end envelope: {worst:.2f} tokens "
                  "(≤ 0 is within the guarantee)."]
    if ttft:
        lines.append(f"- First token after send (client clock, an upper bound): p50 {ttft['p50_s']} s, "
                     f"p90 {ttft['p90_s']} s, max {ttft['max_s']} s over {ttft['requests']} requests.")
    return lines


def soak_cluster_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    cfg, chaos = doc["config"], doc["chaos"]
    users = doc["counter_checks"]["per_user"]
    worst = max((u["worst_excess"] for u in users.values()), default=None)
    gauges_on = {k: v for k, v in doc["gauges_end"].items() if v}
    lines = [
        f"{doc['requests']} streamed requests from {len(cfg.get('user_rates', {}))} named users with limits "
        f"{cfg['min_rate']:g}–{cfg['max_rate']:g} tok/s plus anonymous traffic, "
        f"`max_tokens` up to {cfg['max_tokens']}, "
        f"{100 * cfg['cancel_fraction']:g} % planned as client cancellations, {cfg['concurrency']} at a time "
        f"over {doc['engines']} engines sharing one real redis-server (request i to engine i mod "
        f"{doc['engines']}, or the other one while it is down), `--max-num-seqs {cfg['max_num_seqs']} "
        f"--max-num-active-seqs {cfg['max_num_active_seqs']}`, each model worker on its own CPU. Chaos (s "
        f"after the load began, monotonic clock): engine {doc['engines']} killed (SIGKILL to its process "
        f"group) at {chaos['engine_stop_sent']:.1f}, healthy again at {chaos['engine_healthy']:.1f}; Redis "
        f"killed (SIGKILL) at {chaos['redis_killed']:.1f} and started again, empty, at "
        f"{chaos['redis_answering']:.1f}; every engine's /metrics showed the shared store again at "
        f"{_num(chaos['all_shared_again'], '.1f')}. "
        f"Load average before / after: {'/'.join(f'{x:g}' for x in doc['load_before'])} / "
        f"{'/'.join(f'{x:g}' for x in doc['load_after'])} on {doc['machine']['nproc']} cores; "
        f"{doc['runtime_s']:g} s of load, {doc['wall_s']:g} s in all with the servers' startup.",
        "",
        "| result | finished | cancelled | errors | retried (their engine killed under them) | truncated or "
        "miscounted | users over the bound (engines' counters) | worst excess, tokens | gauges not 0 at the end |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        f"| {'PASS' if doc['ok'] else '**FAIL**'} | {doc['finished']} | {doc['cancelled']} | {doc['errors']} | "
        f"{doc['retried_requests']} | {doc['truncated_or_miscounted']} | "
        f"{doc['counter_checks']['users_over_the_bound']} | {_num(worst, '.1f')} | "
        f"{', '.join(f'{k} = {v:g}' for k, v in gauges_on.items()) or 'none'} |",
        "",
        "The bound is judged on each engine's own per-user counter (`tokens_charged_total` of "
        f"`/v1/output_rate/users`, read every {cfg['read_every']:g} s, {doc['counter_checks']['reads']} reads), "
        "summed over the engines and over the restarted engine's two processes, for every pair of reads up to "
        f"{cfg['max_window']:g} s apart (the window from the first read's sending to the second's answer). "
        f"The bound is the documented one across engines, (W + {shared_slack_s():g}) × N + 1 + E × L, "
        "for each store process the window touches (Redis restarted empty: a fresh burst), plus the local "
        f"fallback's (W + {BURST_S:g}) × N "
        "+ E over the part of the window from the kill until every engine showed the shared store again; "
        "windows around the engine's kill and restart get no widening (its users' debt stays in the store). "
        "Tokens the killed engine charged after its last read (taken just before the kill) are not counted.",
    ]
    return lines


def shared_store_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    calls = doc["calls"]
    lines = [
        f"Limiter calls as the scheduler makes them, {calls['users_per_step']} users per step: in memory "
        f"{calls['in_memory_ns_per_step'] / 1000:.1f} µs, lease limiter spending local leases "
        f"{calls['lease_ns_per_step'] / 1000:.1f} µs per step (no network inside a call).",
        "",
        "| store | active users | round trips/s | commands/s sent | commands/s inside Redis | tok/s spent of |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in ("round_trips", "cluster_round_trips"):
        t = doc.get(key)
        if t:
            lines.append(f"| {t['store']} | {t['users']} | {t['round_trips_per_s']:.1f} | "
                         f"{t['engine_commands_per_s']:.1f} | {t['redis_commands_incl_script_inner_per_s']:.0f} | "
                         f"{t['tokens_per_s']:.0f} of {t['expected_tokens_per_s']} |")
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f} %"


def _fair_share_targets(doc: Doc, modes: dict) -> list[str]:
    """The issue's targets that this run speaks to, once rate/ceil/weight ran."""
    def workload(mode: str, name: str) -> dict | None:
        return ((modes.get(mode) or {}).get("workloads") or {}).get(name)

    lines = []
    weighted = workload("shares", "weighted")
    if weighted and weighted["fairness"]["max_share_deviation"] is not None:
        dev = weighted["fairness"]["max_share_deviation"]
        lines.append(f"- Weighted, rate/ceil/weight: largest share deviation {100 * dev:.0f} % over "
                     f"{_plural(weighted['fairness'].get('windows_counted') or 0, 'window')} counted"
                     + _verdict(100 * dev, 100 * doc["target_share_deviation"], unit=" %",
                                failed=_fair_share_failed(weighted)) + ".")
    for name in FAIR_SHARE_EQUAL_RATES:
        w = workload("shares", name)
        if w and w.get("borrowed_shares"):
            lines += _borrowed_target_lines(name, w, (doc.get("config") or {}).get("max_skew") or 2.0)
    for name in ("overload", "weighted"):
        shares, hard, stock = workload("shares", name), workload("hard", name), workload("stock", name)
        if shares and stock:
            lines.append(f"- {name}: total throughput rate/ceil/weight / stock "
                         f"{shares['throughput_tok_s'] / stock['throughput_tok_s']:.2f}.")
        if shares and hard and shares["light"]["ttft_p50_s"] and hard["light"]["ttft_p50_s"]:
            ratio = shares["light"]["ttft_p50_s"] / hard["light"]["ttft_p50_s"]
            lines.append(f"- {name}: light user's first-token p50, rate/ceil/weight / hard caps {ratio:.2f}"
                         + _verdict(ratio, doc.get("target_light_ttft_ratio"),
                                    failed=_fair_share_failed(shares, hard)) + ".")
    solo = {mode: workload(mode, "solo") for mode in ("stock", "hard", "shares")}
    unlimited = (solo["shares"] or {}).get("unlimited_same_server")
    if unlimited and unlimited.get("tok_s"):
        ratio = solo["shares"]["tok_s"] / unlimited["tok_s"]
        rounds = solo["shares"].get("rounds") or []
        how = (f"one after the other, {solo['shares']['seconds']:g} s and {unlimited['seconds']:g} s on vLLM's "
               "own token counter, one run each" if not rounds else
               f"{len(rounds)} rounds on one server, the borrower first in odd rounds and second in even ones, "
               f"{solo['shares']['seconds']:g} s and {unlimited['seconds']:g} s in all on vLLM's own token counter; "
               "per round " + ", ".join(_num(r.get("ratio"), ".3f") for r in rounds) + "x"
               + _round_spread([r["ratio"] for r in rounds if r.get("ratio") is not None]) + "; pooled")
        lines.append(
            f"- One borrower alone against an unlimited user on the same server ({solo['shares']['streams']} "
            f"closed-loop streams each, {how}): {solo['shares']['tok_s']:g} "
            f"tok/s (rate {solo['shares']['rate']:g}, no ceiling) against {unlimited['tok_s']:g}, {ratio:.3f}x"
            + _verdict(ratio, doc.get("target_solo_ratio"), at_most=False)
            + ("" if solo["shares"].get("tokens_per_step") is None or unlimited.get("tokens_per_step") is None
               else f"; {solo['shares']['tokens_per_step']:.1f} against {unlimited['tokens_per_step']:.1f} "
                    "tokens per engine step")
            + ".")
    if solo["shares"] and solo["stock"]:
        ratio = solo["shares"]["tok_s"] / solo["stock"]["tok_s"]
        lines.append(
            f"- One borrower alone ({solo['shares']['streams']} closed-loop streams of one user, rate "
            f"{solo['shares']['rate']:g}, no ceiling): {solo['shares']['tok_s']:g} tok/s against "
            f"{solo['stock']['tok_s']:g} on stock vLLM (no limit), {ratio:.3f}x"
            # Two servers at two times: the machine's speed drifts between them by more than the
            # target's margin, so beside a same-server comparison this one is context, not the test.
            + (_verdict(ratio, doc.get("target_solo_ratio"), at_most=False) if not unlimited else
               f" (another server, started {solo['stock'].get('started_at') or 'at another time'}: not judged "
               "against the target, which the same-server comparison above is)")
            + ("" if solo["shares"].get("tokens_per_step") is None or solo["stock"].get("tokens_per_step") is None
               else f"; {solo['shares']['tokens_per_step']:.1f} tokens per engine step against "
                    f"{solo['stock']['tokens_per_step']:.1f}, {solo['shares']['engine_steps_per_s']:g} steps/s "
                    f"against {solo['stock']['engine_steps_per_s']:g}")
            + ("" if not solo["hard"] else f"; as a hard cap {solo['hard']['tok_s']:g} tok/s")
            + f" (vLLM's own token counter over {solo['shares']['seconds']:g} s on the client's clock, one run "
            "each).")
    elif (solo["shares"] or solo["stock"]) and not unlimited:
        have = next(mode for mode in ("shares", "stock") if solo[mode])
        lines.append(f"- One borrower alone: only the {have} run is in this JSON ({solo[have]['tok_s']:g} tok/s, "
                     f"{solo[have]['streams']} closed-loop streams); the ratio needs both stock and "
                     "rate/ceil/weight (`--workload solo`).")
    return [""] + lines if lines else []


def _round_spread(ratios: list[float]) -> str:
    """The per-round ratios' mean and its standard error: how far the machine's drift
    between phases leaves the pooled figure uncertain."""
    if len(ratios) < 3:
        return ""
    mean = statistics.mean(ratios)
    error = statistics.stdev(ratios) / math.sqrt(len(ratios))
    return f" (their mean {mean:.3f}, standard error {error:.3f})"


FAIR_SHARE_MODES = (("stock", "stock vLLM (FCFS)"), ("hard", "hard caps"), ("shares", "rate/ceil/weight"))
#: The workloads with equal guaranteed rates and unequal weights (issue 33).
FAIR_SHARE_EQUAL_RATES = ("equal-rates-1-3", "equal-rates-1-2-3-4")
#: fair_share runs at other slot settings, each in its own JSON (a companion of ``fair_share``).
FAIR_SHARE_VARIANTS = {
    "fair_share-4active-tiny-llama": "Few active slots: the tiny model, 4 active slots (`--slots few`)",
    "fair_share-4active-bench-llama": "Few active slots on the bench model: 4 active slots (`--active-seqs 4`)",
}


#: fair_share's in-quota workload alone at each slot setting, each in its own JSON (a companion of
#: ``fair_share``, no figure).
FAIR_SHARE_IN_QUOTA = {
    "fair_share-in-quota-few": "A user within its rate beside saturating borrowers: the tiny model, 4 active slots",
    "fair_share-in-quota-many": "A user within its rate beside saturating borrowers: the bench model, 8 active slots",
    "fair_share-in-quota-few-2streams": "A user within its rate beside saturating borrowers, two streams: the tiny "
                                        "model, 4 active slots",
    "fair_share-in-quota-many-2streams": "A user within its rate beside saturating borrowers, two streams: the bench "
                                         "model, 8 active slots",
}


def _in_quota_lines(w: dict, active: int) -> list[str]:
    """The in-quota workload: one row per run, then the target over the runs."""
    o = w["options"]
    streams = o.get("streams", 1)  # carol's closed-loop streams (runs before the option: one)
    borrowers = ["bob", "dave"][:o["borrowers"]]
    lines = [
        "",
        f"| run: started (1-min load before) | {'one stream' if streams == 1 else f'{streams} streams'}, no limit "
        f"(tok/s) | carol alone | carol beside the "
        f"borrower{'s' if len(borrowers) > 1 else ''} | ratio beside / min(limit, alone) | "
        + " ".join(f"{b} tok/s (of which borrowed)," for b in borrowers)
        + f" tokens per step (of {active}) | carol's requests active / held for quota / waiting, mean of the "
        "reads beside | carol's requests beside: queued to first token p50 / max, first to last token p50 | "
        + ("carol beside: share of the phase with a request in the engine; tok/s then" if streams == 1 else
           "carol beside: request-seconds in the engine per second of the phase (summed over her streams); "
           "tok/s per request then")
        + " | engine steps/s beside | "
        "sample beside: seconds between the reads; reads; carol's requests finished; client errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |",
    ]
    for run in w["runs"]:
        t = run["carol_tok_s"]
        beside = run["phases"].get("beside") or {}
        users = beside.get("users") or {}
        carol = users.get("carol") or {}
        req = carol.get("requests_mean") or {}
        client = carol.get("client_requests") or {}
        heavy = ", ".join(f"{_num((users.get(b) or {}).get('tok_s'), '.0f')} "
                          f"({_num((users.get(b) or {}).get('borrowed_tokens', 0) / beside['seconds'], '.0f')})"
                          for b in borrowers if beside.get("seconds"))
        lines.append(
            f"| {run['started_at']} ({_num((run.get('load_before') or [None])[0], '.1f')}) | {_num(t['unlimited'], '.1f')} "
            f"| {_num(t['alone'], '.1f')} | {_num(t['beside'], '.1f')} | {_num(run['ratio'])} | {heavy}; "
            f"{_num(beside.get('tokens_per_step'), '.2f')} | {_num(req.get('active'), '.2f')} / "
            f"{_num(req.get('throttled'), '.2f')} / {_num(req.get('waiting'), '.2f')} | "
            f"{_ms(client.get('first_token_p50_s'))} / {_ms(client.get('first_token_max_s'))}, "
            f"{_ms(client.get('generation_p50_s'))} | {_in_engine(client)} | "
            f"{_num(beside.get('engine_steps_per_s'), '.0f')} | {_num(beside.get('seconds'), '.1f')}; {beside.get('reads', 0)}; "
            f"{client.get('finished', 0)}; {sum((run.get('errors') or {}).values())} |")
    if w.get("ratio_min") is not None:
        target = w.get("target_ratio", 0.95)
        lines += ["", f"- carol beside the borrowers / min(its limit {o['rate']:g}, its tok/s alone), on the engine's "
                  f"charged-token counter over {o['measured_s']:g} s per phase, {_plural(w['n_runs'], 'run')} "
                  f"(each its own server): min {w['ratio_min']:.3f}, mean {w['ratio_mean']:.3f}"
                  + _verdict(w["ratio_min"], target, at_most=False)
                  + ("" if w["ratio_min"] >= target else
                     f": the worst run {target - w['ratio_min']:.3f} below it, carol at "
                     f"{100 * w['ratio_min']:.0f} % of its reference")
                  + "."]
    for i, run in enumerate(w["runs"], 1):
        beside = run["phases"].get("beside") or {}
        carol = (beside.get("users") or {}).get("carol") or {}
        client = carol.get("client_requests") or {}
        if client.get("first_token_share") is None:
            continue
        share = client["first_token_share"] + client["generation_share"]
        lines.append(
            f"- Run {i}, beside: a request of carol's was in the engine (queued to last token, the engine's stamps "
            f"of the {client['finished']} that finished in the phase) {100 * share:.0f} % of the phase"
            + ("" if streams == 1 else f" (summed over her {streams} streams' requests: up to {100 * streams} %)")
            + ", "
            + ("" if client.get("tok_s_in_engine") is None else f"at {client['tok_s_in_engine']:.0f} tok/s, ")
            + f"queued to first token p50 {_ms(client.get('first_token_p50_s'))}; the rest, "
            f"{client['outside_engine_total_s']:.1f} s (p50 {_ms(client.get('outside_engine_p50_s'))} per request), "
            "went from the client's send to the engine's queue and from the last token to the client's end of "
            f"stream (the API server and the client{'' if streams == 1 else ', summed over the streams'}). "
            + ("" if carol.get("reads_with_no_request") is None else
               f"The plugin's per-user gauge showed no request of carol's (active, held or waiting) at "
               f"{carol['reads_with_no_request']} of {beside.get('reads', 0)} reads. ")
            + f"Held for quota {carol.get('throttled_s', 0):g} s; the engine "
            f"made {_num(beside.get('engine_steps_per_s'), '.0f')} steps/s (one token per step per request), "
            f"{_num(beside.get('tokens_per_step'), '.2f')} tokens per step of {active}.")
    return lines


def _in_engine(client: dict) -> str:
    """The share of the phase a stream had a request in the engine (queued to last token, the
    engine's stamps of the requests that finished in it) and its tok/s then."""
    share = None if client.get("first_token_share") is None else client["first_token_share"] + client["generation_share"]
    return f"{_percent(share)}; {_num(client.get('tok_s_in_engine'), '.0f')}"


def _in_quota_priority(runs: list[Doc]) -> str:
    """Which of the runs had their clients at a raised CPU priority."""
    got, raised = _raised_runs({str(i): run for i, run in enumerate(runs)})
    if got is None:
        return ", at the default CPU priority"
    if len(raised) == len(runs):
        return f", at nice {got['nice']}"
    return (f", at nice {got['nice']} in {len(raised)} of the {len(runs)} runs "
            "(the default priority in the others)")


def in_quota_section(name: str, title: str, doc: Doc) -> list[str]:
    """A companion JSON of the in-quota workload alone."""
    cfg = doc["config"]
    w = (((doc.get("modes") or {}).get("shares") or {}).get("workloads") or {}).get("in-quota")
    if not w:
        return []
    o = w["options"]
    borrowers = ["bob", "dave"][:o["borrowers"]]
    run_docs = w["runs"]
    code: dict[str, int] = {}
    for run in run_docs:
        c = run.get("code") or {}
        text = ((c.get("commit") or "?")[:7]
                + (f" with uncommitted {', '.join(x.split()[-1] for x in c['src_changes'])}"
                   if c.get("src_changes") else ""))
        code[text] = code.get(text, 0) + 1
    classes = sorted({r.get("scheduler_class") for r in (doc.get("modes") or {}).values()
                      if (r or {}).get("scheduler_class")})
    return [
        "", f"### {title}", "",
        f"`{MAKES[name]}` (with `--in-quota-append` for each further run): on `{cfg['model']}` with "
        f"{_active_seqs(doc)} active slots (`--max-num-seqs 16`), the rate/ceil/weight server only. "
        f"**carol** has a hard cap of {o['rate']:g} tok/s and keeps "
        + ("one closed-loop stream" if o.get("streams", 1) == 1 else
           f"{o['streams']} closed-loop streams (sharing her limit: one can be in the engine while another "
           "crosses the API server)")
        + f" of {o['max_tokens']}-token requests ({o['prompt_tokens']} prompt tokens) in flight, driven from "
        "a child process in a session of its own (from the benchmark's own process, in the caller's shell "
        "session, her client stalled for seconds beside the busy engine, and those gaps came out of her rate)"
        + _in_quota_priority(run_docs) + "; "
        + " and ".join(f"**{b}**" for b in borrowers)
        + f" {'borrows' if len(borrowers) == 1 else 'borrow'} with {{rate {o['borrower_rate']:g}, ceil null}}, "
        f"{o['borrower_streams']} closed-loop streams of {o['borrower_max_tokens']}-token requests each. Three "
        f"phases per run, each {o['warmup_s']:g} s of load then {o['measured_s']:g} s measured: "
        + ("one stream of carol's load from a user with no limit of its own (what one stream reaches)"
           if o.get("streams", 1) == 1 else
           f"carol's {o['streams']} streams from a user with no limit of its own (what they reach)")
        + ", carol alone, carol beside "
        "the borrowers. Every tok/s is the increase of the engine's "
        "`vllm:output_rate_output_tokens_charged_total` from the first to the last `/metrics` read within the "
        "phase (reads every 0.5 s; the plugin reports about once a second, so each edge may be a second stale). "
        f"Target (issue 33): carol beside ≥ {w.get('target_ratio', 0.95):g} × min(its limit, its tok/s alone).",
        *_in_quota_lines(w, _active_seqs(doc)),
        "", _runs_line([r.get("started_at") for r in run_docs], [r.get("load_before") for r in run_docs]),
        "", "Code the servers ran (the plugin is installed editable: the working tree): "
        + "; ".join(f"{text} ({_plural(n, 'run')})" for text, n in code.items()) + "."
        + (f" Scheduler class: {', '.join(f'`{c}`' for c in classes)} (from the engine log)." if classes else ""),
    ]


def _share_tolerance(target: dict) -> str:
    return (f"± {target['tolerance']:g}" if target["kind"] == "absolute"
            else f"± {100 * target['tolerance']:.0f} % of it")


def _borrowed_target_lines(name: str, w: dict, max_skew: float) -> list[str]:
    """The issue's targets for the shares of borrowed tokens, with their sample, met or missed."""
    b = w["borrowed_shares"]
    if "over_run" not in b:  # a result from before the figure was kept over the run
        return [f"- {name}, rate/ceil/weight: largest per-window share deviation "
                f"{_percent(b.get('max_share_deviation'))} (recorded before the over-the-run figure)."]
    target = b["target"]
    tol = target["tolerance"]
    failed = _fair_share_failed(w)
    n_windows = len(next(iter(b["per_window"].values()), [])) - 1
    tokens = sum(b["borrowed_tokens_over_run"].values())
    span = b.get("run_span_s") or [0, 0]
    misses = []
    for u, ws in b["weight_share"].items():
        share = b["over_run"].get(u)
        if share is None:
            continue
        off = abs(share - ws) if target["kind"] == "absolute" else abs(share / ws - 1)
        if off > tol:
            misses.append(f"{u} {share:.3f} against {ws:.3f}, off by "
                          + (f"{off:.3f}" if target["kind"] == "absolute" else f"{100 * off:.0f} %"))
    shares = ", ".join(f"{u} {_num(v)}" for u, v in b["over_run"].items())
    if "run_end_skew_s" in b:
        where = (f"{tokens:,} borrowed tokens from {span[0]:.0f} s to {span[1]:.0f} s, the reads nearest to the "
                 "start and the end of the load")
        if b["run_end_skew_s"] > max_skew:
            where += f" (the end read {b['run_end_skew_s']:.0f} s from the end: the API server answered late)"
    else:  # recorded before the figure stopped at the end of the load
        where = (f"{tokens:,} borrowed tokens from the first to the last read, {span[1] - span[0]:.0f} s, the drain "
                 "after the load included")
    over_run = (f"- {name}, rate/ceil/weight, share of borrowed tokens over the run (engine counter, {where}; "
                f"one run): {shares} (target: weight share {_share_tolerance(target)}")
    if failed:
        over_run += (f", **not met**: {failed}; " + ("the figure alone would meet it)" if b["met_over_run"] else
                                                     "the figure misses it too: " + "; ".join(misses) + ")"))
    elif b["met_over_run"]:
        over_run += ", met)"
    else:
        over_run += ", **missed**: " + "; ".join(misses) + ")"
    worst = b.get("worst_window_deviation")
    fmt = (lambda x: f"{x:.3f}") if target["kind"] == "absolute" else (lambda x: f"{100 * x:.0f} %")
    windows = (f"- {name}, rate/ceil/weight, every {w['window_s']:g} s window after the first: "
               f"{b['windows_counted']} of {n_windows} windows counted"
               + (f" ({b['windows_not_counted']} not: a /metrics edge missing or nothing borrowed)"
                  if b["windows_not_counted"] else "")
               + f", worst deviation from the weight shares {'-' if worst is None else fmt(worst)} (target "
               f"{_share_tolerance(target)}, ")
    if failed:
        windows += f"**not met**: {failed}; "
        if b["windows_missed"]:
            windows += (f"the figure misses it too, in {b['windows_missed']} of {b['windows_counted']} windows, "
                        f"worst by {fmt(max(worst - tol, 0))} beyond the tolerance).")
        elif b["windows_counted"] == n_windows:
            windows += "the figure alone would meet it)."
        else:
            windows += "the windows counted meet it, but not every window was counted)."
    elif b["windows_missed"] == 0 and b["windows_not_counted"] == 0 and b["windows_counted"]:
        windows += "met)."
    elif b["windows_missed"] == 0:
        windows += "not shown: not every window was counted)."
    else:
        windows += (f"**missed** in {b['windows_missed']} of {b['windows_counted']} windows, worst by "
                    f"{fmt(worst - tol)} beyond the tolerance).")
    lines = [over_run + ".", windows]
    per_step, active = w.get("tokens_per_step"), w.get("active_seqs")
    if per_step is not None and active and per_step < 0.8 * active:
        gauges = w.get("engine_requests") or {}
        running, waiting = ((gauges.get("running") or {}).get("mean"), (gauges.get("waiting") or {}).get("mean"))
        line = f"- {name}: the engine ran {per_step:.1f} requests per step of its {active} active slots"
        if running is not None and waiting is not None:
            line += f", with {running:g} requests running and {waiting:g} waiting in it on average (vLLM's gauges)"
            line += (": fewer requests reached it than it had slots, so it was not the bottleneck and the weights had "
                     "little to split" if running < active else
                     ": more were running than it filled slots per step, so the scheduler left slots empty")
        line += (f"; the client's event loop lagged up to {_num(w.get('loop_lag_max_s'), '.0f')} s and sent up to "
                 f"{_num(w.get('send_late_max_s'), '.0f')} s late.")
        lines.append(line)
    return lines


def _fair_share_failed(*workloads: dict) -> str | None:
    """What failed in the runs a target rests on (client timeouts and errors), or None."""
    timeouts = other = 0
    for workload in workloads:
        t, o = _client_errors(workload.get("errors"))
        timeouts, other = timeouts + t, other + o
    parts = ([_plural(timeouts, "client timeout")] if timeouts else []) + \
        ([_plural(other, "other client error")] if other else [])
    return " and ".join(parts) + " in those runs" if parts else None


def _fair_share_sample(workload: dict) -> str:
    windows = (workload.get("fairness") or {}).get("windows_counted")
    timeouts, other = _client_errors(workload.get("errors"))
    finished = (workload.get("requests_by_status") or {}).get("finished")
    return (f"{'-' if windows is None else _plural(windows, 'window')}; {_num(finished, 'd')} finished; "
            f"{timeouts}, {other}")


def _active_seqs(doc: Doc) -> int:
    return int((doc.get("config") or {}).get("active_seqs") or 8)


def _fair_share_tables(doc: Doc, modes: dict) -> list[str]:
    active = _active_seqs(doc)
    lines: list[str] = []
    for name in ("overload", "weighted"):
        if not any(((modes.get(key) or {}).get("workloads") or {}).get(name) for key, _ in FAIR_SHARE_MODES):
            continue
        lines += [
            "",
            f"| {name} | total tok/s (tokens per engine step, of {active}) | tok/s per client after the first window "
            "(of its guaranteed rate) | service difference max / "
            "mean (tokens per weight per window) | share deviation | light user's first token p50 / p90 | "
            "sample: windows counted; requests finished; client timeouts, other errors |",
            "| --- | ---: | --- | ---: | ---: | ---: | --- |",
        ]
        for key, label in FAIR_SHARE_MODES:
            result = modes.get(key) or {}
            w = (result.get("workloads") or {}).get(name)
            if not w:
                lines.append(f"| {label} | not run: `python benchmarks/fair_share.py --mode {key}` | | | | | |")
                continue
            f, light = w["fairness"], w["light"]
            per_user = ", ".join(
                f"{u} {_num(s['tok_s_after_first_window'], '.0f')}"
                + ("" if s.get("of_guaranteed") is None else f" ({100 * s['of_guaranteed']:.0f} %)")
                for u, s in w["users"].items())
            lines.append(
                f"| {label} | {w['throughput_tok_s']:.0f}"
                + ("" if w.get("tokens_per_step") is None else f" ({w['tokens_per_step']:.1f})")
                + f" | {per_user} | {_num(f['max'], '.0f')} / "
                f"{_num(f['mean'], '.0f')} | {_percent(f['max_share_deviation'])} | "
                f"{_ms(light['ttft_p50_s'])} / {_ms(light['ttft_p90_s'])} of the {light['engine_stamped']} of "
                f"{light['requests']} that finished ({light['requests'] - light['with_first_token']} had no first "
                f"token by the end) | {_fair_share_sample(w)} |")
    for name in FAIR_SHARE_EQUAL_RATES:
        ran = [(key, label, ((modes.get(key) or {}).get("workloads") or {}).get(name))
               for key, label in FAIR_SHARE_MODES]
        ran = [(key, label, w) for key, label, w in ran if w]
        if not ran:
            continue
        lines += [
            "",
            f"| {name} | client (weight share) | share of borrowed tokens: over the run / after the first "
            f"window | per window | tok/s after the first window | total tok/s (tokens per step, of {active}; "
            "requests running / waiting in the engine, mean of the reads) | "
            "sample: borrowed tokens over the run; windows counted; requests finished; in flight peak / cap; "
            "arrivals skipped; windows backlogged; client timeouts, other errors |",
            "| --- | --- | ---: | --- | ---: | ---: | --- |",
        ]
        for key, label, w in ran:
            b = w.get("borrowed_shares") or {}
            timeouts, other = _client_errors(w.get("errors"))
            finished = (w.get("requests_by_status") or {}).get("finished")
            for i, (u, s) in enumerate(w["users"].items()):
                ws = (b.get("weight_share") or {}).get(u, s["weight"] / sum(x["weight"] for x in w["users"].values()))
                if b.get("over_run"):
                    share = f"{_num(b['over_run'].get(u))} / {_num(b['after_first_window'].get(u))}"
                    per_window = " ".join(_num(x, ".2f") for x in b["per_window"][u])
                    sample = (f"{b['borrowed_tokens_over_run'][u]:,}; {b['windows_counted']}"
                              + (f"; {_num(finished, 'd')} finished" if i == 0 else ""))
                elif b:
                    share = f"- / {_num(b['after_first_window'].get(u))}"
                    per_window = " ".join(_num(x, ".2f") for x in b["per_window"][u])
                    sample = f"{b['borrowed_tokens_after_first_window'][u]:,} after the first window"
                else:
                    share, per_window = "- (no borrowing in this mode)", "-"
                    sample = f"{_num(finished, 'd')} finished" if i == 0 else ""
                sample += ("; " if sample else "") + (
                           f"{_num(s.get('peak_in_flight'), 'd')} / {_num(s.get('in_flight_cap'), 'd')}; "
                           f"{s['arrivals_skipped']}; {_num(s.get('backlogged_windows'), 'd')} of "
                           f"{len(w['service'][u])}")
                if i == 0:
                    sample += f"; {timeouts}, {other}"
                gauges = w.get("engine_requests") or {}
                total = ("" if i else f"{w['throughput_tok_s']:.0f}"
                         + ("" if w.get("tokens_per_step") is None else f" ({w['tokens_per_step']:.1f}"
                            + ("" if not gauges.get("running") or not gauges.get("waiting") else
                               f"; {gauges['running']['mean']:g} / {gauges['waiting']['mean']:g}") + ")"))
                lines.append(f"| {label if i == 0 else ''} | {u} ({ws:.3f}) | {share} | {per_window} | "
                             f"{_num(s['tok_s_after_first_window'], '.0f')} | {total} | {sample} |")
    return lines


def _fair_share_runs(modes: dict) -> list[str]:
    ran = [(label, modes[key]) for key, label in FAIR_SHARE_MODES if (modes.get(key) or {}).get("status") == "ran"]
    lines: list[str] = []
    differs = [label for label, r in ran if r.get("config_differs")]
    if differs:
        lines += ["", f"**Not comparable**: {', '.join(differs)} ran with other workload options than the "
                  "latest run (JSON `workload_config`)."]
    if ran:
        late = [w.get("send_late_max_s") for _, r in ran for w in r["workloads"].values()
                if w.get("send_late_max_s") is not None]
        lines += ["", _runs_line([w.get("started_at") or r["started_at"] for _, r in ran for w in r["workloads"].values()],
                                 [w.get("load_before") or r["load_before"] for _, r in ran
                                  for w in r["workloads"].values()])
                  .removesuffix(".")
                  + (f"; the client sent up to {max(late):.0f} s late" if late else "")
                  + ". A lagging client sends late; the service and first-token figures are the engine's own and "
                  "do not move with it (except the requests cut at the end of a run, counted on receive times)."]
        code: dict[str, list[str]] = {}
        for label, r in ran:
            for name, w in r["workloads"].items():
                c = w.get("code") or r.get("code")
                if c:
                    text = ((c["commit"][:7] if c.get("commit") else "?")
                            + (f" with uncommitted {', '.join(x.split()[-1] for x in c['src_changes'])}"
                               if c.get("src_changes") else ""))
                    code.setdefault(text, []).append(f"{label} {name}")
        if code:
            lines += ["", "Code the servers ran (the plugin is installed editable: the working tree): " + "; ".join(
                f"{text} ({', '.join(runs)})" for text, runs in code.items()) + "."]
        classes = sorted({r["scheduler_class"] for _, r in ran if r.get("scheduler_class")})
        if classes:
            lines += ["", f"Scheduler class the plugin's servers ran: {', '.join(f'`{c}`' for c in classes)} "
                      "(read from the engine log; the CPU build turns async scheduling off, so "
                      "`OutputRateAsyncScheduler` does not run on this machine)."]
    return lines


def _fair_share_body(doc: Doc) -> list[str]:
    modes = doc.get("modes", {})
    in_quota = (((modes.get("shares") or {}).get("workloads") or {}).get("in-quota"))
    lines = [] if not in_quota else [
        "", "**in-quota** (rate/ceil/weight only): carol, a hard cap and one closed-loop stream, alone and then "
        "beside saturating borrowers (no ceiling); tok/s on the engine's charged-token counter per phase "
        "(issue 33: beside ≥ 0.95 × min(limit, alone)).", *_in_quota_lines(in_quota, _active_seqs(doc))]
    return _fair_share_tables(doc, modes) + lines + _fair_share_targets(doc, modes) + _fair_share_runs(modes)


def _raised(run: Doc) -> dict[str, Any] | None:
    """The raised CPU priority a run's clients had (None: the default)."""
    got = run.get("client_priority") or {}
    return got if got.get("threads") or got.get("autogroup") else None


def _raised_runs(runs: dict[str, Doc]) -> tuple[dict[str, Any] | None, list[str]]:
    """The first raised grant among ``runs`` (None: none was raised), and which runs had one."""
    raised = [label for label, run in runs.items() if _raised(run)]
    return (_raised(runs[raised[0]]) if raised else None), raised


def _client_priority(doc: Doc) -> str:
    """How the page's runs had their clients scheduled beside the engine (the same cores)."""
    runs = {f"{dict(FAIR_SHARE_MODES).get(mode, mode)} {name}": w for mode, r in (doc.get("modes") or {}).items()
            for name, w in ((r or {}).get("workloads") or {}).items() if w}
    got, raised = _raised_runs(runs)
    if got is None:
        return " The clients ran at the default CPU priority, beside the engine on the same cores."
    labels = {"threads": "threads", "autogroup": "session's autogroup"}
    how = f"nice {got['nice']} (their {' and '.join(label for k, label in labels.items() if got.get(k))})"
    which = ("" if len(raised) == len(runs) else
             f" in {', '.join(sorted(raised))}; the others ran at the default priority")
    return (f" The clients ran at {how}{which}: at the default priority a many-stream client on the same "
            "cores as the busy engine could be left runnable but unserved for seconds, so the load it offered "
            "was not the workload's.")


def fair_share_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    cfg, cap = doc["config"], doc["capacity"]
    a, b = cfg["overload_load"]
    equal = any(name in ((r or {}).get("workloads") or {}) for r in doc.get("modes", {}).values()
                for name in FAIR_SHARE_EQUAL_RATES)
    lines = [
        "VTC's two synthetic workloads (Sheng et al., OSDI 2024, section 5.2), scaled to this machine, "
        f"on `{cfg['model']}` with {_active_seqs(doc)} active slots (a workload tests sharing only while the "
        "engine is the bottleneck: its tokens per step near the active slots). "
        f"Capacity C = {cap['tok_s']:g} output tok/s ({cap['streams']} closed-loop streams on the stock "
        f"server); every client sends open loop at fixed intervals, {cfg['prompt_tokens']} prompt + "
        f"{cfg['max_tokens']} output tokens per request, for {cfg['duration']:g} s. **overload**: A and B, "
        f"equal weights, offering {a:g} C and {b:g} C. **weighted**: W1–W4, weights 1–4, "
        + (f"each offering {cfg['weighted_load']:g} C." if cfg["weighted_arrivals"] == "equal"
           else f"offering {cfg['weighted_load'] * 4:g} C in proportion to their weights (as VTC).")
        + f" Guaranteed rates: {cfg['guaranteed']:g} C per workload, split by weight; **hard caps** make them "
        "ceilings, **rate/ceil/weight** gives the same rates with no ceiling and the workload's weights. "
        f"A light user sends {cfg['light_max_tokens']} tokens every {cfg['light_interval']:g} s in every mode "
        f"(limited to {cfg['light_rate']:g} tok/s in the two plugin modes)." + _client_priority(doc),
    ]
    if equal:
        lines += [
            "",
            "**equal-rates-1-3** (E1, E3: weights 1 and 3) and **equal-rates-1-2-3-4** (Q1–Q4): every client "
            f"has the same guaranteed rate, {cfg.get('equal_rate', 5):g} tok/s, so only the weights can split the "
            f"spare capacity (issue 33). Each offers {cfg.get('equal_rates_load', 0.8):g} C"
            + (f" with at most {cfg['equal_rates_in_flight']} requests in flight (an arrival beyond is skipped), "
               "so each stays backlogged for the whole run and its backlog stays bounded"
               if cfg.get("equal_rates_in_flight") else "")
            + ". Their figure: each client's share of the **borrowed** tokens on the engine's "
            "`vllm:output_rate_borrowed_tokens_total` counter, over the run (first to last `/metrics` read), "
            f"after the first window and per {cfg['window']:g} s window, against its weight share. Targets "
            "(issue 33): E3 0.75 ± 0.05 over the run and in every window after the first; with 1:2:3:4 each share "
            "within ± 10 % of its weight share.",
        ]
    lines += [
        "",
        f"Service per client per {cfg['window']:g} s window: on the engine's per-user counters where the plugin "
        "runs (`/metrics`, windows whose edges had no read within "
        f"{cfg.get('max_skew', 2):g} s are left out); on stock vLLM, which has no per-user counter, each "
        "request's tokens spread over its first-to-last token span as the engine stamped it (per-request "
        "metrics), as VTC attributes service. **Service difference** (VTC's fairness metric, output tokens "
        "only): in each window, among the clients backlogged throughout it, service divided by weight, "
        "largest minus smallest; max and mean over the windows after the first. **Share deviation**: the "
        "largest |share of the backlogged clients' tokens / weight share − 1| in any window after the first. "
        "A counter window's edges are the engine's about-once-a-second reports, so one window may hold up to "
        "a second more than its 10 s worth. "
        "The light user's first-token time is the engine's own stamp (queued in the engine to first token) "
        "of its requests that finished.",
    ]
    lines += _fair_share_body(doc)
    if image:
        lines += ["", f"![service per user over time, stock vs hard caps vs rate/ceil/weight]({image})"]
    for name, title in FAIR_SHARE_VARIANTS.items():
        variant = extra.get(name)
        if not variant:
            continue
        vcfg, vcap = variant["config"], variant.get("capacity") or {}
        lines += [
            "", f"### {title}", "",
            f"The same benchmark on `{vcfg['model']}` with {_active_seqs(variant)} active slots "
            f"(`{MAKES[name]}`): C = {_num(vcap.get('tok_s'), 'g')} output tok/s "
            + (f"({vcap['streams']} closed-loop streams on the stock server), " if vcap.get("streams") else
               ("(given with `--capacity`), " if str(vcap.get("measured_in_mode", "")).startswith("given")
                else f"({vcap.get('measured_in_mode', 'not measured')}), "))
            + f"{vcfg['duration']:g} s per workload"
            + (f", equal-rate clients offering {vcfg['equal_rates_load']:g} C each with at most "
               f"{vcfg['equal_rates_in_flight']} requests in flight" if vcfg.get("equal_rates_in_flight") else "")
            + "; only the workloads run at this setting are shown." + _client_priority(variant),
            *_fair_share_body(variant),
            "", f"![service per user over time, {title.split(':')[0].lower()}]({name}.png)",
        ]
    for name, title in FAIR_SHARE_IN_QUOTA.items():
        if extra.get(name):
            lines += in_quota_section(name, title, extra[name])
    return lines


def _reads(side: Doc | None) -> str:
    reads = (side or {}).get("counter_reads")
    return str(len(reads)) if isinstance(reads, list) else "-"


def gateway_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    cfg, sides = doc["config"], doc["sides"]
    order = [side for side in ("stock", "gateway", "plugin") if side in sides]
    labels = {"stock": "stock vLLM", "gateway": f"LiteLLM {doc.get('gateway_version') or ''} TPM → stock vLLM",
              "plugin": "plugin"}
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f} ms"  # noqa: E731

    def window(side: str, w: str) -> str:
        row = sides[side]["users"]["heavy"]["windows"][w]
        if "engine_ratio" in row:
            return f"{row['engine_ratio']:.2f} (engine; client {row['client_ratio']:.2f})"
        return f"{row['client_ratio']:.2f} (client)"

    def cells(fn: Callable[[str], str]) -> str:
        return " | ".join(fn(side) for side in order)

    def user(side: str, who: str) -> dict:
        return sides[side]["users"][who]

    lines = [
        f"The same load on each side for {cfg['duration']:g} s: user `heavy` keeps {cfg['heavy_streams']} streams "
        f"in flight (limit {cfg['heavy_limit']:g} tok/s), user `light` one stream with a {cfg['light_pause']:g} s "
        f"pause after each answer (limit {cfg['default_limit']:g} tok/s); every request asks for "
        f"{cfg['max_tokens']} tokens, a 429 is retried after {cfg['retry_after']:g} s, requests in flight at the "
        "end are cancelled. The gateway is LiteLLM's proxy with no database, each key's `tpm_limit` (limit × 60) "
        "returned by its `custom_auth` hook and `token_rate_limit_type: output`, in front of the same stock "
        "server; the plugin runs on a fresh server with the same limits.",
        "",
        "Clocks: tok/s and the stock and gateway windows are on this client's receive times. Streams stall on "
        "this loaded 2-core machine (the client sees gaps of seconds, then a bunch of tokens), so windows on "
        "that clock overstate a paced rate; the plugin's windows are on the engine's own charged-token counter, "
        f"read {_reads(sides.get('plugin'))} times in the run ({cfg['read_every']:g} s apart plus each read's own "
        "time; growth between two reads at most W apart), with its client-side "
        "figure beside it. The light user's first token: send to first token received, client clock, same "
        "pacing on every side. One run per side, one after another: the load average differs between them.",
        "",
        "| | " + " | ".join(labels[side] for side in order) + " |",
        "| --- |" + " ---: |" * len(order),
        "| heavy tok/s | " + cells(lambda s: f"{user(s, 'heavy')['tokens_per_s']:.1f}") + " |",
        "| heavy, most tokens in any 10 s ÷ limit | " + cells(lambda s: window(s, "10s")) + " |",
        "| heavy, most tokens in any 60 s ÷ limit | " + cells(lambda s: window(s, "60s")) + " |",
        "| heavy 429s | " + cells(lambda s: str(user(s, "heavy")["rejected_429"])) + " |",
        "| heavy requests answered | " + cells(lambda s: str(user(s, "heavy")["answered"])) + " |",
        "| light tok/s | " + cells(lambda s: f"{user(s, 'light')['tokens_per_s']:.1f}") + " |",
        "| light requests answered (429s) | "
        + cells(lambda s: f"{user(s, 'light')['answered']} ({user(s, 'light')['rejected_429']})") + " |",
        "| light first token p50 / p99 (requests) | "
        + cells(lambda s: f"{ms(user(s, 'light')['first_token_p50_s'])} / {ms(user(s, 'light')['first_token_p99_s'])}"
                f" ({user(s, 'light')['first_tokens']})") + " |",
        "| answers whose token count ≠ usage | "
        + cells(lambda s: str(sum(u["usage_mismatches"] for u in sides[s]["users"].values()))) + " |",
        "| client errors other than 429 (cancelled at the end) | "
        + cells(lambda s: f"{sum(u['other_errors'] for u in sides[s]['users'].values())} "
                f"({sum(u['cancelled_at_end'] for u in sides[s]['users'].values())})") + " |",
        "",
        "1-min load average before each side's run: "
        + ", ".join(f"{labels[s].strip()} {sides[s]['load_before'][0]:.1f}" for s in order)
        + (f"; started {doc['started_at']} (UTC)" if doc.get("started_at") else "") + ".",
    ]
    if image:
        lines += ["", f"![The heavy user's tokens per second on the three sides]({image})"]
    return lines


def gpu_twin_lines(doc: Doc, extra: dict[str, Doc | None], image: str | None) -> list[str]:
    """The twin's target table, as its own page renders it; the rest stays on that page."""
    spec = importlib.util.spec_from_file_location("_benchmark_gpu_twin", BENCHMARKS / "gpu_twin.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    full = module.render(doc).splitlines()
    start = full.index("## Targets (issue 44)") + 1
    end = next((i for i in range(start, len(full)) if full[i].startswith("## ")), len(full))
    lines = ["vLLM's real scheduler, stock and ours, with fabricated model outputs on a clock advanced by a "
             "GPU cost model (no GPU ran; CPU times are this machine's). The cost model, its source and fit "
             "error, the workloads and every run's figures: [gpu_twin.md](gpu_twin.md).", ""]
    lines += full[start:end]
    if image:
        lines += ["", f"![Scheduler CPU per step against idle users and running requests]({image})"]
    return lines


@dataclass(frozen=True)
class Section:
    name: str  # the result's stem under docs/benchmarks/
    title: str
    render: Callable[[Doc, dict[str, Doc | None], str | None], list[str]]
    companions: tuple[str, ...] = ()
    #: companions drawn by the section's own ``plot`` into docs/COMPANION.png (DRAWN_FROM_JSON only)
    figure_companions: tuple[str, ...] = ()


SECTIONS = (
    Section("demo", "Stock vLLM vs the plugin on one workload (`vllm-output-rate demo`)", demo_lines),
    Section("demo-cluster", "One quota over several engines (`vllm-output-rate demo-cluster`)", demo_cluster_lines),
    Section("scheduler_step", "Scheduler step cost (`benchmarks/scheduler_step.py`)", scheduler_step_lines,
            ("scheduler_step_fast_paths", "scheduler_step_store", "scheduler_step_borrowing")),
    Section("throughput_ratio", "End-to-end throughput, limits never hit vs feature off "
            "(`benchmarks/throughput_ratio.py`)", throughput_lines),
    Section("offline_throughput", "In-process throughput (`benchmarks/offline_throughput.py`)", offline_lines),
    Section("idle_cpu", "Server CPU with every user throttled (`benchmarks/idle_cpu.py`)", idle_lines,
            ("idle_cpu_spin_off", *IDLE_VARIANTS)),
    Section("itl_single", "Single-stream inter-token latency (`benchmarks/itl_single.py`)", itl_lines,
            ("itl_single_instructions",)),
    Section("kv_pressure", "KV cache held by a throttled user (`benchmarks/kv_pressure.py`)", kv_lines),
    Section("prompt_flood", "A prompt flood beside a light user (`benchmarks/prompt_flood.py`)",
            prompt_flood_lines),
    Section("soak", "Soak: many users, cancellations, preemption churn (`benchmarks/soak.py`)", soak_lines),
    Section("soak_cluster", "Chaos soak: two engines, one Redis killed and restarted, one engine restarted "
            "(`benchmarks/soak.py --engines 2 --store redis-server --max-tokens 256`)", soak_cluster_lines),
    Section("shared_store", "Cost of the shared Redis store (`benchmarks/shared_store.py`)", shared_store_lines),
    Section("fair_share", "Fair share of spare capacity: stock vs hard caps vs rate/ceil/weight "
            "(`benchmarks/fair_share.py`)", fair_share_lines, (*FAIR_SHARE_VARIANTS, *FAIR_SHARE_IN_QUOTA),
            figure_companions=tuple(FAIR_SHARE_VARIANTS)),
    Section("gateway_compare", "The same load through a gateway limiter (`benchmarks/gateway_compare.py`)",
            gateway_lines),
    Section("gpu_twin", "GPU twin: 10,000 users, 256 and 1,024 running, on an H100's modelled clock "
            "(`benchmarks/gpu_twin.py`)", gpu_twin_lines),
)


# --------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------


def _load(path: Path) -> Doc | None:
    return json.loads(path.read_text()) if path.is_file() else None


def machine_text(machine: dict) -> str:
    parts = [machine.get("cpu_model") or "unknown CPU", f"{machine.get('nproc')} CPU cores"]
    if machine.get("mem_total_gib"):
        parts.append(f"{machine['mem_total_gib']:g} GiB RAM")
    parts += [f"vLLM {machine.get('vllm')}", f"torch {machine.get('torch')}", f"Python {machine.get('python')}"]
    return ", ".join(parts)


def _commits(doc: Any) -> list[str]:
    """Every code commit a result records (``code.commit`` or ``git.commit`` at any depth), in order."""
    found: list[str] = []
    if isinstance(doc, dict):
        for key in ("code", "git"):
            code = doc.get(key)
            if isinstance(code, dict) and code.get("commit") and code["commit"] not in found:
                found.append(code["commit"])
        for key, value in doc.items():
            if key not in ("code", "git"):
                found += [c for c in _commits(value) if c not in found]
    elif isinstance(doc, list):
        for value in doc:
            found += [c for c in _commits(value) if c not in found]
    return found


def committed_in(path: Path) -> str | None:
    """The last commit that changed ``path`` (None outside a git checkout): a result that
    records no code commit was measured on code at or before it."""
    import subprocess

    try:
        done = subprocess.run(["git", "log", "-1", "--format=%h", "--", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def recorded_line(names_docs: list[tuple[str, Doc]], page_machine: str | None,
                  results: Path | None = None) -> str:
    """What each result file of a section records of its code and machine ("not recorded" where
    it holds nothing), so that a reader can tell which code on which machine made each figure.
    ``page_machine``: the one machine the page's head names, referred to rather than repeated."""
    parts = []
    for name, doc in names_docs:
        commits = _commits(doc)
        code = ("commit " + ", ".join(f"`{c[:10]}`" for c in commits)) if commits else "commit not recorded"
        since = None if commits or results is None else committed_in(results / f"{name}.json")
        if since:
            code += f" (the file last changed in `{since}`: the code measured is at or before it)"
        if not doc.get("machine"):
            machine = "machine not recorded"
        elif machine_text(doc["machine"]) == page_machine:
            machine = "the machine named at the top"
        else:
            machine = machine_text(doc["machine"])
        load = doc.get("load_before")
        load_text = (f"; 1-min load before the run {load[0]:g}" if isinstance(load, list) and load else "")
        parts.append(f"`{name}.json`: {code}; {machine}{load_text}")
    return "Recorded: " + " · ".join(parts) + "."


#: Marks a sentence or table row of the page whose target was missed or not met.
MISSED_MARKS = ("**missed**", "**not met**")


def _as_sentence(line: str) -> str:
    """A list item as it is; a table row as its non-empty cells, joined (a row read alone)."""
    if line.startswith("|"):
        return " · ".join(cell.strip() for cell in line.strip("|").split("|") if cell.strip())
    return line.lstrip("- ")


def missed_targets(sections: list[tuple[str, list[str]]]) -> list[str]:
    """Every line that misses a target, under its section's title: one list for the whole page."""
    lines: list[str] = []
    for title, body in sections:
        hits = [line.strip() for line in body if any(mark in line for mark in MISSED_MARKS)]
        if hits:
            lines.append(f"- **{title}**")
            lines += [f"  - {_as_sentence(hit)}" for hit in hits]
    return lines


def provenance(docs: dict[str, Doc]) -> list[str]:
    """The machine(s) and the dates, stated once for the whole page."""
    machines: dict[str, list[str]] = {}
    for name, doc in docs.items():
        if doc.get("machine"):
            machines.setdefault(machine_text(doc["machine"]), []).append(name)
    dates = sorted(doc["started_at"] for doc in docs.values() if doc.get("started_at"))
    lines = []
    if len(machines) == 1:
        lines.append(f"Machine: {next(iter(machines))}.")
    else:
        lines += [f"Machine for {', '.join(names)}: {text}." for text, names in machines.items()]
    if dates:
        lines.append(f"Runs started between {dates[0]} and {dates[-1]} (UTC)." if dates[0] != dates[-1]
                     else f"Run started {dates[0]} (UTC).")
    return lines


def render(results: Path, page: Path) -> str:
    """The page's text; copies each section's figure next to the page."""
    docs: dict[str, Doc] = {}
    missing: list[str] = []
    body: list[str] = []
    rendered: list[tuple[str, list[str]]] = []
    for section in SECTIONS:
        doc = _load(results / f"{section.name}.json")
        extra = {name: _load(results / f"{name}.json") for name in section.companions}
        missing += [name for name in (section.name, *section.companions)
                    if (doc if name == section.name else extra[name]) is None]
        if doc is None:
            continue
        docs[section.name] = doc
        docs.update({name: d for name, d in extra.items() if d is not None})
        image = None
        source = results / f"{section.name}.json"
        figure = page.parent / f"{section.name}.png"
        if section.name in DRAWN_FROM_JSON:
            draw_figure(section.name, source, figure)
        elif (results / figure.name).is_file():
            shutil.copyfile(results / figure.name, figure)
        for name in section.figure_companions:
            if extra.get(name) is not None and section.name in DRAWN_FROM_JSON:
                draw_figure(section.name, results / f"{name}.json", page.parent / f"{name}.png")
                why = record_mismatch(page.parent / f"{name}.png", results / f"{name}.json")
                if why:
                    print(f"warning: {why}", file=sys.stderr)
        warning = []
        if figure.is_file():
            image = figure.name
            why = record_mismatch(figure, source)
            if why:
                print(f"warning: {why}", file=sys.stderr)
                warning = [f"**The figure below is not from this result's JSON** (it does not carry the "
                           f"digest of `{source.name}`): re-run `{MAKES[section.name]}`.", ""]
        section_body = section.render(doc, extra, image)
        rendered.append((section.title, section_body))
        files = [(section.name, doc), *((name, d) for name, d in extra.items() if d is not None)]
        body += [f"## {section.title}", "", files, "", *warning, *section_body, ""]
    machines = {machine_text(d["machine"]) for d in docs.values() if d.get("machine")}
    page_machine = next(iter(machines)) if len(machines) == 1 else None
    # Each section's files, replaced by the line saying what they record.
    body = [recorded_line(line, page_machine, results) if isinstance(line, list) else line for line in body]
    results_link = Path(os.path.relpath(results, page.parent)).as_posix()
    head = [
        "# Performance",
        "",
        f"<!-- Generated by `{COMMAND}` from {results.as_posix()}/*.json; do not edit: change the "
        "generator or re-run a benchmark. -->",
        "",
        f"Generated by `{COMMAND}` from the benchmarks' JSON in [`{results.as_posix()}/`]({results_link}/). "
        "Every figure on this page comes from those files.",
        "",
    ]
    head += [*provenance(docs), ""] if docs else ["No benchmark result is committed yet.", ""]
    if docs:
        head += ["Each section starts with what its result files record: the code commit the run measured "
                 "(\"not recorded\" where the file holds none), the machine, when it started and the machine's "
                 "load. Nothing here ran on a GPU.", ""]
    missed = missed_targets(rendered)
    if missed:
        head += ["## Missed targets", "",
                 "Every target this page reports as missed or not met, in one place (each is repeated, with its "
                 "context, in its section below):", "", *missed, ""]
    tail = []
    if missing:
        tail = ["## Not measured yet", "", "| result | command that writes it |", "| --- | --- |",
                *(f"| `{name}.json` | `{MAKES[name]}` |" for name in missing), ""]
    return "\n".join(head + body + tail).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS_DIR), help="the benchmarks' JSON (default: %(default)s)")
    ap.add_argument("--page", default="docs/performance.md", help="the page to write (default: %(default)s)")
    args = ap.parse_args(argv)
    page = Path(args.page)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render(Path(args.results), page))
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
