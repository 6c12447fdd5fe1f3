"""Tests of the bench analysis, the performance-page report, the benchmark
harness's pure parts, and the bench end to end against a small fake
OpenAI-compatible SSE server (no vLLM needed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from pathlib import Path
from collections import Counter
from dataclasses import dataclass, field

import pytest
from fake_http import serving_app

from vllm_output_rate.settings import ANONYMOUS_USER, USER_ARG
from vllm_output_rate.tools import analysis, bench, render, report
from vllm_output_rate.tools.analysis import (
    envelope_worst,
    guarantee_bound,
    inter_token_gaps,
    rate_series,
    summarize,
    time_to_first_token,
)
from vllm_output_rate.tools.measure import (
    CANCELLED,
    ERROR,
    FINISHED,
    HTTP_ERROR,
    RequestRecord,
    max_in_window,
    metric_sum,
    parse_metrics,
    percentile,
    stream_body,
)
from vllm_output_rate.tools.bench import UserSpec
from vllm_output_rate_harness import benchkit

FIXTURE = Path(__file__).parent / "data" / "demo_small.json"


def finished(user, token_times, start=0.0, completion_tokens=None, stream=0, end=None):
    """A finished request whose usage matches unless told otherwise."""
    token_times = list(token_times)
    return RequestRecord(
        user=user,
        stream=stream,
        start=start,
        token_times=token_times,
        end=end if end is not None else (token_times[-1] if token_times else start),
        completion_tokens=len(token_times) if completion_tokens is None else completion_tokens,
        status=FINISHED,
        http_status=200,
    )


# --------------------------------------------------------------------------
# Window maxima, percentiles, gaps
# --------------------------------------------------------------------------


def test_max_in_window_counts_closed_windows():
    times = [0.0, 0.5, 1.0, 1.5, 3.0]
    assert max_in_window(times, 1.0) == 3  # 0.0, 0.5 and 1.0: both ends count
    assert max_in_window(times, 0.25) == 1
    assert max_in_window(times, 10.0) == 5
    assert max_in_window([], 1.0) == 0


def test_max_in_window_sorts_and_counts_simultaneous_tokens():
    # Tokens of one chunk share a receive time; streams interleave unsorted.
    times = [2.0, 0.0, 2.0, 2.0, 0.5, 2.0]
    assert max_in_window(times, 0.0) == 4
    assert max_in_window(times, 1.5) == 5  # 0.5 .. 2.0


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_gaps_are_zero_within_a_chunk_and_ttft_is_from_request_start():
    record = finished("u", [1.25, 1.25, 1.25, 1.5, 2.0], start=1.0)
    assert inter_token_gaps(record) == [0.0, 0.0, 0.25, 0.5]
    assert time_to_first_token(record) == 0.25
    assert time_to_first_token(finished("u", [])) is None


def test_summary_percentiles_pool_all_requests_of_a_user():
    records = [
        finished("u", [1.0, 1.5], start=0.5),  # ttft 0.5, gap 0.5
        finished("u", [3.0, 3.0, 4.0], start=2.0),  # ttft 1.0, gaps 0, 1.0
    ]
    (s,) = summarize(records, {})
    assert s.ttft_p50_s == pytest.approx(0.75)
    assert s.gap_p50_s == pytest.approx(0.5)
    assert s.gap_p99_s == pytest.approx(0.99)  # 0.5 + 0.98 * 0.5
    assert s.tokens == 5
    assert s.first_token_s == 1.0 and s.last_token_s == 4.0
    assert s.active_span_s == 3.0
    assert s.tokens_per_s == pytest.approx(5 / 3)


# --------------------------------------------------------------------------
# Usage check, errors, anonymous user
# --------------------------------------------------------------------------


def test_completion_tokens_mismatch_is_detected_on_finished_requests_only():
    records = [
        finished("u", [0.0, 0.25]),
        finished("u", [1.0, 1.25], completion_tokens=3),  # server says 3, we got 2
        RequestRecord("u", 1, 0.0, [0.5], completion_tokens=None, status=CANCELLED),
    ]
    (s,) = summarize(records, {})
    assert s.usage_mismatches == 1
    assert s.usage_match is False
    assert s.requests_finished == 2 and s.requests_cancelled == 1
    assert s.tokens == 5  # tokens of the cancelled request still count


def test_missing_usage_counts_as_mismatch_and_no_finished_is_na():
    (s,) = summarize([finished("u", [0.0], completion_tokens=None)], {})
    assert s.usage_match is True
    record = finished("u", [0.0])
    record.completion_tokens = None  # server sent no usage chunk
    (s,) = summarize([record], {})
    assert s.usage_match is False
    (s,) = summarize([RequestRecord("u", 0, 0.0, status=CANCELLED)], {})
    assert s.usage_match is None


def test_errors_count_http_errors_and_exceptions():
    records = [
        RequestRecord("u", 0, 0.0, status=HTTP_ERROR, http_status=500, error="boom"),
        RequestRecord("u", 0, 0.3, status=ERROR, error="ReadError"),
        finished("u", [1.0]),
    ]
    (s,) = summarize(records, {})
    assert s.errors == 2
    assert s.requests_started == 3 and s.requests_finished == 1


def test_anonymous_user_parsing_and_request_body():
    anonymous = bench.parse_user_spec("-:2")
    assert anonymous == UserSpec(ANONYMOUS_USER, 2, bench.DEFAULT_MAX_TOKENS)
    assert not anonymous.sends_identity
    config = bench.BenchConfig(urls=["http://127.0.0.1:1"], users=[anonymous], duration_s=1)
    body = bench.request_body(config, "m", anonymous)
    assert "vllm_xargs" not in body
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True}

    named = bench.parse_user_spec("user-a:3:50")
    assert named == UserSpec("user-a", 3, 50)
    assert bench.request_body(config, "m", named)["vllm_xargs"] == {USER_ARG: "user-a"}
    assert bench.parse_limit("-=5") == (ANONYMOUS_USER, 5.0)


def test_anonymous_user_gets_its_own_limit_in_the_summary():
    records = [finished(ANONYMOUS_USER, [0.0]), finished("a", [0.0])]
    summaries = summarize(records, {ANONYMOUS_USER: 5.0}, default_limit=50.0)
    by_user = {s.user: s for s in summaries}
    assert by_user[ANONYMOUS_USER].limit_tokens_per_s == 5.0
    assert by_user[ANONYMOUS_USER].anonymous
    assert by_user["a"].limit_tokens_per_s == 50.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a:2", UserSpec("a", 2, 200)),
        ("a:2:7", UserSpec("a", 2, 7)),
        ("team:x:4", UserSpec("team:x", 4, 200)),
    ],
)
def test_parse_user_spec(text, expected):
    assert bench.parse_user_spec(text) == expected


@pytest.mark.parametrize("text", ["a", "a:", ":2", "a:0", "a:2:0", "a:two"])
def test_parse_user_spec_rejects(text):
    with pytest.raises(Exception):
        bench.parse_user_spec(text)


def test_dash_values_are_attached_so_argparse_accepts_them():
    argv = ["--user", "-:2", "--limit", "-=5", "--user", "a:1", "--json", "-x.json"]
    assert bench.attach_anonymous_values(argv) == [
        "--user=-:2", "--limit=-=5", "--user", "a:1", "--json", "-x.json"
    ]


def test_duplicate_user_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--user", "a:1", "--user", "a:2", "--duration", "1"])
    assert exc.value.code == 2
    assert "more than once" in capsys.readouterr().err


# --------------------------------------------------------------------------
# The guarantee check
# --------------------------------------------------------------------------

RATE = 4.0  # tok/s; 1 / RATE = 0.25 s is exact in binary, so windows are exact


def ideal_pacing(seconds: float) -> list[float]:
    """What GCRA allows a greedy user: one token every 1 / RATE seconds."""
    return [k / RATE for k in range(int(seconds * RATE) + 1)]


def test_guarantee_passes_on_ideally_paced_tokens():
    times = ideal_pacing(10)
    (s,) = summarize([finished("u", times, end=10.0)], {"u": RATE})
    assert s.guarantee == "PASS"
    one_second = next(c for c in s.windows if c.label == "1s")
    assert one_second.max_tokens == 5  # 0, .25, .5, .75, 1.0
    assert one_second.bound == pytest.approx(guarantee_bound(1.0, RATE)) == pytest.approx(5.4)
    assert [c.label for c in s.windows] == ["1s", "2s", "5s", "span"]
    assert s.windows[-1].window_s == 10.0 and s.windows[-1].max_tokens == 41
    assert s.envelope.passed and s.envelope.tokens == 41


def test_guarantee_fails_on_an_extra_burst():
    # Two tokens more at t=0 than pacing allows: 7 in [0, 1] > 5.4.
    times = [0.0, 0.0] + ideal_pacing(10)
    (s,) = summarize([finished("u", times)], {"u": RATE})
    assert s.guarantee == "FAIL"
    failed = [c.label for c in s.windows if c.passed is False]
    assert "1s" in failed
    assert render.tightest(s).startswith("1s: 7 > 5.4")


def test_measured_stall_widens_receive_windows_but_not_beyond_it():
    times = [0.0] + ideal_pacing(10)  # one token over: 6 in [0, 1] > 5.4
    # The stream ended (as the client saw it) at 11 s: the envelope holds.
    (strict,) = summarize([finished("u", times, end=11.0)], {"u": RATE})
    assert strict.guarantee == "FAIL" and strict.envelope.passed
    # A client that stalled 0.25 s may have bunched one token (at 4 tok/s) into a window.
    (stalled,) = summarize([finished("u", times, end=11.0)], {"u": RATE}, client_lag_s=0.25)
    assert stalled.guarantee == "PASS" and stalled.receive_stall_s == 0.25
    one_second = next(c for c in stalled.windows if c.label == "1s")
    assert one_second.within_bound is False and one_second.passed is True
    assert one_second.stall_allowance == 1.0
    # Two tokens over is more than that stall explains.
    (beyond,) = summarize([finished("u", [0.0, 0.0] + ideal_pacing(10), end=11.0)], {"u": RATE},
                          client_lag_s=0.25)
    assert beyond.guarantee == "FAIL"


def test_stall_is_measured_from_server_timestamps_when_present():
    # The server spread 9 tokens over 2 s; the client got them within 0.5 s.
    record = finished("u", [3.0 + k / 16 for k in range(9)], start=0.5)
    record.server_generation_s = 2.0
    assert analysis.receive_stall([record]) == pytest.approx(1.5)
    assert analysis.receive_stall([record], client_lag_s=1.7) == 1.7


def test_envelope_ignores_bunched_delivery():
    # Paced at the limit by the server, but each request's tokens reached the
    # client in one bunch at its end (a stalled client): receive windows look
    # like 4x the rate, the envelope (send -> end of each request) does not.
    records = []
    for k in range(10):
        start = 2.0 * k
        records.append(finished("u", [start + 2.0] * 8, start=start, end=start + 2.0))
    (s,) = summarize(records, {"u": RATE})
    assert next(c for c in s.windows if c.label == "1s").within_bound is False
    assert s.envelope.passed is True
    excess, width, count = envelope_worst([(r.start, r.end, r.n_tokens) for r in records], RATE)
    assert excess <= 0 and count <= guarantee_bound(width, RATE)


def test_envelope_catches_a_sustained_overrun_whatever_the_stall():
    # 3x the limit for 20 s, spread evenly; a huge measured stall cannot hide it.
    records = [finished("u", [k + j / (3 * RATE) for j in range(int(3 * RATE))], start=k, end=k + 1.0)
               for k in range(20)]
    (s,) = summarize(records, {"u": RATE}, client_lag_s=5.0)
    assert s.envelope.passed is False
    assert s.guarantee == "FAIL"


def test_envelope_worst_matches_brute_force_on_random_requests():
    import random

    for seed in range(30):
        rng = random.Random(seed)
        reqs = []
        for _ in range(rng.randint(1, 12)):
            start = round(rng.uniform(0, 10), 2)
            reqs.append((start, round(start + rng.uniform(0, 3), 2), rng.randint(0, 40)))
        rate, burst = rng.choice([2.0, 5.0, 20.0]), 0.1
        brute = None
        for a in {s for s, _, n in reqs if n}:
            for b in {e for _, e, n in reqs if n}:
                count = sum(n for s, e, n in reqs if s >= a and e <= b)
                if count:
                    excess = count - (max(b - a, 0.0) + burst) * rate - 1
                    brute = excess if brute is None else max(brute, excess)
        worst = envelope_worst(reqs, rate, burst)
        if brute is None:
            assert worst is None
        else:
            assert worst[0] == pytest.approx(brute), (seed, reqs)


def test_envelope_worst_picks_the_densest_request_set():
    requests = [(0.0, 10.0, 5), (2.0, 3.0, 20), (2.5, 3.2, 20), (8.0, 9.0, 1)]
    excess, width, count = envelope_worst(requests, rate=10.0, burst_s=0.1)
    # Sent at or after 2.0 and ended by 3.2: 40 tokens in 1.2 s.
    assert count == 40 and width == pytest.approx(1.2)
    assert excess == pytest.approx(40 - (1.2 + 0.1) * 10 - 1)
    assert envelope_worst([], 1.0) is None


def test_guarantee_fails_when_the_average_rate_is_too_high():
    times = [k / (2 * RATE) for k in range(int(10 * 2 * RATE))]  # twice the limit
    (s,) = summarize([finished("u", times)], {}, default_limit=RATE)
    assert s.guarantee == "FAIL"
    assert all(c.passed is False for c in s.windows)


def test_guarantee_spans_all_streams_of_a_user():
    # Each stream alone is within the limit; together they are at 2x.
    stream0 = finished("u", ideal_pacing(5), stream=0)
    stream1 = finished("u", [t + 0.125 for t in ideal_pacing(5)], stream=1)
    (alone,) = summarize([stream0], {"u": RATE})
    (both,) = summarize([stream0, stream1], {"u": RATE})
    assert alone.guarantee == "PASS"
    assert both.guarantee == "FAIL"
    assert both.streams == 2


def test_no_limit_means_na():
    (s,) = summarize([finished("u", ideal_pacing(2))], {"other": 1.0})
    assert s.guarantee == "n/a"
    assert all(c.bound is None and c.passed is None for c in s.windows)
    assert s.limit_tokens_per_s is None
    row = render.table_rows([s])[0]
    assert row[1] == "-" and row[render.TABLE_HEADERS.index("guarantee")] == "n/a"


def test_summary_order_follows_streams_and_includes_idle_users():
    records = [finished("z", [0.0]), finished("b", [0.0]), finished("extra", [0.0])]
    summaries = summarize(records, {}, streams={"b": 2, "z": 1, "idle": 3})
    assert [s.user for s in summaries] == ["b", "z", "idle", "extra"]
    idle = summaries[2]
    assert idle.tokens == 0 and idle.streams == 3 and idle.guarantee == "n/a"
    assert idle.tokens_per_s is None


def test_plot_labels_survive_matplotlib_legend_rules():
    # matplotlib drops legend labels that start with "_".
    assert render.plot_label(ANONYMOUS_USER) == "anonymous"
    assert not render.plot_label("_hidden").startswith("_")
    assert render.plot_label("user-a") == "user-a"


def test_text_report_lists_every_user_and_window():
    summaries = summarize(
        [finished("a", ideal_pacing(3)), finished(ANONYMOUS_USER, [0.0, 0.0, 0.0])],
        {"a": RATE},
    )
    text = render.format_report(summaries)
    assert "PASS" in text and ANONYMOUS_USER in text and "span" in text
    assert text.splitlines()[0].split()[0] == "user"


# --------------------------------------------------------------------------
# Section rendering (the performance page)
# --------------------------------------------------------------------------


def sample_result() -> dict:
    summaries = summarize(
        [finished("user-a", ideal_pacing(3)), finished("b|c", [0.0, 0.5], completion_tokens=3)],
        {"user-a": RATE},
        streams={"user-a": 1, "b|c": 1},
    )
    return {
        "schema": bench.SCHEMA,
        "command": "vllm-output-rate bench --user user-a:1 --duration 3",
        "started_at": "2025-01-02T03:04:05+00:00",
        "config": {"model": "tiny", "duration_s": 3.0, "windows_s": [1.0, 2.0, 5.0], "burst_s": 0.1},
        "client": {"loop_lag_max_s": 0.012},
        "summary": [s.to_dict() for s in summaries],
    }


def test_render_section_has_command_date_note_table_and_image():
    text = report.render_section(sample_result(), "bench.png", note="8-core laptop")
    assert "`vllm-output-rate bench --user user-a:1 --duration 3`" in text
    assert "2025-01-02T03:04:05+00:00" in text
    assert "Machine: 8-core laptop" in text
    assert "client loop lag max: 12 ms" in text
    assert "![Output rate per user over time](bench.png)" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 4  # header, rule, two users
    assert "| user-a | 4 |" in table[2] and "| PASS |" in table[2]
    assert "b\\|c" in table[3] and "NO (1)" in table[3]  # pipe escaped; mismatch shown
    assert all(line.count(" | ") == len(render.TABLE_HEADERS) - 1 for line in table[2:])


def test_render_section_without_note_or_image():
    text = report.render_section(sample_result())
    assert "Machine" not in text and "![" not in text


def test_rate_series_bins_tokens_per_second_for_every_user():
    records = [finished("a", [0.1, 0.2, 1.5, 2.99]), finished("b", [0.5, 0.5], start=0.4)]
    series = rate_series(records, bin_s=1.0, end_s=4.0)
    assert series == {"a": [2.0, 1.0, 1.0, 0.0], "b": [2.0, 0.0, 0.0, 0.0]}
    assert rate_series(records, bin_s=0.5)["a"] == [4.0, 0.0, 0.0, 2.0, 0.0, 2.0]


def test_share_is_of_all_tokens_received_in_the_run():
    records = [finished("a", [0.0] * 30), finished("b", [0.0] * 10)]
    by_user = {s.user: s for s in summarize(records, {})}
    assert by_user["a"].share == pytest.approx(0.75) and by_user["b"].share == pytest.approx(0.25)


PROMETHEUS_TEXT = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 120.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 30.0
"""


