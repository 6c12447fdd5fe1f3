"""Prompt cost on its own: :class:`PromptCost` over a real limiter and ledger.

Steps are driven by hand on integer time: repay debts, open the ledger,
charge chunks, settle with what "vLLM" scheduled.  Keys are strings.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.prompt_cost import PromptCost, exact_weight

MS = 1_000_000
S = 1_000_000_000


class NetLimiter(OutputRateLimiter):
    """A real limiter that also counts tokens taken net of refunds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.net = 0

    def take_up_to(self, user, now_ns, count):
        got = super().take_up_to(user, now_ns, count)
        self.net += got
        return got

    def try_take(self, user, now_ns, count=1):
        ok = super().try_take(user, now_ns, count)
        self.net += count if ok else 0
        return ok

    def refund(self, user, now_ns, count=1):
        self.net -= count
        super().refund(user, now_ns, count)


def parts(rate=100, weight=0.5):
    limiter = NetLimiter(rate)
    lanes = Lanes()
    ledger = Ledger(limiter, lanes)
    return limiter, lanes, ledger, PromptCost(ledger, weight)


def track(lanes, key, user="u"):
    lanes.track(key, user)
    lanes.admit(key, True)


def step(prompt, ledger, now, chunks, scheduled=None):
    """One step: chunks is [(key, start, count, num_prompt)]; returns keys dispatched."""
    if prompt.debt:
        prompt.repay(now)
    ledger.open(now, False)
    sent = {}
    for key, start, count, num_prompt in chunks:
        user = ledger._user_of[key]
        if prompt.uncharged(key, start, count, num_prompt) and not prompt.can_pay(key, user):
            continue
        prompt.charge(key, user, start, count, num_prompt)
        sent[key] = count
    if scheduled is not None:
        sent = {k: v for k, v in sent.items() if k in scheduled}
    prompt.settle(lambda key: sent.get(key, 0), now)
    ledger.settle(set())
    return sent


def test_exact_weight_reads_decimals_exactly():
    assert exact_weight(0.1) == Fraction(1, 10)
    assert exact_weight(0) == 0 and exact_weight(0.0) == 0
    with pytest.raises(ValueError):
        exact_weight(-1)
    with pytest.raises(ValueError):
        exact_weight("x")


def test_a_chunk_is_charged_whole_into_debt_and_the_debt_empties_the_quota():
    limiter, lanes, ledger, prompt = parts(rate=100, weight=0.5)
    track(lanes, "a")
    now = 10 * S
    assert step(prompt, ledger, now, [("a", 0, 512, 4000)]) == {"a": 512}
    # 256 tokens charged; the burst allowed 11, the rest is debt.
    assert limiter.net + prompt.debt["u"] == 256
    assert prompt.prompt_tokens == {"u": 512}
    # In debt: the next chunk waits, even when the quota has tokens again.
    assert step(prompt, ledger, now + 100 * MS, [("a", 512, 512, 4000)]) == {}
    assert "u" in ledger.blocked
    # After the debt is paid at the rate, the next chunk goes.
    t = now + 100 * MS
    while prompt.debt:
        t += 10 * MS
        step(prompt, ledger, t, [])
    assert step(prompt, ledger, t + 10 * MS, [("a", 512, 512, 4000)]) == {"a": 512}


def test_positions_charged_once_recompute_and_cache_hits_are_free():
    limiter, lanes, ledger, prompt = parts(rate=10_000, weight=1)
    track(lanes, "a")
    now = S
    # A cache hit up to 64: the first chunk starts there.
    step(prompt, ledger, now, [("a", 64, 100, 300)])
    assert prompt.prompt_tokens["u"] == 100 and prompt.charged_upto["a"] == 164
    # Preempted and recomputed from 0: positions below 164 are not charged again.
    assert prompt.uncharged("a", 0, 164, 300) == 0
    step(prompt, ledger, now + 10 * MS, [("a", 0, 200, 300)])
    assert prompt.prompt_tokens["u"] == 136  # 164..200
    # Output positions (beyond the prompt) are never prompt-charged.
    step(prompt, ledger, now + 20 * MS, [("a", 200, 150, 300)])
    assert prompt.prompt_tokens["u"] == 236
    assert prompt.uncharged("a", 300, 10, 300) == 0
    assert limiter.net == 236


