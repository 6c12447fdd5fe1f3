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
from vllm_output_rate.policy.prompt_cost import PromptCost, exact_weight, whole_cost

MS = 1_000_000
S = 1_000_000_000



@given(
    st.fractions(min_value=0, max_value=8, max_denominator=1000),
    st.integers(min_value=0, max_value=100_000),
    st.fractions(min_value=0, max_value=1, max_denominator=1000).filter(lambda c: c < 1),
)
def test_whole_cost_is_the_fraction_arithmetic(weight, positions, credit):
    """The integer form of a chunk's cost is exactly ceil(weight x n - credit) and its credit left."""
    owed = weight * positions - credit
    whole = math.ceil(owed) if owed > 0 else 0
    got = whole_cost(weight, positions, credit)
    assert got == (whole, whole - owed)
    assert 0 <= got[1] and (got[1] < 1 or whole == 0)


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
    before = dict(limiter.state)
    step(prompt, ledger, now, [("a", 0, 100, 400), ("b", 0, 50, 400)], scheduled=set())
    assert limiter.net == 0 and not prompt.debt and limiter.state == before
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


class CapLender:
    """A prompt lender over a real limiter (a borrower's ceiling), counting
    what it lent net of refunds and what it was ever refunded."""

    def __init__(self, ceil):
        self.cap = NetLimiter(ceil)
        self.refunded = 0

    def room(self, user, now_ns):
        return self.cap.available(user, now_ns)

    def take(self, user, now_ns, tokens):
        return self.cap.take_up_to(user, now_ns, tokens)

    def refund(self, user, now_ns, tokens):
        self.refunded += tokens
        self.cap.refund(user, now_ns, tokens)


def borrowing_step(prompt, ledger, lender, now, chunks, scheduled=None):
    """``step`` where a chunk whose user's quota is empty borrows, as the step
    policy lends (``StepDecision._prompt_lender_for``): when the lender can pay
    its whole cost and a sampled token.  Returns (keys dispatched, keys borrowed)."""
    if prompt.debt:
        prompt.repay(now)
    ledger.open(now, False)
    sent, borrowed = {}, set()
    for key, start, count, num_prompt in chunks:
        user = ledger._user_of[key]
        if not prompt.uncharged(key, start, count, num_prompt):
            continue
        use = None
        if ledger.quota_now(user) == 0 and prompt.cost_of(key, user, start, count, num_prompt) + 1 <= lender.room(user, now):
            use = lender
        if not prompt.can_pay(key, user, use):
            continue
        debt = prompt.debt.get(user, 0)
        prompt.charge(key, user, start, count, num_prompt, use)
        sent[key] = count
        if use is not None:
            borrowed.add(key)
            assert prompt.debt.get(user, 0) == debt  # a borrowed chunk never owes
    if scheduled is not None:
        sent = {k: v for k, v in sent.items() if k in scheduled}
    prompt.settle(lambda key: sent.get(key, 0), now)
    ledger.settle(set())
    return sent, borrowed


def test_a_borrowed_chunk_is_paid_by_the_lender_whole_and_refunded_to_it():
    limiter, lanes, ledger, prompt = parts(rate=10, weight=1)
    lender = CapLender(1000)
    track(lanes, "a")
    track(lanes, "b")
    now = 10 * S
    # The quota's burst pays the first chunk (2 tokens of 2), the second borrows its 40.
    sent, borrowed = borrowing_step(prompt, ledger, lender, now, [("a", 0, 2, 100), ("b", 0, 40, 100)])
    assert sent == {"a": 2, "b": 40} and borrowed == {"b"}
    assert limiter.net == 2 and lender.cap.net == 40 and not prompt.debt
    assert prompt.borrowed_tokens == {"u": 40} and prompt.prompt_tokens == {"u": 42}
    # Borrowed but not scheduled: all 30 go back to the lender, none to the quota.
    sent, borrowed = borrowing_step(prompt, ledger, lender, now + MS, [("b", 40, 30, 100)], scheduled=set())
    assert borrowed == {"b"} and sent == {}
    assert lender.cap.net == 40 and lender.refunded == 30 and limiter.net == 2
    assert prompt.borrowed_tokens == {"u": 40} and prompt.charged_upto["b"] == 40
    # Too dear for the lender's room now (its burst is spent): nothing is lent, the chunk waits.
    poor = CapLender(10)
    poor.take("u", now, poor.room("u", now))
    sent, borrowed = borrowing_step(prompt, ledger, poor, now + 2 * MS, [("b", 40, 30, 100)])
    assert sent == {} and not borrowed and "u" in ledger.refused


