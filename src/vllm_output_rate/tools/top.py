"""``vllm-output-rate top --url URL``: a live per-user view of a server, like htop.

Reads the server's ``/metrics`` once a second (the ``vllm:output_rate_*``
series the plugin exports) and shows one row per user: its group (only when
groups are configured), limit, current tok/s,
active / throttled / waiting requests, throttled %, borrowed tok/s (spare
capacity beyond the rate, "-" while nobody may borrow) and a spark-line of the
last minute; sorted by current rate.  ``q`` quits.  Drawn with ``rich``.

The parsing and the per-user model (:func:`parse_metrics`, :class:`TopModel`)
are plain functions over text, tested without a terminal.
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from vllm_output_rate.tools import measure

PREFIX = "vllm:output_rate_"
SPARKS = "▁▂▃▄▅▆▇█"
HISTORY_S = 60
#: Current rate: charged tokens over this many seconds (smooths stats batching).
RATE_WINDOW_S = 3.0
#: How long the key loop waits for a key before looking for a new reading.
KEY_WAIT_S = 0.1
#: How long one /metrics read may take before it counts as failed.
READ_TIMEOUT_S = 5.0


@dataclass
class UserSample:
    charged: float = 0.0
    prompt: float | None = None  # prompt tokens charged; None: not exported
    throttled_s: float = 0.0
    limit: float | None = None
    active: int = 0
    throttled: int = 0
    waiting: int = 0
    borrowed: float | None = None  # None: the server exports no borrowed series
    group: str | None = None  # None: in no group (or no groups configured)


@dataclass
class Snapshot:
    users: dict[str, UserSample] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str) -> Snapshot:
    """The plugin's series (summed over models / engines) from Prometheus text."""
    snap = Snapshot()
    for name, samples in measure.parse_metrics(text).items():
        for labels, value in samples:
            _add_sample(snap, name, labels, value)
    return snap


def _add_sample(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        key = name.removeprefix("vllm:")
        snap.engine[key] = snap.engine.get(key, 0.0) + value
        return
    if not name.startswith(PREFIX) or name.endswith("_created"):
        return
    key = name[len(PREFIX):]
    user = labels.get("user")
    if user is None:
        snap.engine[key] = snap.engine.get(key, 0.0) + value
        return
    row = snap.users.setdefault(user, UserSample())
    if key == "output_tokens_charged_total":
        row.charged += value
    elif key == "prompt_tokens_charged_total":
        row.prompt = (row.prompt or 0.0) + value
    elif key == "throttled_seconds_total":
        row.throttled_s += value
    elif key == "borrowed_tokens_total":
        row.borrowed = (row.borrowed or 0.0) + value
    elif key == "limit_tokens_per_second":
        row.limit = value
    elif key == "user_group" and value and "group" in labels:
        row.group = labels["group"]
    elif key == "requests":
        state = labels.get("state")
        if state in ("active", "throttled", "waiting"):
            setattr(row, state, getattr(row, state) + int(value))


@dataclass
class Row:
    user: str
    limit: float | None
    rate: float
    active: int
    throttled: int
    waiting: int
    throttled_pct: float
    spark: str
    prompt_rate: float | None = None  # prompt tokens charged per second; None: not exported
    borrowed: float | None = None  # tok/s beyond the rate; None: not exported
    group: str | None = None  # the user's group; None: none


class TopModel:
    """Per-user rates from successive snapshots (times in seconds)."""

    def __init__(self, history_s: int = HISTORY_S) -> None:
        self._points: deque[tuple[float, Snapshot]] = deque()
        self._history_s = history_s
        self.engine: dict[str, float] = {}

    def update(self, t: float, snap: Snapshot) -> None:
        self._points.append((t, snap))
        while self._points and self._points[0][0] < t - self._history_s - 1.5:
            self._points.popleft()
        self.engine = snap.engine

    def rows(self) -> list[Row]:
        if not self._points:
            return []
        t_now, now = self._points[-1]
        base_t, base = self._at_or_before(t_now - RATE_WINDOW_S)
        dt = t_now - base_t
        rows = []
        for user, cur in now.users.items():
            before = base.users.get(user, UserSample())
            rate = max(0.0, cur.charged - before.charged) / dt if dt > 0 else 0.0
            thr = max(0.0, cur.throttled_s - before.throttled_s) / dt if dt > 0 else 0.0
            prompt = None
            if cur.prompt is not None:
                prompt = max(0.0, cur.prompt - (before.prompt or 0.0)) / dt if dt > 0 else 0.0
            borrowed = None
            if cur.borrowed is not None:
                gained = cur.borrowed - (before.borrowed or 0.0)
                borrowed = max(0.0, gained) / dt if dt > 0 else 0.0
            rows.append(Row(
                user=user, limit=cur.limit, rate=rate, active=cur.active,
                throttled=cur.throttled, waiting=cur.waiting,
                throttled_pct=min(100.0, 100.0 * thr), spark=self._spark(user, cur.limit),
                prompt_rate=prompt,
                borrowed=borrowed,
                group=cur.group,
            ))
        rows.sort(key=lambda r: (-r.rate, r.user))
        return rows

    def _at_or_before(self, t: float) -> tuple[float, Snapshot]:
        chosen = self._points[0]
        for point in self._points:
            if point[0] > t:
                break
            chosen = point
        return chosen

    def per_second(self, user: str) -> list[float]:
        """The user's rate in each interval between snapshots, oldest first."""
        out = []
        points = list(self._points)
        for (t0, a), (t1, b) in zip(points, points[1:]):
            if t1 <= t0:
                continue
            before = a.users.get(user, UserSample()).charged
            after = b.users.get(user, UserSample()).charged
            out.append(max(0.0, after - before) / (t1 - t0))
        return out[-self._history_s:]

    def _spark(self, user: str, limit: float | None) -> str:
        values = self.per_second(user)
        if not values:
            return ""
        top = max(max(values), limit or 0.0) or 1.0
        return "".join(
            " " if v <= 0 else SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))]
            for v in values
        )


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def render(model: TopModel, url: str, error: str | None = None):
    from rich.table import Table
    from rich.text import Text

    engine = model.engine
    title = Text.assemble(
        ("vllm-output-rate top ", "bold"), (url, "cyan"),
        f"   running {_fmt(engine.get('num_requests_running'))}"
        f"  waiting {_fmt(engine.get('num_requests_waiting'))}"
        f"  throttled {_fmt(engine.get('throttled_requests'))}"
        f"  reloads {_fmt(engine.get('limit_reloads_total'))}"
        f" (failed {_fmt(engine.get('limit_reload_failures_total'))})   q quits",
    )
    table = Table(title=title, title_justify="left", expand=True)
    rows = model.rows()
    # Prompt and borrowed columns only when the engine exports those series
    # (an input token weight; someone who may borrow): a narrow pane keeps room.
    prompt = any(row.prompt_rate is not None for row in rows)
    borrowed = any(row.borrowed is not None for row in rows)
    # The group column only when some user is in a group (groups configured).
    grouped = any(row.group is not None for row in rows)
    right = {"justify": "right"}
    for name, kw in (
        ("USER", {"no_wrap": True}),
        *((("GROUP", {"no_wrap": True, "max_width": 16}),) if grouped else ()),
        ("LIMIT", right), ("TOK/S", right), ("ACTIVE", right),
        ("THROTTLED", right), ("WAITING", right), ("THR%", right),
        *((("PROMPT/S", right),) if prompt else ()),
        *((("BORROWED", right),) if borrowed else ()),
        (f"LAST {HISTORY_S}s", {"no_wrap": True}),
    ):
        table.add_column(name, **kw)
    for row in rows:
        style = "red" if row.throttled_pct >= 50 else None
        cells = [row.user, *([row.group or "-"] if grouped else []), _fmt(row.limit),
                 _fmt(row.rate), str(row.active), str(row.throttled), str(row.waiting),
                 f"{row.throttled_pct:.0f}%"]
        cells += [_fmt(row.prompt_rate)] if prompt else []
        cells += [_fmt(row.borrowed)] if borrowed else []
        table.add_row(*cells, row.spark, style=style)
    if error:
        table.caption = Text(error, style="yellow")
    return table


