"""Keep a bench or demo run for the performance page, and render its section.

Usage::

    python -m vllm_output_rate.tools.report --demo results/demo.json \\
        --png results/demo.png --out docs/benchmarks/demo
    python -m vllm_output_rate.tools.report --demo-cluster results/demo-cluster.json \\
        --png results/demo-cluster.png --out docs/benchmarks/demo-cluster
    python -m vllm_output_rate.tools.report --bench results/bench.json --out docs/benchmarks/bench

A run's JSON holds every request's token times (megabytes); the page needs
only the summaries.  ``main`` writes ``PREFIX.json`` without the raw
requests (:func:`page_document`) and ``PREFIX.png`` (copied from ``--png``,
or drawn from the raw data when ``--png`` is not given or missing), where
``benchmarks/render_performance.py`` reads them.  The PNG carries the sha256
of that ``PREFIX.json`` in its metadata (``render.DIGEST_KEY``): the raw
requests it was drawn from are not kept, so the digest ties the two files
to one run.

Rendering (:func:`render_section`, :func:`render_demo_section`) is pure: a
parsed document in, Markdown out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from vllm_output_rate.tools.analysis import BURST_S, UserSummary
from vllm_output_rate.tools.render import (
    COMPARISON_HEADERS,
    TABLE_HEADERS,
    comparison_rows,
    guarantee_note,
    markdown_table,
    plot_comparison,
    figure_metadata,
    plot_run,
    stamp_png,
    table_rows,
)

PROG = "python -m vllm_output_rate.tools.report"


def _code(text: str) -> str:
    """Inline code that survives backticks inside ``text``."""
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`"


def _facts(result: Mapping[str, Any], dated: bool) -> list[str]:
    config = result.get("config", {})
    facts = [f"Date: {result.get('started_at', '?')}"] if dated else []
    if config.get("model"):
        facts.append(f"model: {_code(str(config['model']))}")
    if config.get("duration_s") is not None:
        facts.append(f"duration: {config['duration_s']:g} s")
    lag = (result.get("client") or {}).get("loop_lag_max_s")
    if lag is not None:
        facts.append(f"client loop lag max: {lag * 1000:.0f} ms")
    return facts


def render_section(
    result: Mapping[str, Any], image_link: str | None = None, note: str | None = None,
    dated: bool = True,
) -> str:
    """Markdown for one bench result (a parsed ``--json`` document); ``dated``
    False leaves the run's date out (a page that states it once)."""
    summaries = [UserSummary.from_dict(s) for s in result.get("summary", [])]
    burst = result.get("config", {}).get("burst_s", BURST_S)
    lines = [f"Command: {_code(result.get('command', '?'))}", "", " · ".join(_facts(result, dated))]
    if note:
        lines += ["", f"Machine: {note}"]
    if image_link:
        lines += ["", f"![Output rate per user over time]({image_link})"]
    lines += ["", markdown_table(TABLE_HEADERS, table_rows(summaries)), "", guarantee_note(burst)]
    return "\n".join(lines)


def _summaries(doc: Mapping[str, Any]) -> list[UserSummary]:
    return [UserSummary.from_dict(s) for s in doc.get("summary", [])]


def demo_headline(demo: Mapping[str, Any]) -> str:
    """One sentence: what the light user gained, what the heavy user was held to."""
    light, heavy = demo["light_user"], demo["heavy_user"]
    stock = {s.user: s for s in _summaries(demo["stock"])}
    plugin = {s.user: s for s in _summaries(demo["plugin"])}
    parts = []
    h_s, h_p = stock.get(heavy), plugin.get(heavy)
    if h_s and h_p and h_s.tokens_per_s and h_p.tokens_per_s:
        parts.append(
            f"`{heavy}` ({demo['workload']['heavy_streams']} streams) is held to "
            f"{h_p.tokens_per_s:.1f} tok/s under its {h_p.limit_tokens_per_s:g} tok/s limit "
            f"(stock: {h_s.tokens_per_s:.0f} tok/s)")
    l_s, l_p = stock.get(light), plugin.get(light)
    if l_s and l_p and l_s.share is not None and l_p.share is not None:
        text = f"`{light}` (1 stream) goes from {100 * l_s.share:.0f} % to {100 * l_p.share:.0f} % of the output"
        if l_s.ttft_p50_s is not None and l_p.ttft_p50_s is not None:
            text += (f", its median first-token time from {l_s.ttft_p50_s * 1000:.0f} ms "
                     f"to {l_p.ttft_p50_s * 1000:.0f} ms")
        parts.append(text)
    return "; ".join(parts) + "." if parts else ""


