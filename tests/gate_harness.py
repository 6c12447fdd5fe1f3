"""Step the plain-Python gate as the adapter steps it, on a fake clock.

Shared by the policy tests of borrowing (``tests/policy/test_borrow.py``) and
groups (``tests/policy/test_groups.py``), which differ only in how they build
the gate's limiter and borrowing.  One step: ``plan`` -> ``borrow(plan, room)``
-> the sampled keys -> ``ledger.settle`` -> ``borrowing.settle``.  Time is an
integer count of nanoseconds; keys are strings.
"""

from __future__ import annotations

MS = 1_000_000
S = 1_000_000_000


def bound(window_s: float, rate: float) -> int:
    """Most tokens a user of ``rate`` tok/s may sample in ``window_s`` seconds."""
    return int((window_s + 0.1) * rate + 1 + 1e-9)


def max_in_window(times: list[int], window_ns: int) -> int:
    """Most events in any half-open window ``[t, t + window_ns)``."""
    times = sorted(times)
    best = lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window_ns:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


class GateWorld:
    """A gate (with borrowing, or None for none), and the record of what sampled when."""

    def __init__(self, gate, borrowing) -> None:
        self.gate = gate
        self.borrowing = borrowing
        self.gate.borrowing = borrowing
        self.now = 10 * S
        self.times: dict[str, list[int]] = {}  # user -> time of every sampled token
        self.guaranteed: dict[str, list[int]] = {}  # user -> time of every non-borrowed token
        self.n = 0

    def add(self, user: str, streams: int) -> list[str]:
        """``streams`` new waiting requests of ``user``; their keys."""
        keys = []
        for _ in range(streams):
            key = f"{user}-{self.n}"
            self.n += 1
            self.gate.lanes.track(key, user)
            self.gate.lanes.admit(key, progressing=False)
            keys.append(key)
        return keys

    def forget(self, key: str) -> None:
        self.gate.lanes.forget(key)

    def step(self, slots: int, dt: int = 10 * MS, drop=frozenset()):
        """One engine step with ``slots`` free; keys in ``drop`` do not sample.  Returns the plan."""
        gate = self.gate
        plan = gate.plan(self.now, slots)
        if self.borrowing is not None and plan.throttled and not plan.over_cap:
            room = slots - len(plan.visible)
            if room > 0:
                gate.borrow(plan, room)
        sampled = {k for k in plan.visible + plan.borrowed if k not in drop}
        gate.settle(sampled)
        borrowed = set(plan.borrowed)
        for key in sampled:
            user = gate.lanes.user_of[key]
            self.times.setdefault(user, []).append(self.now)
            if key not in borrowed:
                self.guaranteed.setdefault(user, []).append(self.now)
        self.now += dt
        return plan
