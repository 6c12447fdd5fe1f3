"""``vllm-output-rate top``: parsing /metrics text and the per-user model.

The terminal itself is tested against a real server in tmux
(``test_operate_server.py::test_top_in_tmux``).
"""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from vllm_output_rate.tools.top import (
    HISTORY_S,
    Sources,
    TopModel,
    cluster_view,
    parse_metrics,
    parse_sources,
    read_sources,
    render,
)


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


# -- several engines ------------------------------------------------------------------


def engine_text(charged: dict, limits: dict, store: str | None = None, extra: str = "") -> str:
    """One engine's /metrics: charge counters, limits, and the store mode in force."""
    body = exposition(charged, {}, {}, limits)
    if store is not None:
        body += "".join(
            f'vllm:output_rate_store_mode{{mode="{mode}",model_name="m"}} {int(mode == store)}\n'
            for mode in ("shared", "local", "closed")
        )
    return body + extra


def two_engine_model(store: str | None, charged_at) -> TopModel:
    """Reads at t = 0..4 of engines a and b; ``charged_at(engine, t)`` is alice's counter."""
    model = TopModel()
    for t in range(5):
        model.update_engines(float(t), {
            name: parse_metrics(engine_text({"alice": charged_at(name, t)}, {"alice": 30.0}, store))
            for name in ("http://a", "http://b")
        })
    return model


def test_cluster_rate_is_the_sum_of_the_engines_rates():
    # alice at 20 tok/s on engine a and 10 tok/s on engine b: 30 over the cluster.
    model = two_engine_model("shared", lambda name, t: (20.0 if name == "http://a" else 10.0) * t)
    view = cluster_view(model)
    (alice,) = view.rows
    assert alice.rate == 30.0
    assert alice.charged_by_engine == {"http://a": 80.0, "http://b": 40.0}
    assert alice.charged == sum(alice.charged_by_engine.values()) == 120.0
    assert view.answering == ["http://a", "http://b"] and view.shared_store


def test_shared_store_shows_one_quota_and_no_store_one_per_engine():
    shared = cluster_view(two_engine_model("shared", lambda name, t: 10.0 * t))
    alone = cluster_view(two_engine_model(None, lambda name, t: 10.0 * t))
    assert (shared.rows[0].quota, shared.rows[0].quota_text) == (30.0, "30")
    assert (alone.rows[0].quota, alone.rows[0].quota_text) == (60.0, "2×30")
    assert not alone.shared_store
    for view_model, expected in (
        (two_engine_model("shared", lambda n, t: 10.0 * t), "quota shared through the store"),
        (two_engine_model(None, lambda n, t: 10.0 * t), "each engine enforces its own limit"),
    ):
        console = Console(width=150, record=True)
        console.print(render(view_model, "2 engines"))
        shown = console.export_text()
        assert expected in shown and "engines 2/2 answering" in shown
        alice = next(line for line in shown.splitlines() if "alice" in line)
        assert ("2×30" in alice) == (expected != "quota shared through the store")


def test_an_engine_restart_is_a_reset_not_a_negative_rate():
    # Engine b restarts between t=2 and t=3: its counter drops from 200 to 5,
    # then grows by 100 a second again.  Its 5 + 100 tokens count, nothing
    # is subtracted.
    def charged(name, t):
        if name == "http://a":
            return 50.0 * t
        return 100.0 * t if t <= 2 else 5.0 + 100.0 * (t - 3)

    model = two_engine_model("shared", charged)
    (alice,) = cluster_view(model).rows
    # Window: t=1..4 (3 s): a grew 150; b grew 100 (1->2) + 5 (reset) + 100 (3->4).
    assert alice.rate == (150.0 + 205.0) / 3
    assert min(model.per_second("alice")) >= 0
    assert model.per_second("alice")[2] == 50.0 + 5.0


