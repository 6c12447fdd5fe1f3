"""What differs between the vLLM release series the adapter supports.

One :class:`VllmSeries` per supported ``major.minor`` series, all in
:data:`SERIES`.  Code that must behave differently on two series asks the
installed series' object (``compat.installed_series()``) for a named fact or
helper; nothing else in the adapter compares version numbers.

Adding a series: add its object here (start from a copy of the newest one),
list the differences you find as fields, add the series to the touch-point
table (``touchpoints.py``), and run the checks listed in CONTRIBUTING.md
("Adding a vLLM series").

Importing this module does not import vLLM (the CLI refuses bad versions
before vLLM is imported); the helpers import what they need when called.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, ContextManager


@dataclass(frozen=True)
class VllmSeries:
    """The adapter-relevant facts of one vLLM release series."""

    major: int
    minor: int
    #: Module that defines ``make_arg_parser`` (the parser of ``vllm serve``).
    cli_args_module: str
    #: The engine core has a stack-dump watchdog fed at the start of
    #: ``EngineCoreProc._process_engine_step`` and disabled around blocking
    #: waits on the input queue (``vllm.utils.watch_dog``).
    engine_watchdog: bool
    #: vLLM's waiting loop re-queues a request for which no token can be
    #: scheduled (``_reserve_prefill_lookahead`` returned 0) and goes on with
    #: the next one; before, it stopped admitting for the whole step.  Where
    #: it does, the scheduler's early skip of a waiting request whose user
    #: cannot pay (``_ec_transfer_pending`` override) is redundant but harmless.
    waiting_loop_skips_unschedulable: bool

    @property
    def name(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def key(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def idle_wait_guard(self) -> ContextManager[None]:
        """Context for the plugin's own blocking wait on the engine's input queue.

        Where the engine watchdog exists, it is switched off around the wait
        exactly as vLLM does around its own idle wait; otherwise a no-op.
        """
        if not self.engine_watchdog:
            return contextlib.nullcontext()
        from vllm.utils.watch_dog import get_watch_dog

        return get_watch_dog().disable()

    def make_arg_parser(self, parser: Any) -> Any:
        """vLLM's ``make_arg_parser`` for ``vllm serve`` (its module moved in 0.33)."""
        return importlib.import_module(self.cli_args_module).make_arg_parser(parser)


V0_32 = VllmSeries(
    major=0,
    minor=32,
    cli_args_module="vllm.entrypoints.launchers.cli_args",
    engine_watchdog=False,
    waiting_loop_skips_unschedulable=False,
)

V0_33 = VllmSeries(
    major=0,
    minor=33,
    cli_args_module="vllm.entrypoints.common.cli_args",
    engine_watchdog=True,
    waiting_loop_skips_unschedulable=True,
)

#: Every supported series, oldest first.
SERIES: dict[tuple[int, int], VllmSeries] = {s.key: s for s in (V0_32, V0_33)}
#: Their names (``"0.32"``), for per-series tables.
ALL_SERIES: tuple[str, ...] = tuple(s.name for s in SERIES.values())
