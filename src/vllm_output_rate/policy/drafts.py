"""Speculative-decoding drafts: paid when dispatched, settled when the output arrives.

With speculative decoding a decode step for one request carries ``k`` draft
tokens besides the one it always samples, and emits between 1 and ``k + 1``
tokens: the accepted drafts plus one.  The scheduler pays the one token
through the gate as for any step, and the drafts through this account:

* :meth:`DraftAccount.pay` -- at dispatch, while vLLM schedules the request,
  as many of its drafts as the user's quota allows *now* (the caller then
  schedules only those; a draft is optional, the sampled token is not);
* :meth:`DraftAccount.settle_step` -- at the end of ``schedule()``, drafts
  paid for a request that did not end up scheduled with them are refunded at
  once (the same single refund point as the sampled token's), and the rest
  are remembered against that step;
* :meth:`DraftAccount.settle_output` -- when the step's output arrives (under
  async scheduling, after the next step was planned), drafts the model
  rejected are refunded.

**Bound.**  Let a user's takes in a window be ``n`` and its refunds in the
same window ``r``.  GCRA only moves TAT forward by one interval per take and
back by one per refund (a refund that would move it before now makes the
user idle, which later takes treat the same way), and every take needed
``TAT - now <= burst``; so ``n - r <= (W + burst) * N + 1`` exactly as without
refunds.  The tokens *emitted* by steps dispatched in the window are ``n``
minus the refunds of those steps' own rejected drafts; refunds inside the
window of drafts dispatched *before* it are the only ones that do not belong
to the window's takes, and there are at most ``k`` of them per step of the
user in flight when the window opens.  Hence, over any window of W seconds::

    emitted <= (W + burst) * N + 1 + k * (user's steps in flight at its start)

with one step in flight per request under synchronous scheduling and two
under async scheduling.  ``tests/policy/test_drafts.py`` checks it on random
drafts, acceptances and output delays.

Plain Python over opaque keys and user names; no vLLM.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable

from vllm_output_rate.policy.limiter import Limiter

Key = Hashable


class DraftAccount:
    """Draft tokens paid in the current step and in steps whose output is due.

    ``charged_tokens`` is the gate's per-user cumulative total of charged
    tokens (the ledger's dict, shared): drafts kept at the end of a step are
    added to it, rejected ones taken off again when the output arrives.

    Invariants (``tests/policy/test_drafts.py``): every draft paid is either
    refunded once or kept once; a kept draft is refunded only by the output
    of the step it was dispatched in, and only when the model rejected it;
    an output never seen leaves its step's drafts charged.
    """

    def __init__(self, limiter: Limiter, charged_tokens: dict[str, int]) -> None:
        self.limiter = limiter
        self.charged_tokens = charged_tokens
        #: This step's payments: key -> (user, drafts paid).
        self._paid: dict[Key, tuple[str, int]] = {}
        #: Steps dispatched with drafts and not yet settled, oldest first:
        #: (step token, {key: (user, drafts kept)}).
        self._in_flight: deque[tuple[Any, dict[Key, tuple[str, int]]]] = deque()
        #: Drafts refunded because the model rejected them, cumulative.
        self.rejected_total = 0
        #: Drafts kept whose output never arrived (cumulative).
        self.unsettled_total = 0

    def pay(self, key: Key, user: str, now_ns: int, wanted: int) -> int:
        """Take up to ``wanted`` draft tokens for ``key`` now; return how many."""
        if wanted <= 0:
            return 0
        paid = self.limiter.take_up_to(user, now_ns, wanted)
        if paid:
            _, before = self._paid.get(key, (user, 0))
            self._paid[key] = (user, before + paid)
        return paid

    def settle_step(self, step: Any, now_ns: int, scheduled: Callable[[Key], int]) -> int:
        """End a step: keep, per key, the drafts ``scheduled(key)`` says were
        dispatched with it (at most what was paid), refund the rest now, and
        remember the kept ones against ``step``.  Returns the refund."""
        paid = self._paid
        if not paid:
            return 0
        refund = self.limiter.refund
        charged = self.charged_tokens
        kept: dict[Key, tuple[str, int]] = {}
        refunded = 0
        for key, (user, count) in paid.items():
            keep = min(count, max(scheduled(key), 0))
            if keep < count:
                refund(user, now_ns, count - keep)
                refunded += count - keep
            if keep:
                kept[key] = (user, keep)
                charged[user] = charged.get(user, 0) + keep
        paid.clear()
        if kept:
            self._in_flight.append((step, kept))
        return refunded

    def settle_output(self, step: Any, now_ns: int, accepted: Callable[[Key], int]) -> int:
        """The output of ``step`` arrived: refund, per key, the kept drafts
        beyond ``accepted(key)``.  Steps dispatched before ``step`` whose
        output was never settled keep their charge.  Returns the refund."""
        in_flight = self._in_flight
        if not in_flight or not any(entry[0] is step for entry in in_flight):
            return 0
        while True:
            token, kept = in_flight.popleft()
            if token is step:
                break
            self.unsettled_total += sum(count for _, count in kept.values())
        refund = self.limiter.refund
        charged = self.charged_tokens
        refunded = 0
        for key, (user, count) in kept.items():
            rejected = count - min(count, max(accepted(key), 0))
            if rejected:
                refund(user, now_ns, rejected)
                charged[user] = charged.get(user, 0) - rejected
                refunded += rejected
        self.rejected_total += refunded
        return refunded

    def in_flight(self) -> int:
        """Drafts kept and not yet settled, over all steps in flight."""
        return sum(count for _, kept in self._in_flight for _, count in kept.values())
