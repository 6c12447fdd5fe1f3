"""Groups: a second quota over users (a team, a tenant).

Optional, present only when groups are configured; plain Python, no vLLM.
A group has a limit written as a user's (``{rate, ceil, weight}``), and a user
joins at most one group (``group:`` in its own limit).  A user without a
group is decided exactly as without groups.

**The rule.**  Every token charged to a user of a group (output, drafts,
prompt cost) is paid on the user's quotas *and* on the group's, and a token
goes only when both levels can pay:

* a *guaranteed* token needs the user's guaranteed quota (its rate, and its
  ceiling when it has one above the rate) and the group's (likewise);
  :class:`~.joint.JointLimiter` pays both, all or nothing per token;
* a *borrowed* token (spare capacity, :mod:`.borrow`) needs each level's
  *cap*: its ceiling when it has one above its rate, its rate when it is a
  hard cap, nothing without a ceiling (:class:`CapLimiter`).  So a user may
  borrow when either level may (a hard-capped user of a group with a ceiling
  spends its own rate beyond the group's rate, up to the group's ceiling),
  and every level's ceiling bounds every token of it.

**Bound.**  Every token of a group's users is a take on the group's quota at
its cap, so over any window of W seconds the group's users together get at
most ``(W + burst) x cap + 1`` tokens (the GCRA bound of that quota; cap = the
group's rate for a hard-capped group, and, with borrowing, the group's ceiling
for all of its tokens and its rate for the guaranteed ones), each user still
within its own bounds.  Prompt cost adds its one chunk of debt per user, and
drafts their tokens in flight, exactly as for a user.

**Fair share.**  Spare capacity is shared in two levels (:mod:`.borrow`):
first between groups and users without a group, by their weights, then
inside a group between its members, by theirs.

One level is enough: a group is what operators budget (a team, a tenant, a
customer), and the scheduler's unit of fairness stays the user.  Every level
costs each charge one more quota to pay (a take on the group's limiter; with
a store, one more key and lease per charge), and with two levels a token
already needs two to agree at every step; a tree would need every level's
ceiling to agree before a token goes, with more ways for a user to be held
back by a quota it cannot see.  Nested budgets are better expressed as one
group per budget holder.
"""

from __future__ import annotations

from typing import Mapping

from vllm_output_rate.policy.borrow import CeiledLimiter, ShareTable
from vllm_output_rate.policy.joint import JointLimiter
from vllm_output_rate.policy.limiter import Limiter

#: What a quota without a cap could pay for: more than any step asks.
_UNBOUNDED = 1 << 62


def _cap(table: ShareTable, key: str, rate: Limiter, ceiling: Limiter | None) -> Limiter | None:
    """The quota ``key``'s borrowed tokens are paid on: its ceiling when it
    has one above its rate, its rate when it is a hard cap, none when it has
    no ceiling."""
    if table.ceiled(key):
        return ceiling
    return None if table.borrows(key) else rate


class GroupQuotas:
    """Who is in which group, each group's shares, and the groups' quotas.

    ``rate`` is keyed by group and holds each group's rate; ``ceiling``
    (None while no group has a ceiling above its rate) each group's ceiling.
    The owner of the quotas (the scheduler) keeps this object across
    reloads, so the groups' quota state is kept too.
    """

    def __init__(
        self,
        user_groups: Mapping[str, str | None],
        default_group: str | None,
        table: ShareTable,
        rate: Limiter,
        ceiling: Limiter | None = None,
    ) -> None:
        self.rate = rate
        self.ceiling = ceiling
        self.update(user_groups, default_group, table)

    def update(
        self, user_groups: Mapping[str, str | None], default_group: str | None, table: ShareTable
    ) -> None:
        """New membership and shares (a reload); the quotas keep their state.

        ``user_groups`` names every user with an entry of its own (None: in
        no group); every other user is in ``default_group``.
        """
        self._of = dict(user_groups)
        self.default_group = default_group
        self.table = table

    def of(self, user: str) -> str | None:
        """``user``'s group, or None."""
        return self._of.get(user, self.default_group)

    def members(self) -> dict[str, list[str]]:
        """group -> the named users in it (the default group's unnamed users aside)."""
        out: dict[str, list[str]] = {}
        for user, group in self._of.items():
            if group is not None:
                out.setdefault(group, []).append(user)
        return out

    def guaranteed(self) -> Limiter:
        """The groups' guaranteed quota: rate, and ceiling for a group with one."""
        if self.ceiling is None:
            return self.rate
        return CeiledLimiter(self.rate, self.ceiling, self.table)

    def cap(self, group: str) -> Limiter | None:
        """The quota a borrowed token of ``group`` is paid on (None: none)."""
        return _cap(self.table, group, self.rate, self.ceiling)

    def joint(self, own: Limiter) -> JointLimiter:
        """Users' guaranteed quota ``own`` paid together with their groups'."""
        return JointLimiter(own, self.guaranteed(), self.of)

    def close(self) -> None:
        self.rate.close()
        if self.ceiling is not None:
            self.ceiling.close()


