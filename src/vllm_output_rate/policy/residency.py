"""Residency follows the rate: how many requests of a user may hold KV.

A resident request (admitted: KV blocks and a model-runner slot) of a user
held to R tokens/s moves only as fast as the user's quota lets it.  Keeping
more requests resident than the quota can move does not make the user any
faster -- it spreads the same R tokens/s over more streams -- but every one
of them holds KV for longer, and KV is what other users run out of first.
So a user's requests become resident only as far as its quota can keep each
of them moving at a minimum pace ``p`` (``min_stream_tokens_per_second``);
the rest wait un-admitted in the waiting queue, holding no KV.

The rule, per user u::

    K(u) = max(1, floor(R(u) / p(u)))          resident requests admitted
    resident(u) <= K(u) <= floor(R(u) / p(u)) + 1

* ``R(u)`` is the fastest the user's quota can pay: its rate for a hard cap,
  its ``ceil`` for a borrower with a ceiling.  A borrower without a ceiling
  may take the engine's whole spare capacity, which the policy cannot know
  in advance: it has no residency cap (``None``), as in stock vLLM.
* ``p(u)`` is the user's own ``min_stream_tokens_per_second`` or the
  top-level default (:data:`DEFAULT_MIN_STREAM_TOKENS_PER_SECOND`); 0 turns
  the rule off for that user.
* ``max(1, ...)``: a user slower than one stream's minimum pace still runs
  one request at a time (the ``+ 1`` of the bound covers it).
* K(u) streams sharing R(u) each get R(u) / K(u) >= p(u) tokens/s while all
  of them decode (a stream alone may go faster, up to the engine's speed).
* Ratios of configured numbers are taken on their decimal values
  (``Fraction(repr(x))``), so 0.6 / 0.2 is 3, not 2.999... floored to 2.

The bound holds for requests admitted under the rule.  Requests admitted
before a limit was lowered (a reload), or beyond a borrower's spare capacity
while it lasted, may exceed it: :meth:`Residency.surplus` counts them, and
:class:`~vllm_output_rate.policy.displacement.Displacement` releases those
first when another user's request needs KV (least generated first, within
the recompute budget).

A newcomer's wait.  A request of a user within its cap and with quota,
finding no free KV when vLLM's waiting loop reaches it, is admitted in that
same step when a throttled user holds a surplus stream whose recompute the
budget affords.  Otherwise every throttled user u holds at most K(u)
requests, so when the KV cache holds sum over throttled users of K(u)
full-length requests plus the newcomer's prompt, the newcomer finds room in
the step it arrives in and samples its first token within
ceil(prompt / max_num_batched_tokens) steps -- whatever the recompute
budget, 0 included (``tests/adapter/test_residency_scheduler.py``).

With limits never hit the cap does not bind in practice: K(u) streams
decoding every step of length T ask for K(u) / T tokens/s, more than R(u)
once T < 1 / p(u) (0.5 s at the default), so a user holding more than K(u)
decoding streams on such steps is refused within its burst.  The
stock-equivalence test (limits of 1e9 tok/s) runs unchanged.

Plain Python: no vLLM import.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, Mapping

#: Default minimum pace of one resident stream, in tokens/s.  Two tokens a
#: second is a stream a reader sees moving (a word about every half second)
#: and keeps clients and proxies far from their idle timeouts, while a user
#: limited to R tok/s holds at most R/2 requests' KV.  Faster minimums bound
#: KV tighter but make a throttled user's requests wait un-admitted sooner.
DEFAULT_MIN_STREAM_TOKENS_PER_SECOND = 2.0

#: What :meth:`Residency.cap` returns for a user without a residency cap.
NO_CAP = None
#: Most users whose cap :class:`Residency` keeps (then it forgets them all).
_USERS_KEPT = 1 << 16


def _decimal(value: float) -> Fraction:
    return Fraction(repr(float(value)))


def residency_cap(top_rate: float | None, min_pace: float) -> int | None:
    """K = max(1, floor(top_rate / min_pace)); None (no cap) without a top
    rate (a borrower without ceiling) or with ``min_pace`` 0 (rule off)."""
    if top_rate is None or min_pace <= 0:
        return NO_CAP
    return max(1, int(_decimal(top_rate) // _decimal(min_pace)))


class Residency:
    """Per-user residency caps from the users' limits and minimum paces.

    ``limit_of(user)`` returns the user's (rate, ceil) -- ceil None: no
    ceiling -- as configured; ``paces`` holds the users with a minimum pace
    of their own, ``default_pace`` is everybody else's.  Caps are computed
    once per distinct (rate or ceiling, pace), and each user's is kept (every
    step asks for the same users' again, once per waiting request), until
    :meth:`update` (a reload) forgets them all.

    Invariants (``tests/policy/test_residency.py``):

    * ``cap(u)`` is None or >= 1, and ``cap(u) <= floor(R/p) + 1``;
    * ``admits(u, n)`` iff ``cap(u)`` is None or ``n < cap(u)``: admitting
      while it holds never takes a user beyond its cap;
    * ``surplus(u, n) = max(0, n - cap(u))`` (0 without a cap).
    """

    __slots__ = ("_default_pace", "_paces", "_limit_of", "_caps", "_cap_of")

    def __init__(
        self,
        default_pace: float,
        paces: Mapping[str, float],
        limit_of: Callable[[str], tuple[float, float | None]],
    ) -> None:
        self._caps: dict[tuple[float | None, float], int | None] = {}
        self._cap_of: dict[str, int | None] = {}  # user -> cap, at most _USERS_KEPT
        self.update(default_pace, paces, limit_of)

    def update(
        self,
        default_pace: float,
        paces: Mapping[str, float],
        limit_of: Callable[[str], tuple[float, float | None]],
    ) -> None:
        """New limits or paces (a reload): every cap is computed afresh."""
        if default_pace < 0 or any(p < 0 for p in paces.values()):
            raise ValueError("minimum paces must not be negative")
        self._default_pace = default_pace
        self._paces = dict(paces)
        self._limit_of = limit_of
        self._caps.clear()
        self._cap_of.clear()

    def cap(self, user: str) -> int | None:
        """Resident requests ``user`` may be admitted up to (None: no cap)."""
        cap_of = self._cap_of
        if user in cap_of:
            return cap_of[user]
        rate, ceil = self._limit_of(user)
        key = (None if ceil is None else max(rate, ceil), self._paces.get(user, self._default_pace))
        caps = self._caps  # per distinct (top rate, pace): as many as configured limits
        if key in caps:
            cap = caps[key]
        else:
            cap = caps[key] = residency_cap(*key)
        if len(cap_of) >= _USERS_KEPT:
            cap_of.clear()  # bounded whatever user names requests bring
        cap_of[user] = cap
        return cap

    def admits(self, user: str, resident: int) -> bool:
        """May one more request of ``user``, which holds ``resident``, be admitted?"""
        cap = self.cap(user)
        return cap is None or resident < cap

    def room(self, user: str, resident: int) -> int | None:
        """How many more requests ``user`` may be admitted (None: no cap)."""
        cap = self.cap(user)
        return None if cap is None else max(0, cap - resident)

    def surplus(self, user: str, resident: int) -> int:
        """Resident requests of ``user`` beyond its cap (from a lowered limit)."""
        cap = self.cap(user)
        return 0 if cap is None else max(0, resident - cap)
