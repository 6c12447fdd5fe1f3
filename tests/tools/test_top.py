"""``vllm-output-rate top``: parsing /metrics text and the per-user model.

The terminal itself is tested against a real server in tmux
(``test_operate_server.py::test_top_in_tmux``).
"""

from __future__ import annotations

import time

from rich.console import Console

from vllm_output_rate.tools.top import TopModel, parse_metrics, render


def exposition(charged: dict, throttled: dict, requests: dict, limits: dict, running=3) -> str:
    lines = [
        "# HELP vllm:num_requests_running x",
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1',
        'vllm:output_rate_throttled_requests{model_name="m"} 2.0',
        'vllm:output_rate_limit_reloads_total{model_name="m"} 1.0',
    ]
    for user, v in charged.items():
        lines.append(f'vllm:output_rate_output_tokens_charged_total{{model_name="m",user="{user}"}} {v}')
        lines.append(f'vllm:output_rate_output_tokens_charged_created{{model_name="m",user="{user}"}} 1.7e9')
    for user, v in throttled.items():
        lines.append(f'vllm:output_rate_throttled_seconds_total{{model_name="m",user="{user}"}} {v}')
    for (user, state), v in requests.items():
        lines.append(f'vllm:output_rate_requests{{model_name="m",state="{state}",user="{user}"}} {v}')
    for user, v in limits.items():
        lines.append(f'vllm:output_rate_limit_tokens_per_second{{model_name="m",user="{user}"}} {v}')
    return "\n".join(lines) + "\n"


def test_parse_metrics_reads_the_plugin_series():
    snap = parse_metrics(exposition(
        {"alice": 120.0, "__other__": 5.0}, {"alice": 2.5},
        {("alice", "active"): 1, ("alice", "throttled"): 2, ("alice", "waiting"): 0},
        {"alice": 20.0},
    ))
    alice = snap.users["alice"]
    assert (alice.charged, alice.throttled_s, alice.limit) == (120.0, 2.5, 20.0)
    assert (alice.active, alice.throttled, alice.waiting) == (1, 2, 0)
    assert snap.users["__other__"].limit is None
    assert snap.engine["num_requests_running"] == 3 and snap.engine["throttled_requests"] == 2


def test_borrowed_column_from_the_borrowed_series():
    from vllm_output_rate.tools.top import TopModel

    def text(charged, borrowed):
        return (
            f'vllm:output_rate_output_tokens_charged_total{{model_name="m",user="b"}} {charged}\n'
            f'vllm:output_rate_borrowed_tokens_total{{model_name="m",user="b"}} {borrowed}\n'
            f'vllm:output_rate_output_tokens_charged_total{{model_name="m",user="h"}} {charged}\n'
        )

    model = TopModel()
    model.update(0.0, parse_metrics(text(0, 0)))
    model.update(4.0, parse_metrics(text(400, 300)))
    rows = {row.user: row for row in model.rows()}
    assert rows["b"].borrowed == 75.0 and rows["b"].rate == 100.0
    assert rows["h"].borrowed is None  # no borrowed series: shown as "-"


def test_parse_metrics_unescapes_user_names():
    # Prometheus escapes backslash, double quote and newline in label values;
    # a user is shown under the name its requests carried.
    text = (
        'vllm:output_rate_output_tokens_charged_total{model_name="m",user="a\\"b\\\\c"} 7.0\n'
        'vllm:output_rate_limit_tokens_per_second{model_name="m",user="a\\"b\\\\c"} 5.0\n'
    )
    snap = parse_metrics(text)
    assert list(snap.users) == ['a"b\\c']
    assert (snap.users['a"b\\c'].charged, snap.users['a"b\\c'].limit) == (7.0, 5.0)


def test_rates_sort_and_spark_line():
    model = TopModel()
    for t in range(0, 11):
        model.update(float(t), parse_metrics(exposition(
            {"slow": 20.0 * t, "fast": 300.0 * t, "idle": 7.0},
            {"slow": 0.5 * t},
            {("slow", "throttled"): 2, ("fast", "active"): 4},
            {"slow": 20.0, "fast": 1000.0},
        )))
    rows = model.rows()
    assert [r.user for r in rows] == ["fast", "slow", "idle"]
    fast, slow, idle = rows
    assert abs(fast.rate - 300) < 1e-9 and abs(slow.rate - 20) < 1e-9 and idle.rate == 0
    assert slow.throttled_pct == 50.0 and slow.throttled == 2 and fast.active == 4
    assert len(slow.spark) == 10 and set(slow.spark) <= set("▁▂▃▄▅▆▇█")
    assert idle.spark.strip() == ""
    console = Console(width=120, record=True)
    console.print(render(model, "http://x"))
    text = console.export_text()
    assert "fast" in text and "300" in text and "50%" in text and "1000" in text