def test_an_engine_that_does_not_answer_is_shown_not_fatal():
    model = TopModel()
    text = engine_text({"alice": 0.0}, {"alice": 30.0}, "shared")
    model.update_engines(0.0, {"http://a": parse_metrics(text), "http://b": parse_metrics(text)})
    model.update_engines(1.0, {"http://a": parse_metrics(engine_text({"alice": 30.0}, {"alice": 30.0}, "shared"))},
                         {"http://b": "cannot read http://b/metrics: refused"})
    view = cluster_view(model)
    assert view.answering == ["http://a"] and view.engines == ["http://a", "http://b"]
    assert view.rows[0].rate == 30.0
    console = Console(width=150, record=True)
    console.print(render(model, "2 engines"))
    shown = console.export_text()
    assert "engines 1/2 answering" in shown and "cannot read http://b/metrics" in shown


NEW_SERIES = (
    'vllm:output_rate_ceil_tokens_per_second{model_name="m",user="alice"} 90.0\n'
    'vllm:output_rate_weight{model_name="m",user="alice"} 3.0\n'
    'vllm:output_rate_residency_cap_requests{model_name="m",user="alice"} 4.0\n'
    'vllm:output_rate_residency_held_requests{model_name="m",user="alice"} 2.0\n'
)


def test_ceiling_weight_and_residency_columns_blank_where_absent():
    model = TopModel()
    for t in range(2):
        model.update_engines(float(t), {
            "http://a": parse_metrics(engine_text({"alice": 10.0 * t, "bob": 5.0 * t},
                                                  {"alice": 30.0, "bob": 30.0}, extra=NEW_SERIES)),
            # An engine without those series yet (an older plugin): still summed, never a crash.
            "http://b": parse_metrics(engine_text({"alice": 10.0 * t}, {"alice": 30.0})),
        })
    rows = {row.user: row for row in cluster_view(model).rows}
    alice, bob = rows["alice"], rows["bob"]
    assert (alice.ceil, alice.weight, alice.residency_cap, alice.residency_held) == (90.0, 3.0, 4.0, 2.0)
    assert (bob.ceil, bob.weight, bob.residency_cap, bob.residency_held) == (None, None, None, None)
    assert alice.would_hold is None  # no shadow series: no WOULD columns
    console = Console(width=150, record=True)
    console.print(render(model, "2 engines"))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "USER" in line)
    for column in ("CEIL", "WEIGHT", "RES HELD/CAP"):
        assert column in header
    assert "WOULD" not in header
    assert "2/4" in next(line for line in lines if "alice" in line)
    bob_line = next(line for line in lines if "bob" in line)
    assert "90" not in bob_line and "/" not in bob_line

    # Without any of them: no such column at all.
    plain = TopModel()
    plain.update(0.0, parse_metrics(engine_text({"alice": 1.0}, {"alice": 30.0})))
    console = Console(width=150, record=True)
    console.print(render(plain, "http://a"))
    header = next(line for line in console.export_text().splitlines() if "USER" in line)
    assert "CEIL" not in header and "WEIGHT" not in header and "RES" not in header


def shadow_text(mode: str, charged: float, held: float, throttled_s: float, borrowed: float,
                waiting: float) -> str:
    return engine_text({"alice": charged}, {"alice": 20.0}) + (
        f'vllm:output_rate_mode{{mode="enforce",model_name="m"}} {int(mode == "enforce")}\n'
        f'vllm:output_rate_mode{{mode="shadow",model_name="m"}} {int(mode == "shadow")}\n'
        f'vllm:output_rate_shadow_held_tokens_total{{model_name="m",user="alice"}} {held}\n'
        f'vllm:output_rate_shadow_throttled_seconds_total{{model_name="m",user="alice"}} {throttled_s}\n'
        f'vllm:output_rate_shadow_borrowed_tokens_total{{model_name="m",user="alice"}} {borrowed}\n'
        f'vllm:output_rate_shadow_residency_held_requests{{model_name="m",user="alice"}} {waiting}\n'
    )


