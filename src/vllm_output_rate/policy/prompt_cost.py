"""Prompt cost: computed prompt tokens charged to the user at a weight.

One part of the per-step gate, used only with ``input_token_weight`` > 0
(at weight 0 the scheduler never calls it, and decides exactly as without
it).  Requests are opaque keys, users strings, positions plain integers.

The rule.  Each prompt position a dispatched chunk *computes* costs its
user ``weight`` tokens of the same quota as output tokens, charged at
dispatch and refunded at the step's end when the chunk was not scheduled
after all (the ledger's one refund point, :meth:`PromptCost.settle`).
Positions served from the prefix cache are never dispatched, so never
charged; positions computed again after a preemption lie below the
request's high-water mark (:attr:`PromptCost.charged_upto`) and are not
charged again: recompute is the engine's cost, not the user's.

Dispatch and debt.  A chunk that computes uncharged prompt positions is
dispatched only when its user can pay: no debt outstanding (nor any user of
its group, with groups), not refused in this step, and at least one token
available now (or this request's own output token already paid for in the
step).  Its whole cost is then charged: what the quota holds is taken from
the limiter, the rest becomes the user's *debt*.  At the start of every step
each debt is repaid from the limiter first (:meth:`PromptCost.repay`), so a
user in debt finds its quota empty -- its decodes, prefills and admissions
all wait -- until the debt is paid off.  A chunk is never split to what the
quota allows: tiny chunks would cost the engine a step each, and without
chunked prefill a prompt longer than the burst could never be dispatched at
all.

Borrowed chunks.  A user that may borrow (its ceiling above its rate, or
none) and whose quota cannot pay a chunk's whole cost may instead pay it
from a *lender* (:class:`PromptLender`, the step policy's view of
borrowing), under the conditions in which its output tokens borrow: spare
engine room (the step policy decides: a step that hid nothing runnable for
lack of room; a resident prefill, or a waiting request admitted on its
user's quota or into a slot set aside for borrowers), and its cap able to
pay the chunk's whole cost and its sampled token now (no ceiling: always).
Nothing that holds prompts changes: a user in debt, or held by its group,
is refused whether it could borrow or not.  The whole cost is taken from
the cap (its own ceiling and its group's, with groups), never from the
guaranteed rate, and never becomes debt; it is refunded to the cap if the
chunk does not run, and kept it counts in :attr:`PromptCost.borrowed_tokens`.
Paid from the quota instead, the part the quota lacks would become debt,
holding every prompt of the user until its rate paid it off.  A user that
does not borrow is never lent anything: the rule above, unchanged.

Bound.  Debt is only ever incurred by a chunk dispatched without debt, so
it never exceeds one chunk's cost.  Let ``C`` be the most prompt tokens one
chunk computes.  Tokens taken from the limiter obey GCRA's bound; what was
charged in a window is what was taken in it plus the debt still open at its
end, so over any window of ``W`` seconds::

    output tokens + weight x prompt tokens charged <= (W + burst) x N + 1 + ceil(weight x C)

``N`` is the rate of a hard-capped user, and the ceiling of a borrower with
one: a borrower's guaranteed tokens are paid on its ceiling too (the
composed quota), its borrowed output tokens and borrowed chunks on the
ceiling alone, in whole tokens taken before the chunk runs (no debt), so the
same bound holds with its ceiling for ``N``.  A borrower without a ceiling
is bounded by room only, for prompts as for output.

With groups the same holds for a group's users together, N the group's rate
(its ceiling, for a group that borrows; a member's borrowed chunk is paid on
it):
a member's chunk also waits while any member of its group owes one, so a
group too owes at most one chunk.  The members it held back queue and, once
it is paid, go one chunk each in the order they started waiting, the member
that owed behind them (:meth:`PromptCost._held_by_group`): members take turns,
so a member with a backlog waits at most one chunk of each other member.

Exactness.  The weight is a fraction; each user keeps a *credit* below one
token: a chunk costs ``ceil(weight x n - credit)`` whole tokens and leaves
the overpaid fraction as credit, so whole tokens charged are always at
least the exact weighted cost and exceed it by less than one token.
Refunds are settled per user, against the exact cost of the chunks kept.

Invariants (``tests/policy/test_prompt_cost.py``):

* a prompt position of a request is charged at most once while the
  request is tracked, however often it is computed;
* after :meth:`PromptCost.settle`, for every user: whole tokens charged
  (cumulative) = weight x prompt tokens kept + credit, 0 <= credit < 1;
* a user's debt never exceeds the cost of one chunk;
* a borrowed chunk takes its whole cost from its lender and nothing from the
  limiter; what is refunded to the lender in a step never exceeds what the
  step took from it.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, Hashable, Protocol

from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.rates import exact_rate

Key = Hashable
_ZERO = Fraction(0)
#: How long a member waiting for its group's turn keeps its place without
#: asking again (ns): twice the longest idle wait, so a member whose chunk is
#: still pending asks again well within it.
GROUP_TURN_NS = 500_000_000


class PromptLender(Protocol):
    """Where a borrowed chunk is paid (the step policy's view of borrowing)."""

    def room(self, user: str, now_ns: int) -> int | None:
        """Tokens it could lend ``user`` now (None: any number; 0 for a user
        that does not borrow)."""

    def take(self, user: str, now_ns: int, tokens: int) -> int:
        """Lend up to ``tokens``; returns how many were lent."""

    def refund(self, user: str, now_ns: int, tokens: int) -> None:
        """Give back ``tokens`` lent in this step."""


def exact_weight(value: object) -> Fraction:
    """``value`` as an exact non-negative fraction (``ValueError`` otherwise)."""
    if not isinstance(value, bool) and isinstance(value, (int, float, Fraction)) and value == 0:
        return _ZERO
    return exact_rate(value, "input token weight")


def whole_cost(weight: Fraction, positions: int, credit: Fraction) -> tuple[int, Fraction]:
    """What ``positions`` prompt positions cost at ``weight`` with ``credit``
    paid ahead: the whole tokens, ceil(weight x positions - credit) (0 if
    that is not positive), and the credit left, those tokens less that
    amount.  Worked out on the fractions' integers: the charge runs once per
    prompt chunk inside vLLM's loop, where Fraction's operators were most of
    its time."""
    p, q = weight.numerator, weight.denominator
    a, b = credit.numerator, credit.denominator
    num = p * positions * b - a * q  # (weight x positions - credit) x den
    den = q * b
    whole = -((-num) // den) if num > 0 else 0
    left = whole * den - num
    return whole, (Fraction(left, den) if left else _ZERO)


def _first_in_line(line: dict[str, tuple[int, int]]) -> str:
    """The member of a group's line that started waiting first (ties: the
    one that asked first)."""
    return min(line, key=lambda member: line[member][0])


def _still_waiting(
    line: dict[str, tuple[int, int]], user: str, group: str,
    group_of: Callable[[str], str | None], now_ns: int,
) -> dict[str, tuple[int, int]]:
    """The places in a group's line that still hold: ``user``'s, and those of
    members that asked within :data:`GROUP_TURN_NS` and are still members."""
    return {
        member: place for member, place in line.items()
        if member == user or (now_ns - place[1] <= GROUP_TURN_NS and group_of(member) == group)
    }


class PromptCost:
    """Prompt positions charged at ``weight`` tokens each, per user.

    ``charged_upto``: key -> prompt positions below which nothing is
    charged again.  ``debt``: user -> whole tokens charged and not yet taken
    from the limiter.  ``credit``: user -> fraction of a token paid ahead.
    ``prompt_tokens``: user -> prompt tokens charged and kept, cumulative
    (metrics read it).  ``borrowed_tokens``: user -> whole tokens of
    borrowed chunks kept, cumulative.
    """

    def __init__(self, ledger: Ledger, weight: object = 0) -> None:
        self._ledger = ledger
        self.weight = exact_weight(weight)
        self.charged_upto: dict[Key, int] = {}
        self.debt: dict[str, int] = {}
        self.credit: dict[str, Fraction] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.borrowed_tokens: dict[str, int] = {}
        #: This step's borrowed charges: key -> whole tokens lent for it.
        self.step_borrowed: dict[Key, int] = {}
        #: user -> the lender of its borrowed charges in this step.
        self._lenders: dict[str, PromptLender] = {}
        #: This step's charges: key -> (user, first charged position, chunk start, end).
        self.step_charges: dict[Key, tuple[str, int, int, int]] = {}
        #: user -> (credit before its first charge of the step, whole tokens charged).
        self._step_users: dict[str, tuple[Fraction, int]] = {}
        #: user -> its group (``policy/groups.py``); None without groups.
        self.group_of: Callable[[str], str | None] | None = None
        #: group -> member waiting for its turn -> (when it started waiting,
        #: when it last asked); the one waiting longest goes first.
        self._waiting: dict[str, dict[str, tuple[int, int]]] = {}

    def set_weight(self, weight: object) -> None:
        """A new weight, from the next charge on (debts and credits stay)."""
        self.weight = exact_weight(weight)

    def uncharged(self, key: Key, start: int, count: int, num_prompt: int) -> int:
        """Prompt positions of ``[start, start + count)`` not charged before."""
        first = self.charged_upto.get(key, 0)
        if first < start:
            first = start
        end = start + count
        if end > num_prompt:
            end = num_prompt
        return end - first if end > first else 0

    def can_pay(self, key: Key, user: str, lender: PromptLender | None = None) -> bool:
        """May a chunk of ``key`` that computes uncharged prompt positions go now?

        ``lender``: the user's quota is empty and the caller found that
        borrowing may pay this chunk (spare room, the cap's room for its
        whole cost): then it goes on what is borrowed, unless something
        holds the user's prompts (a debt, its group's turn).  A no is
        remembered for the step (the user is refused and blocked, as the
        ledger does for output tokens).
        """
        ledger = self._ledger
        # A user in debt waits for its own debt, not for a turn: it queues in
        # its group's line once paid, behind the members it held back.  Any
        # other member is asked first, whatever else refuses it: asking keeps
        # its place in the line.  A key whose token is paid already (the
        # plan kept it for this waiting request's turn) goes even if another
        # request of the user was refused before it in vLLM's order.
        if not self.debt.get(user) and not self._held_by_group(user):
            if ledger.is_charged(key):
                return True
            if user not in ledger.refused:
                if ledger.limiter.available(user, ledger.now_ns) > 0:
                    return True
                ledger.limiter.want(user, ledger.now_ns)
            if lender is not None:
                return True
        ledger.refuse(user)
        return False

    def cost_of(self, key: Key, user: str, start: int, count: int, num_prompt: int) -> int:
        """Whole tokens :meth:`charge` would take for the chunk now (its
        user's credit counted); nothing is changed."""
        first = max(start, self.charged_upto.get(key, 0))
        end = min(start + count, num_prompt)
        if end <= first:
            return 0
        return whole_cost(self.weight, end - first, self.credit.get(user, _ZERO))[0]

    def _held_by_group(self, user: str) -> bool:
        """Must ``user``'s chunk wait for its group?

        While a user of the group owes a chunk, no member's chunk goes (a
        group owes at most one chunk, as a user does).  The members held back
        queue; once the group owes nothing they go in the order they started
        waiting, and a member that asks while others wait (the one that owed
        among them) queues behind them.  So members take turns, in whatever
        order vLLM asks them: a member with a backlog waits at most one chunk
        of each other member.  A member that stopped asking for
        :data:`GROUP_TURN_NS` loses its place.
        """
        group_of = self.group_of
        if group_of is None:
            return False
        group = group_of(user)
        if group is None:
            return False
        now = self._ledger.now_ns
        line = self._waiting.get(group)
        if not (self.debt and any(group_of(u) == group for u in self.debt)):
            if not line:
                return False
            live = _still_waiting(line, user, group, group_of, now)
            for other in [other for other in line if other not in live]:
                del line[other]
            if not line:
                return False
            if _first_in_line(line) == user:
                line[user] = (line[user][0], now)  # its turn: it stays first until charged
                return False
        line = self._waiting.setdefault(group, {})
        place = line.get(user)
        line[user] = (now if place is None else place[0], now)
        return True

    def held_by_debt(self, user: str) -> bool:
        """Does a debt (``user``'s own, or a member of its group's) hold
        ``user``?  Debts are repaid only from the guaranteed quota, so no
        refill of a borrowing cap lets such a user run sooner."""
        if self.debt.get(user):
            return True
        group_of = self.group_of
        if group_of is None or not self.debt:
            return False
        group = group_of(user)
        return group is not None and any(group_of(debtor) == group for debtor in self.debt)

    def holds_prompt(self, user: str) -> bool:
        """Would a chunk of ``user`` that computes uncharged prompt positions
        wait now (its debt, its group's, another member's turn)?  Asks
        nothing: unlike :meth:`can_pay`, nobody is refused or queued."""
        if not self.weight:
            return False
        if self.held_by_debt(user):
            return True
        group_of = self.group_of
        group = None if group_of is None else group_of(user)
        if group_of is None or group is None:
            return False
        line = self._waiting.get(group)
        if not line:
            return False
        waiting = _still_waiting(line, user, group, group_of, self._ledger.now_ns)
        return bool(waiting) and _first_in_line(waiting) != user

    def line_of(self, user: str) -> frozenset[str]:
        """The members of ``user``'s group waiting in its line for a prompt
        turn now (empty: no line, no member's chunk waits for a turn).
        While it is not empty every member that asks joins it, and a member
        whose chunk goes leaves it (:meth:`charge`), so its next chunk waits
        behind any member that asked meanwhile.  Asks nothing."""
        group_of = self.group_of
        group = None if group_of is None else group_of(user)
        if group_of is None or group is None:
            return frozenset()
        line = self._waiting.get(group)
        if not line:
            return frozenset()
        return frozenset(_still_waiting(line, user, group, group_of, self._ledger.now_ns))

    def charge(
        self, key: Key, user: str, start: int, count: int, num_prompt: int,
        lender: PromptLender | None = None,
    ) -> int:
        """Charge the chunk ``[start, start + count)`` of ``key`` (after
        :meth:`can_pay` said yes); return the whole tokens it cost.

        Takes what the quota holds; the rest becomes debt.  With ``lender``
        (the one :meth:`can_pay` was given) the chunk is borrowed: its
        whole cost is lent, nothing is taken from the quota.
        """
        first = max(start, self.charged_upto.get(key, 0))
        end = min(start + count, num_prompt)
        if end <= first:
            return 0
        credit = self.credit.get(user, _ZERO)
        if user not in self._step_users:
            self._step_users[user] = (credit, 0)
        whole, self.credit[user] = whole_cost(self.weight, end - first, credit)
        if whole:
            ledger = self._ledger
            got = 0
            if lender is not None:
                got = lender.take(user, ledger.now_ns, whole)
                if got:
                    self.step_borrowed[key] = self.step_borrowed.get(key, 0) + got
                    self._lenders[user] = lender
            if got < whole:  # not lent (the caller checked the room: never, borrowing)
                got += ledger.limiter.take_up_to(user, ledger.now_ns, whole - got)
            if got < whole:
                self.debt[user] = self.debt.get(user, 0) + whole - got
        before, charged = self._step_users[user]
        self._step_users[user] = (before, charged + whole)
        self.step_charges[key] = (user, first, start, end)
        if self.group_of is not None:
            group = self.group_of(user)
            if group is not None and group in self._waiting:
                # Its turn is used, even if vLLM does not schedule the chunk
                # after all (no KV for it, say): kept, a member that cannot
                # get in would hold back the members that could, forever.
                self._waiting[group].pop(user, None)
        return whole

    def repay(self, now_ns: int) -> None:
        """Pay debts from the limiter, as far as each user's quota allows."""
        take_up_to = self._ledger.limiter.take_up_to
        for user, owed in list(self.debt.items()):
            got = take_up_to(user, now_ns, owed)
            if got >= owed:
                del self.debt[user]
            elif got:
                self.debt[user] = owed - got

    def settle(self, scheduled: Callable[[Key], int], now_ns: int) -> int:
        """End the step: keep what was scheduled, refund the rest.

        ``scheduled(key)`` is how many positions vLLM scheduled for the key
        in the step (0: not scheduled).  Returns whole tokens refunded.
        What borrowed chunks that did not run were lent goes back to their
        lender first, then any debt is cancelled, then the quota refunded.
        """
        if not self.step_charges:
            return 0
        kept_by_user: dict[str, int] = {}
        #: user -> tokens lent for chunks that did not run in full.
        unrun_lent: dict[str, int] = {}
        step_borrowed = self.step_borrowed
        for key, (user, first, start, end) in self.step_charges.items():
            kept_end = min(end, start + scheduled(key))
            kept = kept_end - first if kept_end > first else 0
            kept_by_user[user] = kept_by_user.get(user, 0) + kept
            if kept:
                self.charged_upto[key] = kept_end
            if step_borrowed and kept_end < end and key in step_borrowed:
                unrun_lent[user] = unrun_lent.get(user, 0) + step_borrowed[key]
        lent_by_user: dict[str, int] = {}
        for key, lent in step_borrowed.items():
            user = self.step_charges[key][0]
            lent_by_user[user] = lent_by_user.get(user, 0) + lent
        refunded = 0
        refund = self._ledger.limiter.refund
        for user, (before, charged) in self._step_users.items():
            kept = kept_by_user.get(user, 0)
            whole, self.credit[user] = whole_cost(self.weight, kept, before)
            if kept:
                self.prompt_tokens[user] = self.prompt_tokens.get(user, 0) + kept
            back = charged - whole
            lent = lent_by_user.get(user, 0)
            if back > 0:
                refunded += back
                to_lender = min(back, unrun_lent.get(user, 0))
                if to_lender:
                    self._lenders[user].refund(user, now_ns, to_lender)
                    back -= to_lender
                    lent -= to_lender
            if lent > 0:
                self.borrowed_tokens[user] = self.borrowed_tokens.get(user, 0) + lent
            if back <= 0:
                continue
            debt = self.debt.get(user, 0)
            if debt:  # what was never taken is given back first
                cancel = min(debt, back)
                back -= cancel
                if debt > cancel:
                    self.debt[user] = debt - cancel
                else:
                    del self.debt[user]
            if back:
                refund(user, now_ns, back)
        self.step_charges.clear()
        self._step_users.clear()
        if step_borrowed:
            step_borrowed.clear()
            self._lenders.clear()
        return refunded

    def ready_at_ns(
        self, user: str, now_ns: int, quota_ready: Callable[[str], int], decoding: bool = False
    ) -> int:
        """When an engine that ran nothing must step again for ``user``,
        as far as prompt cost is concerned, given ``quota_ready(u)``: when
        ``u``'s quota next pays a token.

        A debt is repaid only in steps, from what the quota holds then, and
        a quota holds no more than its burst: a user in debt, or held by a
        member of its group that is, needs a step whenever a debtor's quota
        can pay again (sleeping longer would lose what the quota cannot
        hold).  A member waiting for its turn in its group needs one when
        the member first in line can go (if it is still asking) or loses
        its turn, and its own quota can pay.  ``decoding``: the user holds
        resident decoding streams, which a debt of another member does not
        hold (it holds the group's prompts): they run when its quota pays.
        """
        group_of = self.group_of
        if group_of is None:
            return quota_ready(user)
        group = group_of(user)
        if group is None or user in self.debt:
            return quota_ready(user)
        debtors = [u for u in self.debt if group_of(u) == group]
        if debtors:
            soonest = min(map(quota_ready, debtors))
            return min(soonest, quota_ready(user)) if decoding else soonest
        ready = quota_ready(user)
        line = self._waiting.get(group)
        if line:
            first = _first_in_line(line)
            if first != user:
                _, asked = line[first]
                # Asked in this step (and refused: its own quota is spent),
                # it keeps its turn while it asks; otherwise the turn lapses.
                turn = quota_ready(first) if asked == now_ns else asked + GROUP_TURN_NS
                ready = max(ready, turn)
        return ready

    def forget(self, key: Key) -> None:
        """The request left for good."""
        self.charged_upto.pop(key, None)

    def forget_user(self, user: str) -> None:
        """The user has no request left: drop its credit (it paid that ahead;
        dropping it never under-charges).  Debt is kept until paid."""
        self.credit.pop(user, None)
