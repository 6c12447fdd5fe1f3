"""DraftAccount: drafts paid at dispatch, refunded when rejected, on a fake clock."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.factory import make_borrowing, make_group_quotas, make_limiter
from vllm_output_rate.policy.drafts import DraftAccount
from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.settings import OutputRateSettings

MS = 1_000_000
RATE = 50.0
K = 4


def max_in_window(times: list[int], window_ns: int) -> int:
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window_ns:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_emitted_tokens_stay_within_the_bound_and_charges_settle(data):
    """Random steps of R requests of one user, each paying its sampled token
    and up to K drafts, dispatched or not, outputs arriving one or two steps
    later with a random number of drafts accepted: the tokens emitted by the
    steps dispatched in any window stay within (W + 0.1) N + 1 + K R D (D
    steps in flight per request), and once every output is in, the drafts
    still charged are exactly the accepted ones.  The charged total never
    goes down on the way (metrics would take a decrease for a restart)."""
    limiter = OutputRateLimiter(RATE)
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    charged = ledger.charged_tokens
    requests = data.draw(st.integers(1, 4))
    depth = data.draw(st.integers(1, 2))  # steps in flight: sync 1, async 2
    now = 10**12
    in_flight: deque = deque()
    emitted: list[int] = []
    accepted_total = 0
    published = 0  # the total as metrics read it, after every call
    for _ in range(data.draw(st.integers(5, 120))):
        now += data.draw(st.integers(1, 30)) * MS
        step = object()
        dispatched: dict[int, int] = {}
        for key in range(requests):
            if not limiter.try_take("u", now):
                continue
            paid = account.pay(key, "u", now, data.draw(st.integers(0, K)))
            if data.draw(st.integers(0, 9)) == 0:  # not scheduled after all
                limiter.refund("u", now, 1)
                continue
            dispatched[key] = paid
        account.settle_step(step, now, lambda key: dispatched.get(key, -1))
        assert charged.get("u", 0) >= published  # metrics may read it here
        published = charged.get("u", 0)
        accepted = {key: data.draw(st.integers(0, drafts)) for key, drafts in dispatched.items()}
        for key, count in accepted.items():
            emitted.extend([now] * (1 + count))
            accepted_total += count
        in_flight.append((step, accepted))
        while len(in_flight) >= depth:
            done, acc = in_flight.popleft()
            account.settle_output(done, now, lambda key: acc.get(key, 0))
            assert charged.get("u", 0) >= published  # never down: not a restart
            published = charged.get("u", 0)
    while in_flight:
        done, acc = in_flight.popleft()
        account.settle_output(done, now, lambda key: acc.get(key, 0))
    assert account.in_flight() == 0
    assert charged.get("u", 0) == accepted_total
    for window_ms in (1, 10, 50, 100, 300, 1000):
        bound = (window_ms / 1000 + 0.1) * RATE + 1 + K * requests * depth
        assert max_in_window(emitted, window_ms * MS) <= bound, window_ms


def test_pay_takes_only_what_the_quota_allows_now():
    limiter = OutputRateLimiter(10.0)  # burst 0.1 s: two tokens at once
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    assert account.pay("r", "u", 0, 5) == 2
    assert account.pay("r2", "u", 0, 5) == 0
    assert limiter.available("u", 0) == 0


def test_undispatched_drafts_are_refunded_at_the_end_of_the_step():
    limiter = OutputRateLimiter(10.0)
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    charged = ledger.charged_tokens
    account.pay("r", "u", 0, 2)
    assert account.settle_step("s1", 0, lambda key: 0) == 2
    assert limiter.available("u", 0) == 2 and charged == {}
    assert account.in_flight() == 0


def test_an_output_settles_only_its_own_step_and_older_ones_stay_charged():
    limiter = OutputRateLimiter(100.0)
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    charged = ledger.charged_tokens
    for step in ("s1", "s2", "s3"):
        account.pay("r", "u", 0, 2)
        account.settle_step(step, 0, lambda key: 2)
    # Paid, and counted only once their fate is known.
    assert charged == {} and account.in_flight() == 6
    assert limiter.available("u", 0) == 11 - 6
    # s2's output: one of its two drafts rejected.  s1's output never came:
    # its drafts stay paid and count now.
    assert account.settle_output("s2", 0, lambda key: 1) == 1
    assert charged == {"u": 2 + 1} and account.unsettled_total == 2
    assert account.in_flight() == 2  # s3 still due
    assert account.settle_output("s1", 0, lambda key: 0) == 0  # gone: keeps its charge
    assert account.settle_output("s3", 0, lambda key: 5) == 0  # all accepted
    assert account.in_flight() == 0
    assert charged == {"u": 5} and limiter.available("u", 0) == 11 - 5


def test_drafts_rejected_after_a_reload_moved_their_user_go_back_to_the_group_that_paid():
    """Under async scheduling a step's output arrives after the next step
    started, and a reload may have moved the user to another group in
    between.  The rejected drafts go back to the quotas charged for them (the
    user's and its old group's), and the new group gets no credit for tokens
    it never paid."""
    def settings_with(group_of_x: str) -> OutputRateSettings:
        return OutputRateSettings.from_additional_config({"output_rate": {
            "default_user_output_tokens_per_second": 100,
            "user_output_tokens_per_second": {"x": {"rate": 100, "group": group_of_x},
                                              "v": {"rate": 100, "group": "B"}},
            "groups": {"A": 100, "B": 100},
        }})

    now = 10**12
    before = settings_with("A")
    rate = make_limiter(before)
    groups = make_group_quotas(before)
    borrowing, limiter = make_borrowing(before, rate, None, groups)
    assert borrowing is None  # hard caps: drafts are paid on user and group
    full = groups.rate.available("A", now)
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    assert account.pay("rx", "x", now, 3) == 3
    account.settle_step("s1", now, lambda key: 3)
    assert groups.rate.available("A", now) == full - 3
    # v spends group B's whole quota; then x moves from A to B.
    assert limiter.take_up_to("v", now, full) == full
    after = settings_with("B")
    groups = make_group_quotas(after, groups)
    _, ledger.limiter = make_borrowing(after, rate, None, groups)
    assert groups.of("x") == "B"
    # s1's output: all three drafts rejected.
    assert account.settle_output("s1", now, lambda key: 0) == 3
    assert groups.rate.available("A", now) == full  # the group that paid
    assert groups.rate.available("B", now) == 0  # no credit for what it never paid
    assert rate.available("x", now) == full



def test_drafts_rejected_after_a_reload_gave_their_user_a_ceiling_credit_no_ceiling():
    """The ceiling variant of the test above (the charge-path machine's
    "refund of 2 to users' ceiling"): drafts paid while the user had no
    ceiling go back to its rate only, not to the ceiling a reload gave it
    while they were in flight."""
    def settings_with(x_limit: object) -> OutputRateSettings:
        return OutputRateSettings.from_additional_config({"output_rate": {
            "default_user_output_tokens_per_second": 100,
            "user_output_tokens_per_second": {"x": x_limit,
                                              "v": {"rate": 100, "ceil": 400}},
        }})

    now = 10**12
    before = settings_with(100)
    rate = make_limiter(before)
    borrowing, limiter = make_borrowing(before, rate, None, None)
    ceiling = borrowing.ceiling
    ledger = Ledger(limiter, Lanes())
    account = DraftAccount(ledger)
    assert account.pay("rx", "x", now, 3) == 3
    account.settle_step("s1", now, lambda key: 3)
    assert rate.available("x", now) == rate.available("v", now) - 3
    after = settings_with({"rate": 100, "ceil": 400})
    borrowing, ledger.limiter = make_borrowing(after, rate, borrowing, None)
    assert borrowing.ceiling is ceiling and borrowing.table.ceiled("x")
    full = ceiling.available("x", now)
    assert ceiling.take_up_to("x", now, full) == full  # x spends its new ceiling
    # s1's output: all three drafts rejected.
    assert account.settle_output("s1", now, lambda key: 0) == 3
    assert rate.available("x", now) == rate.available("v", now)  # the quota that paid
    assert ceiling.available("x", now) == 0  # no credit for what it never paid
