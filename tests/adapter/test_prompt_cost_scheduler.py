"""Prompt cost (``input_token_weight``) on vLLM's real scheduler, fake clock.

The bound checked (policy/prompt_cost.py): over any window of W seconds a
user's output tokens + weight x prompt tokens charged stay within
(W + 0.1) x N + 1 + ceil(weight x C), C the most prompt tokens one chunk
computes (the token budget here).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.adapter.scheduler import OutputRateScheduler
from vllm_output_rate.policy.gate import MAX_IDLE_WAIT_NS
from vllm_output_rate_harness.scheduler_sim import MS, Harness

S = 1_000_000_000
BUDGET = 512


def limits(default, weight, **users):
    return {
        "default_user_output_tokens_per_second": default,
        "user_output_tokens_per_second": users,
        "input_token_weight": weight,
    }


def distinct_prompt(seed: int, length: int) -> list[int]:
    """A prompt sharing no 16-token block with another seed's (no cache hits)."""
    return [100 + (seed * 7919 + i * 31) % 900 for i in range(length)]


class LookupCountingScheduler(OutputRateScheduler):
    """Counts vLLM's prefix-cache lookups of waiting requests: the per-request
    work its waiting loop does before our skip hook after the lookup."""

    lookups = 0

    def _get_local_prefix_cache_hit(self, request, *args):  # 0.33 adds a length
        self.lookups += 1
        return super()._get_local_prefix_cache_hit(request, *args)

    def lookups_in_step(self) -> int:
        """Lookups since the last call."""
        count, self.lookups = self.lookups, 0
        return count


def cost_series(h: Harness, user: str, weight, steps: int, dt_ns: int = 10 * MS, on_step=None):
    """Run ``steps`` steps; return [(time of step, cumulative output + weight x prompt charged)]."""
    sched = h.sched
    series = []
    for index in range(steps):
        if on_step is not None:
            on_step(index)
        now = h.clock.now_ns
        h.step(dt_ns)
        prompt = sched.output_rate_prompt_cost.prompt_tokens.get(user, 0)
        output = sched.output_rate_gate.ledger.charged_tokens.get(user, 0)
        series.append((now, output + Fraction(weight) * prompt))
    return series


def worst_excess(series, rate, extra) -> Fraction:
    """Max over windows [t_i, t_j] of cost charged in it minus its bound (<= 0: held)."""
    worst = Fraction(-10**9)
    previous = [Fraction(0)] + [c for _, c in series[:-1]]
    for i, (t0, _) in enumerate(series):
        before = previous[i]
        for t1, cumulative in series[i:]:
            window = Fraction(t1 - t0, S)
            excess = (cumulative - before) - ((window + Fraction(1, 10)) * rate + 1 + extra)
            worst = max(worst, excess)
    return worst


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_prompt_flood_is_held_to_its_rate_and_the_light_users_decodes_are_not_slowed(
    async_, long_context_model_dir
):
    """8 prompts of 4,000 tokens with max_tokens 1 at weight 0.5, rate 100 tok/s,
    beside a light user decoding: the flood's cost stays within its bound in
    every window, and the light user samples in exactly the steps it would alone."""
    def run(with_flood: bool):
        h = Harness(
            limits(100, 0.5, light=1000), async_=async_, max_num_batched_tokens=BUDGET,
            max_model_len=8192, num_blocks=4000, model_dir=long_context_model_dir,
        )
        light = h.add("light", prompt_len=8, max_tokens=250, request_id="light")
        h.step(10 * MS)
        if with_flood:
            for i in range(8):
                h.add("flood", max_tokens=1, prompt=distinct_prompt(i, 4000))
        series = cost_series(h, "flood", Fraction(1, 2), 300)
        h.drain()
        return h, light, series

    alone, _, _ = run(False)
    h, _, series = run(True)
    assert h.records["light"].sample_times == alone.records["light"].sample_times
    assert len(h.records["light"].sample_times) == 250
    extra = math.ceil(Fraction(1, 2) * BUDGET)
    assert worst_excess(series, 100, extra) <= 0
    # Held, not starved: over 3 s it was charged about its rate's worth.
    window_s = Fraction(series[-1][0] - series[0][0], S)
    assert series[-1][1] >= (window_s - 1) * 100
    pc = h.sched.output_rate_prompt_cost
    assert pc.prompt_tokens["flood"] >= 512 and not pc.prompt_tokens.get("light", 0) > 8


