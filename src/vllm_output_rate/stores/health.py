"""Is the shared store answering?  The mode in force, and when it changes.

``shared`` while the store answers; after ``outage_after_ns`` of silence
the configured fallback (``local`` or ``closed``) until the next answer.
The silence counts from the last answer, or, when a round with nothing to
ask came after that answer, from the first failed round trip: such an idle
round sends nothing (no ping: round trips cost) and so proves nothing, and
it never counts as an answer.  One log line when an outage starts, one when
it ends.
"""

from __future__ import annotations

import logging
from typing import Callable

from vllm_output_rate.policy.gcra import NS_PER_S
from vllm_output_rate.stores.backend import CLOSED, LOCAL, SHARED, LeaseConfig

# The log lines keep the engine side's logger name, which operators filter on.
logger = logging.getLogger("vllm_output_rate.stores.lease")


class StoreHealth:
    """The outage state machine of one engine's lease rounds (callers hold the book's lock)."""

    def __init__(
        self, config: LeaseConfig, describe: Callable[[], str], stats: dict[str, int], now_ns: int
    ) -> None:
        self._config = config
        self._describe = describe
        self._stats = stats
        self.mode = SHARED
        self._outage_started_ns: int | None = None
        self._last_answer_ns = now_ns  # the store counts as up at start
        # Start of the current run of failed round trips (None: the last one was answered).
        self._silent_since_ns: int | None = None
        self._idle_since_answer = True  # no round trip since the last answer (none yet)

    def idle_round(self) -> None:
        """A round had nothing to ask, so it sent nothing and learnt nothing."""
        self._idle_since_answer = True

    def failed(self, now_ns: int, exc: BaseException) -> bool:
        """A round trip got no answer; True when the engine is (still) in an outage.

        One slow or lost answer on a loaded machine is not an outage; no
        answer for ``outage_after_ns`` is.
        """
        if self._silent_since_ns is None:
            self._silent_since_ns = now_ns if self._idle_since_answer else self._last_answer_ns
        if now_ns - self._silent_since_ns < self._config.outage_after_ns:
            return False
        if self._outage_started_ns is None:
            self._outage_started_ns = now_ns
            self._stats["outages"] += 1
            what = (
                f"each engine enforces rate / {self._config.expected_engines} locally"
                if self._config.fallback == LOCAL
                else "every limited user pauses"
            )
            logger.warning(
                "output-rate store %s unreachable (%s); until it answers, %s",
                self._describe(),
                type(exc).__name__,
                what,
            )
        self.mode = LOCAL if self._config.fallback == LOCAL else CLOSED
        return True

    def answered(self, received_ns: int) -> None:
        """A round trip was answered: the store is up, shared quota again."""
        self._last_answer_ns = received_ns
        self._silent_since_ns = None
        self._idle_since_answer = False
        if self.mode is SHARED:
            return
        started, self._outage_started_ns = self._outage_started_ns, None
        self.mode = SHARED
        logger.warning(
            "output-rate store %s answers again after %.1f s; shared quota resumed",
            self._describe(),
            (received_ns - started) / NS_PER_S if started is not None else 0.0,
        )

    def restart(self, now_ns: int) -> None:
        """Count the store as just answered at ``now_ns`` (a new clock)."""
        self._last_answer_ns = now_ns
        self._silent_since_ns = None
        self._idle_since_answer = True
