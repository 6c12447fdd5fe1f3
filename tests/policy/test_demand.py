"""The waiting demand the borrowing offer keeps room for (``policy/demand.py``), no vLLM."""

from __future__ import annotations

import pytest

from vllm_output_rate.policy.demand import waiting_demand
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.limiter import OutputRateLimiter

NOW = 10**12


def _gate_with_waiting(waiting: list[tuple[str, str]]) -> StepGate:
    """b {0.01 tok/s, burst spent, may borrow} has two resident streams that
    could borrow; p {100 tok/s} has quota now; ``waiting``: (request, user)
    in queue order; the step planned."""
    gate = StepGate(OutputRateLimiter(0.01, {"p": 100.0}))
    lanes = gate.lanes
    for key in ("b0", "b1"):
        lanes.track(key, "b")
        lanes.admit(key, progressing=False)
    for key, user in waiting:
        lanes.track(key, user)
    while gate.ledger.limiter.try_take("b", NOW):
        pass
    gate.plan(NOW, 8)
    return gate


def _paying_and_borrowing(paying_waiting: int):
    """p has ``paying_waiting`` waiting requests beside b's two streams."""
    waiting = [f"p{i}" for i in range(paying_waiting)]
    return _gate_with_waiting([(key, "p") for key in waiting]), waiting


@pytest.mark.parametrize("free_slots", [0, 1, 2, 5])
def test_room_is_kept_only_for_paying_requests_a_model_runner_slot_is_free_for(free_slots):
    """Without a free slot vLLM admits none of them: room kept for them
    would stay empty while borrowers' streams wait (issue 43)."""
    gate, waiting = _paying_and_borrowing(4)
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=free_slots, output_left=lambda key: 100, queued={},
    )
    assert demand == (min(free_slots, 4), 0)


def test_the_scan_still_stops_after_as_many_paying_requests_as_the_room():
    """Past the room's worth of paying requests nothing later counts (the
    queue's scan stays bounded by the room, slots free or not)."""
    gate, waiting = _paying_and_borrowing(10)
    seen: list[str] = []

    def output_left(key):
        return 100

    def counted(keys):
        for key in keys:
            seen.append(key)
            yield key

    waiting_demand(
        counted(waiting), gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=3, free_slots=0, output_left=output_left, queued={},
    )
    assert seen == waiting[:3]


def _borrower_with_waiting_prompts(waiting_count: int):
    """b {0.01 tok/s, burst spent, may borrow}: two resident streams and
    ``waiting_count`` waiting requests; p {100 tok/s} one waiting request."""
    gate, paying = _paying_and_borrowing(1)
    waiting = [f"bw{i}" for i in range(waiting_count)]
    for key in waiting:
        gate.lanes.track(key, "b")
    return gate, paying + waiting


@pytest.mark.parametrize("blocked", [False, True])
def test_a_borrowers_waiting_requests_prompt_cost_refuses_take_no_room(blocked):
    """A user out of quota cannot pay a prompt, borrowing or not: room kept
    for its waiting requests would stay empty beside its borrowed streams
    (issue 44).  Those prompt cost lets through still count."""
    gate, waiting = _borrower_with_waiting_prompts(3)
    asked: list[str] = []

    def prompt_blocked(key, has_quota):
        asked.append(key)
        assert has_quota == key.startswith("p")
        return blocked and key.startswith("bw")

    queued: dict = {}
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued=queued,
        prompt_blocked=prompt_blocked,
    )
    if blocked:
        # The first refusal settles the user: its backlog costs one question.
        assert demand == (1, 0) and not queued.get("b") and asked == ["p0", "bw0"]
    else:
        assert demand == (1, 3) and queued["b"] == [100, 100, 100]


def test_a_paying_users_requests_prompt_cost_holds_take_no_room():
    """A user with quota but in prompt debt (or held by its group's) pays
    no prompt: none of its fresh requests is admitted, so none is kept
    room for; the borrower's requests then count."""
    gate, waiting = _borrower_with_waiting_prompts(3)
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued={},
        prompt_blocked=lambda key, has_quota: key.startswith("p"),
    )
    assert demand == (0, 3)