def test_waiting_prompts_of_a_user_in_debt_cost_no_per_step_lookups():
    """The benchmark's flood (eight 525-token prompts, max_tokens 1, weight
    0.5) beside a decoding light user: while the flood is in debt its
    waiting requests are skipped before vLLM looks them up in the prefix
    cache, so the steps cost what they cost without them (the lookups are
    counted by a subclass of our scheduler); once the debt is paid the next
    prompt goes."""
    h = Harness(limits(100, 0.5, light=100_000), max_num_batched_tokens=2048, max_model_len=2048,
                scheduler_cls=LookupCountingScheduler)
    pc = h.sched.output_rate_prompt_cost
    light = h.add("light", prompt_len=16, max_tokens=1000, request_id="light")
    h.step(10 * MS)
    for i in range(8):
        h.add("flood", max_tokens=1, prompt=distinct_prompt(i, 525))
    h.step(10 * MS)  # the first prompt goes, into debt; the other seven wait
    h.sched.lookups_in_step()
    assert pc.prompt_tokens["flood"] == 525 and pc.debt.get("flood")
    steps_in_debt = steps = 0
    while pc.prompt_tokens["flood"] == 525 and steps < 400:
        h.step(10 * MS)
        steps += 1
        assert "light" in h.sampled_log[-1]
        if pc.debt.get("flood") and pc.prompt_tokens["flood"] == 525:  # no prompt went, still in debt
            steps_in_debt += 1
            assert h.sched.lookups_in_step() == 0
        h.sched.lookups_in_step()
    # 263 tokens of cost at 100 tok/s: about 2.6 s of 10 ms steps, then the
    # next prompt goes (into debt again).
    assert 200 <= steps_in_debt <= 300 and steps <= steps_in_debt + 2
    assert pc.prompt_tokens["flood"] == 2 * 525
    assert not light.is_finished()


def test_queued_prompts_of_a_user_refused_for_one_cost_one_lookup_a_step():
    """A capped user's decoding stream spends its quota (10 tok/s) whenever
    there is some, so its four queued prompts are refused in every step (at
    weight 0.01 its own prompt left no debt).  Once the first of them is
    refused after its prefix-cache lookup, the others are refused before
    theirs (StepDecision._prompt_refused_again): one lookup a step, not four."""
    h = Harness(limits(1000, 0.01, capped=10), max_num_batched_tokens=2048, max_model_len=2048,
                scheduler_cls=LookupCountingScheduler)
    pc = h.sched.output_rate_prompt_cost
    h.add("capped", prompt_len=16, max_tokens=1000, request_id="stream")
    h.step(10 * MS)
    for i in range(4):
        h.add("capped", max_tokens=4, prompt=distinct_prompt(i, 64))
    h.sched.lookups_in_step()
    per_step = []
    for _ in range(50):
        h.step(10 * MS)
        per_step.append(h.sched.lookups_in_step())
    assert pc.prompt_tokens["capped"] == 16  # the stream's own prompt: none of the queued went
    assert max(per_step) == 1 and sum(per_step) == 50


def test_a_prompt_flood_at_weight_0_is_free_and_at_0_5_stops_blocking_admissions(
    long_context_model_dir,
):
    """A light user's new request arrives behind eight queued 4,000-token
    prompts: at weight 0 it waits for their prefills; at 0.5 the flood is in
    debt and skipped, and the light request is admitted at once."""
    def first_token_step(weight) -> int:
        h = Harness(
            limits(100, weight, light=1000), max_num_batched_tokens=BUDGET,
            max_model_len=8192, num_blocks=4000, model_dir=long_context_model_dir,
        )
        for i in range(8):
            h.add("flood", max_tokens=1, prompt=distinct_prompt(i, 4000))
        for _ in range(3):
            h.step(10 * MS)
        h.add("light", prompt_len=8, max_tokens=4, request_id="late")
        for step in range(200):
            h.step(10 * MS)
            if "late" in h.sampled_log[-1]:
                return step
        return 200

    assert first_token_step(0.5) <= 1
    assert first_token_step(0) > 20


