"""``bench --scenario twin`` without a server: the workload generator
(``tools/workload.py``) and the twin's table computed from hand-made engine reads.

The real-server run is ``tests/server/test_bench_twin_server.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from fake_http import serving_app

from vllm_output_rate.settings import load_limits_file
from vllm_output_rate.tools import bench
from vllm_output_rate.tools.analysis import guarantee_bound
from vllm_output_rate.tools.bench import EngineRead, TwinRun, engine_read, format_twin_table, twin_figures
from vllm_output_rate.tools.measure import FINISHED, RequestRecord
from vllm_output_rate.tools.workload import LIGHT_RATE, build_twin_workload

NAMED = 12  # four caps, six borrowers, two group members


def signature(w):
    """Everything a run depends on, comparable."""
    return (w.limits, w.arrivals, {u: [[(j.prompt_len, j.max_tokens, j.think_s) for j in s] for s in ss]
                                   for u, ss in w.streams.items()}, w.capped, w.borrowers, w.in_quota)


# -- the generator ------------------------------------------------------------------


def test_a_seed_gives_one_workload_and_another_seed_another():
    once, again = build_twin_workload(16, users=300, seed=7), build_twin_workload(16, users=300, seed=7)
    assert signature(once) == signature(again)
    assert build_twin_workload(16, users=300, seed=7).arrivals != build_twin_workload(16, users=300, seed=8).arrivals


@pytest.mark.parametrize("seed", range(3))
def test_the_long_tail_is_heavy_a_few_send_many_and_most_none_or_one(seed):
    w = build_twin_workload(64, users=2000, duration_s=60, seed=seed)
    per_user = Counter(user for _, user, _, _ in w.arrivals)
    light = 2000 - NAMED
    counts = sorted(per_user.values(), reverse=True)
    # the busiest 1 % of the tail send a quarter or more of its requests (evenly spread: about 1 %)
    assert sum(counts[: light // 100]) >= 0.25 * len(w.arrivals), counts[:20]
    none_or_one = light - len(per_user) + sum(1 for n in per_user.values() if n == 1)
    assert none_or_one >= 0.95 * light
    assert counts[0] >= 5
    assert set(per_user) == w.in_quota and not w.in_quota & set(w.streams)


@pytest.mark.parametrize("r", [1, 8, 64, 256])
def test_heavy_users_caps_borrowers_and_group_scale_with_concurrency(r):
    w = build_twin_workload(r, users=100, duration_s=5)
    assert w.capped == {"cap-0": 0.25 * r, "cap-1": 0.5 * r, "cap-2": 1.0 * r, "cap-3": 2.0 * r}
    assert w.borrowers == {"borrow-0": 1, "borrow-1": 1, "borrow-2": 1, "borrow-3": 1, "borrow-w2": 2, "borrow-w3": 3}
    streams = {user: len(s) for user, s in w.streams.items()}
    assert streams == {**{u: max(1, r // 8) for u in w.capped},
                       **{f"borrow-{i}": max(1, r // 4) for i in range(4)},
                       "borrow-w2": max(1, r // 8), "borrow-w3": max(1, r // 8),
                       "grp-0": max(1, r // 16), "grp-1": max(1, r // 16)}
    assert w.groups == {"research": (0.5 * r, ("grp-0", "grp-1"))}
    assert len(w.users) == 100 and w.serve_args("l.json")[-4:] == ["--max-num-seqs", str(2 * r),
                                                                  "--max-num-active-seqs", str(r)]


def test_a_burst_goes_on_the_serve_command_and_never_into_the_limits_file(tmp_path):
    w = build_twin_workload(32, users=50, burst_s=0.3)
    path = tmp_path / "limits.json"
    path.write_text(w.limits_text())
    assert load_limits_file(str(path)).default_rate == LIGHT_RATE  # a burst key would be refused
    args = w.serve_args(str(path))
    assert args[args.index("--output-rate-burst-seconds") + 1] == "0.3"
    assert "--output-rate-burst-seconds" not in build_twin_workload(32, users=50).serve_args(str(path))


def test_the_limits_file_is_one_the_server_accepts(tmp_path):
    w = build_twin_workload(32, users=50, idle_users=3, seed=1)
    path = tmp_path / "limits.json"
    path.write_text(w.limits_text())
    settings = load_limits_file(str(path))
    assert settings.default_rate == LIGHT_RATE and settings.input_token_weight == 0.01
    assert len(settings.user_rates) == 53
    assert settings.limit_of("cap-3")[:2] == (64.0, 64.0)  # a hard cap: ceiling = rate
    assert settings.limit_of("borrow-0")[:2] == (1.6, None)  # no ceiling
    assert settings.limit_of("borrow-w3") == (1.6, 192.0, 3.0)
    assert settings.group_rates["research"] == 16.0
    assert settings.limit_of("u00000")[0] == LIGHT_RATE


def test_length_scale_shrinks_every_request_to_fit_a_small_model():
    w = build_twin_workload(8, users=40, duration_s=30, length_scale=0.1, kv_pressure=True, capacity_tok_s=400)
    jobs = [j for streams in w.streams.values() for s in streams for j in s]
    assert all(38 <= j.prompt_len <= 51 and 100 <= j.max_tokens <= 150 for j in jobs)
    assert all(26 <= p <= 77 and 3 <= m <= 26 for _, _, p, m in w.arrivals)
    assert w.arrivals and all(0 < t < 30 for t, _, _, _ in w.arrivals)


def test_too_few_users_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="more than the 12 named"):
        build_twin_workload(8, users=12)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scenario", "twin", "--users", "5", "--dry-run"])
    assert exit_info.value.code == 2
    assert "more than the 12 named" in capsys.readouterr().err


def test_dry_run_writes_the_limits_and_prints_how_to_serve_them(tmp_path, capsys):
    path = tmp_path / "out" / "limits.json"
    bench.main(["--scenario", "twin", "--concurrency", "16", "--users", "30", "--limits-out", str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert path.exists() and "--max-num-seqs 32 --max-num-active-seqs 16" in out and str(path) in out
    assert "30 configured users" in out
    bench.main(["--scenario", "twin", "--concurrency", "16", "--users", "30", "--burst-seconds", "0.3",
                "--limits-out", str(path), "--dry-run"])
    assert "--output-rate-burst-seconds 0.3 --max-num-seqs 32" in capsys.readouterr().out
    assert "burst" not in path.read_text()


def test_the_limits_can_be_printed_and_the_tail_sent_alone(capsys):
    bench.main(["--scenario", "twin", "--concurrency", "4", "--users", "13", "--limits-out", "-", "--dry-run"])
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["user_output_tokens_per_second"]["u00000"] == LIGHT_RATE
    args = bench.build_parser().parse_args(["--scenario", "twin", "--users", "300", "--tail-only"])
    alone, together = bench.twin_workload(args, 30.0), build_twin_workload(256, users=300, duration_s=30.0)
    assert alone.arrivals == together.arrivals and alone.limits == together.limits
    assert not alone.streams and not alone.capped and not alone.borrowers


def test_user_streams_and_the_scenario_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--scenario", "twin", "--user", "a:1", "--dry-run"])
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--duration", "1"])
    assert "--user" in capsys.readouterr().err


# -- reading the engine --------------------------------------------------------------

METRICS = """# TYPE vllm:output_rate_output_tokens_charged counter
vllm:output_rate_output_tokens_charged_total{model_name="m",user="cap-0"} 40.0
vllm:output_rate_output_tokens_charged_created{model_name="m",user="cap-0"} 1.7e9
vllm:output_rate_prompt_tokens_charged_total{model_name="m",user="cap-0"} 300.0
vllm:output_rate_requests{model_name="m",state="active",user="borrow-0"} 1.0
vllm:output_rate_requests{model_name="m",state="waiting",user="borrow-0"} 2.0
vllm:output_rate_requests{model_name="m",state="active",user="borrow-1"} 0.0
vllm:output_rate_limit_tokens_per_second{model_name="m",user="cap-0"} 3.0
vllm:output_rate_group_output_tokens_charged_total{group="research",model_name="m"} 9.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
"""


def test_a_read_keeps_the_counters_the_table_needs():
    read = engine_read(METRICS, 1.0, 1.5)
    assert read.output == {"cap-0": 40.0} and read.prompt == {"cap-0": 300.0}
    assert read.backlog == {"borrow-0": 2.0}  # held or waiting only: an active request is being served
    assert (read.generated, read.in_engine, read.shared_store) == (1234.0, 5.0, False)
    assert read.charged("cap-0", 0.01) == pytest.approx(43.0)
    assert engine_read(METRICS + 'vllm:output_rate_store_mode{mode="shared",model_name="m"} 1.0\n', 0, 0).shared_store
    w = build_twin_workload(8, users=20)  # cap-0 at 2 tok/s, the engine says 3
    assert bench.limit_mismatches(read, w) == ["cap-0: 3 tok/s on the engine, 2 in the scenario"]
    agreeing = METRICS.replace('user="cap-0"} 3.0', 'user="cap-0"} 2.0')
    assert bench.limit_mismatches(engine_read(agreeing, 0, 0), w) == []


# -- the table -------------------------------------------------------------------------

T0 = 100.0
LOAD_S = 20.0


def read_at(t: float, output: dict, backlog: dict, generated: float, prompt: dict | None = None,
            in_engine: float = 1.0) -> EngineRead:
    return EngineRead(T0 + t, T0 + t + 0.01, dict(output), dict(prompt or {}), dict(backlog), {}, generated,
                      in_engine, False)


def hand_made_run(served_per_s: dict[str, float], idle_at: dict[str, float] | None = None,
                  cap_rate: float = 2.0) -> tuple[object, TwinRun]:
    """Reads every second over a 20 s load: each borrower served at its rate per
    second, ``cap-0`` at ``cap_rate``; a borrower in ``idle_at`` has nothing in the
    engine at that read."""
    w = build_twin_workload(8, users=20, duration_s=LOAD_S)
    users = dict(served_per_s, **{"cap-0": cap_rate})
    reads = [read_at(-0.5, {}, {}, 0.0, in_engine=0)]
    for second in range(1, int(LOAD_S) + 2):
        backlog = {u: 0 if (idle_at or {}).get(u) == second else 1 for u in users}
        reads.append(read_at(second, {u: rate * second for u, rate in users.items()}, backlog,
                             10.0 * second, prompt={"cap-0": 100.0 * second}))
    final = reads[-1]
    reads.append(EngineRead(final.sent + 1, final.done + 1, final.output, final.prompt, {}, {},
                            final.generated, 0, False))
    records = [RequestRecord(user="u00001", start=1.0, token_times=[1.25, 1.3], status=FINISHED),
               RequestRecord(user="u00002", start=2.0, token_times=[2.5], status=FINISHED),
               RequestRecord(user="cap-0", start=0.0, token_times=[5.0], status=FINISHED)]
    w.in_quota = {"u00001", "u00002"}
    return w, TwinRun("m", T0, LOAD_S, reads, records, [], True)


EQUAL = {f"borrow-{i}": 10.0 for i in range(4)}


def test_equal_service_is_fair_and_a_capped_user_at_its_rate_is_at_one():
    w, run = hand_made_run({**EQUAL, "borrow-w2": 20.0, "borrow-w3": 30.0})
    f = twin_figures(w, run, window_s=5.0)
    cap = f["capped"]["cap-0"]
    # 2 tok/s over 21 s of reads, plus 0.01 x 100 prompt tokens a second
    assert cap["output_tokens"] == 2.0 * 21 and cap["prompt_tokens_charged"] == 100.0 * 21
    assert cap["achieved_over_limit"] == pytest.approx((42 + 21) / (2.0 * LOAD_S))
    assert cap["bound_tokens"] == pytest.approx(guarantee_bound(run.reads[-1].done - run.reads[0].sent, 2.0))
    assert cap["within_bound"] is False  # 63 charged against about 47: the prompt cost counts
    assert [x["end_s"] for x in f["fairness_windows"]] == [5.0, 10.0, 15.0, 20.0]
    for window in f["fairness_windows"]:
        assert window["backlogged_borrowers"] == 6
        assert window["jain_equal_weight"] == pytest.approx(1.0) and window["gap_equal_weight_tokens"] == 0
        assert window["jain_weighted_all"] == pytest.approx(1.0)  # service / weight equal for all six
    # from the read before the load to the first read at or after its end (20 s)
    assert f["throughput_tok_s"] == pytest.approx(10.0 * 20 / (run.reads[20].done - run.reads[0].sent))
    ft = f["in_quota_first_token_ms"]
    assert ft["requests"] == 2 and ft["p50"] == pytest.approx(375.0)  # cap-0's first token is not in quota


def test_unequal_service_lowers_jain_and_a_borrower_idle_at_one_read_leaves_that_window():
    served = {**EQUAL, "borrow-0": 30.0, "borrow-w2": 20.0, "borrow-w3": 30.0}
    w, run = hand_made_run(served, idle_at={"borrow-1": 7})
    f = twin_figures(w, run, window_s=5.0)
    second = f["fairness_windows"][1]  # (5, 10]: borrow-1 had nothing in the engine at 7 s
    assert second["backlogged_borrowers"] == 5
    xs = [150.0, 50.0, 50.0]  # borrow-0, -2, -3 over 5 s
    assert second["jain_equal_weight"] == pytest.approx(sum(xs) ** 2 / (3 * sum(x * x for x in xs)))
    assert second["gap_equal_weight_tokens"] == pytest.approx(100.0)
    assert second["gap_weighted_all_tokens"] == pytest.approx(100.0)
    assert f["fairness_windows"][2]["backlogged_borrowers"] == 6


def test_reads_before_the_engine_first_reported_a_borrower_do_not_empty_the_first_window():
    w, run = hand_made_run({**EQUAL, "borrow-w2": 20.0, "borrow-w3": 30.0})
    for read in run.reads[1:3]:  # the engine's first report comes at 3 s
        read.backlog = {}
    first = twin_figures(w, run, window_s=5.0)["fairness_windows"][0]
    assert first["backlogged_borrowers"] == 6 and first["jain_equal_weight"] == pytest.approx(1.0)
    for read in run.reads[1:7]:  # not a borrower in the engine before 6 s: nobody through (0, 5]
        read.backlog = {}
    assert twin_figures(w, run, window_s=5.0)["fairness_windows"][0]["backlogged_borrowers"] == 0


def test_the_table_has_every_row_and_every_column_names_its_clock():
    w, run = hand_made_run({**EQUAL, "borrow-w2": 20.0, "borrow-w3": 30.0})
    f = twin_figures(w, run, window_s=10.0)
    text = format_twin_table(f, "title line")
    lines = text.splitlines()
    assert lines[0] == "title line"
    header = lines[1]
    assert header.count("[engine counters]") == 3 and header.count("[client clock]") == 1
    for user in w.capped:
        assert any(line.startswith(f"| {user} |") for line in lines), user
    assert "| cap-0 | 2.0 | 42 | 2,100 | 1.5750 |" in text and text.count("| NO |") == 1
    # the farthest from 1 of 1.575, 0, 0, 0: a capped user that got nothing is the worst
    assert f["capped_worst_ratio"] == 0.0
    assert "| 10 | 6 | 1.0000 | 0 |" in text and "| 20 | 6 |" in text
    assert "[engine counters; charged = output + prompt cost]" in text


# -- the whole run against a fake engine (no vLLM) ---------------------------------------


class FakeEngine:
    """An OpenAI-compatible streaming server whose /metrics counts, per user, the
    tokens it sent (as charged), its requests in flight, and all tokens generated."""

    def __init__(self, per_user_series: bool = True) -> None:
        self.per_user_series = per_user_series
        self.sent: Counter = Counter()
        self.in_flight: Counter = Counter()
        self.bodies: list = []

    def app(self):
        from aiohttp import web

        async def models(request):
            return web.json_response({"object": "list", "data": [{"id": "fake"}]})

        async def completions(request):
            body = await request.json()
            self.bodies.append(body)
            user = body["vllm_xargs"]["output_rate_user"]
            self.in_flight[user] += 1
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            try:
                for i in range(body["max_tokens"]):
                    last = i == body["max_tokens"] - 1
                    choice = {"index": 0, "text": "x", "token_ids": [100 + i],
                              "finish_reason": "length" if last else None}
                    await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.sent[user] += 1
                    await asyncio.sleep(0.005)
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # the client cancelled: nothing more to send
                pass
            finally:
                self.in_flight[user] -= 1
            return response

        async def metrics(request):
            lines = [f'vllm:generation_tokens_total{{model_name="fake"}} {sum(self.sent.values())}',
                     f'vllm:num_requests_running{{model_name="fake"}} {sum(self.in_flight.values())}',
                     'vllm:num_requests_waiting{model_name="fake"} 0']
            if self.per_user_series:
                for user, n in self.sent.items():
                    lines.append(f'vllm:output_rate_output_tokens_charged_total{{model_name="fake",user="{user}"}} {n}')
                for user, n in self.in_flight.items():
                    # The fake serves one request at a time per stream and holds nothing
                    # for quota: what it has not answered yet waits.
                    lines.append(f'vllm:output_rate_requests{{model_name="fake",state="waiting",user="{user}"}} {n}')
            return web.Response(text="\n".join(lines) + "\n")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/metrics", metrics)
        return app


def serving(fake: FakeEngine):
    return serving_app(fake.app())


FAKE_SCENARIO = ["--scenario", "twin", "--concurrency", "2", "--users", "20", "--length-scale", "0.05",
                 "--capacity", "2000", "--duration", "1", "--fairness-window", "0.5", "--read-every", "0.1"]


def test_a_run_sends_the_workload_cancels_at_the_end_and_counts_what_the_engine_counted(tmp_path, capsys):
    fake = FakeEngine()
    with serving(fake) as url:
        doc = bench.main(["--url", url, *FAKE_SCENARIO, "--json", str(tmp_path / "t.json")])
    f = doc["figures"]
    # every request the engine saw was recorded (some cancelled at the end before they reached it)
    assert f["settled"] and f["requests"]["finished"] <= len(fake.bodies) <= f["requests"]["sent"]
    for user in ("cap-0", "cap-1", "cap-2", "cap-3"):
        assert f["capped"][user]["output_tokens"] == fake.sent[user] > 0  # the engine's count, exactly
    assert {b["vllm_xargs"]["output_rate_user"] for b in fake.bodies} >= {"cap-0", "borrow-w3", "grp-1"}
    prompts = [b["prompt"] for b in fake.bodies]
    assert all(isinstance(p, list) and p and all(10 <= t < 680 for t in p) for p in prompts)  # token ids
    assert [w["end_s"] for w in f["fairness_windows"]] == [0.5, 1.0]
    assert all(0 <= w["backlogged_borrowers"] <= 6 for w in f["fairness_windows"])
    assert f["in_quota_first_token_ms"]["requests"] > 0
    assert not sum(fake.in_flight.values())  # the load's last requests were cancelled, not left running
    assert "no per-user counters" not in capsys.readouterr().out


def test_an_engine_without_the_plugin_is_said_to_have_no_per_user_counters(capsys):
    with serving(FakeEngine(per_user_series=False)) as url:
        bench.main(["--url", url, *FAKE_SCENARIO])
    assert "no per-user counters" in capsys.readouterr().out
