"""Tables and figures of bench results (one run, or stock vs plugin).

Pure functions of :class:`~.analysis.UserSummary` /
:class:`~.measure.RequestRecord` data: the same code renders a live run and a
recorded JSON file.  Figures are drawn on a bare matplotlib ``Figure`` with an
Agg canvas (no pyplot, no global backend state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from vllm_output_rate.settings import ANONYMOUS_USER
from vllm_output_rate.tools.analysis import (
    BURST_S,
    NOT_CHECKED,
    VERDICT_BASIS,
    UserSummary,
    WindowCheck,
    bound_terms,
    cumulative_series,
    rate_series,
    shared_slack_s,
    ttft_series,
)
from vllm_output_rate.tools.measure import RequestRecord

# --------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ms_pair(p50: float | None, p99: float | None) -> str:
    if p50 is None or p99 is None:
        return "-"
    return f"{p50 * 1000:.0f} / {p99 * 1000:.0f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def usage_cell(s: UserSummary) -> str:
    if s.usage_match is None:
        return "n/a"
    return "yes" if s.usage_match else f"NO ({s.usage_mismatches})"


def tightest(s: UserSummary) -> str:
    """The check closest to (or furthest over) its bound, e.g. ``envelope 20.1s: 610 <= 634.0``."""
    candidates: list[tuple[float, str]] = []
    env = s.envelope
    if env is not None and env.bound:
        relation = "<=" if env.passed else ">"
        candidates.append((env.tokens / env.bound,
                           f"envelope {env.window_s:.1f}s: {env.tokens} {relation} {env.bound:.1f}"))
    for c in s.windows:
        if not c.bound:
            continue
        allowed = c.bound + (c.stall_allowance or 0.0)
        relation = "<=" if c.passed else ">"
        candidates.append((c.max_tokens / allowed,
                           f"{c.label}: {c.max_tokens} {relation} {allowed:.1f}"))
    if not candidates:
        return "-"
    return max(candidates)[1]


def window_result(check: WindowCheck) -> str:
    if check.passed is None:
        return NOT_CHECKED
    return "PASS" if check.passed else "FAIL"


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------

TABLE_HEADERS = [
    "user", "limit tok/s", "streams", "finished/sent", "tokens", "tok/s", "share",
    "guarantee", "tightest check", "receive stall ms", "TTFT p50/p99 ms",
    "gap p50/p99 ms", "usage = tokens", "errors",
]


def table_rows(summaries: Sequence[UserSummary]) -> list[list[str]]:
    """Cells of the per-user table, in the order of TABLE_HEADERS."""
    return [
        [
            s.user,
            "-" if s.limit_tokens_per_s is None else f"{s.limit_tokens_per_s:g}",
            str(s.streams),
            f"{s.requests_finished}/{s.requests_started}",
            str(s.tokens),
            num(s.tokens_per_s),
            percent(s.share),
            s.guarantee,
            tightest(s),
            f"{s.receive_stall_s * 1000:.0f}",
            ms_pair(s.ttft_p50_s, s.ttft_p99_s),
            ms_pair(s.gap_p50_s, s.gap_p99_s),
            usage_cell(s),
            str(s.errors),
        ]
        for s in summaries
    ]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|")  # a "|" inside a cell would end it early

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def guarantee_note(burst_s: float = BURST_S, shared_store: bool = False) -> str:
    if shared_store:
        bound = (f"Guarantee across engines sharing one store: at most "
                 f"(W + {shared_slack_s(burst_s):g}) × limit + 1 + E × L tokens in any window "
                 "of W s, summed over the E engines the user's requests went to "
                 "(L = max(1, ceil(0.1 × limit)), the lease size). ")
    else:
        bound = f"Guarantee: at most (W + {burst_s:g}) × limit + 1 tokens in any window of W s. "
    return (
        bound + f"Judged on the {VERDICT_BASIS}: the envelope counts whole requests sent at or "
        "after a and ended by b against b − a (delivery stalls can only widen it); the "
        "receive-time windows (W = 1, 2, 5 s and the active span) get the user's measured "
        "receive stall (\"receive stall ms\") added to W."
    )


ENGINE_HEADERS = ["user", "engine", "tokens received", "server charged"]


def engine_rows(summaries: Sequence[UserSummary]) -> list[list[str]]:
    """Per user and engine: tokens received (client) and charged (that engine's
    ``/metrics``), then the user's sum over all engines."""
    rows = []
    for s in summaries:
        urls = list(dict.fromkeys([*s.tokens_by_engine, *s.server_charged_by_engine]))
        if not urls:
            continue
        for url in urls:
            charged = s.server_charged_by_engine.get(url)
            rows.append([s.user, url, str(s.tokens_by_engine.get(url, 0)), num(charged, 0)])
        rows.append([s.user, f"sum over {len(urls)}", str(s.tokens), num(s.server_charged_tokens, 0)])
    return rows