def test_prefix_cache_hits_are_not_charged():
    h = Harness(limits(10_000, 1), max_num_batched_tokens=BUDGET)
    first = distinct_prompt(1, 640)
    h.add("a", max_tokens=1, prompt=first)
    h.run_until_done()
    pc = h.sched.output_rate_prompt_cost
    assert pc.prompt_tokens["a"] == 640
    # The same 640 tokens (40 full blocks, cached) and 64 new ones.
    h.add("a", max_tokens=1, prompt=first + distinct_prompt(2, 64))
    h.run_until_done()
    assert pc.prompt_tokens["a"] == 640 + 64
    assert h.sched.output_rate_gate.ledger.charged_tokens["a"] == 2


def test_recompute_after_preemption_is_not_charged():
    """A KV cache too small for every request: vLLM preempts and recomputes,
    the user is charged each prompt position once."""
    h = Harness(limits(10_000, 1), num_blocks=24, max_num_batched_tokens=128, prefix_caching=False)
    prompts = [distinct_prompt(i, 60) for i in range(6)]
    requests = [h.add("a", max_tokens=60, prompt=p) for p in prompts]
    h.run_until_done()
    assert all(r.finished for r in h.records.values())
    assert sum(r.num_preemptions for r in requests) > 0
    # vLLM computed more positions than the requests hold: the recompute.
    computed = sum(sum(o.num_scheduled_tokens.values()) for o in h.step_outputs)
    assert computed > sum(len(p) + 60 - 1 for p in prompts)
    pc = h.sched.output_rate_prompt_cost
    assert pc.prompt_tokens["a"] == sum(map(len, prompts))
    assert not pc.charged_upto  # forgotten with their requests


def test_whole_prefill_takes_the_user_into_debt_of_one_prompt():
    """Without chunked prefill a prompt is one chunk: it goes when the user
    can pay one token, and its cost beyond the quota is debt."""
    budget = 2048
    h = Harness(limits(400, 0.5, light=1000), chunked=False, max_num_batched_tokens=budget)
    h.add("light", prompt_len=8, max_tokens=200, request_id="light")
    for i in range(3):
        h.add("flood", max_tokens=1, prompt=distinct_prompt(i, 2000))
    series = cost_series(h, "flood", Fraction(1, 2), 350)
    assert worst_excess(series, 400, math.ceil(Fraction(1, 2) * budget)) <= 0
    done = sorted(r.sample_times[0] for r in h.records.values() if r.user == "flood" and r.finished)
    # Each prompt costs 1 + 1000 tokens: at 400 tok/s the next one waits about 2.5 s.
    assert len(done) == 2 and done[1] - done[0] >= (1001 - 41) * S // 400
    assert len(h.records["light"].sample_times) == 200


def test_reload_changes_the_weight_live():
    h = Harness(limits(10_000, 0), max_num_batched_tokens=BUDGET)
    pc = h.sched.output_rate_prompt_cost
    h.add("a", max_tokens=1, prompt=distinct_prompt(1, 100))
    h.run_until_done()
    assert not pc.prompt_tokens
    h.sched.apply_output_rate_limits(
        OutputRateSettings(default_rate=10_000, input_token_weight=0.25)
    )
    assert h.sched.output_rate_settings.input_token_weight == 0.25
    h.add("a", max_tokens=1, prompt=distinct_prompt(2, 100))
    h.run_until_done()
    assert pc.prompt_tokens == {"a": 100}
    assert h.sched.output_rate_users()["users"]["a"]["prompt_tokens_charged_total"] == 100
    h.sched.apply_output_rate_limits(OutputRateSettings(default_rate=10_000))
    h.add("a", max_tokens=1, prompt=distinct_prompt(3, 100))
    h.run_until_done()
    assert pc.prompt_tokens == {"a": 100}