def test_a_debt_holds_a_borrowers_prompts_though_a_lender_would_pay():
    limiter, lanes, ledger, prompt = parts(rate=10, weight=1)
    track(lanes, "a")
    step(prompt, ledger, 10 * S, [("a", 0, 100, 400)])  # into debt: the burst paid 2 of 100
    assert prompt.debt["u"] == 98
    lender = CapLender(10**6)
    ledger.open(10 * S + MS, False)
    assert not prompt.can_pay("a", "u", lender)
    assert "u" in ledger.refused and not lender.cap.net


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    weight=st.sampled_from([Fraction(1, 2), Fraction(1, 3), 1, Fraction(1, 16)]),
    rate=st.sampled_from([1, 5, 20]),
    ceil=st.sampled_from([100, 400, 1000]),
    steps=st.lists(
        st.tuples(
            st.integers(1, 60),  # ms since the last step
            st.lists(st.tuples(st.integers(0, 2), st.integers(1, 64), st.booleans()), max_size=3),
        ),
        min_size=1, max_size=60,
    ),
)
def test_borrowed_and_quota_paid_chunks_stay_exact_and_borrowing_never_owes(weight, rate, ceil, steps):
    """Whole tokens taken from the quota and the lender, plus debt, are the
    exact cost of what ran plus a credit below one token; the lender is never
    refunded more than it lent, a borrowed chunk never adds debt, and what
    the lender kept obeys its own GCRA bound."""
    limiter, lanes, ledger, prompt = parts(rate=rate, weight=weight)
    lender = CapLender(ceil)
    keys = ["k0", "k1", "k2"]
    for key in keys:
        track(lanes, key)
    progress = dict.fromkeys(keys, 0)
    now = 5 * S
    lent_at: list[tuple[int, int]] = []  # (time, lender's net after the step)
    for dt, chunks in steps:
        now += dt * MS
        wanted, seen = [], set()
        for index, count, scheduled in chunks:
            key = keys[index]
            if key not in seen:
                seen.add(key)
                wanted.append((key, progress[key], count, 10**9, scheduled))
        keep = {key for key, *_, scheduled in wanted if scheduled}
        sent, _ = borrowing_step(prompt, ledger, lender, now, [w[:4] for w in wanted], scheduled=keep)
        for key, count in sent.items():
            progress[key] += count
        credit = prompt.credit.get("u", Fraction(0))
        total = sum(prompt.prompt_tokens.values())
        assert 0 <= credit < 1
        assert limiter.net + lender.cap.net + prompt.debt.get("u", 0) == weight * total + credit
        assert lender.cap.net >= 0
        assert prompt.borrowed_tokens.get("u", 0) <= lender.cap.net
        lent_at.append((now, lender.cap.net))
    for i, (t0, _) in enumerate(lent_at):
        before = lent_at[i - 1][1] if i else 0
        for t1, net in lent_at[i:]:
            assert net - before <= (Fraction(t1 - t0, S) + Fraction(1, 10)) * ceil + 1


def test_forget_user_drops_credit_but_never_debt():
    limiter, lanes, ledger, prompt = parts(rate=10, weight=Fraction(1, 3))
    track(lanes, "a")
    step(prompt, ledger, S, [("a", 0, 100, 400)])
    assert prompt.debt["u"] and prompt.credit["u"]
    prompt.forget("a")
    prompt.forget_user("u")
    assert "u" not in prompt.credit and prompt.debt["u"]
    assert "a" not in prompt.charged_upto


# ---------------------------------------------------------------------------
# members of a group take turns (issue 31, defect 1)
# ---------------------------------------------------------------------------


def group_parts(members: str, group_rate=20, weight=1):
    """PromptCost over the factory's quotas: every member at 1,000 tok/s of
    its own, all of them in group g at ``group_rate`` (the binding quota)."""
    from vllm_output_rate.factory import make_borrowing, make_group_quotas, make_limiter
    from vllm_output_rate.settings import OutputRateSettings

    settings = OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": 1000,
        "user_output_tokens_per_second": {m: {"rate": 1000, "group": "g"} for m in members},
        "groups": {"g": group_rate},
        "input_token_weight": weight,
    }})
    groups = make_group_quotas(settings)
    _, limiter = make_borrowing(settings, make_limiter(settings), None, groups)
    lanes = Lanes()
    ledger = Ledger(limiter, lanes)
    prompt = PromptCost(ledger, weight)
    prompt.group_of = groups.of
    for member in members:
        track(lanes, member, member)  # one prompt per member, its key its name
    return ledger, prompt