def test_shadow_mode_shows_what_enforcing_would_do():
    # alice at 40 tok/s with a limit of 20 on two engines in shadow mode:
    # half its tokens would have been held, it would have been throttled
    # half the time (per engine), and its cap would keep 1 request waiting on each.
    model = TopModel()
    for t in range(4):
        model.update_engines(float(t), {
            name: parse_metrics(shadow_text("shadow", 20.0 * t, 10.0 * t, 0.25 * t, 2.0 * t, 1))
            for name in ("http://a", "http://b")
        })
    view = cluster_view(model)
    assert view.shadow and view.modes == {"http://a": "shadow", "http://b": "shadow"}
    (alice,) = view.rows
    assert alice.rate == 40.0 and alice.would_hold == 20.0 and alice.would_borrow == 4.0
    assert alice.would_throttle_pct == 50.0 and alice.would_wait == 2
    console = Console(width=170, record=True)
    console.print(render(model, "2 engines"))
    shown = console.export_text()
    assert "SHADOW mode" in shown
    header = next(line for line in shown.splitlines() if "USER" in line)
    assert "WOULD HOLD/S" in header and "WOULD THR%" in header

    # Enforcing: no shadow line, no WOULD columns (the shadow series are still exported).
    enforcing = TopModel()
    enforcing.update(0.0, parse_metrics(shadow_text("enforce", 0, 0, 0, 0, 0)))
    view = cluster_view(enforcing)
    assert not view.shadow and view.modes == {"": "enforce"}
    console = Console(width=170, record=True)
    console.print(render(enforcing, "http://a"))
    shown = console.export_text()
    assert "WOULD" not in shown and "SHADOW" not in shown


# -- reading: URLs, Prometheus, errors ----------------------------------------------------


def test_urls_repeat_or_comma_separate():
    sources = parse_sources(["http://a:1/, http://b:2", "http://c:3", "http://a:1"], None)
    assert sources.urls == ("http://a:1", "http://b:2", "http://c:3")
    assert parse_sources(None, None).urls == ("http://127.0.0.1:8000",)
    assert parse_sources(None, "http://p:9090/").prometheus == "http://p:9090"
    with pytest.raises(ValueError):
        parse_sources(["http://a"], "http://p")


def _client(handler):
    import httpx

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_engines_read_and_a_401_is_a_hint_not_a_crash():
    import httpx

    def handler(request):
        if request.url.host == "b":
            return httpx.Response(401, text="no")
        return httpx.Response(200, text=engine_text({"alice": 7.0}, {"alice": 30.0}, "shared"))

    with _client(handler) as client:
        _, snaps, errors = read_sources(Sources(urls=("http://a", "http://b")), client)
    assert snaps["http://a"].users["alice"].charged == 7.0
    assert snaps["http://a"].store_mode == "shared"
    assert list(errors) == ["http://b"] and "401" in errors["http://b"]
    assert "\n" not in errors["http://b"]


def prometheus_answer(results):
    return {"status": "success", "data": {"resultType": "vector", "result": results}}