def format_report(summaries: Sequence[UserSummary], burst_s: float = BURST_S) -> str:
    """The plain-text report printed after a run (with a per-engine table when
    the run used several engines)."""
    details = []
    for s in summaries:
        env = s.envelope
        if env is not None and env.bound is not None:
            details.append([s.user, "envelope", f"{env.window_s:.2f}", str(env.tokens),
                            f"{env.bound:.1f}", "-", "-", "PASS" if env.passed else "FAIL"])
        for c in s.windows:
            if c.bound is None:
                continue  # no known limit: nothing to check
            details.append([
                s.user, c.label, f"{c.window_s:.2f}", str(c.max_tokens),
                "-" if c.bound is None else f"{c.bound:.1f}",
                "-" if c.within_bound is None else ("yes" if c.within_bound else "no"),
                "-" if c.stall_allowance is None else f"{c.stall_allowance:.1f}",
                window_result(c),
            ])
    parts = [text_table(TABLE_HEADERS, table_rows(summaries))]
    engines = {url for s in summaries for url in s.tokens_by_engine}
    if len(engines) > 1:
        parts.append("Per engine (tokens received by the client; charged = the engine's "
                     "vllm:output_rate_output_tokens_charged_total during the run):\n"
                     + text_table(ENGINE_HEADERS, engine_rows(summaries)))
    shared = any(s.shared_store for s in summaries)
    if details:
        parts.append(guarantee_note(burst_s, shared) + "\n" + text_table(
            ["user", "check", "W s", "max tokens", "strict bound", "within strict",
             "stall +", "result"], details))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------
# Stock vs plugin
# --------------------------------------------------------------------------

COMPARISON_HEADERS = [
    "user", "server", "limit tok/s", "tok/s", "share of output", "TTFT p50 / p99 ms",
    "gap p50 / p99 ms", "receive stall ms", "guarantee",
]


def comparison_rows(stock: Sequence[UserSummary], plugin: Sequence[UserSummary]) -> list[list[str]]:
    """Per user, one row for the stock run and one for the plugin run."""
    by_stock = {s.user: s for s in stock}
    rows = []
    for p in plugin:
        for label, s in (("stock vLLM", by_stock.get(p.user)), ("plugin", p)):
            if s is None:
                continue
            limit = "-" if label == "stock vLLM" or s.limit_tokens_per_s is None else f"{s.limit_tokens_per_s:g}"
            rows.append([
                plot_label(s.user), label, limit, num(s.tokens_per_s), percent(s.share),
                ms_pair(s.ttft_p50_s, s.ttft_p99_s), ms_pair(s.gap_p50_s, s.gap_p99_s),
                f"{s.receive_stall_s * 1000:.0f}",
                s.guarantee if label == "plugin" else "- (no limit)",
            ])
    return rows


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------


def plot_label(user: str) -> str:
    """Legend text; matplotlib leaves labels starting with "_" out of legends."""
    if user == ANONYMOUS_USER:
        return "anonymous"
    return f"user {user}" if user.startswith("_") else user


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


#: Lowest rate a rate panel shows (its floor); empty bins are drawn there.
RATE_FLOOR = 5.0


def user_colors(users: Sequence[str]) -> dict[str, str]:
    return {user: f"C{i % 10}" for i, user in enumerate(users)}


def draw_rates(ax, records: Sequence[RequestRecord], limits: Mapping[str, float | None],
               colors: Mapping[str, str], end_s: float | None = None, bin_s: float = 1.0) -> None:
    """Tokens received per second (bins of ``bin_s``), log scale, each limit as a dashed line.

    Empty bins are drawn on the panel's floor (RATE_FLOOR) rather than
    dropping out of the log scale.
    """
    series = rate_series(records, bin_s, end_s)
    for user, rates in series.items():
        color = colors.get(user, "C9")
        xs = [i * bin_s for i in range(len(rates) + 1)]
        ys = [max(r, RATE_FLOOR) for r in rates]
        ax.stairs(ys, xs, color=color, linewidth=2.0, label=f"{plot_label(user)} output")
        limit = limits.get(user)
        if limit:
            ax.axhline(limit, color=color, linestyle="--", linewidth=1.3,
                       label=f"{plot_label(user)} limit {limit:g} tok/s")
    ax.set_yscale("log")
    ax.set_ylim(bottom=RATE_FLOOR)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel(f"output tok/s received ({bin_s:g} s bins, log)")
    ax.grid(True, which="both", alpha=0.25)


