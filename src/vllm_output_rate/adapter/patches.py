"""The registry of every change this plugin makes to vLLM: :data:`PATCHES`.

vLLM loads general plugins in every process (API server, engine core,
workers) before it parses CLI arguments or resolves the scheduler class, so
:func:`apply_all` -- called from the plugin entry point -- installs these
patches early enough everywhere.  Each entry (:class:`Patch`) names what it
changes, why, the vLLM members it relies on (rows of the checked table in
:mod:`.touchpoints`) and the vLLM series it is installed on.  Every patch
changes vLLM only through :mod:`.install` (idempotent; wrapped callables keep
the original as ``__wrapped__``).  With the feature off, every patched
callable does exactly what the original does.

The scheduler subclasses (:mod:`.scheduler`) override vLLM methods instead of
patching them; their touch-points are in the same table.  Three patches are
written next to what they serve (:mod:`.worker_idle`, :mod:`.metrics`,
:mod:`.admin`) and installed only through this registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
from dataclasses import dataclass
from typing import Any, Callable

from vllm_output_rate.adapter.admin import install_admin_utility
from vllm_output_rate.adapter.compat import installed_series
from vllm_output_rate.adapter.install import wrap
from vllm_output_rate.adapter.metrics import install_prometheus_export, install_stats_field
from vllm_output_rate.adapter.options import add_operate_args, merge_operate_args
from vllm_output_rate.adapter.series import ALL_SERIES
from vllm_output_rate.adapter.worker_idle import install_worker_idle
from vllm_output_rate.settings import (
    CONFIG_KEY,
    DEFAULT_FLAG,
    GROUPS_FLAG,
    LIMITS_FILE_FLAG,
    MODE_FLAG,
    MODE_KEY,
    MODES,
    OVERRIDES_FLAG,
    SHADOW,
    InvalidUserError,
    OutputRateConfigError,
    OutputRateSettings,
    USER_ARG,
    parse_cli,
    resolve_user,
    validate_rate,
)
from vllm_output_rate.stores.config import add_store_args, merge_store_args
from vllm_output_rate.stores.redis_store import check_store_at_startup

logger = logging.getLogger(__name__)

SCHEDULER_CLS = "vllm_output_rate.adapter.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER_CLS = "vllm_output_rate.adapter.scheduler.OutputRateAsyncScheduler"
#: Selected instead while shadow mode is or may become in force (``mode:
#: shadow``, or a limits file, whose reload may switch it): enforce or shadow.
SHADOW_SCHEDULER_CLS = "vllm_output_rate.adapter.shadow.ShadowScheduler"
SHADOW_ASYNC_SCHEDULER_CLS = "vllm_output_rate.adapter.shadow.ShadowAsyncScheduler"

# Whether the latest engine config created in this process turned the
# feature on.  Front-end checks (identity, beam search) follow it.  It is
# mirrored in an environment variable so that API-server processes spawned
# after the config was made (--api-server-count > 1) inherit it.
_FRONTEND_ENV = "VLLM_OUTPUT_RATE_FRONTEND_ACTIVE"
_frontend_active = os.environ.get(_FRONTEND_ENV) == "1"


def frontend_active() -> bool:
    return _frontend_active


def _set_frontend_active(active: bool) -> None:
    global _frontend_active
    _frontend_active = active
    if active:
        os.environ[_FRONTEND_ENV] = "1"
    else:
        os.environ.pop(_FRONTEND_ENV, None)


# -- engine_args.cli -------------------------------------------------------------


def _default_rate_arg(text: str) -> float | str:
    try:
        if text.strip().startswith("{"):  # {"rate": .., "ceil": .., "weight": ..}
            parse_cli(text, None, check_groups=False)
            return text  # parsed again, with the overrides and groups, by parse_cli
        return validate_rate(text, "value")
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix("value: ").removeprefix(f"{DEFAULT_FLAG}: ")
        ) from None


def _overrides_arg(text: str) -> str:
    # Validated here for an early, precise error; kept as text so that
    # from_cli_args has one parsing path for both flags.
    try:
        parse_cli("1", text, check_groups=False)  # the groups: once every flag is in
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix(f"{OVERRIDES_FLAG}: ").removeprefix(f"{OVERRIDES_FLAG}")
        ) from None
    return text


def _groups_arg(text: str) -> str:
    try:
        parse_cli("1", None, text)
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix(f"{GROUPS_FLAG}: ").removeprefix(f"{GROUPS_FLAG}")
        ) from None
    return text


def add_output_rate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        title="OutputRate",
        description=(
            "Per-user output-token rate limits (vllm-output-rate plugin). The "
            "user is vllm_xargs.output_rate_user of each request; requests "
            "without it share the user '__anonymous__'."
        ),
    )
    group.add_argument(
        DEFAULT_FLAG,
        dest="default_user_output_tokens_per_second",
        type=_default_rate_arg,
        default=None,
        metavar="N",
        help="Turn per-user output rate limiting on: every user without its own "
        "entry gets N output tokens/s, shared by all of its requests. "
        "Positive, may be fractional. Off when not given. Also "
        '\'{"rate": N, "ceil": C, "weight": W}\': beyond N, up to C tok/s of spare '
        "capacity (null: no ceiling), shared by weight.",
    )
    group.add_argument(
        OVERRIDES_FLAG,
        dest="user_output_tokens_per_second",
        type=_overrides_arg,
        default=None,
        metavar="JSON",
        help='Per-user overrides as a JSON object, e.g. \'{"user-a": 20, '
        f'"user-b": 500}}\' (tokens/s). Requires {DEFAULT_FLAG}.',
    )
    group.add_argument(
        GROUPS_FLAG,
        dest="output_rate_groups",
        type=_groups_arg,
        default=None,
        metavar="JSON",
        help='Groups of users as a JSON object, e.g. \'{"team-a": {"rate": 200, '
        '"ceil": 400}}\': every token of a user in a group (its limit written '
        '{"rate": N, "group": "team-a"}) is paid on the group\'s quota too. '
        f"Requires {DEFAULT_FLAG}.",
    )
    add_operate_args(parser)
    add_mode_arg(parser)
    add_store_args(parser)


def add_mode_arg(parser: argparse.ArgumentParser) -> None:
    """``--output-rate-mode``, in a group of its own."""
    group = parser.add_argument_group(
        title="OutputRate mode",
        description="Adopt the vllm-output-rate plugin safely: count first, enforce later.",
    )
    group.add_argument(
        MODE_FLAG,
        dest="output_rate_mode",
        choices=MODES,
        default=None,
        help="enforce (default): the limits hold. shadow: vLLM schedules exactly as without "
        "the plugin, and the vllm:output_rate_shadow_* series count what the limits would "
        f"have held, throttled and borrowed. A limits file's 'mode' key wins and switches "
        f"between them on reload ({LIMITS_FILE_FLAG}).",
    )


def merge_mode_arg(args: argparse.Namespace, section: dict | None) -> dict | None:
    """Fold ``--output-rate-mode`` into the ``output_rate`` section."""
    mode = getattr(args, "output_rate_mode", None)
    if mode is None:
        return section
    if section is None:
        raise OutputRateConfigError(
            f"{MODE_FLAG} needs the feature on ({DEFAULT_FLAG} or {LIMITS_FILE_FLAG})"
        )
    section[MODE_KEY] = mode
    return section


def _patch_engine_args_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make_add_cli_args(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            add_output_rate_args(parser)
            return parser

        return add_cli_args

    def make_from_cli_args(original):
        def from_cli_args(cls, args: argparse.Namespace):
            engine_args = original(cls, args)
            merge_cli_into_engine_args(engine_args, args)
            return engine_args

        return from_cli_args

    wrap(EngineArgs, "add_cli_args", make_add_cli_args)
    wrap(EngineArgs, "from_cli_args", make_from_cli_args)


def merge_cli_into_engine_args(engine_args: Any, args: argparse.Namespace) -> None:
    """Move the plugin's flags into ``engine_args.additional_config``."""
    default = getattr(args, "default_user_output_tokens_per_second", None)
    overrides = getattr(args, "user_output_tokens_per_second", None)
    groups = getattr(args, "output_rate_groups", None)
    section = parse_cli(None if default is None else str(default), overrides, groups)
    section = merge_operate_args(args, section)
    section = merge_mode_arg(args, section)
    try:
        section = merge_store_args(args, section)
        if getattr(args, "output_rate_store", None) is not None:
            # Here, in the process that parsed the flag, before any engine
            # starts: a store the engines could never use stops startup in
            # one line instead of leaving every engine in its fallback.
            check_store_at_startup(args.output_rate_store)
    except OutputRateConfigError:
        raise
    except ValueError as exc:  # store flags: one-line message naming the flag
        raise OutputRateConfigError(str(exc)) from None
    if section is None:
        return
    additional = dict(engine_args.additional_config or {})
    if CONFIG_KEY in additional:
        raise OutputRateConfigError(
            f"{DEFAULT_FLAG} and --additional-config '{{\"{CONFIG_KEY}\": ...}}' "
            "both set the output rates; use one of them"
        )
    additional[CONFIG_KEY] = section
    engine_args.additional_config = additional