def test_a_chunk_not_scheduled_is_refunded_exactly():
    limiter, lanes, ledger, prompt = parts(rate=1000, weight=Fraction(1, 3))
    track(lanes, "a")
    track(lanes, "b")
    now = S
    before = dict(limiter._tat)
    step(prompt, ledger, now, [("a", 0, 100, 400), ("b", 0, 50, 400)], scheduled=set())
    assert limiter.net == 0 and not prompt.debt and limiter._tat == before
    assert prompt.credit.get("u", 0) == 0 and not prompt.prompt_tokens
    # One of two kept: exactly its cost, credit below one token.
    step(prompt, ledger, now, [("a", 0, 100, 400), ("b", 0, 50, 400)], scheduled={"b"})
    assert prompt.prompt_tokens == {"u": 50}
    assert limiter.net == math.ceil(Fraction(50, 3))
    assert limiter.net - Fraction(50, 3) == prompt.credit["u"]
    assert "a" not in prompt.charged_upto


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    weight=st.sampled_from([Fraction(1, 2), Fraction(1, 3), Fraction(7, 10), 1, 2, Fraction(1, 16)]),
    rate=st.sampled_from([5, 20, 100, 333]),
    steps=st.lists(
        st.tuples(
            st.integers(1, 60),  # ms since the last step
            st.lists(st.tuples(st.integers(0, 2), st.integers(1, 256), st.booleans()), max_size=3),
        ),
        min_size=1, max_size=80,
    ),
)
def test_weighted_prompt_charges_stay_within_the_bound_and_exact(weight, rate, steps):
    """Over any window, weight x prompt tokens kept <= (W + 0.1) x N + 1 + ceil(weight x C),
    and whole tokens charged are the exact cost plus a credit below one token."""
    limiter, lanes, ledger, prompt = parts(rate=rate, weight=weight)
    keys = ["k0", "k1", "k2"]
    for key in keys:
        track(lanes, key)
    progress = dict.fromkeys(keys, 0)
    now = 5 * S
    kept_at: list[tuple[int, int]] = []  # (time, prompt tokens kept)
    largest = 0
    for dt, chunks in steps:
        now += dt * MS
        wanted = []
        seen = set()
        for index, count, scheduled in chunks:
            key = keys[index]
            if key in seen:
                continue
            seen.add(key)
            wanted.append((key, progress[key], count, 10**9, scheduled))
        keep = {key for key, *_, scheduled in wanted if scheduled}
        sent = step(prompt, ledger, now, [w[:4] for w in wanted], scheduled=keep)
        for key, count in sent.items():
            progress[key] += count
            kept_at.append((now, count))
            largest = max(largest, count)
        # Exactness, after every step.
        credit = prompt.credit.get("u", Fraction(0))
        total = sum(prompt.prompt_tokens.values())
        assert 0 <= credit < 1
        assert limiter.net + prompt.debt.get("u", 0) == weight * total + credit
        assert prompt.debt.get("u", 0) <= math.ceil(weight * largest) if largest else True
    extra = math.ceil(weight * largest)
    for i, (t0, _) in enumerate(kept_at):
        cost = Fraction(0)
        for t1, count in kept_at[i:]:
            cost += weight * count
            window_s = Fraction(t1 - t0, S)
            assert cost <= (window_s + Fraction(1, 10)) * rate + 1 + extra


def test_forget_user_drops_credit_but_never_debt():
    limiter, lanes, ledger, prompt = parts(rate=10, weight=Fraction(1, 3))
    track(lanes, "a")
    step(prompt, ledger, S, [("a", 0, 100, 400)])
    assert prompt.debt["u"] and prompt.credit["u"]
    prompt.forget("a")
    prompt.forget_user("u")
    assert "u" not in prompt.credit and prompt.debt["u"]
    assert "a" not in prompt.charged_upto