class GroupShareTable:
    """The users' :class:`~.borrow.ShareTable` seen through their groups: what
    :class:`~.borrow.Borrowing` asks of a table.

    A user *borrows* when its own limit or its group's has room above the
    rate; it is *ceiled* (its borrowed tokens are paid on a quota,
    :class:`CapLimiter`) unless neither level has a ceiling.  A user without a
    group is the users' table's alone.
    """

    def __init__(self, users: ShareTable, groups: GroupQuotas) -> None:
        self.users = users
        self.groups = groups
        self.group_of = groups.of

    def borrows(self, user: str) -> bool:
        if self.users.borrows(user):
            return True
        group = self.group_of(user)
        return group is not None and self.groups.table.borrows(group)

    def ceiled(self, user: str) -> bool:
        group = self.group_of(user)
        if group is None:
            return self.users.ceiled(user)
        users = self.users
        if users.ceiled(user) or not users.borrows(user):
            return True
        return self.groups.cap(group) is not None

    def weight(self, user: str) -> float:
        return self.users.weight(user)

    def group_weight(self, group: str) -> float:
        return self.groups.table.weight(group)

    def ceilings(self) -> tuple[float, dict[str, float]]:
        return self.users.ceilings()

    def any_borrower(self) -> bool:
        return self.users.any_borrower() or self.groups.table.any_borrower()


class CapLimiter:
    """The quota borrowed tokens are paid on, per user, at both levels.

    What :class:`~.borrow.Borrowing` needs of its ceiling (``available``,
    ``take_up_to``, ``refund``), over users: each level (the user, its group)
    with a cap contributes one quota -- its ceiling when it has one above its
    rate, its rate when it is a hard cap -- and a token is taken only when all
    of them can pay, from all of them.  ``ceiling`` is the users' ceiling
    limiter (None while no user has a ceiling above its rate).
    """

    def __init__(self, rate: Limiter, ceiling: Limiter | None, users: ShareTable, groups: GroupQuotas) -> None:
        self.rate = rate
        self.ceiling = ceiling
        self.users = users
        self.groups = groups

    def _own(self, user: str) -> Limiter | None:
        """The user's own cap, its group's aside."""
        return _cap(self.users, user, self.rate, self.ceiling)

    def _levels(self, user: str) -> list[tuple[Limiter, str]]:
        own = self._own(user)
        levels: list[tuple[Limiter, str]] = [] if own is None else [(own, user)]
        group = self.groups.of(user)
        if group is not None:
            cap = self.groups.cap(group)
            if cap is not None:
                levels.append((cap, group))
        return levels

    def group_available(self, group: str, now_ns: int) -> int | None:
        """Tokens ``group``'s own cap could pay for now, shared by its members
        (None: the group has no cap)."""
        cap = self.groups.cap(group)
        return None if cap is None else cap.available(group, now_ns)

    def own_available(self, user: str, now_ns: int) -> int:
        """Tokens the user's own cap could pay for now, its group's aside."""
        own = self._own(user)
        return _UNBOUNDED if own is None else own.available(user, now_ns)

    def available(self, user: str, now_ns: int) -> int:
        return min((limiter.available(key, now_ns) for limiter, key in self._levels(user)), default=_UNBOUNDED)

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` as every level allows, from every level."""
        levels = self._levels(user)
        taken = min(count, self.available(user, now_ns))
        if taken <= 0:
            return 0
        paid: list[tuple[Limiter, str]] = []
        for limiter, key in levels:
            got = limiter.take_up_to(key, now_ns, taken)
            if got < taken:
                for earlier, earlier_key in paid:
                    earlier.refund(earlier_key, now_ns, taken - got)
                taken = got
            paid.append((limiter, key))
        return taken

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        for limiter, key in self._levels(user):
            limiter.refund(key, now_ns, count)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """When every level's cap can pay one token again."""
        return max((limiter.ready_at_ns(key, now_ns) for limiter, key in self._levels(user)), default=now_ns)

    def close(self) -> None:
        """Nothing of its own: the owners of the quotas close them."""
