"""Issue 33's shapes on vLLM's real Scheduler / AsyncScheduler with a fake clock.

The real server's shapes: ``--max-num-seqs 16`` and ``--max-num-active-seqs``
4 or 8, 200-token requests from closed-loop clients (each stream sends its
next request a *turnaround* after its last one finished: the API server's
and the client's time, which the engine cannot see), 3 ms per step.  Every
figure is counted on the harness (each dispatched sample) or on the
engine's own borrowed-token counter, never on a wall clock.

What the real server showed and these shapes reproduce (issue 33):

* weights 1:3 at equal rates: every stream of a borrower borrowed in
  rotation, so all of a user's requests progressed in lockstep and finished
  within a few steps of each other; its clients then re-sent all at once and
  for a turnaround the user had nothing to run while the other took every
  slot.  The user with the larger weight finishes sooner and so waited more
  often: d2's share of borrowed tokens fell to 0.66-0.73 at 8 active slots with a
  50-step turnaround and at 4 slots with a 330-step one (0.75 wanted).
  Borrowed streams now go oldest first (stock vLLM's run-to-completion
  order), so a user's requests finish one after another and its clients
  re-send while its other requests run;
* a user within its rate beside a borrower, and a lone borrower beside
  stock vLLM: the engine makes the same decisions as promised (these tests
  guard that); what the real server lost there was time without a request
  in the engine (the clients' turnaround), see the tests' comments.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from vllm_output_rate_harness.scheduler_sim import MS, Harness, limits

STEP_NS = 3 * MS  # about a tiny-model step at 4-8 active requests on the testbed
MAX_TOKENS = 200
PROMPT = 16
WEIGHTED = limits(
    100000,
    d1={"rate": 5, "ceil": None, "weight": 1},
    d2={"rate": 5, "ceil": None, "weight": 3},
)


class ClosedLoop:
    """Streams of closed-loop clients on a :class:`Harness`: each stream
    sends its next request ``turnaround`` steps (plus up to ``jitter``,
    seeded) after its last one finished; each step takes ``step_ns``."""

    def __init__(self, h: Harness, streams: dict[str, int], turnaround: int,
                 jitter: int = 10, seed: int = 1, step_ns: int = STEP_NS) -> None:
        self.h = h
        self.step_ns = step_ns
        self.turnaround = turnaround
        self.jitter = jitter
        self.random = random.Random(seed)
        self.live: dict[str, str] = {}  # request id -> user
        self.sends: list[tuple[int, int, str]] = []  # (step, order, user)
        self.steps = 0
        self.present: Counter = Counter()  # user -> steps with a request in the engine
        for user, n in streams.items():
            for _ in range(n):
                self._send(user)

    def _send(self, user: str) -> None:
        rid = self.h.add(user, prompt_len=PROMPT, max_tokens=MAX_TOKENS).request_id
        self.live[rid] = user

    def run(self, steps: int) -> None:
        h = self.h
        for _ in range(steps):
            for user in set(self.live.values()):
                self.present[user] += 1
            h.step(self.step_ns)
            step = self.steps = self.steps + 1
            for rid in [rid for rid in self.live if h.records[rid].finished]:
                user = self.live.pop(rid)
                due = step + self.turnaround + self.random.randint(0, self.jitter)
                self.sends.append((due, len(self.sends), user))
            self.sends.sort()
            while self.sends and self.sends[0][0] <= step:
                self._send(self.sends.pop(0)[2])


def tokens_by_user(h: Harness, start: int = 0) -> Counter:
    got: Counter = Counter()
    for log in h.sampled_log[start:]:
        for rid in log:
            got[h.records[rid].user] += 1
    return got


# -- weights 1:3 at equal rates ----------------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "active, turnaround",
    # Each turnaround is within what 8 streams can carry at the weighted
    # share: d2 needs 3 (of 4) or 6 (of 8) requests in the engine at all
    # times, and a 200-token request runs 200 steps, so a stream may spend
    # at most 333 (4 active) or 67 (8 active) steps outside.
    [(4, 330), (8, 50)],
    ids=["4-active", "8-active"],
)
def test_equal_rates_weights_one_to_three_with_closed_loop_clients(active, turnaround, async_):
    h = Harness(WEIGHTED, max_num_seqs=16, max_num_active_seqs=active, async_=async_)
    clients = ClosedLoop(h, {"d1": 8, "d2": 8}, turnaround)
    borrowed = h.sched.output_rate_gate.borrowing.borrowed_tokens
    window = 1000  # 3 s of fake time; the first one is the warm-up
    clients.run(window)
    shares = []
    for _ in range(3):
        before = dict(borrowed)
        clients.run(window)
        d1, d2 = (borrowed.get(u, 0) - before.get(u, 0) for u in ("d1", "d2"))
        shares.append(d2 / (d1 + d2))
    total_d1, total_d2 = borrowed["d1"], borrowed["d2"]
    # Before: d2 0.66-0.73 per window (both shapes, sync and async): every
    # one of its requests finished together and the clients' turnaround left
    # it nothing to run while d1 took every slot.
    assert all(abs(share - 0.75) <= 0.05 for share in shares), shares
    assert abs(total_d2 / (total_d1 + total_d2) - 0.75) <= 0.05
    # The engine stays busy: the weights share the slots, not idle time.
    assert sum(map(len, h.sampled_log)) >= 0.95 * active * clients.steps
    h.check_resident_consistent()


# -- a user within its rate beside a borrower -------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("active", [4, 8])
def test_user_within_its_rate_beside_a_borrower_gets_its_limit(active, async_):
    # carol (a hard cap of 100 tok/s, one stream) beside bob {rate: 10,
    # ceil: null} with 12: bob's requests finish and arrive throughout.
    h = Harness(limits(100000, carol=100, bob={"rate": 10, "ceil": None}),
                max_num_seqs=16, max_num_active_seqs=active, async_=async_)
    clients = ClosedLoop(h, {"bob": 12, "carol": 1}, turnaround=5)
    clients.run(3000)  # 9 s
    got = tokens_by_user(h)
    seconds = clients.steps * STEP_NS / 1e9
    assert got["carol"] >= 0.95 * 100 * seconds, got
    assert got["bob"] >= 0.95 * (active * clients.steps - got["carol"]), got  # bob takes the rest
    h.check_resident_consistent()


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_user_within_its_rate_loses_only_the_time_it_has_no_request(async_):
    # The real server's figure (carol 52-92 tok/s beside bob, 100 alone) was
    # time without a request of hers in the engine: on its step trace she was
    # admitted in the step her request arrived and then sampled every 10.0 ms,
    # while 0.4-2.3 s passed between one request's end and the next one's
    # arrival (the API server and the client on a 2-core machine streaming
    # bob's tokens).  A long turnaround here: what she gets while she has a
    # request is her limit, beside the borrower.
    h = Harness(limits(100000, carol=100, bob={"rate": 10, "ceil": None}),
                max_num_seqs=16, max_num_active_seqs=4, async_=async_)
    clients = ClosedLoop(h, {"bob": 12, "carol": 1}, turnaround=150)
    clients.run(3000)
    got = tokens_by_user(h)
    seconds_present = clients.present["carol"] * STEP_NS / 1e9
    assert seconds_present < 0.85 * clients.steps * STEP_NS / 1e9  # the turnaround was real
    assert got["carol"] >= 0.95 * 100 * seconds_present, (got, seconds_present)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_user_within_its_rate_with_two_streams_beside_a_borrower_on_the_bench_shape(async_):
    # The bench model's shape (8 active of 16 slots, ~15 ms a step) with
    # carol at 50 tok/s on two streams beside bob's 12 borrowing ones, each
    # client re-sending 7 steps (~100 ms) after a finish: the server showed
    # carol at 37.9-43.3 tok/s on the engine's counter.  The scheduler's own
    # decisions give her the limit: what is missing there is not decided
    # here (time between her requests, stalls of the engine process).
    step_ns = 15 * MS
    h = Harness(limits(100000, carol=50, bob={"rate": 10, "ceil": None}),
                max_num_seqs=16, max_num_active_seqs=8, async_=async_)
    clients = ClosedLoop(h, {"bob": 12, "carol": 2}, turnaround=7, step_ns=step_ns)
    clients.run(2000)  # 30 s
    got = tokens_by_user(h)
    seconds = clients.steps * step_ns / 1e9
    assert got["carol"] >= 0.95 * 50 * seconds, got
    assert got["carol"] <= 50 * (seconds + 0.1) + 1, got  # and never more than its bound
    h.check_resident_consistent()


# -- a lone borrower beside stock vLLM ---------------------------------------------------


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("active", [4, 8])
@pytest.mark.parametrize("turnaround", [5, 150])
def test_lone_borrower_with_closed_loop_clients_gets_stock_tokens(active, turnaround, async_):
    # bob {rate: 10, ceil: null} alone with 12 streams, beside the same
    # clients on stock vLLM, step for step (the real server's 0.74x was not
    # a scheduling difference: its trace had all 4 slots sampling in 1,583
    # of 1,584 steps; the steps themselves were slower on a loaded machine).
    def run(config):
        h = Harness(config, max_num_seqs=16, max_num_active_seqs=active, async_=async_)
        clients = ClosedLoop(h, {"bob": 12}, turnaround)
        clients.run(2000)
        return tokens_by_user(h)["bob"]

    stock = run(None)
    shared = run(limits(100000, bob={"rate": 10, "ceil": None}))
    assert shared >= 0.95 * stock, (shared, stock)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_weights_hold_when_another_user_takes_resident_slots(async_):
    """Issue 33 on the bench model, 8 active of 16 resident slots: when
    another user takes resident slots (here a hard-capped user sending a
    short request every 20 steps, more than its rate serves, so it fills
    up to its residency cap of 10), each slot a borrower's finished request
    frees goes to it; d2, whose requests finish three times as fast, loses
    its slots first and is left with 1 resident stream against d1's 5 (the
    6 slots left to borrowers are all that borrow: the active cap has room
    for 8).  Slots came back only as requests finished, hundreds of steps
    later, so d2's share of borrowed tokens fell to 0.51 and then overshot
    to 0.86 while the counters paid it back (the server showed 0.64 in one
    window, with evictions for a light user).  Wanted: 0.75 +- 0.05 in
    every window.  Now the borrower ahead of its weighted share by more
    than a margin gives one of its hidden streams to the one behind
    (policy/handover.py): d1 and d2 alternate between 2:4 and 1:5 slots,
    0.73-0.76 per window."""
    config = limits(
        100000,
        d1={"rate": 5, "ceil": None, "weight": 1},
        d2={"rate": 5, "ceil": None, "weight": 3},
        light=20,
    )
    h = Harness(config, max_num_seqs=16, max_num_active_seqs=8, async_=async_,
                max_model_len=2048, num_blocks=4000)
    borrowed = h.sched.output_rate_gate.borrowing.borrowed_tokens
    live: dict[str, str] = {}

    def send(user: str) -> None:
        live[h.add(user, prompt_len=64, max_tokens=512).request_id] = user

    for _ in range(24):
        send("d1")
        send("d2")

    def run(steps: int) -> None:
        for i in range(steps):
            if i % 20 == 0:
                h.add("light", prompt_len=16, max_tokens=16)
            h.step(STEP_NS)
            for rid in [rid for rid in live if h.records[rid].finished]:
                send(live.pop(rid))  # the client sends its next one at once

    run(1000)
    shares = []
    for _ in range(4):
        before = dict(borrowed)
        run(1000)
        d1, d2 = (borrowed.get(u, 0) - before.get(u, 0) for u in ("d1", "d2"))
        shares.append(d2 / (d1 + d2))
    assert all(abs(share - 0.75) <= 0.05 for share in shares), shares
    h.check_resident_consistent()