def test_history_is_bounded():
    model = TopModel(history_s=60)
    for t in range(0, 500):
        model.update(float(t), parse_metrics(exposition({"u": float(t)}, {}, {}, {})))
    assert len(model._points) <= 63
    assert len(model.per_second("u")) == 60


class _HeldMetrics:
    """A /metrics endpoint on 127.0.0.1 that answers the first read at once
    and holds every later one until :meth:`close` (a server too busy to
    answer)."""

    def __init__(self) -> None:
        import http.server
        import threading

        reads, answered = [], []
        self.release = release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                reads.append(self.path)
                if len(reads) > 1:
                    release.wait()
                body = exposition({"alice": 1.0}, {}, {}, {"alice": 20.0}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                answered.append(self.path)

            def log_message(self, *args):
                pass

        self.reads = reads
        self.answered = answered
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


#: A hang guard, not a speed limit: with the read held until the test ends
#: and top's own read timeout longer still, top can only exit in this time
#: if q does not wait for the read.
QUIT_GUARD_S = 60


def test_q_quits_while_a_metrics_read_hangs():
    # The key loop must not wait for /metrics: on a loaded server a read can
    # take seconds, and q has to quit at once anyway.
    import os
    import pty
    import subprocess
    import sys

    metrics = _HeldMetrics()
    leader, follower = pty.openpty()
    # top as the CLI runs it, with a read timeout beyond the guard: a q that
    # waited for the held read could not quit within it.
    code = (
        "import sys; from vllm_output_rate.tools import top; "
        f"top.READ_TIMEOUT_S = {10 * QUIT_GUARD_S}; top.main(sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--url", metrics.url, "--interval", "0.2"],
        stdin=follower, stdout=follower, stderr=follower, close_fds=True,
    )
    os.close(follower)
    try:
        screen = b""
        deadline = time.monotonic() + 60
        # The first read drew the table; the second one hangs.
        while len(metrics.reads) < 2 or b"alice" not in screen:
            assert proc.poll() is None and time.monotonic() < deadline, screen
            screen += _drain(leader)
        os.write(leader, b"q")
        proc.wait(timeout=QUIT_GUARD_S)
        assert proc.returncode == 0
        # It quit while the read was still held.
        assert len(metrics.answered) == 1, metrics.answered
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
        metrics.close()


def _drain(fd: int) -> bytes:
    import os
    import select

    ready, _, _ = select.select([fd], [], [], 0.1)
    return os.read(fd, 65536) if ready else b""


def test_prompt_tokens_charged_show_as_a_rate_per_user():
    def text(prompt):
        return exposition({"flood": 10.0}, {}, {}, {"flood": 20.0}) + (
            f'vllm:output_rate_prompt_tokens_charged_total{{model_name="m",user="flood"}} {prompt}\n'
        )

    model = TopModel()
    model.update(0.0, parse_metrics(text(1000.0)))
    model.update(2.0, parse_metrics(text(1800.0)))
    (row,) = model.rows()
    assert row.user == "flood" and row.prompt_rate == 400.0
    console = Console(width=140, record=True)
    console.print(render(model, "http://127.0.0.1:8000"))
    shown = console.export_text()
    assert "PROMPT/S" in shown and "400" in shown


def test_group_column_only_when_some_user_is_in_a_group():
    def text(with_groups):
        body = exposition({"alice": 10.0, "bob": 5.0, "carol": 1.0}, {}, {},
                          {"alice": 20.0, "bob": 20.0, "carol": 1000.0})
        if with_groups:
            body += ('vllm:output_rate_user_group{group="team-a",model_name="m",user="alice"} 1.0\n'
                     'vllm:output_rate_user_group{group="team-a",model_name="m",user="bob"} 1.0\n'
                     'vllm:output_rate_group_output_tokens_charged_total{group="team-a",model_name="m"} 15.0\n')
        return body

    for with_groups in (False, True):
        model = TopModel()
        model.update(0.0, parse_metrics(text(with_groups)))
        rows = {row.user: row for row in model.rows()}
        assert rows["alice"].group == ("team-a" if with_groups else None)
        assert rows["carol"].group is None and "team-a" not in rows  # groups are no user rows
        # The tmux test's pane is 150 columns wide: every column still fits.
        console = Console(width=150, record=True)
        console.print(render(model, "http://127.0.0.1:8000"))
        shown = console.export_text()
        header = next(line for line in shown.splitlines() if "USER" in line)
        assert ("GROUP" in header) == with_groups
        assert "LAST 60s" in header and "THR%" in header
        if with_groups:
            carol = next(line for line in shown.splitlines() if "carol" in line)
            assert "team-a" in next(line for line in shown.splitlines() if "alice" in line)
            assert " - " in carol  # in no group
