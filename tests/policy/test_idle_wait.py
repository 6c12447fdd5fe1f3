"""How long an engine that ran nothing sleeps (issue 31, defect 2).

The idle wait must be the earliest time somebody can actually run: never 0
while nobody can (the engine would step empty back to back), and never later
than the first time somebody can (a user would wait longer than its quota
says).  Blocked borrowers are the case that went wrong: a borrower without a
ceiling was "ready now" even when borrowing could not help it.

The quotas are built by the factory from settings, as the scheduler builds
them; a step follows the adapter's protocol on a fake clock: repay prompt
debts -> ``plan`` -> ``borrow`` -> charges and prompt chunks ->
``ledger.settle`` -> ``borrowing.settle`` -> ``PromptCost.settle`` ->
``idle_wait_ns`` when the step ran nothing.
"""

from __future__ import annotations

import pytest

from gate_harness import MS, S
from vllm_output_rate.factory import make_borrowing, make_group_quotas, make_limiter
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.settings import OutputRateSettings

#: Long enough that no wait below is capped: the waits are compared whole.
NO_CAP_NS = 1000 * S


class Engine:
    """The gate, borrowing and prompt cost the scheduler would build for
    ``limits``, and an engine loop around them.

    Requests are of two kinds: ``streams`` (resident decoding requests) and
    ``prompts`` (requests whose next step computes prompt positions; each
    asks for its chunk in every step, in the order added, as vLLM would)."""

    def __init__(self, limits: dict, slots: int = 8) -> None:
        settings = OutputRateSettings.from_additional_config({"output_rate": limits})
        self.rate = make_limiter(settings)
        groups = make_group_quotas(settings)
        borrowing, limiter = make_borrowing(settings, self.rate, None, groups)
        self.gate = StepGate(limiter, max_idle_wait_ns=NO_CAP_NS)
        self.gate.borrowing = borrowing
        self.prompt = PromptCost(self.gate.ledger, settings.input_token_weight)
        self.prompt.group_of = None if groups is None else groups.of
        # What the scheduler's prompt-cost hooks hand the gate.
        self.gate.prompt_cost = self.prompt
        self.slots = slots
        self.now = 10 * S
        #: key -> [user, next prompt position, prompt length]
        self.prompts: dict[str, list] = {}
        self.chunks_sent: list[tuple[int, str]] = []  # (time, key) of every chunk that went
        self.waits: list[int] = []  # the idle wait of every step that ran nothing

    def stream(self, user: str, key: str) -> None:
        self.gate.lanes.track(key, user)
        self.gate.lanes.admit(key, progressing=False)

    def prompt_of(self, user: str, key: str, length: int) -> None:
        self.gate.lanes.track(key, user)
        self.prompts[key] = [user, 0, length]

    def step(self) -> int | None:
        """One step at ``now``; returns the idle wait if it ran nothing (else None)."""
        gate, prompt, now = self.gate, self.prompt, self.now
        if prompt.debt:
            prompt.repay(now)
        plan = gate.plan(now, self.slots)
        if gate.borrowing is not None and not plan.over_cap:
            gate.borrow(plan, self.slots - len(plan.visible) - plan.reserved)
        ran = set(plan.visible) | set(plan.borrowed)
        sent = {}
        for key, (user, start, length) in list(self.prompts.items()):
            count = length - start
            if prompt.uncharged(key, start, count, length) and not prompt.can_pay(key, user):
                continue
            prompt.charge(key, user, start, count, length)
            sent[key] = count
        gate.settle(ran)
        prompt.settle(lambda key: sent.get(key, 0), now)
        for key in sent:
            self.chunks_sent.append((now, key))
            del self.prompts[key]  # one chunk is the whole prompt here
        if ran or sent:
            return None
        wait = gate.idle_wait_ns()
        self.waits.append(wait)
        return wait

    def run_until_sent(self, key: str, max_steps: int = 2000) -> int:
        """Step, sleeping each idle wait (10 ms after a step that ran
        something), until ``key``'s chunk goes; the time it went."""
        for _ in range(max_steps):
            wait = self.step()
            if any(k == key for _, k in self.chunks_sent):
                return self.now
            assert wait != 0, f"idle wait 0 at {self.now} while nobody can run"
            self.now += 10 * MS if wait is None else wait
        raise AssertionError(f"{key} never went in {max_steps} steps")

    def poll_until_sent(self, key: str, tick: int = MS) -> int:
        """The same, stepping every ``tick`` whatever the idle wait says: the
        first time (to a tick) the chunk can go."""
        while not any(k == key for _, k in self.chunks_sent):
            self.step()
            if any(k == key for _, k in self.chunks_sent):
                return self.now
            self.now += tick
        raise AssertionError("unreachable")


def debt_then_second_prompt(limits: dict, user: str = "b") -> Engine:
    """``user``'s first 40-token prompt goes into prompt debt; its second waits on it."""
    engine = Engine(limits)
    engine.prompt_of(user, "first", 40)
    engine.prompt_of(user, "second", 40)
    assert engine.step() is None
    assert engine.chunks_sent == [(10 * S, "first")] and engine.prompt.debt.get(user)
    engine.now += 10 * MS
    return engine