class _Keys:
    """Single key presses from the terminal without waiting for Enter (POSIX)."""

    def __init__(self) -> None:
        self._fd = None
        self._saved = None

    def __enter__(self) -> "_Keys":
        if sys.stdin.isatty():
            import termios
            import tty

            self._fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str | None:
        import select

        if self._fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            import os

            return os.read(self._fd, 1).decode(errors="ignore")
        return None


class _Poller:
    """Reads ``/metrics`` every ``interval`` seconds on its own thread.

    A read can take seconds on a loaded server (up to READ_TIMEOUT_S), and the
    key loop must not wait for it: ``q`` quits at once."""

    def __init__(self, url: str, interval: float) -> None:
        self.url = url
        self.interval = interval
        self.results: "queue.Queue[tuple[float, Snapshot | None, str | None]]" = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="top-poller", daemon=True)

    def read_once(self, client) -> tuple[float, Snapshot | None, str | None]:
        import httpx

        try:
            response = client.get(f"{self.url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            return time.monotonic(), None, f"cannot read {self.url}/metrics: {exc}"
        return time.monotonic(), parse_metrics(response.text), None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # the thread is a daemon: a read in flight is not waited for

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=READ_TIMEOUT_S) as client:
            while not self._stop.wait(self.interval):
                self.results.put(self.read_once(client))


def run(url: str, interval: float = 1.0, once: bool = False) -> None:
    import httpx
    from rich.console import Console
    from rich.live import Live

    url = url.rstrip("/")
    model = TopModel()
    console = Console()
    poller = _Poller(url, interval)

    def apply(result: tuple[float, Snapshot | None, str | None]) -> str | None:
        t, snap, error = result
        if snap is not None:
            model.update(t, snap)
        return error

    with httpx.Client(timeout=READ_TIMEOUT_S) as client:
        error = apply(poller.read_once(client))
    if once:
        console.print(render(model, url, error))
        return
    poller.start()
    try:
        with _Keys() as keys, Live(
            render(model, url, error), console=console, screen=True, auto_refresh=False
        ) as live:
            while True:
                if keys.read(KEY_WAIT_S) in ("q", "Q", "\x03"):
                    return
                try:
                    result = poller.results.get_nowait()
                except queue.Empty:
                    continue
                error = apply(result)
                live.update(render(model, url, error), refresh=True)
    finally:
        poller.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate top",
        description="Live per-user view of a vLLM server running the output-rate plugin "
        "(reads its /metrics once a second; q quits).",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    args = parser.parse_args(argv)
    try:
        run(args.url, args.interval, args.once)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