def test_prometheus_samples_are_summed_by_name_and_labels():
    samples = parse_metrics(PROMETHEUS_TEXT)
    assert metric_sum(samples, "vllm:num_preemptions_total") == 7.0
    assert metric_sum(samples, "vllm:num_requests_running") == 3.0
    assert metric_sum(samples, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 30.0
    assert metric_sum(samples, "vllm:num_requests_waiting") is None


# --------------------------------------------------------------------------
# The demo's figure and table, on recorded data (tests/tools/data/demo_small.json:
# the first seconds of a real `make demo` run, both sides)
# --------------------------------------------------------------------------


@pytest.fixture
def demo_doc():
    return json.loads(FIXTURE.read_text())


def test_recorded_demo_reproduces_its_summaries(demo_doc):
    # Recorded before the several-engine fields existed: those come out at
    # their one-engine defaults, every recorded field is reproduced exactly.
    for side in ("stock", "plugin"):
        redone = [s.to_dict() for s in bench.summarize_document(demo_doc[side])]
        recorded = demo_doc[side]["summary"]
        assert [{k: s[k] for k in old} for s, old in zip(redone, recorded)] == recorded
        for s in redone:
            assert s["tokens_by_engine"] == {} and s["shared_store"] is False
            assert s["server_charged_tokens"] is None


def test_demo_table_has_one_row_per_user_and_server(demo_doc):
    stock = [analysis.UserSummary.from_dict(s) for s in demo_doc["stock"]["summary"]]
    plugin = [analysis.UserSummary.from_dict(s) for s in demo_doc["plugin"]["summary"]]
    rows = render.comparison_rows(stock, plugin)
    assert [(r[0], r[1]) for r in rows] == [
        ("heavy", "stock vLLM"), ("heavy", "plugin"), ("light", "stock vLLM"), ("light", "plugin")]
    heavy_plugin = rows[1]
    assert heavy_plugin[2] == "30"  # the limit is shown for the plugin run only
    assert rows[0][2] == "-" and rows[0][-1] == "- (no limit)"
    by_user = {s.user: s for s in plugin}
    assert heavy_plugin[-1] == by_user["heavy"].guarantee
    # Shares of one run add up to the whole output.
    for run in (stock, plugin):
        assert sum(s.share for s in run) == pytest.approx(1.0)


def test_demo_section_and_figure_from_recorded_data(demo_doc, tmp_path):
    png = tmp_path / "demo.png"
    report.draw_demo(demo_doc, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.render_demo_section(demo_doc, "docs/demo.png", note="2 CPU cores")
    assert text.startswith("Command: `vllm-output-rate demo")
    assert "![Stock vLLM vs vllm-output-rate on the same workload](docs/demo.png)" in text
    assert "Machine: 2 CPU cores" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4
    assert all(line.count(" | ") == len(render.COMPARISON_HEADERS) - 1 for line in table[2:])
    headline = report.demo_headline(demo_doc)
    assert "`heavy`" in headline and "`light`" in headline and "limit" in headline


def test_report_main_keeps_demo_for_the_page_without_raw_requests(demo_doc, tmp_path):
    result = tmp_path / "demo.json"
    result.write_text(json.dumps(demo_doc))
    prefix = tmp_path / "docs" / "results" / "demo"
    report.main(["--demo", str(result), "--out", str(prefix)])
    kept = json.loads(prefix.with_suffix(".json").read_text())
    assert "requests" not in kept["stock"] and "requests" not in kept["plugin"]
    assert kept["stock"]["summary"] == demo_doc["stock"]["summary"]
    assert prefix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # drawn from the raw data
    # The page renders the kept document as it would the whole run, dated once elsewhere.
    assert report.render_demo_section(kept, "demo.png", dated=False) == \
        report.render_demo_section(demo_doc, "demo.png", dated=False)
    assert "Date:" not in report.render_demo_section(kept, dated=False)


def test_report_main_copies_a_given_figure(demo_doc, tmp_path):
    result = tmp_path / "demo.json"
    result.write_text(json.dumps(demo_doc))
    figure = tmp_path / "run.png"
    figure.write_bytes(b"\x89PNG-not-really")
    report.main(["--demo", str(result), "--png", str(figure), "--out", str(tmp_path / "kept")])
    assert (tmp_path / "kept.png").read_bytes() == b"\x89PNG-not-really"


def test_report_main_unreadable_input_fails_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(["--bench", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.json" in err
    assert not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------
# End to end against a fake OpenAI-compatible server on 127.0.0.1
# --------------------------------------------------------------------------

CHUNK_SIZES = (3, 1, 2, 4)  # tokens per SSE chunk, cycled: several per chunk


@dataclass
class FakeServerState:
    tokens_sent: Counter = field(default_factory=Counter)
    bodies: list = field(default_factory=list)
    # With ``metrics``: GET /metrics exports the plugin's charged-token counter
    # per user, starting from ``charged_before`` (what earlier runs left there).
    metrics: bool = False
    charged_before: Counter = field(default_factory=Counter)


def make_fake_app(state: FakeServerState):
    from aiohttp import web

    def sse(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def completions(request):
        body = await request.json()
        state.bodies.append(body)
        user = body.get("vllm_xargs", {}).get(USER_ARG, ANONYMOUS_USER)
        if user == "broken":
            return web.json_response({"error": {"message": "nope"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # Like vLLM: a first chunk may carry the prompt ids and no output token.
        await response.write(sse({"choices": [{"index": 0, "text": "", "token_ids": [], "prompt_token_ids": [1, 2]}]}))
        # "slow": 20 ms pauses; "paced": one token every 0.1 s (10 tok/s);
        # everybody else as fast as the loop goes (~1000 tok/s).
        pause = {"slow": 0.05, "paced": 0.1}.get(user, 0.002)
        remaining, next_id, size_index = body["max_tokens"], 100, 0
        while remaining:
            if user == "cut" and remaining < body["max_tokens"]:
                await response.write_eof()  # connection ends without finish_reason
                return response
            size = 1 if user == "paced" else min(CHUNK_SIZES[size_index % len(CHUNK_SIZES)], remaining)
            size_index += 1
            remaining -= size
            ids = list(range(next_id, next_id + size))
            next_id += size
            choice = {"index": 0, "text": "x" * size, "token_ids": ids,
                      "finish_reason": None if remaining else "length"}
            await response.write(sse({"choices": [choice], "usage": None}))
            state.tokens_sent[user] += size
            await asyncio.sleep(pause)
        reported = body["max_tokens"] + (1 if user == "miscount" else 0)
        usage = {"prompt_tokens": 2, "completion_tokens": reported, "total_tokens": reported + 2}
        await response.write(sse({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def metrics(request):
        lines = ["# TYPE vllm:output_rate_output_tokens_charged counter"]
        for user in sorted(set(state.charged_before) | set(state.tokens_sent)):
            value = state.charged_before[user] + state.tokens_sent[user]
            lines.append(f'vllm:output_rate_output_tokens_charged_total{{model_name="fake-model",user="{user}"}} {value}')
        return web.Response(text="\n".join(lines) + "\n")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    if state.metrics:
        app.router.add_get("/metrics", metrics)
    return app


@pytest.fixture
def fake_server():
    """The fake app in its own thread and event loop, on a free 127.0.0.1 port."""
    with running_fake_server(FakeServerState()) as served:
        yield served


@contextlib.contextmanager
def running_fake_server(state: FakeServerState):
    with serving_app(make_fake_app(state)) as url:
        yield url, state


def test_bench_counts_tokens_exactly_against_fake_server(fake_server, tmp_path, capsys):
    url, state = fake_server
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    bench.main([
        "--url", url,
        "--user", "alice:2:10",
        "--user", "-:1:7",
        "--user", "miscount:1:5",
        "--user", "broken:1",
        "--duration", "0.6",
        "--grace", "10",
        "--limit", "alice=1000",
        "--default-limit", "1000",
        "--json", str(out_json),
        "--plot", str(out_png),
        "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert "model=fake-model" in printed

    document = json.loads(out_json.read_text())
    assert set(document) >= {"schema", "command", "started_at", "config", "summary", "requests", "totals"}
    records = bench.records_from_document(document)
    summaries = {s["user"]: s for s in document["summary"]}
    assert list(summaries) == ["alice", ANONYMOUS_USER, "miscount", "broken"]

    # Exact counts: what the client recorded is what the server sent.
    received = Counter()
    for record in records:
        received[record.user] += len(record.token_times)
    assert received == state.tokens_sent
    for user in ("alice", ANONYMOUS_USER, "miscount"):
        assert summaries[user]["tokens"] == state.tokens_sent[user] > 0
    # Every finished request ran to max_tokens and nothing was cut off.
    max_tokens = {"alice": 10, ANONYMOUS_USER: 7, "miscount": 5}
    for record in records:
        if record.user != "broken":
            assert record.status == FINISHED
            assert len(record.token_times) == max_tokens[record.user]
    assert summaries["alice"]["requests_finished"] >= 2  # both streams re-issued

    assert summaries["alice"]["usage_match"] is True
    assert summaries[ANONYMOUS_USER]["usage_match"] is True
    assert summaries["miscount"]["usage_match"] is False
    assert summaries["miscount"]["usage_mismatches"] == summaries["miscount"]["requests_finished"]
    assert summaries["broken"]["errors"] >= 1 and summaries["broken"]["tokens"] == 0
    assert {r.http_status for r in records if r.user == "broken"} == {500}
    assert summaries["alice"]["receive_stall_s"] >= 0

    # Anonymous requests carry no identity; the others do.
    for body in state.bodies:
        assert body["model"] == "fake-model"
        assert body["return_token_ids"] is True and body["stream"] is True
    assert sum(1 for b in state.bodies if "vllm_xargs" not in b) == summaries[ANONYMOUS_USER]["requests_started"]

    # The raw data reproduces the summary.
    assert [s.to_dict() for s in bench.summarize_document(document)] == document["summary"]

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    prefix = tmp_path / "page" / "bench"
    report.main(["--bench", str(out_json), "--png", str(out_png), "--out", str(prefix)])
    kept = json.loads(prefix.with_suffix(".json").read_text())
    assert "requests" not in kept and kept["summary"] == document["summary"]
    # The same image, now carrying the digest of the kept JSON.
    from vllm_output_rate.tools.render import DIGEST_KEY, json_digest, png_text

    assert png_text(prefix.with_suffix(".png"))[DIGEST_KEY] == json_digest(prefix.with_suffix(".json"))
    assert len(prefix.with_suffix(".png").read_bytes()) > len(out_png.read_bytes())
    text = report.render_section(kept, "bench.png", note="test machine")
    assert "![Output rate per user over time](bench.png)" in text
    assert "| alice | 1000 |" in text and "Machine: test machine" in text


def test_verdict_fails_a_server_that_overruns_and_passes_one_that_paces(fake_server, tmp_path):
    """The fake server ignores limits: `overrun` gets ~1000 tok/s against a
    20 tok/s limit (50x: no measured stall on this machine can explain it);
    `paced` gets 10 tok/s against 20 (even all of it bunched into one window
    fits the 1 s bound), and `cut` streams end without a finish_reason."""
    url, state = fake_server
    document = bench.main([
        "--url", url, "--user", "overrun:2:30", "--user", "paced:1:10", "--user", "cut:1:5",
        "--duration", "1.5", "--grace", "10", "--limit", "overrun=20", "--limit", "paced=20",
        "--no-progress",
    ])
    by_user = {s["user"]: s for s in document["summary"]}
    overrun, paced = by_user["overrun"], by_user["paced"]
    assert overrun["guarantee"] == "FAIL"
    assert overrun["envelope"]["passed"] is False
    assert overrun["tokens"] == state.tokens_sent["overrun"]
    assert paced["guarantee"] == "PASS" and paced["envelope"]["passed"] is True
    assert paced["tokens"] == state.tokens_sent["paced"] > 0
    cut = [bench.RequestRecord.from_dict(r) for r in document["requests"] if r["user"] == "cut"]
    assert cut and all(r.status == ERROR and "finish_reason" in r.error for r in cut)
    assert by_user["cut"]["errors"] == len(cut)


def test_requests_still_running_after_grace_are_cancelled_and_kept(fake_server, tmp_path):
    url, _ = fake_server
    out_json = tmp_path / "r.json"
    bench.main([
        "--url", url, "--user", "slow:2:1000", "--duration", "0.2", "--grace", "0.3",
        "--limit", "slow=1000", "--json", str(out_json), "--no-progress",
    ])
    document = json.loads(out_json.read_text())
    records = bench.records_from_document(document)
    assert len(records) == 2 and {r.status for r in records} == {CANCELLED}
    (summary,) = document["summary"]
    assert summary["requests_cancelled"] == 2 and summary["requests_finished"] == 0
    assert summary["tokens"] == sum(len(r.token_times) for r in records) > 0
    assert summary["usage_match"] is None and summary["errors"] == 0
    assert document["wall_s"] < 2


def test_report_draws_missing_plot_from_json(fake_server, tmp_path):
    url, _ = fake_server
    out_json = tmp_path / "r.json"
    bench.main(["--url", url, "--user", "a:1:3", "--duration", "0.1", "--json", str(out_json), "--no-progress"])
    prefix = tmp_path / "img" / "plot"
    report.main(["--bench", str(out_json), "--png", str(tmp_path / "not-drawn.png"), "--out", str(prefix)])
    assert prefix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------
# Several engines: --url repeated, streams spread, tokens summed per user
# --------------------------------------------------------------------------


def test_streams_are_dealt_round_robin_over_the_urls_from_user_to_user():
    users = [UserSpec("a", 4), UserSpec("b", 1), UserSpec("c", 3)]
    placement = bench.assign_urls(users, ["u1", "u2"])
    assert [placement[("a", i)] for i in range(4)] == ["u1", "u2", "u1", "u2"]
    assert placement[("b", 0)] == "u1"
    assert [placement[("c", i)] for i in range(3)] == ["u2", "u1", "u2"]
    three = bench.assign_urls(users, ["u1", "u2", "u3"])
    assert {three[("a", i)] for i in range(4)} == {"u1", "u2", "u3"}
    assert list(Counter(three.values()).values()) == [3, 3, 2]  # 8 streams, balanced
    one = bench.assign_urls(users, ["u"])
    assert set(one.values()) == {"u"} and len(one) == 8


def test_bound_across_engines_is_the_documented_one():
    # stores/lease.py and README: (W + 0.6) x N + 1 + E x ceil(0.1 x N), the
    # 0.6 s being the store's credit (a lease lifetime) and the lifetime.
    assert analysis.lease_size(30.0) == 3  # 30.0 * 0.1 > 3 in floating point
    assert analysis.lease_size(0.5) == 1 and analysis.lease_size(101) == 11
    assert guarantee_bound(1.0, 30.0, shared_engines=2) == pytest.approx(55.0)
    assert guarantee_bound(20.0, 30.0, shared_engines=2) == pytest.approx(625.0)
    assert guarantee_bound(1.0, 30.0, shared_engines=3) == pytest.approx(58.0)
    # A burst above the lifetime is the store's credit itself.
    assert guarantee_bound(1.0, 30.0, burst_s=0.5, shared_engines=1) == pytest.approx(1 + 3 + 1.8 * 30)
    # No shared store: one engine's own limiter.
    assert guarantee_bound(1.0, 30.0, shared_engines=0) == guarantee_bound(1.0, 30.0) == pytest.approx(34.0)


def served_by(url, record):
    record.url = url
    return record


def test_a_users_tokens_are_summed_over_engines_for_figures_and_verdict():
    # Each engine paces the user at its limit: fine for either alone, twice the
    # limit summed (what engines without a shared store hand out).
    e1 = served_by("http://e1", finished("u", ideal_pacing(10), end=10.0))
    e2 = served_by("http://e2", finished("u", [t + 0.125 for t in ideal_pacing(10)], end=10.125))
    (alone,) = summarize([e1], {"u": RATE}, shared_store=True)
    assert alone.guarantee == "PASS" and alone.engines == 1
    (both,) = summarize([e1, e2], {"u": RATE}, shared_store=True)
    assert both.tokens == 82 and both.tokens_by_engine == {"http://e1": 41, "http://e2": 41}
    assert both.engines == 2 and both.tokens_per_s == pytest.approx(82 / 10.125)
    assert both.guarantee == "FAIL" and both.envelope.passed is False
    # Every window of 2 s or more; a 1 s window holds 9 tokens, within the
    # (1 + 0.6) x 4 + 1 + 2 = 9.4 two engines may give.
    assert all(c.passed is False for c in both.windows if c.window_s >= 2)


def test_shared_store_bound_allows_each_engines_lease_and_no_more():
    # RATE 4 tok/s: lease L = 1, lifetime 0.3 s.  Ideal pacing plus 4 tokens
    # at t = 0: 9 tokens in [0, 1] -- over one engine's own bound (5.4), within
    # the bound across 2 engines ((1 + 0.6) x 4 + 1 + 2 = 9.4), over it for 1 (8.4).
    e1 = served_by("http://e1", finished("u", [0.0, 0.0, 0.0] + ideal_pacing(10), end=10.0))
    e2 = served_by("http://e2", finished("u", [0.0], end=0.0))
    (own,) = summarize([e1, e2], {"u": RATE})
    assert own.guarantee == "FAIL" and not own.shared_store
    (two,) = summarize([e1, e2], {"u": RATE}, shared_store=True)
    one_second = next(c for c in two.windows if c.label == "1s")
    assert (one_second.max_tokens, one_second.bound) == (9, pytest.approx(9.4))
    assert two.guarantee == "PASS" and two.envelope.passed
    e2.url = "http://e1"  # the same tokens from one engine: only one lease of slack
    (one,) = summarize([e1, e2], {"u": RATE}, shared_store=True)
    assert one.engines == 1 and one.guarantee == "FAIL"


def test_charged_delta_per_engine_skips_engines_it_cannot_read():
    before = {"a": {"heavy": 1000.0}, "b": {}, "c": None, "d": {"x": 1.0}}
    after = {"a": {"heavy": 1040.0, "light": 7.0}, "b": {"heavy": 12.0}, "c": {"heavy": 5.0},
             "d": None, "e": {}}
    assert bench.charged_delta(before, after) == {
        "a": {"heavy": 40.0, "light": 7.0}, "b": {"heavy": 12.0}}


def test_bench_spreads_streams_over_engines_and_sums_each_user(tmp_path, capsys):
    # Engine 1 already counted 1000 tokens of heavy (an earlier run): only the
    # growth during this run is charged to it.
    states = [FakeServerState(metrics=True, charged_before=Counter({"heavy": 1000})),
              FakeServerState(metrics=True)]
    out_json = tmp_path / "r.json"
    with running_fake_server(states[0]) as (url1, _), running_fake_server(states[1]) as (url2, _):
        document = bench.main([
            "--url", url1, "--url", url2, "--user", "heavy:4:10", "--user", "light:1:5",
            "--duration", "0.5", "--grace", "10", "--limit", "heavy=1000", "--default-limit", "1000",
            "--json", str(out_json), "--no-progress",
        ])
    printed = capsys.readouterr().out
    assert document["config"]["urls"] == [url1, url2] and document["config"]["shared_store"]
    sent = [state.tokens_sent for state in states]
    by_user = {s["user"]: s for s in document["summary"]}
    heavy, light = by_user["heavy"], by_user["light"]
    # heavy's streams alternate between the engines; light's one stream is on the first.
    placed = {(r["stream"], r["url"]) for r in document["requests"] if r["user"] == "heavy"}
    assert placed == {(0, url1), (1, url2), (2, url1), (3, url2)}
    assert sent[0]["heavy"] > 0 and sent[1]["heavy"] > 0 and sent[1]["light"] == 0
    # Client side: per engine exactly what it sent, summed per user.
    assert heavy["tokens_by_engine"] == {url1: sent[0]["heavy"], url2: sent[1]["heavy"]}
    assert heavy["tokens"] == sent[0]["heavy"] + sent[1]["heavy"] and heavy["engines"] == 2
    assert light["tokens_by_engine"] == {url1: sent[0]["light"]} and light["engines"] == 1
    # Server side: each engine's counter growth, summed over engines.
    assert heavy["server_charged_by_engine"] == {url1: sent[0]["heavy"], url2: sent[1]["heavy"]}
    assert heavy["server_charged_tokens"] == heavy["tokens"]
    assert light["server_charged_tokens"] == light["tokens"] > 0
    # The verdict is judged against the bound across the engines each user used.
    heavy_1s = next(w for w in heavy["windows"] if w["label"] == "1s")
    light_1s = next(w for w in light["windows"] if w["label"] == "1s")
    assert heavy_1s["bound"] == pytest.approx(guarantee_bound(1.0, 1000.0, shared_engines=2))
    assert light_1s["bound"] == pytest.approx(guarantee_bound(1.0, 1000.0, shared_engines=1))
    # The JSON reproduces the summary; the report has the per-engine table.
    assert [s.to_dict() for s in bench.summarize_document(document)] == document["summary"]
    assert "Per engine" in printed and f"heavy  {url2}" in printed
    assert "sum over 2" in printed and "E × L" in printed

    # make demo-cluster renders the same document (table rows per user, figure).
    from vllm_output_rate.tools import demo_cluster

    document["cluster"] = {"command": "vllm-output-rate demo-cluster", "heavy_limit": 1000.0}
    block = demo_cluster.markdown(document)
    # The page's copy has no raw requests: the rates under load travel with it.
    kept = report.page_document(demo_cluster.with_rates_under_load(document))
    assert "requests" not in kept and demo_cluster.markdown(kept) == block
    rows = [line for line in block.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| heavy", "| light"]
    assert f"| {sent[0]['heavy']} (engine 1) + {sent[1]['heavy']} (engine 2) | {heavy['tokens']} |" in rows[0]
    assert "(W + 0.6) × 1000 + 1 + 200 tokens" in block  # E x L = 2 x ceil(0.1 x 1000)
    figure = tmp_path / "cluster.png"
    render.plot_engines(bench.records_from_document(document), {"heavy": 1000.0}, figure)
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_the_same_url_twice_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--url", "http://127.0.0.1:1", "--url", "http://127.0.0.1:1/", "--user", "a:1",
                    "--duration", "1"])
    assert exc.value.code == 2 and "more than once" in capsys.readouterr().err


def test_unreachable_server_exits_nonzero_with_one_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as exc:
        bench.main(["--url", f"http://127.0.0.1:{port}", "--user", "a:1", "--duration", "1", "--no-progress"])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "cannot reach server" in err


# --------------------------------------------------------------------------
# Churn counters (benchmarks: preemptions and recomputed tokens)
# --------------------------------------------------------------------------


def churn_text(preemptions: float, readmitted: float | None = None, cached: float | None = None,
               generated: float = 0.0) -> str:
    lines = [f'vllm:num_preemptions_total{{engine="0"}} {preemptions}',
             f'vllm:generation_tokens_total{{engine="0"}} {generated}']
    if readmitted is not None:
        lines += [f'vllm_output_rate:readmitted_requests_total{{engine="0"}} {preemptions}',
                  f'vllm_output_rate:readmitted_tokens_total{{engine="0"}} {readmitted}',
                  f'vllm_output_rate:readmitted_cached_tokens_total{{engine="0"}} {cached}']
    return "\n".join(lines) + "\n"


def test_recompute_figures_are_deltas_between_two_readings():
    from vllm_output_rate_harness.churn import recompute_figures

    before = parse_metrics(churn_text(3, 100, 40, generated=1000))
    after = parse_metrics(churn_text(8, 1300, 340, generated=5000))
    figures = recompute_figures(before, after)
    assert figures["preemptions"] == 5 and figures["readmissions"] == 5
    assert figures["recomputed_tokens"] == (1300 - 100) - (340 - 40)
    assert figures["generation_tokens"] == 4000
    # A server without the churn counters: preemptions only.
    plain = recompute_figures(parse_metrics(churn_text(0)), parse_metrics(churn_text(2)))
    assert plain["preemptions"] == 2 and plain["recomputed_tokens"] is None


def test_churn_stat_logger_exports_readmissions_of_preempted_requests():
    from types import SimpleNamespace

    from prometheus_client import REGISTRY
    from vllm.v1.metrics.stats import PrefixCacheStats

    from vllm_output_rate_harness import churn

    def value(name):
        return REGISTRY.get_sample_value(name + "_total", {"engine": "7"}) or 0.0

    logger = churn.stat_logger_class()(vllm_config=None, engine_index=7)
    before = [value(n) for n in (churn.READMITTED_REQUESTS, churn.READMITTED_TOKENS, churn.READMITTED_CACHED)]
    stats = PrefixCacheStats()
    stats.record(num_tokens=50, num_hits=0, preempted=False)  # a new request: not churn
    stats.record(num_tokens=300, num_hits=128, preempted=True)
    stats.record(num_tokens=90, num_hits=0, preempted=True)
    logger.record(SimpleNamespace(prefix_cache_stats=stats), None)
    logger.record(None, None)  # iteration-only updates carry no scheduler stats
    after = [value(n) for n in (churn.READMITTED_REQUESTS, churn.READMITTED_TOKENS, churn.READMITTED_CACHED)]
    assert [b - a for a, b in zip(before, after)] == [2, 390, 128]


def test_churn_costs_per_finished_request_and_per_output_token():
    from vllm_output_rate_harness.churn import churn_costs, churn_line

    churn = {"preemptions": 4.0, "readmissions": 4.0, "readmitted_tokens": 500.0,
             "readmitted_cached_tokens": 100.0, "recomputed_tokens": 400.0, "generation_tokens": 2000.0}
    costs = churn_costs(churn, finished_requests=8)
    assert costs["preemptions_per_finished_request"] == 0.5
    assert costs["recomputed_tokens_per_output_token"] == 0.2 and costs["output_tokens"] == 2000.0
    assert "0.5 per finished request" in churn_line(costs)
    # Without the server's own token count the caller's stands in; without the
    # churn counters only preemptions are known.
    plain = churn_costs({"preemptions": 2.0, "recomputed_tokens": None, "generation_tokens": None}, 0, 50)
    assert plain["preemptions_per_finished_request"] is None and plain["output_tokens"] == 50
    assert plain["recomputed_tokens_per_output_token"] is None
    assert "unknown" in churn_line(plain)


# --------------------------------------------------------------------------
# Sliding windows of any length (the soak's check)
# --------------------------------------------------------------------------


def _brute_sliding_excess(times, rate, extra_s):
    ordered = sorted(times)
    best = (-math.inf, 0.0)
    for i, a in enumerate(ordered):
        for j in range(i, len(ordered)):
            width = ordered[j] - a
            excess = (j - i + 1) - guarantee_bound(width, rate) - extra_s * rate
            if excess > best[0]:
                best = (excess, width)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_sliding_excess_is_the_worst_window_between_two_tokens(seed):
    import random

    rng = random.Random(seed)
    times = [rng.uniform(0, 5) for _ in range(rng.randint(1, 60))]
    rate, extra = rng.choice([1.0, 5.0, 20.0]), rng.choice([0.0, 0.3])
    excess, width = analysis.sliding_excess(times, rate, extra)
    brute_excess, _ = _brute_sliding_excess(times, rate, extra)
    assert excess == pytest.approx(brute_excess)
    assert 0.0 <= width <= max(times) - min(times)


def test_sliding_excess_passes_ideal_pacing_and_fails_a_burst():
    assert analysis.sliding_excess(ideal_pacing(10), RATE)[0] <= 0
    burst = [1.0] * 5  # five tokens at one instant
    assert analysis.sliding_excess(burst, RATE) == (pytest.approx(5 - guarantee_bound(0.0, RATE)), 0.0)


# --------------------------------------------------------------------------
# The benchmark harness (benchkit, with the wheel's runkit): its parts that need no server
# --------------------------------------------------------------------------


def test_stream_body_asks_for_exact_token_counts_and_names_the_user():
    body = stream_body("m", "alice", 7, prompt=[1, 2, 3])
    assert body["ignore_eos"] is True and body["return_token_ids"] is True and body["stream"] is True
    assert body["vllm_xargs"] == {USER_ARG: "alice"} and body["prompt"] == [1, 2, 3]
    assert "vllm_xargs" not in stream_body("m", None, 7)


@pytest.mark.parametrize("name, root, role", [
    ("vllm-output-rate", True, "api_server"),
    ("VLLM::EngineCore python", False, "engine_core"),
    ("VLLM::Worker_TP0 python", False, "worker"),
    ("python -c from multiprocessing", False, "other"),
])
def test_server_process_roles_come_from_their_names(name, root, role):
    assert benchkit.role_of(name, root) == role


def test_cpu_meter_splits_a_window_by_role_client_and_foreign():
    import os

    meter = benchkit.CpuMeter([os.getpid()])  # this process stands in for a server
    meter.start()
    sum(i * i for i in range(20000))
    cpu = meter.stop()
    assert set(cpu["servers"][0]) == set(benchkit.ROLES)
    assert cpu["wall_s"] > 0 and cpu["foreign"] >= 0 and cpu["busy"] >= 0
    assert benchkit.as_share(1.5, 3.0) == 0.5 and benchkit.as_share(1.5, 3.0, 100, 1) == 50.0
    with pytest.raises(RuntimeError):
        benchkit.CpuMeter([]).stop()


def test_a_client_in_its_own_session_asks_for_priority_and_says_what_it_got():
    import subprocess
    import sys

    # In a child: the raised priority must not outlive the check in this process.
    code = (
        "import json, os\n"
        "from vllm_output_rate.tools import runkit\n"
        "from vllm_output_rate_harness import benchkit\n"
        "def main():\n"
        "    got = benchkit.raise_client_priority(-3)\n"
        "    print(json.dumps([got, runkit.client_priority, os.getsid(0) == os.getpid(),\n"
        "                      os.getpriority(os.PRIO_PROCESS, 0),\n"
        "                      os.path.exists('/proc/self/autogroup')\n"
        "                      and open('/proc/self/autogroup').read().split()[-1]]), flush=True)\n"
        "    return 3\n"
        "raise SystemExit(benchkit.in_own_session(main))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr  # the child's exit code comes back
    got, recorded, session_leader, nice, autogroup_nice = json.loads(done.stdout.splitlines()[-1])
    assert session_leader and got == recorded and got["nice"] == -3
    # in_own_session asks for CLIENT_NICE before main; main asked again for -3
    assert nice == (-3 if got["threads"] else 0)
    if got["autogroup"]:
        assert autogroup_nice == "-3"


def test_report_head_and_outputs(tmp_path, capsys):
    import argparse

    doc = benchkit.start_report("schema/1", argparse.Namespace(out="x", rounds=2), ["--flag"])
    assert doc["config"] == {"out": "x", "rounds": 2} and doc["server_args"] == ["--flag"]
    assert doc["machine"]["nproc"] >= 1 and len(doc["load_before"]) == 3
    benchkit.finish_report(doc)
    assert "_t_begin" not in doc and doc["wall_s"] >= 0 and len(doc["load_after"]) == 3
    assert "nproc=" in benchkit.machine_line(doc)

    def draw(d, png):
        png.write_bytes(b"\x89PNG")

    written = benchkit.write_outputs(doc, tmp_path / "results" / "bench", suffix="_store", plot=draw)
    assert [p.name for p in written] == ["bench_store.json", "bench_store.png"]
    assert json.loads(written[0].read_text())["schema"] == "schema/1"
    assert benchkit.table(["a", "bb"], [["1", "2"]]).splitlines()[0] == "a  bb"
    assert benchkit.log_dir_for("x", str(tmp_path / "logs")) == tmp_path / "logs"


# --------------------------------------------------------------------------
# The performance page (benchmarks/render_performance.py)
# --------------------------------------------------------------------------

RENDER_PAGE = Path(__file__).resolve().parents[2] / "benchmarks" / "render_performance.py"


def render_page(results: Path, page: Path) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(RENDER_PAGE), "--results", str(results), "--page", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return page.read_text()


def test_performance_page_renders_what_exists_and_names_what_is_missing(demo_doc, tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    kept = report.page_document(demo_doc)
    kept["machine"] = {"cpu_model": "Test CPU", "nproc": 2, "mem_total_gib": 7.5, "vllm": "0.32.0",
                       "torch": "2.9.0", "python": "3.11.9"}
    (results / "demo.json").write_text(json.dumps(kept))
    (results / "demo.png").write_bytes(b"\x89PNG")
    page = tmp_path / "docs" / "performance.md"
    text = render_page(results, page)
    assert text.startswith("# Performance\n") and "Generated by `python benchmarks/render_performance.py`" in text
    # The machine and the date once; the demo's own block carries no date.
    assert text.count("Test CPU, 2 CPU cores") == 1 and text.count(demo_doc["started_at"]) == 1
    assert "Date:" not in text
    assert "![Stock vLLM vs vllm-output-rate on the same workload](demo.png)" in text
    assert (tmp_path / "docs" / "demo.png").read_bytes() == b"\x89PNG"
    # Every other result is listed by name with the command that writes it.
    missing = text.split("## Not measured yet", 1)[1]
    assert "`demo.json`" not in missing
    for name in ("scheduler_step", "throughput_ratio", "idle_cpu", "itl_single", "kv_pressure", "soak"):
        assert f"| `{name}.json` | `" in missing
    # Generated whole: a second run writes the same page.
    assert render_page(results, page) == text


def test_a_stalled_client_is_told_its_figures_may_be_its_own_pace():
    assert bench.client_lag_warning(None) is None
    assert bench.client_lag_warning(0.046) is None
    assert bench.client_lag_warning(bench.CLIENT_LAG_WARNING_S - 0.01) is None
    warning = bench.client_lag_warning(3.033)
    assert warning is not None and "3.0 s" in warning and "not the server's" in warning


def test_the_demo_runs_its_bench_in_a_session_of_its_own_and_passes_its_exit_code_on(monkeypatch):
    from vllm_output_rate.tools import demo, runkit

    started = []
    monkeypatch.setattr(runkit, "in_own_session", lambda run: started.append(run) or 3)
    with pytest.raises(SystemExit) as exc:
        demo.main(["--only", "stock", "--out", "unused"])
    assert exc.value.code == 3 and len(started) == 1  # nothing ran outside the session
    monkeypatch.setattr(runkit, "in_own_session", lambda run: 0)
    assert demo.main(["--only", "stock", "--out", "unused"]) is None