def test_without_prompt_cost_a_borrowers_waiting_requests_count_as_before():
    gate, waiting = _borrower_with_waiting_prompts(3)
    assert waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued={},
    ) == (1, 3)


def _lone_borrower_filling_the_room(waiting_count: int, paying: tuple[str, ...] = ()):
    """b's two streams fill a room of 2 and ``waiting_count`` of its requests
    wait; then p's waiting requests ``paying``."""
    waiting = [f"bw{i}" for i in range(waiting_count)]
    gate = _gate_with_waiting([(key, "b") for key in waiting] + [(key, "p") for key in paying])
    return gate, waiting


def _scan(gate, waiting, seen):
    def counted(keys):
        for key in keys:
            seen.append(key)
            yield key

    return waiting_demand(
        counted(waiting), gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=2, free_slots=4, output_left=lambda key: 100, queued={},
    )


def test_the_scan_stops_once_every_user_with_a_request_is_settled():
    """A lone borrower whose own streams fill the room: its first waiting
    request settles it, and no later request can change the demand, so its
    backlog is not walked at every step."""
    gate, waiting = _lone_borrower_filling_the_room(50)
    seen: list[str] = []
    assert _scan(gate, waiting, seen) == (0, 0)
    assert seen == ["bw0"]


def test_the_scan_goes_on_past_a_settled_user_while_another_may_still_count():
    """The early stop waits for every user: a paying user's request behind
    a settled borrower's backlog still takes its room."""
    gate, waiting = _lone_borrower_filling_the_room(50, paying=("p0",))
    seen: list[str] = []
    assert _scan(gate, waiting + ["p0"], seen) == (1, 0)
    assert seen == waiting + ["p0"]


def _budget(tokens: int, chunked: bool = True, longest: int = 0, prompt: int = 120):
    from vllm_output_rate.policy.demand import PrefillBudget

    return PrefillBudget(tokens, chunked, longest, lambda key: prompt)


@pytest.mark.parametrize(("chunked", "longest", "counted"), [
    (True, 0, 2),  # 120 tokens, then the 8 left begin a second prompt's first chunk
    (False, 0, 1),  # a whole prompt over the 8 left does not begin: vLLM's loop ends there
    (True, 64, 2),  # chunks of 64: two fill the budget
    (True, 32, 4),
])
def test_the_count_ends_once_the_token_budget_can_begin_no_more_prompts(chunked, longest, counted):
    """A wave of 120-token prompts and a 128-token step: room is kept only
    for the admissions the step's token budget can begin (issue 44: room
    kept for a dozen a step hid the borrowers' resident streams), and the
    first that cannot begin ends the scan, as it ends the engine's loop."""
    gate, waiting = _paying_and_borrowing(10)
    seen: list[str] = []

    def counted_keys(keys):
        for key in keys:
            seen.append(key)
            yield key

    demand = waiting_demand(
        counted_keys(waiting), gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=8, free_slots=8, output_left=lambda key: 100, queued={},
        prefill=_budget(128, chunked, longest),
    )
    assert demand == (counted, 0)
    assert seen == waiting[: counted + 1]


def test_a_budget_the_visible_requests_spent_keeps_no_room_for_admissions():
    gate, waiting = _borrower_with_waiting_prompts(3)
    queued: dict = {}
    assert waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued=queued,
        prefill=_budget(0),
    ) == (0, 0)


def test_borrowers_admissions_begin_in_what_the_guaranteed_requests_leave():
    """Borrowers' prompts ahead in the queue are admitted after a request
    its user can pay (``borrow_admits`` holds them to the count; with prompt
    cost they wait for it): they count only for the budget it leaves."""
    gate, waiting = _borrower_with_waiting_prompts(3)
    ahead = waiting[1:] + waiting[:1]  # bw0, bw1, bw2, p0
    queued: dict = {}
    demand = waiting_demand(
        ahead, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued=queued,
        prefill=_budget(250, chunked=False),
    )
    # In queue order two borrowed prompts would fit and the paying one not;
    # the paying one goes first, and one borrowed prompt fits after it.
    assert demand == (1, 1)
    # Without the budget: (1, 3).
    assert waiting_demand(
        ahead, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=4, output_left=lambda key: 100, queued={},
    ) == (1, 3)