def test_limits_file_weight_is_reloaded_and_a_file_without_it_means_the_flags(tmp_path):
    import json
    import os

    path = tmp_path / "limits.json"

    def write(data, bump):
        path.write_text(json.dumps(data))
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * S))

    write({"default_user_output_tokens_per_second": 1000, "input_token_weight": 1}, 0)
    h = Harness({"limits_file": str(path), "default_user_output_tokens_per_second": 7,
                 "input_token_weight": 0.25})
    watcher = h.sched._operate.watcher
    watcher.stop()  # checked by hand below
    sched = h.sched
    assert sched.output_rate_prompt_cost.weight == 1  # the file wins
    write({"default_user_output_tokens_per_second": 1000, "input_token_weight": 0.5}, 1)
    assert watcher.check()
    h.step(10 * MS)
    assert sched.output_rate_prompt_cost.weight == Fraction(1, 2)
    write({"default_user_output_tokens_per_second": 1000}, 2)  # no key: the flag's 0.25
    assert watcher.check()
    h.step(10 * MS)
    assert sched.output_rate_prompt_cost.weight == Fraction(1, 4)
    failures = sched.output_rate_reload_failures
    write({"default_user_output_tokens_per_second": 1000, "input_token_weight": -1}, 3)
    assert watcher.check()
    h.step(10 * MS)
    assert sched.output_rate_reload_failures == failures + 1
    assert sched.output_rate_prompt_cost.weight == Fraction(1, 4)


def test_a_user_in_debt_does_not_take_the_visible_room_of_others(long_context_model_dir):
    """Active cap 4 and four resident prefills of a user that falls into prompt
    debt (weight raised by a reload while they prefill 64 tokens a step): the
    light user admitted beside them samples in every step, its stream is not
    hidden behind prefills that cannot pay."""
    h = Harness(
        limits(100, 0, light=1000), max_num_seqs=16, max_num_active_seqs=4,
        max_num_batched_tokens=BUDGET, max_model_len=8192, num_blocks=4000,
        model_dir=long_context_model_dir,
    )
    h.sched.scheduler_config.long_prefill_token_threshold = 64  # many prefills at once
    for i in range(8):
        h.add("flood", max_tokens=1, prompt=distinct_prompt(i, 4000))
    for _ in range(5):
        h.step(10 * MS)
    prefilling = [r for r in h.sched.running if r.num_computed_tokens < r.num_prompt_tokens]
    assert len(prefilling) == 4
    h.sched.apply_output_rate_limits(
        OutputRateSettings(default_rate=100, user_rates={"light": 1000}, input_token_weight=0.5)
    )
    h.step(10 * MS)
    assert h.sched.output_rate_prompt_cost.debt.get("flood")
    h.add("light", prompt_len=8, max_tokens=100, request_id="light")
    steps = 0
    while not h.records["light"].finished and steps < 300:
        h.step(10 * MS)
        steps += 1
    # Admitted in the first step, then one token per step.
    assert h.records["light"].finished and steps <= 101


