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

**Counters.**  The per-user total of charged tokens (read by metrics and
the admin route) counts a draft once its fate is known: when the output of
its step arrives, the accepted drafts (the ones emitted); a step whose
output never arrives, all of its drafts (they stay paid).  Never at
dispatch: vLLM's ``make_stats`` reads the total inside ``update_from_output``,
before the rejected drafts of that very step are known, and a total that
went down afterwards would read as a restart (the whole total counted
again).  So the total only grows.

**Refunds go to who paid.**  A draft is refunded to the quotas that were
charged for it, remembered at :meth:`DraftAccount.pay`
(:func:`~.quota.payers`: every level of a composed limiter, under the key
the user paid it with then, such as its group of that moment).  Under
async scheduling a step's output arrives after the next step started, and a
reload may have moved the user to another group (or given it a ceiling) in
between: the new group never paid for those drafts.

Plain Python over opaque keys and user names; no vLLM.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable

from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.quota import Payers, payers, refund_payers

Key = Hashable
#: One key's drafts: (user, drafts, the quotas that paid them).
Paid = tuple[str, int, Payers]


class DraftAccount:
    """Draft tokens paid in the current step and in steps whose output is due.

    Drafts are paid from ``ledger.limiter``, the quota in force now (the
    ledger is its only holder: a reload replaces it there), and counted in
    the ledger's per-user cumulative total of charged tokens
    (:meth:`Ledger.keep`): a step's drafts are added to it when its output
    arrives, the accepted ones only (see the module doc); it never goes down.  Refunds
    go to the quotas that were paid.

    Invariants (``tests/policy/test_drafts.py``): every draft paid is either
    refunded once or kept once, to and on the quotas that paid it; a kept
    draft is refunded only by the output of the step it was dispatched in,
    and only when the model rejected it; an output never seen leaves its
    step's drafts charged; ``charged_tokens`` only grows, and once every
    output is in it counts exactly the drafts kept.
    """

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        #: This step's payments: key -> (user, drafts paid, payer).
        self._paid: dict[Key, Paid] = {}
        #: Steps dispatched with drafts and not yet settled, oldest first:
        #: (step token, {key: (user, drafts kept, payer)}).
        self._in_flight: deque[tuple[Any, dict[Key, Paid]]] = deque()
        #: Drafts refunded because the model rejected them, cumulative.
        self.rejected_total = 0
        #: Drafts kept whose output never arrived (cumulative).
        self.unsettled_total = 0

    def pay(self, key: Key, user: str, now_ns: int, wanted: int) -> int:
        """Take up to ``wanted`` draft tokens for ``key`` now; return how many."""
        if wanted <= 0:
            return 0
        limiter = self._ledger.limiter
        paid = limiter.take_up_to(user, now_ns, wanted)
        if paid:
            earlier = self._paid.get(key)
            if earlier is None:
                self._paid[key] = (user, paid, payers(limiter, user))
            else:  # a second payment in the same step: no reload in between
                self._paid[key] = (user, earlier[1] + paid, earlier[2])
        return paid

    def settle_step(self, step: Any, now_ns: int, scheduled: Callable[[Key], int]) -> int:
        """End a step: keep, per key, the drafts ``scheduled(key)`` says were
        dispatched with it (at most what was paid), refund the rest now, and
        remember the kept ones against ``step``.  Returns the refund."""
        paid = self._paid
        if not paid:
            return 0
        kept: dict[Key, Paid] = {}
        refunded = 0
        for key, (user, count, payer) in paid.items():
            keep = min(count, max(scheduled(key), 0))
            if keep < count:
                refund_payers(payer, now_ns, count - keep)
                refunded += count - keep
            if keep:
                kept[key] = (user, keep, payer)
        paid.clear()
        if kept:
            self._in_flight.append((step, kept))
        return refunded

    def settle_output(self, step: Any, now_ns: int, accepted: Callable[[Key], int]) -> int:
        """The output of ``step`` arrived: refund, per key, the kept drafts
        beyond ``accepted(key)`` and count the accepted ones as charged.
        Steps dispatched before ``step`` whose output was never settled keep
        their charge (counted now).  Returns the refund."""
        in_flight = self._in_flight
        if not in_flight or not any(entry[0] is step for entry in in_flight):
            return 0
        charged: dict[str, int] = {}
        while True:
            token, kept = in_flight.popleft()
            if token is step:
                break
            for user, count, _ in kept.values():
                charged[user] = charged.get(user, 0) + count
                self.unsettled_total += count
        refunded = 0
        for key, (user, count, payer) in kept.items():
            emitted = min(count, max(accepted(key), 0))
            if emitted:
                charged[user] = charged.get(user, 0) + emitted
            if emitted < count:
                refund_payers(payer, now_ns, count - emitted)
                refunded += count - emitted
        self.rejected_total += refunded
        self._ledger.keep(charged, sampled=False)
        return refunded

    def in_flight(self) -> int:
        """Drafts kept and not yet settled, over all steps in flight."""
        return sum(entry[1] for _, kept in self._in_flight for entry in kept.values())