def limits(users: dict, weight=1, groups=None) -> dict:
    config = {
        "default_user_output_tokens_per_second": 1000,
        "user_output_tokens_per_second": users,
        "input_token_weight": weight,
    }
    if groups is not None:
        config["groups"] = groups
    return config


BORROWER_WITHOUT_CEILING = {"b": {"rate": 10, "ceil": None}}
BORROWER_WITH_CEILING = {"b": {"rate": 10, "ceil": 50}}


@pytest.mark.parametrize(
    "borrower", [BORROWER_WITHOUT_CEILING, BORROWER_WITH_CEILING], ids=["no-ceiling", "ceiling-50"]
)
def test_a_borrower_waiting_on_its_prompt_debt_sleeps_until_it_is_paid(borrower):
    """Rate 10, weight 1: its second prompt waits on the first's debt, which
    borrowing cannot pay.  The engine used to be told 0 at every empty step
    (without a ceiling: borrowing answered "now"; with a ceiling of 50, which
    refills five times faster than the rate, its room answered "now" too,
    though the debt is paid on both).  Now every wait is positive, there is
    at most one empty step per token of its rate, and the prompt goes exactly
    when a 1 ms poll would have sent it (the wait never overshoots)."""
    engine = debt_then_second_prompt(limits(borrower))
    owed = engine.prompt.debt["b"]
    went = engine.run_until_sent("second")
    polled = debt_then_second_prompt(limits(borrower)).poll_until_sent("second")
    assert went <= polled
    assert all(wait > 0 for wait in engine.waits)
    assert len(engine.waits) <= owed + 1


def test_the_idle_wait_of_a_borrower_in_debt_is_what_its_rate_says_not_0():
    """The issue's figure: rate 1, no ceiling, out of quota and in prompt debt:
    the rate limiter says the next token is 0.9 s away (a debt makes it later
    still); the wait was 0."""
    engine = debt_then_second_prompt(limits({"b": {"rate": 1, "ceil": None}}))
    wait = engine.step()
    rate_says = engine.rate.ready_at_ns("b", engine.now) - engine.now
    assert rate_says > 800 * MS
    assert wait is not None and wait >= rate_says


def test_a_borrower_whose_new_request_cannot_pay_its_prompt_cost_sleeps_until_its_quota_can():
    """No debt, but its quota is spent (on output, say): its new prompt cannot
    pay one token, borrowing does not pay prompts, so the wait is its rate's."""
    engine = Engine(limits(BORROWER_WITHOUT_CEILING))
    while engine.rate.available("b", engine.now):
        assert engine.rate.try_take("b", engine.now)
    engine.prompt_of("b", "new", 40)
    wait = engine.step()
    first_token = engine.rate.ready_at_ns("b", engine.now)
    assert wait == first_token - engine.now > 0
    engine.now += wait
    assert engine.run_until_sent("new") == first_token  # it went then, not later


def test_a_borrowers_in_turn_waiting_request_sleeps_until_its_quota_can():
    """Without chunked prefill a waiting request must sample to be admitted:
    it waits in its user's rotation for a guaranteed token (it never borrows),
    so a borrower whose quota is spent sleeps until the quota pays again."""
    engine = Engine(limits(BORROWER_WITHOUT_CEILING, weight=0))
    while engine.rate.available("b", engine.now):
        assert engine.rate.try_take("b", engine.now)
    engine.gate.lanes.track("w", "b")
    engine.gate.lanes.wait_in_turn("w")
    wait = engine.step()
    assert wait == engine.rate.ready_at_ns("b", engine.now) - engine.now > 0


def test_a_ceiled_borrower_with_hidden_streams_still_wakes_when_its_ceiling_pays():
    """What borrowing can do it still may: a borrower whose rate and ceiling
    are both spent, with streams to borrow for, wakes when the ceiling pays
    (before its rate does)."""
    engine = Engine(limits({"b": {"rate": 1, "ceil": 5}}, weight=0))
    for i in range(3):
        engine.stream("b", f"s{i}")
    wait = None
    while wait is None:
        wait = engine.step()
        engine.now += 10 * MS if wait is None else 0
    ceiling = engine.gate.borrowing.ceiling
    assert wait == ceiling.ready_at_ns("b", engine.now) - engine.now > 0
    assert wait < engine.rate.ready_at_ns("b", engine.now) - engine.now