def test_prometheus_api_split_by_instance():
    import httpx

    now = time.time()

    def series(instance, name, value, **labels):
        return {"metric": {"__name__": name, "instance": instance, "job": "vllm",
                           "model_name": "m", **labels},
                "value": [now, str(value)]}

    values = prometheus_answer([
        series("e0:8000", "vllm:output_rate_output_tokens_charged_total", 100, user="alice"),
        series("e1:8000", "vllm:output_rate_output_tokens_charged_total", 50, user="alice"),
        series("e0:8000", "vllm:output_rate_limit_tokens_per_second", 30, user="alice"),
        series("e0:8000", "vllm:output_rate_store_mode", 1, mode="shared"),
        series("e1:8000", "vllm:output_rate_store_mode", 1, mode="shared"),
        series("e1:8000", "vllm:num_requests_running", 3),
    ])
    # timestamp(): each series' scrape time; the engines were scraped 2 s apart.
    times = prometheus_answer([
        {"metric": {"instance": "e0:8000", "job": "vllm", "user": "alice"}, "value": [now, str(now - 4)]},
        {"metric": {"instance": "e1:8000", "job": "vllm", "user": "alice"}, "value": [now, str(now - 2)]},
    ])
    asked = []

    def handler(request):
        asked.append(request.url.params["query"])
        assert request.url.path == "/api/v1/query"
        return httpx.Response(200, json=times if request.url.params["query"].startswith("timestamp(") else values)

    with _client(handler) as client:
        t, snaps, errors = read_sources(Sources(prometheus="http://p:9090"), client)
    assert not errors and sorted(snaps) == ["e0:8000", "e1:8000"]
    assert asked[0].startswith("{__name__=~") and asked[1].startswith("timestamp(")
    assert snaps["e0:8000"].users["alice"].charged == 100 and snaps["e1:8000"].engine["num_requests_running"] == 3
    # Scrape times on the reader's clock: 4 and 2 s before the read.
    assert abs((t - snaps["e0:8000"].t) - 4) < 0.5 and abs((t - snaps["e1:8000"].t) - 2) < 0.5
    model = TopModel()
    model.update_engines(t, snaps)
    assert cluster_view(model).shared_store and cluster_view(model).rows[0].charged == 150

    with _client(lambda request: httpx.Response(503, text="down")) as client:
        _, snaps, errors = read_sources(Sources(prometheus="http://p:9090"), client)
    assert snaps == {} and "503" in errors["http://p:9090"]


def test_prometheus_rates_use_scrape_times():
    # Two reads 1 s apart see one scrape 15 s after the one before: the rate
    # is over the 15 s between scrapes, and a scrape read twice counts once.
    model = TopModel(window_s=60)
    for t, scraped, charged in ((0.0, -1.0, 0.0), (1.0, 14.0, 300.0), (2.0, 14.0, 300.0)):
        snap = parse_metrics(engine_text({"alice": charged}, {"alice": 30.0}))
        snap.t = scraped
        model.update_engines(t, {"e0": snap})
    assert cluster_view(model).rows[0].rate == 20.0


def test_a_narrow_pane_keeps_the_numbers_and_the_newest_spark_points():
    # Every optional column on 150 columns (the tmux test's pane): numbers
    # stay whole, the spark line gives up its oldest points.
    def text(t):
        charged = 1000.0 * min(t, 60) + 3000.0 * max(0, t - 60)
        return engine_text({"carol": charged}, {"carol": 1000.0}, extra=(
            'vllm:output_rate_user_group{group="research-team",model_name="m",user="carol"} 1\n'
            f'vllm:output_rate_prompt_tokens_charged_total{{model_name="m",user="carol"}} {t}\n'
            f'vllm:output_rate_borrowed_tokens_total{{model_name="m",user="carol"}} {t}\n'
            'vllm:output_rate_ceil_tokens_per_second{model_name="m",user="carol"} +Inf\n'
            'vllm:output_rate_weight{model_name="m",user="carol"} 1000\n'
            'vllm:output_rate_residency_cap_requests{model_name="m",user="carol"} +Inf\n'
            'vllm:output_rate_residency_held_requests{model_name="m",user="carol"} 0\n'
        ))

    model = TopModel()
    for t in range(70):
        model.update(float(t), parse_metrics(text(t)))
    console = Console(width=150, record=True)
    console.print(render(model, "http://127.0.0.1:8000"))
    carol = next(line for line in console.export_text().splitlines() if "carol" in line)
    cells = [cell.strip() for cell in carol.split("│")[1:-1]]
    assert cells[2:4] == ["1000", "3000"] and "…" not in carol, carol
    assert "0/∞" in cells and "∞" in cells
    spark = cells[-1]
    assert 0 < len(spark) < HISTORY_S and spark.endswith("█"), spark  # the newest: 3x the old rate