def run_engine_loop(h: Harness, until, max_steps: int = 1000) -> list[float]:
    """Step as vLLM's engine loop does with the plugin: after a step that
    scheduled nothing, sleep the idle wait (on the fake clock), else 10 ms.
    Stops when ``until()`` holds; returns the idle wait of every empty step."""
    waits = []
    for _ in range(max_steps):
        if until():
            return waits
        out = h.step(0)
        wait = h.sched.output_rate_idle_wait_s
        if out.total_num_scheduled_tokens:
            h.clock.advance(10 * MS)
            continue
        waits.append(wait)
        assert wait, f"an empty step told the engine to wait {wait!r} while nobody can run"
        h.clock.advance(int(wait * S))
    raise AssertionError(f"not done in {max_steps} steps: {len(waits)} of them empty")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_borrower_whose_next_prompt_waits_on_prompt_debt_does_not_spin_the_engine(async_, chunked):
    """Issue 31's server case on the real scheduler: one borrower
    (``{rate: 10, ceil: 20}``: a token per 100 ms, within the idle wait's
    cap) at ``input_token_weight: 1``; its first prompt (60 tokens) costs
    more than its ceiling can lend (a burst of 3), so its quota pays it and
    it goes into debt; its second waits for the debt, which borrowing
    cannot pay.  Every empty step used to be told to wait 0 (on a server: a
    core spinning); now each waits for the next token of its rate, so the
    debt is paid in about as many empty steps as it has tokens, and the
    second prompt goes as soon as its user can pay.  (Without a ceiling the
    first prompt would be borrowed whole: no debt.)"""
    h = Harness(
        limits(100, 1, b={"rate": 10, "ceil": 20}), async_=async_, chunked=chunked,
        max_num_batched_tokens=BUDGET,
    )
    h.add("b", max_tokens=1, prompt=distinct_prompt(1, 60), request_id="first")
    second = h.add("b", max_tokens=1, prompt=distinct_prompt(2, 60), request_id="second")
    pc = h.sched.output_rate_prompt_cost
    h.step(10 * MS)
    owed = pc.debt.get("b", 0)
    assert owed > 50
    start = h.clock.now_ns
    waits = run_engine_loop(h, lambda: pc.prompt_tokens.get("b", 0) >= 120)
    h.drain()
    # The debt (and the second prompt's first token) at 10 tok/s: at most one
    # empty step per token, none told 0, and the prompt went when it could.
    assert len(waits) <= owed + 2
    assert all(wait > 0 for wait in waits)
    assert (h.clock.now_ns - start) / S <= (owed + 1) / 10 + MAX_IDLE_WAIT_NS / S + 0.1
    assert second.num_computed_tokens > 0


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_three_members_of_a_group_in_prompt_debt_take_turns(async_, long_context_model_dir):
    """Issue 31's starving third member on the real scheduler: a group of
    100 tok/s at weight 0.5, members a, b and c (1,000 tok/s each of their
    own) each with a 4,000-token prompt, admitted in that order, chunks of
    512 (2.56 s of the group's quota each).  The chunks go round-robin (c
    used to get none while a and b alternated), and the engine, sleeping
    its idle waits, is never told 0."""
    users = {m: {"rate": 1000, "group": "g"} for m in "abc"}
    h = Harness(
        {**limits(1000, 0.5, **users), "groups": {"g": 100}}, async_=async_,
        max_num_batched_tokens=BUDGET, max_model_len=8192, num_blocks=4000,
        model_dir=long_context_model_dir,
    )
    for seed, member in enumerate("abc"):
        h.add(member, max_tokens=1, prompt=distinct_prompt(seed, 4000))
    charged = h.sched.output_rate_prompt_cost.prompt_tokens
    granted: list[str] = []
    seen = dict.fromkeys("abc", 0)

    def nine_chunks_went() -> bool:
        for member in "abc":
            while charged.get(member, 0) > seen[member]:
                seen[member] += BUDGET
                granted.append(member)
        return len(granted) >= 9

    run_engine_loop(h, nine_chunks_went, max_steps=5000)
    h.drain()
    assert sorted(granted[:9]) == sorted("abc" * 3), granted
    for i in range(len(granted) - 2):
        assert len(set(granted[i:i + 3])) == 3, granted  # any three in a row: each member once


def test_a_ceiled_borrowers_borrowed_prompts_stay_within_its_ceiling():
    """A borrower {rate 5, ceil 200} alone on the engine with 24 requests of
    40-token prompts and 2 output tokens at weight 0.1 (6 tokens a request),
    8 slots: its rate would take 29 s; out of it, its new requests' prompts
    are paid by borrowing (on its ceiling), so all of them finish within 2 s
    of fake clock, and output + 0.1 x prompt stays within the ceiling's bound
    in every window (a borrowed chunk is taken whole from the ceiling before
    it runs: no debt beyond the one chunk the bound allows)."""
    weight = Fraction(1, 10)
    h = Harness(limits(1000, 0.1, b={"rate": 5, "ceil": 200}), max_num_seqs=8, max_num_batched_tokens=BUDGET)
    requests = [h.add("b", max_tokens=2, prompt=distinct_prompt(i, 40)) for i in range(24)]
    series = cost_series(h, "b", weight, 200)
    h.drain()
    pc = h.sched.output_rate_prompt_cost
    assert all(r.num_output_tokens == 2 for r in requests)
    assert pc.borrowed_tokens.get("b", 0) >= 40  # ten or more prompts borrowed
    assert worst_excess(series, 200, math.ceil(weight * BUDGET)) <= 0