def test_a_member_held_by_its_groups_prompt_debt_sleeps_until_the_debtor_has_paid():
    """a (1 tok/s of its own) owes a chunk, paid at its own rate; b, in the
    same group with quota to spare, is held by the group's debt.  b's quota
    and the group's have room, yet nobody can run until a has paid."""
    engine = Engine(limits({"a": {"rate": 1, "group": "g"}, "b": {"rate": 100, "group": "g"}},
                           groups={"g": 100}))
    engine.prompt_of("a", "a-first", 40)
    engine.prompt_of("b", "b-first", 40)
    assert engine.step() is None
    assert [key for _, key in engine.chunks_sent] == ["a-first"] and engine.prompt.debt["a"]
    engine.now += 10 * MS
    owed = engine.prompt.debt["a"]
    went = engine.run_until_sent("b-first")
    assert all(wait > 0 for wait in engine.waits)
    assert len(engine.waits) <= owed + 1
    assert went >= 10 * S + (owed - 1) * S  # a's debt, at 1 tok/s


def test_a_member_waiting_for_its_turn_sleeps_until_the_member_first_in_line_can_go():
    """a (0.1 tok/s of its own, spent) is first in line when b's debt is paid;
    b's next prompt waits for a's turn, and a's own quota is what both wait
    for: the engine sleeps until a can pay, then a's prompt goes, and b's
    after a's debt; no empty step is told 0."""
    engine = Engine(limits({"a": {"rate": 0.1, "group": "g"}, "b": {"rate": 1000, "group": "g"}},
                           groups={"g": 20}))
    engine.prompt_of("b", "b-first", 40)
    engine.prompt_of("a", "a-first", 40)
    assert engine.rate.try_take("a", engine.now)  # a's own quota: spent for 10 s
    engine.step()
    assert [key for _, key in engine.chunks_sent] == ["b-first"] and engine.prompt.debt["b"]
    engine.prompt_of("b", "b-second", 40)
    a_can_pay = engine.rate.ready_at_ns("a", engine.now)
    went = engine.run_until_sent("a-first")
    assert went == a_can_pay
    assert all(wait > 0 for wait in engine.waits)
    assert engine.run_until_sent("b-second") > went
    assert all(wait > 0 for wait in engine.waits)


def test_a_user_with_nothing_resident_waits_for_room_while_admissions_wait_for_it():
    # Found by the charge-path machine (``idle``, seed 2: async, a tight KV
    # cache, groups): the only resident stream's user was out of quota, an
    # admission had found no KV (admissions wait for a request to leave), and
    # another user, refused in the step for its group's token that a member's
    # reserved admission held and gave back at settle, had quota at its end
    # but only preempted and waiting requests.  Its quota could buy nothing
    # before room comes, and room comes only when the resident stream runs:
    # the engine was told to wait 0 and stepped empty until that stream's
    # user could pay.
    from vllm_output_rate.policy.limiter import OutputRateLimiter

    gate = StepGate(OutputRateLimiter(100, {"a": 1}), max_idle_wait_ns=NO_CAP_NS)
    lanes = gate.lanes
    lanes.track("a-0", "a")
    lanes.admit("a-0", progressing=False)
    now = 10 * S
    plan = gate.plan(now, 4)
    gate.settle(set(plan.visible))  # a's one token
    lanes.track("b-0", "b")  # b's request waits (preempted, say): nothing resident
    lanes.room_wanted = True  # an admission found no KV; no request has left since
    now += 10 * MS
    plan = gate.plan(now, 4)
    assert not plan.visible  # a is out of quota
    gate.ledger.refuse("b")
    gate.settle(set())
    wait = gate.idle_wait_ns()
    assert wait == gate.ready_at_ns("a", now) - now > 0


def test_a_waiting_request_the_free_kv_cannot_take_leaves_its_groups_token_to_a_resident_stream():
    # Found by the charge-path machine (``idle``, the sample redrawn by the
    # isolation check's fix, 22nd example: sync, no chunked prefill, a tight
    # KV cache, all four users in one group at 10 tok/s): the group's one
    # token went to a member's in-turn waiting request (preempted for KV) that
    # vLLM could not admit, the members' resident streams were left short,
    # the token came back at settle, and the step ran nothing with every user
    # ready again at once: the engine was told to wait 0 and stepped empty at
    # the same instant.  A waiting request the free KV cannot take is passed
    # over in its rotation (``kv_room``), as one the active cap keeps out.
    engine = Engine(limits({"a": {"rate": 1000, "group": "g0"}, "b": {"rate": 1000, "group": "g0"}},
                           weight=0, groups={"g0": 10}))
    gate, limiter, now = engine.gate, engine.gate.ledger.limiter, engine.now
    lanes = gate.lanes
    lanes.track("b-waiting", "b")  # b first in the service order
    lanes.wait_in_turn("b-waiting")
    lanes.track("a-0", "a")
    lanes.admit("a-0", progressing=False)
    while limiter.available("a", now) > 1:  # the group holds one token
        assert limiter.try_take("a", now)
    assert limiter.available("b", now) == 1

    plan = gate.plan(now, 4, kv_room=lambda key: key != "b-waiting")

    assert plan.visible == ["a-0"] and plan.reserved == 0
    gate.settle(set(plan.visible))
    assert limiter.available("b", now) == 0  # a's stream kept the group's token