def test_a_narrow_terminal_gives_up_optional_columns_first():
    def text(t):
        return engine_text({"carol": 1000.0 * t}, {"carol": 1000.0}, extra=(
            'vllm:output_rate_ceil_tokens_per_second{model_name="m",user="carol"} 2000\n'
            'vllm:output_rate_weight{model_name="m",user="carol"} 1000\n'
            'vllm:output_rate_residency_cap_requests{model_name="m",user="carol"} 500\n'
            'vllm:output_rate_residency_held_requests{model_name="m",user="carol"} 0\n'
            'vllm:output_rate_residency_held_requests{model_name="m",user="__other__"} 0\n'
        ))

    model = TopModel()
    for t in range(5):
        model.update(float(t), parse_metrics(text(t)))
    for width, kept in ((85, ()), (110, ("CEIL", "WEIGHT")), (200, ("CEIL", "WEIGHT", "RES HELD/CAP"))):
        console = Console(width=width, record=True)
        console.print(render(model, "http://127.0.0.1:8000", width=width))
        lines = console.export_text().splitlines()
        header = next(line for line in lines if "USER" in line)
        carol = next(line for line in lines if "carol" in line)
        assert "…" not in header + carol and "1000" in carol, (width, header, carol)
        for column in ("CEIL", "WEIGHT", "RES HELD/CAP"):
            assert (column in header) == (column in kept), (width, header)
    other = next(line for line in lines if "__other__" in line)
    assert "0/" not in other  # held requests without a cap: no dangling slash


class _CountingMetrics:
    """A /metrics endpoint on 127.0.0.1 whose alice counter grows by ``step``
    with every read (so each scrape sees a new value), with a shared store."""

    def __init__(self, step: float) -> None:
        import http.server
        import threading

        served = self.served = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                served.append(step * (len(served) + 1))
                body = engine_text({"alice": served[-1]}, {"alice": 30.0}, "shared").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_top_through_a_real_prometheus(tmp_path):
    import httpx
    from prometheus_harness import PrometheusServer

    engines = [_CountingMetrics(100.0), _CountingMetrics(1.0)]
    try:
        with PrometheusServer(tmp_path, [e.target for e in engines], rule_files=()) as prom, \
                httpx.Client(timeout=30, trust_env=False) as client:
            sources = parse_sources(None, prom.url)
            model = TopModel(window_s=60)

            def read_until(enough):
                # A hang guard, not a speed figure: Prometheus scrapes every second.
                deadline = time.monotonic() + 60
                while True:
                    t, snaps, errors = read_sources(sources, client)
                    assert not errors, errors
                    if enough(snaps) or time.monotonic() > deadline:
                        model.update_engines(t, snaps, errors)
                        return snaps
                    time.sleep(0.5)

            def charged(snaps):
                return {name: snap.users["alice"].charged for name, snap in snaps.items()
                        if "alice" in snap.users}

            first = charged(read_until(lambda s: len(charged(s)) == 2))
            # Both engines scraped again since.
            last = read_until(lambda s: len(charged(s)) == 2 and all(
                v > first[k] for k, v in charged(s).items()))
        # Each engine's values carry its scrape time (timestamp(up)), on top's clock.
        assert all(snap.t is not None for snap in last.values()), last
        view = cluster_view(model)
        # Engines told apart by Prometheus' instance label, each a shared-store engine.
        assert sorted(view.answering) == sorted(e.target for e in engines)
        assert view.shared_store
        (alice,) = view.rows
        for engine in engines:
            value = alice.charged_by_engine[engine.target]
            assert value in engine.served, (value, engine.served)  # a value the engine served
        assert alice.charged == sum(alice.charged_by_engine.values())
        assert alice.quota_text == "30" and alice.rate > 0
    finally:
        for engine in engines:
            engine.close()