def plot_run(records: Sequence[RequestRecord], limits: Mapping[str, float | None],
             path: str | Path, title: str = "Output tokens per user", burst_s: float = BURST_S) -> None:
    """One bench run: rate over time (top) and cumulative tokens (bottom)."""
    fig = _figure(9, 7.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    series = cumulative_series(records)
    colors = user_colors(list(series))
    draw_rates(top, records, limits, colors)
    top.set_title(title)
    if series:
        top.legend(loc="best", fontsize="small")
    for user, times in series.items():
        if not times:
            continue
        color = colors[user]
        bottom.step(times, range(1, len(times) + 1), where="post", color=color, label=plot_label(user))
        limit = limits.get(user)
        if limit:
            start, end = times[0], times[-1]
            allowance = burst_s * limit + 1
            bottom.plot([start, end], [allowance, allowance + (end - start) * limit],
                        linestyle="--", color=color, linewidth=1.2, zorder=3,
                        label=f"{plot_label(user)} bound from its first token")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylabel("tokens received (cumulative)")
    bottom.grid(True, which="both", alpha=0.25)
    if series:
        bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path))


def plot_comparison(stock: Sequence[RequestRecord], plugin: Sequence[RequestRecord],
                    limits: Mapping[str, float | None], light_user: str, path: str | Path,
                    end_s: float | None = None, subtitle: str = "") -> None:
    """Stock vLLM vs the plugin on one workload.

    Top: per-user output rate over time, stock (left) and plugin (right),
    same axes; the plugin panel draws each limit in its user's colour.
    Bottom: the light user's time to first token of every request, both runs.
    """
    fig = _figure(12, 8.5)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.25, 1])
    left = fig.add_subplot(grid[0, 0])
    right = fig.add_subplot(grid[0, 1], sharex=left, sharey=left)
    users = list(dict.fromkeys([r.user for r in plugin] + [r.user for r in stock]))
    colors = user_colors(users)
    draw_rates(left, stock, {}, colors, end_s)
    draw_rates(right, plugin, limits, colors, end_s)
    left.set_title("stock vLLM (no limits)")
    right.set_title("with vllm-output-rate")
    right.set_ylabel("")
    left.legend(loc="lower left", fontsize="small")
    right.legend(loc="lower left", fontsize="small")
    bottom = fig.add_subplot(grid[1, :], sharex=left)
    for label, recs, marker, color in (("stock vLLM", stock, "o", "0.45"),
                                       ("with vllm-output-rate", plugin, "s", colors.get(light_user, "C1"))):
        points = ttft_series(recs, light_user)
        if points:
            xs, ys = zip(*points)
            bottom.plot(xs, [y * 1000 for y in ys], marker=marker, linestyle="-", linewidth=0.8,
                        markersize=4, color=color, label=f"{plot_label(light_user)}: {label}")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds since start (request sent)")
    bottom.set_ylabel("time to first token (ms, log)")
    bottom.set_title(f"{plot_label(light_user)}'s time to first token per request")
    bottom.grid(True, which="both", alpha=0.25)
    bottom.legend(loc="best", fontsize="small")
    if subtitle:
        fig.suptitle(subtitle.replace("; ", "\n"), fontsize="medium")
    fig.tight_layout()
    fig.savefig(str(path))


def plot_engines(records: Sequence[RequestRecord], limits: Mapping[str, float | None],
                 path: str | Path, title: str = "Output tokens per user over several engines",
                 burst_s: float = BURST_S, load_end_s: float | None = None) -> None:
    """A run over several engines sharing one store.

    Top: each user's output rate over time, summed over engines (limits dashed).
    Bottom: for each limited user served by more than one engine, cumulative
    tokens received from each engine (thin) and summed (thick), against the
    bound across those engines from the user's first token (dashed) and
    engines x limit, what separate limiters would allow (dotted).
    ``load_end_s``: when the bench stopped issuing requests (a vertical line).
    """
    from vllm_output_rate.tools.analysis import tokens_by_engine

    fig = _figure(9, 7.5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    series = cumulative_series(records)
    colors = user_colors(list(series))
    draw_rates(top, records, limits, colors)
    top.set_title(title)
    if series:
        top.legend(loc="best", fontsize="small")
    styles = ["-", "--", ":", "-."]
    for user, times in series.items():
        limit = limits.get(user)
        own = [r for r in records if r.user == user]
        engines = list(tokens_by_engine(own))
        if not times or not limit or len(engines) < 2:
            continue
        color = colors[user]
        for i, url in enumerate(engines):
            ts = sorted(t for r in own if r.url == url for t in r.token_times)
            if ts:
                bottom.step(ts, range(1, len(ts) + 1), where="post", color=color, alpha=0.55,
                            linewidth=1.0, linestyle=styles[i % len(styles)],
                            label=f"{plot_label(user)} from engine {i + 1}")
        bottom.step(times, range(1, len(times) + 1), where="post", color=color, linewidth=2.2,
                    label=f"{plot_label(user)} summed over {len(engines)} engines")
        start, end = times[0], times[-1]
        slack_s, extra = bound_terms(limit, burst_s, len(engines))
        base = slack_s * limit + 1 + extra
        bottom.plot([start, end], [base, base + (end - start) * limit], linestyle="--", color="0.2",
                    linewidth=1.2, label=f"bound across {len(engines)} engines from the first token")
        bottom.plot([start, end], [0, (end - start) * limit * len(engines)], linestyle=":", color="0.5",
                    linewidth=1.2, label=f"{len(engines)} x limit (separate limiters)")
    if load_end_s is not None:
        for ax in (top, bottom):
            ax.axvline(load_end_s, color="0.6", linewidth=1.0)
        bottom.annotate("last requests issued", (load_end_s, 0), xytext=(4, 4),
                        textcoords="offset points", fontsize="small", color="0.4")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylabel("tokens received (cumulative)")
    bottom.grid(True, which="both", alpha=0.25)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path))