def chunks_granted(members: str, seconds: int, asking=None, dt=100 * MS, never_scheduled=""):
    """Every member has an endless prompt of 512-token chunks and asks for its
    next chunk in every step, in vLLM's order (``members``' order, fixed);
    ``asking(member, now)`` may say a member stopped asking, and vLLM never
    schedules the chunks of ``never_scheduled`` (no KV for them, say).
    Returns the members in the order their chunks went."""
    ledger, prompt = group_parts(members)
    position = dict.fromkeys(members, 0)
    granted = []
    now = 10 * S
    for _ in range(seconds * S // dt):
        chunks = [(m, position[m], 512, 10**9) for m in members if asking is None or asking(m, now)]
        sent = step(prompt, ledger, now, chunks, scheduled=set(members) - set(never_scheduled))
        for member in sent:
            position[member] += 512
            granted.append(member)
        assert not prompt.debt or len(prompt.debt) == 1  # the group owes one chunk at most
        now += dt
    return granted


@pytest.mark.parametrize("members", ["abc", "abcd"])
def test_every_member_of_a_group_in_prompt_debt_gets_its_turn(members):
    """Group at 20 tok/s, weight 1, 512-token chunks (25.6 s of the group's
    quota each), members asking in the same order every step: over 800 s the
    chunks go round-robin, so every member waits at most one chunk of each
    other member between two of its own."""
    granted = chunks_granted(members, 800)
    counts = {m: granted.count(m) for m in members}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert sum(counts.values()) >= 800 * 20 // 512 - 1, counts  # the group's rate, spent
    n = len(members)
    for i in range(len(granted) - n + 1):
        assert len(set(granted[i:i + n])) == n, granted  # any n in a row: each member once


def test_a_member_that_stops_asking_gives_up_its_turn():
    """b, first in line behind a's debt (paid off at about 35.6 s), stops
    asking from 20 s to 40 s: c goes when the group can pay, b's turn having
    lapsed; b, asking again at 40 s, queues behind a, which queued when its
    own debt was paid, and ahead of c, which owes until about 61 s."""
    b_away = (20 * S, 40 * S)
    granted = chunks_granted("abc", 120, asking=lambda m, now: m != "b" or not b_away[0] <= now < b_away[1])
    assert granted == ["a", "c", "a", "b", "c"]


def test_a_member_whose_chunk_vllm_cannot_schedule_does_not_hold_the_others_back():
    """a's turn comes but vLLM never schedules its chunk (refunded each
    time): its turn is spent all the same, so b and c keep taking turns
    instead of waiting behind a for good."""
    granted = chunks_granted("abc", 300, never_scheduled="a")
    assert "a" not in granted
    assert abs(granted.count("b") - granted.count("c")) <= 1 and len(granted) >= 10, granted


# ---------------------------------------------------------------------------
# admissions without chunked prefill: the plan asks holds_prompt
# ---------------------------------------------------------------------------


def test_holds_prompt_says_what_can_pay_would_and_changes_nothing():
    ledger, prompt = group_parts("abc")
    now = 10 * S
    ledger.open(now, False)
    assert not any(prompt.holds_prompt(m) for m in "abc")  # nobody owes, nobody waits
    assert prompt.can_pay("a", "a")
    prompt.charge("a", "a", 0, 512, 10**9)  # a's chunk: the group owes the rest
    assert prompt.debt
    assert all(prompt.holds_prompt(m) for m in "abc")  # the group's debt holds everyone
    ledger.open(now + 1, False)
    assert not prompt.can_pay("c", "c")  # c queues first, then b
    assert not prompt.can_pay("b", "b")
    prompt.debt.clear()  # paid off
    line = {m: place for m, place in prompt._waiting["g"].items()}
    assert not prompt.holds_prompt("c") and prompt.holds_prompt("b") and prompt.holds_prompt("a")
    assert prompt._waiting["g"] == line  # asking queued nobody and moved nobody


def test_a_waiting_request_whose_token_is_kept_pays_its_prompt_after_its_user_was_refused():
    """Without chunked prefill the plan keeps the user's one token for the
    waiting request whose turn it is; vLLM may ask for another request of
    the same user first, which is refused: the one with the kept token must
    still go (it used to be refused with its user)."""
    limiter, lanes, ledger, prompt = parts(rate=5, weight=1)
    for key in ("first", "kept"):
        lanes.track(key, "u")
        lanes.wait_in_turn(key)
    now = 10 * S
    ledger.open(now, False)
    assert limiter.take_up_to("u", now, 1) == 1
    ledger.prepay("u", ["kept"])
    assert not prompt.can_pay("first", "u")  # nothing left for it
    assert prompt.can_pay("kept", "u")


def test_a_group_members_decoding_streams_wake_when_its_own_quota_pays():
    """A debt holds its group's prompts, not a member's decoding streams: a
    member with streams is ready when its own quota pays, a member with only
    prompts when the debtor can repay."""
    _, _, _, prompt = parts()
    prompt.group_of = lambda user: "g"
    prompt.debt["d"] = 3
    ready = {"d": 900 * MS, "m": 200 * MS}.__getitem__
    assert prompt.ready_at_ns("m", 0, ready) == 900 * MS
    assert prompt.ready_at_ns("m", 0, ready, decoding=True) == 200 * MS
    later = {"d": 100 * MS, "m": 200 * MS}.__getitem__
    assert prompt.ready_at_ns("m", 0, later, decoding=True) == 100 * MS  # the debtor's repayment step