def render_demo_section(
    demo: Mapping[str, Any], image_link: str | None = None, note: str | None = None,
    dated: bool = True,
) -> str:
    """Markdown for a ``vllm-output-rate demo`` result: stock vs plugin."""
    stock, plugin = demo["stock"], demo["plugin"]
    lines = [f"Command: {_code(demo.get('command', '?'))}", ""]
    facts = [f"Date: {demo.get('started_at', '?')}"] if dated else []
    model = plugin.get("config", {}).get("model")
    if model:
        facts.append(f"model: {_code(str(model))}")
    facts.append(f"{plugin.get('config', {}).get('duration_s', 0):g} s per run")
    lags = [(d.get("client") or {}).get("loop_lag_max_s") for d in (stock, plugin)]
    if all(x is not None for x in lags):
        facts.append("client loop lag max: " + " / ".join(f"{x * 1000:.0f}" for x in lags) + " ms (stock / plugin)")
    lines.append(" · ".join(facts))
    if note:
        lines += ["", f"Machine: {note}"]
    headline = demo_headline(demo)
    if headline:
        lines += ["", headline]
    if image_link:
        lines += ["", f"![Stock vLLM vs vllm-output-rate on the same workload]({image_link})"]
    lines += [
        "",
        markdown_table(COMPARISON_HEADERS, comparison_rows(_summaries(stock), _summaries(plugin))),
        "",
        "Server flags of both runs: " + _code(shlex.join(demo.get("common_server_args", [])))
        + "; the plugin run adds " + _code(shlex.join(demo.get("plugin_server_args", []))) + ".",
        "",
        guarantee_note(plugin.get("config", {}).get("burst_s", BURST_S)),
    ]
    return "\n".join(lines)


def page_document(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` without the raw requests (a bench run's, or each side's of a demo)."""
    out = {k: v for k, v in document.items() if k != "requests"}
    for side in ("stock", "plugin"):
        if isinstance(out.get(side), Mapping):
            out[side] = page_document(out[side])
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench", metavar="RESULT.json", help="output of bench --json")
    source.add_argument("--demo", metavar="DEMO.json", help="output of vllm-output-rate demo")
    source.add_argument("--demo-cluster", metavar="DEMO.json", help="output of vllm-output-rate demo-cluster")
    parser.add_argument("--png", metavar="PATH", help="the run's figure (drawn from the JSON if missing)")
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.json and PREFIX.png")
    return parser


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def draw_demo(demo: Mapping[str, Any], png: Path) -> None:
    from vllm_output_rate.tools.bench import limits_from_document, records_from_document

    plugin = demo["plugin"]
    end = max(demo["stock"]["config"]["duration_s"], plugin["config"]["duration_s"])
    plot_comparison(records_from_document(demo["stock"]), records_from_document(plugin),
                    limits_from_document(plugin), demo["light_user"], png, end_s=end,
                    subtitle=demo_headline(demo).replace("`", ""))


def _draw(args: argparse.Namespace, result: Mapping[str, Any], png: Path) -> None:
    from vllm_output_rate.tools.bench import limits_from_document, records_from_document

    if args.demo:
        draw_demo(result, png)
    elif args.demo_cluster:
        from vllm_output_rate.tools.demo_cluster import draw_cluster

        draw_cluster(result, png)
    else:
        plot_run(records_from_document(result), limits_from_document(result), png)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        result = json.loads(Path(args.demo or args.demo_cluster or args.bench).read_text())
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    if args.demo_cluster:
        from vllm_output_rate.tools.demo_cluster import with_rates_under_load

        result = with_rates_under_load(result)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    png = prefix.with_name(prefix.name + ".png")
    path = prefix.with_name(prefix.name + ".json")
    path.write_text(json.dumps(page_document(result), indent=1) + "\n")
    if args.png and Path(args.png).exists():
        if Path(args.png).resolve() != png.resolve():
            shutil.copyfile(args.png, png)
    else:
        _draw(args, result, png)
    # The kept JSON leaves the raw requests out, so the figure cannot be drawn
    # again from it: the PNG carries the digest of the JSON written with it.
    try:
        stamp_png(png, figure_metadata(path))
    except ValueError as exc:
        print(f"{PROG}: warning: {png} not stamped with the digest of {path.name}: {exc}", file=sys.stderr)
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