def _fairness_text(per_engine: dict) -> str:
    """/metrics text of the plugin's exporter fed one report per engine index."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from vllm_output_rate.adapter.metrics import OutputRateExporter

    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry=registry)
    for idx, (n, jain, gap) in per_engine.items():
        exporter.observe({"users": {}, "removed": [], "engine": {}, "fairness": {
            "window_s": 10.0, "backlogged_users": n, "jain_index": jain, "service_gap_tokens": gap}},
            engine_idx=idx)
    return generate_latest(registry).decode()


def _shown(model) -> str:
    console = Console(width=200, record=True)
    console.print(render(model, "x"))
    return console.export_text()


def test_fairness_one_line_per_engine_never_summed():
    # One URL serving two data-parallel engines: each its own line.
    model = TopModel()
    model.update(0.0, parse_metrics(_fairness_text({0: (6, 0.8123, 330.0), 1: (1, 1.0, 0.0)})))
    view = cluster_view(model)
    assert [(line.engine, line.fairness.jain, line.fairness.backlogged) for line in view.fairness] == [
        ("0", 0.8123, 6), ("1", 1.0, 1)]
    assert "fairness_jain_index" not in model.engine  # not summed into the engine-wide figures
    shown = _shown(model)
    assert "fairness engine 0: Jain 0.812 among 6 backlogged borrowers over 10 s, " \
           "largest weighted gap 330 tokens" in shown
    assert "fairness engine 1: nobody competed over 10 s (1 backlogged borrower;" in shown
    # A single engine: no engine name.
    model = TopModel()
    model.update(0.0, parse_metrics(_fairness_text({0: (3, 0.99, 12.0)})))
    assert "fairness: Jain 0.990 among 3 backlogged borrowers" in _shown(model)
    # An engine without the plugin's fairness series: no line.
    model = TopModel()
    model.update(0.0, parse_metrics(engine_text({"alice": 1.0}, {"alice": 30.0})))
    assert cluster_view(model).fairness == [] and "fairness" not in _shown(model)


def test_fairness_lines_in_the_multi_engine_views():
    # --url a --url b
    model = TopModel()
    model.update_engines(0.0, {
        "http://a": parse_metrics(_fairness_text({0: (2, 0.95, 40.0)})),
        "http://b": parse_metrics(_fairness_text({0: (4, 0.5, 900.0)})),
    })
    shown = _shown(model)
    assert "fairness http://a engine 0: Jain 0.950 among 2" in shown
    assert "fairness http://b engine 0: Jain 0.500 among 4" in shown
    # --prometheus: the targets told apart by instance, the engines by vLLM's label.
    from vllm_output_rate.tools.top import parse_prometheus

    def item(instance, name, value, engine):
        return {"metric": {"__name__": name, "instance": instance, "job": "vllm", "model_name": "m",
                           "engine": engine}, "value": [0, str(value)]}

    answer = prometheus_answer([
        item("e0:8000", "vllm:output_rate_fairness_jain_index", 0.97, "0"),
        item("e0:8000", "vllm:output_rate_fairness_backlogged_users", 3, "0"),
        item("e0:8000", "vllm:output_rate_fairness_jain_index", 1, "1"),
        item("e0:8000", "vllm:output_rate_fairness_backlogged_users", 0, "1"),
        item("e1:8000", "vllm:output_rate_fairness_jain_index", 0.6, "0"),
        item("e1:8000", "vllm:output_rate_fairness_backlogged_users", 5, "0"),
        item("e1:8000", "vllm:output_rate_fairness_service_gap_tokens", 1234, "0"),
    ])
    model = TopModel()
    model.update_engines(0.0, parse_prometheus(answer))
    lines = [line.text(True) for line in cluster_view(model).fairness]
    assert lines == [
        "fairness e0:8000 engine 0: Jain 0.970 among 3 backlogged borrowers, largest weighted gap - tokens",
        "fairness e0:8000 engine 1: nobody competed (0 backlogged borrowers; Jain 1 by definition)",
        "fairness e1:8000 engine 0: Jain 0.600 among 5 backlogged borrowers, largest weighted gap 1234 tokens",
    ]