# -- engine_args.config ----------------------------------------------------------


_MODEL_KIND_WHY = "it is built for text-only attention decoder models"


@dataclass(frozen=True)
class Refusal:
    """One mode the limiter does not support, and how to recognise it.

    ``on_args`` looks at ``EngineArgs`` before vLLM builds its config (a
    quick, precise error, and the only place where a user-chosen
    ``scheduler_cls`` is still visible); ``on_config`` looks at the built
    ``VllmConfig`` (model kinds, and modes vLLM derives or enables itself).
    """

    mode: str
    why: str
    on_args: Callable[[Any], Any] | None = None
    on_config: Callable[[Any], Any] | None = None

    def error(self) -> OutputRateConfigError:
        return OutputRateConfigError(
            f"per-user output rate limiting does not support {self.mode}: {self.why}"
        )


def _has_store(additional_config: Any) -> bool:
    """Does the configuration share the quota through a store?"""
    settings = OutputRateSettings.from_additional_config(additional_config)
    return settings is not None and settings.store is not None


#: Every refused mode, in the order they are checked.  One message format:
#: "per-user output rate limiting does not support MODE: WHY".
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "data_parallel_size > 1 without --output-rate-store",
        "each data-parallel rank has its own scheduler, so every user would "
        "get one quota per rank; with --output-rate-store the ranks share one",
        on_args=lambda a: (a.data_parallel_size or 1) > 1 and not _has_store(a.additional_config),
        on_config=lambda c: (
            c.parallel_config.data_parallel_size > 1 and not _has_store(c.additional_config)
        ),
    ),
    Refusal(
        "pipeline_parallel_size > 1",
        "several micro-batches in flight are not covered by the skip/refund logic",
        on_args=lambda a: (a.pipeline_parallel_size or 1) > 1,
        on_config=lambda c: c.parallel_config.pipeline_parallel_size > 1,
    ),
    Refusal(
        "KV connectors",
        "they change the KV lifecycle the scheduler relies on",
        on_args=lambda a: a.kv_transfer_config is not None,
        on_config=lambda c: c.kv_transfer_config is not None,
    ),
    Refusal(
        "EC connectors",
        "they change the encoder-cache lifecycle",
        on_args=lambda a: getattr(a, "ec_transfer_config", None) is not None,
        on_config=lambda c: getattr(c, "ec_transfer_config", None) is not None,
    ),
    Refusal(
        "KV offloading",
        "it runs through a KV connector",
        on_args=lambda a: getattr(a, "kv_offloading_size", None),
    ),
    Refusal(
        "a custom scheduler_cls",
        "the rate limit is implemented by its own scheduler class",
        on_args=lambda a: a.scheduler_cls is not None,
    ),
    Refusal("pooling models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.runner_type == "pooling"),
    Refusal("encoder-decoder models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.is_encoder_decoder),
    Refusal(
        "hybrid (attention + state-space) models",
        _MODEL_KIND_WHY,
        on_config=lambda c: c.model_config.is_hybrid,
    ),
    Refusal("attention-free models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.is_attention_free),
    Refusal(
        "diffusion models",
        _MODEL_KIND_WHY,
        on_config=lambda c: getattr(c.model_config, "is_diffusion", False),
    ),
)


def check_engine_args(engine_args: Any) -> None:
    """Refuse modes that break per-user accounting, before vLLM builds them."""
    for refusal in REFUSALS:
        if refusal.on_args is not None and refusal.on_args(engine_args):
            if refusal.mode == "a custom scheduler_cls":
                raise dataclasses.replace(
                    refusal, mode=f"a custom scheduler_cls ({engine_args.scheduler_cls!r})"
                ).error()
            raise refusal.error()


def check_vllm_config(vllm_config: Any) -> None:
    """Refuse model kinds and resolved modes the limiter was not built for."""
    for refusal in REFUSALS:
        if refusal.on_config is not None and refusal.on_config(vllm_config):
            raise refusal.error()


def _patch_create_engine_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            settings = OutputRateSettings.from_additional_config(self.additional_config)
            if settings is None:
                _set_frontend_active(False)
                return original(self, *args, **kwargs)
            check_engine_args(self)
            vllm_config = original(self, *args, **kwargs)
            check_vllm_config(vllm_config)
            sched = vllm_config.scheduler_config
            if settings.mode == SHADOW or settings.limits_file:
                sched.scheduler_cls = (
                    SHADOW_ASYNC_SCHEDULER_CLS if sched.async_scheduling else SHADOW_SCHEDULER_CLS
                )
            else:
                sched.scheduler_cls = (
                    ASYNC_SCHEDULER_CLS if sched.async_scheduling else SCHEDULER_CLS
                )
            _set_frontend_active(True)
            logger.info(
                "vllm-output-rate: per-user output rate limiting on (%s mode, default %s tok/s, "
                "%d override(s), %s scheduling)",
                settings.mode,
                settings.default_rate,
                len(settings.user_rates),
                "async" if sched.async_scheduling else "sync",
            )
            return vllm_config

        return create_engine_config

    wrap(EngineArgs, "create_engine_config", make)


# -- engine_core.idle_wait ---------------------------------------------------------


def _patch_engine_idle_wait() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    # Where vLLM feeds a stack-dump watchdog at the start of each step
    # (VllmSeries.engine_watchdog), it switches it off around its own blocking
    # input-queue wait; ours gets the same treatment, so an engine whose
    # users are all throttled never looks stuck.
    idle_wait_guard = installed_series().idle_wait_guard

    def make(original):
        def _process_engine_step(self):
            model_executed = original(self)
            if not model_executed:
                wait_s = getattr(self.scheduler, "output_rate_idle_wait_s", None)
                if wait_s:
                    try:
                        with idle_wait_guard():
                            request = self.input_queue.get(timeout=wait_s)
                    except queue.Empty:
                        pass
                    else:
                        self._handle_client_request(*request)
            return model_executed

        return _process_engine_step

    wrap(EngineCoreProc, "_process_engine_step", make)


# -- sampling_params.identity ------------------------------------------------------


def _patch_identity_validation() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    def make(original):
        def _verify_extra_args(self):
            original(self)
            if _frontend_active and USER_ARG in self.extra_args:
                try:
                    resolve_user(self.extra_args)
                except InvalidUserError as exc:
                    raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None

        return _verify_extra_args

    wrap(SamplingParams, "_verify_extra_args", make)

    from vllm.v1.engine.input_processor import InputProcessor

    def make_validate(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            enabled = self.__dict__.get("_output_rate_enabled")
            if enabled is None:
                config = self.vllm_config.additional_config
                enabled = OutputRateSettings.from_additional_config(config) is not None
                self._output_rate_enabled = enabled
            if enabled and isinstance(params, SamplingParams):
                try:
                    resolve_user(params.extra_args)
                except InvalidUserError as exc:
                    raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None
            return result

        return _validate_params

    wrap(InputProcessor, "_validate_params", make_validate)


# -- beam_search -------------------------------------------------------------------

BEAM_SEARCH_REFUSAL = (
    "beam search is not available while per-user output rate limiting is on "
    "(its candidate expansion is not charged per sampled token)"
)


def _patch_beam_search() -> None:
    from vllm.entrypoints.generate.beam_search.offline import BeamSearchOfflineMixin
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError

    def make_online(original):
        def to_beam_search_params(self, *args, **kwargs):
            if _frontend_active:
                raise VLLMValidationError(BEAM_SEARCH_REFUSAL, parameter="use_beam_search")
            return original(self, *args, **kwargs)

        return to_beam_search_params

    def make_offline(original):
        def beam_search(self, *args, **kwargs):
            config = self.llm_engine.vllm_config.additional_config
            if OutputRateSettings.from_additional_config(config) is not None:
                raise ValueError(BEAM_SEARCH_REFUSAL)
            return original(self, *args, **kwargs)

        return beam_search

    wrap(ChatCompletionRequest, "to_beam_search_params", make_online)
    wrap(CompletionRequest, "to_beam_search_params", make_online)
    wrap(BeamSearchOfflineMixin, "beam_search", make_offline)


@dataclass(frozen=True)
class Patch:
    """One change to vLLM, installed by :func:`apply_all`."""

    name: str
    #: What in vLLM changes.
    changes: str
    #: Why the feature needs it.
    why: str
    #: Names (``TouchPoint.name``) of the rows of :data:`.touchpoints.TOUCHPOINTS`
    #: the patch relies on; ``touchpoints.problems_of`` checks them.
    relies_on: tuple[str, ...]
    install: Callable[[], None]
    #: The vLLM series it is installed on.
    series: tuple[str, ...] = ALL_SERIES


_REFUSAL_ARGS = (
    "data_parallel_size", "pipeline_parallel_size", "kv_transfer_config",
    "ec_transfer_config", "kv_offloading_size", "scheduler_cls",
)
_REFUSAL_CONFIG = (
    "model_config", "parallel_config", "scheduler_config",
    "kv_transfer_config", "ec_transfer_config", "additional_config",
)
_MODEL_KINDS = ("is_encoder_decoder", "is_hybrid", "is_attention_free")
_SPIN = "SpinCondition"

PATCHES: dict[str, Patch] = {p.name: p for p in (
    Patch(
        "engine_args.cli",
        changes="EngineArgs.add_cli_args gains the plugin's flag groups (rates, operation, "
        "store); EngineArgs.from_cli_args folds them into additional_config['output_rate'] "
        "and, in trusted identity modes, appends the identity middleware to --middleware",
        why="vllm serve has no other way to take plugin flags, and additional_config is "
        "what reaches the engine process unchanged",
        relies_on=("EngineArgs.add_cli_args", "EngineArgs.from_cli_args",
                   "EngineArgs.additional_config"),
        install=_patch_engine_args_cli,
    ),
    Patch(
        "engine_args.config",
        changes="EngineArgs.create_engine_config refuses unsupported modes (REFUSALS) and, "
        "with the feature on, selects the plugin's scheduler class",
        why="the limiter lives in the scheduler, and the refused modes would break "
        "one-quota-per-user accounting",
        relies_on=(
            "EngineArgs.create_engine_config", "EngineArgs.additional_config",
            *(f"EngineArgs.{name}" for name in _REFUSAL_ARGS),
            *(f"VllmConfig.{name}" for name in _REFUSAL_CONFIG),
            "ModelConfig.runner_type", *(f"ModelConfig.{name}" for name in _MODEL_KINDS),
            "ParallelConfig.data_parallel_size", "ParallelConfig.pipeline_parallel_size",
            "SchedulerConfig.scheduler_cls", "SchedulerConfig.async_scheduling",
        ),
        install=_patch_create_engine_config,
    ),
    Patch(
        "engine_core.idle_wait",
        changes="EngineCoreProc._process_engine_step: after a step that ran no model, wait "
        "on the input queue (a new request or abort wakes it at once); on series with an "
        "engine watchdog the wait runs with it disabled, as vLLM's own idle wait does",
        why="while every runnable request is throttled, vLLM would poll its loop every "
        "millisecond and burn a core",
        relies_on=(
            "EngineCoreProc._process_engine_step", "EngineCoreProc._handle_client_request",
            "EngineCoreProc.input_queue", "EngineCoreProc.scheduler",
            "vllm.utils.watch_dog.get_watch_dog", "WatchDog.disable",
        ),
        install=_patch_engine_idle_wait,
    ),
    Patch(
        "sampling_params.identity",
        changes="SamplingParams._verify_extra_args rejects a malformed output_rate_user "
        "(HTTP 400) while the request is parsed; InputProcessor._validate_params checks "
        "again for every request an engine with the feature on accepts",
        why="a bad identity must fail its request, not the engine; the second check catches "
        "SamplingParams built before LLM(...)",
        relies_on=(
            "SamplingParams._verify_extra_args", "SamplingParams.extra_args",
            "InputProcessor._validate_params", "InputProcessor.vllm_config",
            "VllmConfig.additional_config", "vllm.exceptions.VLLMValidationError",
        ),
        install=_patch_identity_validation,
    ),
    Patch(
        "beam_search",
        changes="beam search is refused (HTTP 400 online, ValueError offline) while the "
        "feature is on",
        why="its candidate expansion does not go through the one-charge-per-sampled-token path",
        relies_on=(
            "ChatCompletionRequest.to_beam_search_params",
            "CompletionRequest.to_beam_search_params", "BeamSearchOfflineMixin.beam_search",
            "LLM.llm_engine", "LLMEngine.vllm_config", "vllm.exceptions.VLLMValidationError",
        ),
        install=_patch_beam_search,
    ),
    Patch(
        "worker.idle_spin",
        changes="WorkerProc._init_message_queues: the worker's input queue spins a few ms "
        "per wait while steps come far apart, then sleeps until the engine writes "
        "(worker_idle.py)",
        why="vLLM's reader spins 1 s after each read, so a worker serving throttled users "
        "never sleeps",
        relies_on=(
            "WorkerProc._init_message_queues", "WorkerProc.rpc_broadcast_mq",
            "MessageQueue._spin_condition", f"{_SPIN}.is_reader", f"{_SPIN}.busy_loop_s",
            f"{_SPIN}.last_read", f"{_SPIN}.wait", f"{_SPIN}.record_read",
            "vllm.distributed.device_communicators.shm_broadcast.time",
        ),
        install=install_worker_idle,
    ),
    Patch(
        "metrics.scheduler_stats",
        changes="SchedulerStats gains an optional field, output_rate (metrics.py)",
        why="vLLM's msgpack stats path carries the engine's per-user report to the API "
        "server only as a field of its own stats",
        relies_on=("SchedulerStats", "SchedulerStats.output_rate"),
        install=install_stats_field,
    ),
    Patch(
        "metrics.prometheus",
        changes="PrometheusStatLogger.record also exports the per-user report (metrics.py)",
        why="the per-user series belong on vLLM's own /metrics, in its registry",
        relies_on=(
            "PrometheusStatLogger.record", "PrometheusStatLogger.vllm_config",
            "VllmConfig.model_config", "ModelConfig.served_model_name",
        ),
        install=install_prometheus_export,
    ),
    Patch(
        "engine_core.admin_utility",
        changes="EngineCore gains the utility method output_rate_users (admin.py)",
        why="the admin route runs in the API server and reaches the scheduler only "
        "through an engine-core utility call",
        relies_on=(
            "EngineCore.output_rate_users", "EngineCore.scheduler", "AsyncLLM.engine_core",
            "AsyncMPClient.call_utility_async",
        ),
        install=install_admin_utility,
    ),
)}


def apply_all() -> None:
    """Install every patch meant for the installed vLLM series (each at most once)."""
    series = installed_series().name
    for patch in PATCHES.values():
        if series not in patch.series:
            continue
        try:
            patch.install()
        except Exception as exc:  # a missing attribute means an unexpected vLLM
            raise RuntimeError(
                f"vllm-output-rate: cannot install patch {patch.name!r} on this vLLM ({exc})"
            ) from exc


__all__ = [
    "PATCHES",
    "Patch",
    "apply_all",
    "check_engine_args",
    "check_vllm_config",
    "frontend_active",
    "merge_cli_into_engine_args",
]