# --------------------------------------------------------------------------
# The record: which JSON a figure was drawn from
# --------------------------------------------------------------------------

#: PNG text key holding the sha256 of the JSON a figure was drawn from (or
#: written with, for a demo whose raw requests the kept JSON leaves out).
DIGEST_KEY = "vllm-output-rate json sha256"
#: PNG text key holding that JSON's file name (for a reader; not checked).
SOURCE_KEY = "vllm-output-rate json"

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def json_digest(path: str | Path) -> str:
    """sha256 (hex) of a JSON file's bytes as written."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def figure_metadata(source: str | Path | None) -> dict[str, str]:
    """``savefig(metadata=...)`` naming the JSON a figure is drawn from.

    Empty when ``source`` is None or does not exist (a figure drawn from a
    document never written to disk carries no digest, and fails the record's
    check until it is drawn again from its file).
    """
    if source is None or not Path(source).is_file():
        return {}
    return {DIGEST_KEY: json_digest(source), SOURCE_KEY: Path(source).name}


def sibling_json(png: str | Path) -> Path:
    """``X.png`` -> ``X.json``: where a benchmark writes the JSON its figure comes from."""
    return Path(png).with_suffix(".json")


def _chunks(data: bytes):
    import struct

    if not data.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG file")
    pos = len(_PNG_SIGNATURE)
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        yield pos, kind, data[pos + 8:pos + 8 + length], pos + 12 + length
        pos += 12 + length


def png_text(path: str | Path) -> dict[str, str]:
    """The PNG's tEXt and (uncompressed) iTXt entries."""
    text: dict[str, str] = {}
    for _, kind, body, _ in _chunks(Path(path).read_bytes()):
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            if rest[:1] == b"\0":  # not compressed
                _, _, rest = rest[2:].partition(b"\0")  # language tag
                _, _, value = rest.partition(b"\0")  # translated keyword
                text[key.decode("latin-1")] = value.decode("utf-8")
    return text


def stamp_png(path: str | Path, metadata: Mapping[str, str]) -> None:
    """Write ``metadata`` into an existing PNG as tEXt chunks (replacing
    entries with the same keys); the image data is left as it is."""
    import struct
    import zlib

    data = Path(path).read_bytes()
    keys = {k.encode("latin-1") for k in metadata}
    out = [_PNG_SIGNATURE]
    for _, kind, body, end in _chunks(data):
        if kind == b"tEXt" and body.partition(b"\0")[0] in keys:
            continue
        out.append(data[end - 12 - len(body):end])
        if kind == b"IHDR":
            for key, value in metadata.items():
                chunk = key.encode("latin-1") + b"\0" + value.encode("latin-1")
                out.append(struct.pack(">I", len(chunk)) + b"tEXt" + chunk
                           + struct.pack(">I", zlib.crc32(b"tEXt" + chunk) & 0xFFFFFFFF))
    Path(path).write_bytes(b"".join(out))


def record_mismatch(png: str | Path, source: str | Path) -> str | None:
    """Why ``png`` is not the figure of ``source`` (None: it is)."""
    if not Path(source).is_file():
        return f"{png}: no {source} beside it"
    try:
        carried = png_text(png).get(DIGEST_KEY)
    except ValueError as exc:
        return f"{png}: {exc}"
    if carried is None:
        return f"{png}: carries no digest of {Path(source).name} (drawn before figures were stamped)"
    if carried != json_digest(source):
        return f"{png}: drawn from another version of {Path(source).name} (digest {carried[:12]}…)"
    return None
