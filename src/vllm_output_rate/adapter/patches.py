"""Every place where this plugin changes vLLM behaviour, in one module.

vLLM loads general plugins in every process (API server, engine core,
workers) before it parses CLI arguments or resolves the scheduler class, so
:func:`apply_all` -- called from the plugin entry point -- installs these
patches early enough everywhere.  Each patch is small, named, idempotent, and
keeps the original callable as ``__wrapped__``.  With the feature off, every
patched callable does exactly what the original does.

Touch-points (vLLM 0.32 and 0.33; every vLLM member they use is listed, with
its expected kind and signature per series, in :mod:`.touchpoints`):

``engine_args.cli``
    ``EngineArgs.add_cli_args`` gains the two ``--*-output-tokens-per-second``
    flags in their own group; ``EngineArgs.from_cli_args`` turns them into
    ``additional_config["output_rate"]``.
``engine_args.config``
    ``EngineArgs.create_engine_config`` refuses unsupported modes (the
    :data:`REFUSALS` table) and selects
    our scheduler subclass when the feature is on (stock class otherwise).
``engine_core.idle_wait``
    ``EngineCoreProc._process_engine_step``: after a step that ran no model
    because everything was throttled, wait on the input queue (a new request
    or abort wakes it at once) instead of polling every millisecond.  On
    series with an engine watchdog the wait runs with it disabled, as vLLM's
    own idle wait does (:meth:`.series.VllmSeries.idle_wait_guard`).
``sampling_params.identity``
    ``SamplingParams._verify_extra_args`` rejects malformed
    ``output_rate_user`` values with a validation error (HTTP 400) while the
    request is parsed; ``InputProcessor._validate_params`` checks again for
    every request an engine with the feature on accepts (this catches
    ``SamplingParams`` built before ``LLM(...)``).
``beam_search``
    Beam search is refused (HTTP 400 online, ValueError offline) while the
    feature is on: its candidate expansion does not go through the
    one-charge-per-sampled-token path.
``worker.idle_spin``
    ``WorkerProc._init_message_queues``: the model worker's input queue spins
    a few ms per wait instead of 1 s after each read, then sleeps until the
    engine writes (see :mod:`.worker_idle`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import queue
from dataclasses import dataclass
from typing import Any, Callable

from vllm_output_rate.settings import (
    CONFIG_KEY,
    DEFAULT_FLAG,
    OVERRIDES_FLAG,
    InvalidUserError,
    OutputRateConfigError,
    OutputRateSettings,
    USER_ARG,
    parse_cli,
    resolve_user,
    validate_rate,
)
from vllm_output_rate.adapter.worker_idle import patch_worker_idle

logger = logging.getLogger(__name__)

_PATCHED_MARK = "_vllm_output_rate_patch"

SCHEDULER_CLS = "vllm_output_rate.adapter.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER_CLS = "vllm_output_rate.adapter.scheduler.OutputRateAsyncScheduler"

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


def _install(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)`` once."""
    current = owner.__dict__[name]
    inner = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    if getattr(inner, _PATCHED_MARK, False):
        return
    replacement = make(inner)
    functools.update_wrapper(replacement, inner)
    setattr(replacement, _PATCHED_MARK, True)
    if isinstance(current, staticmethod):
        replacement = staticmethod(replacement)
    elif isinstance(current, classmethod):
        replacement = classmethod(replacement)
    setattr(owner, name, replacement)


# -- engine_args.cli -------------------------------------------------------------


def _default_rate_arg(text: str) -> float:
    try:
        return validate_rate(text, "value")
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


def _overrides_arg(text: str) -> str:
    # Validated here for an early, precise error; kept as text so that
    # from_cli_args has one parsing path for both flags.
    try:
        parse_cli("1", text)
    except OutputRateConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc).removeprefix(f"{OVERRIDES_FLAG}: ").removeprefix(f"{OVERRIDES_FLAG}")
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
        "Positive, may be fractional. Off when not given.",
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
    from vllm_output_rate.adapter.options import add_operate_args

    add_operate_args(parser)
    from vllm_output_rate.stores.config import add_store_args

    add_store_args(parser)


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

    _install(EngineArgs, "add_cli_args", make_add_cli_args)
    _install(EngineArgs, "from_cli_args", make_from_cli_args)


def merge_cli_into_engine_args(engine_args: Any, args: argparse.Namespace) -> None:
    """Move the two flags into ``engine_args.additional_config``."""
    default = getattr(args, "default_user_output_tokens_per_second", None)
    overrides = getattr(args, "user_output_tokens_per_second", None)
    section = parse_cli(None if default is None else str(default), overrides)
    from vllm_output_rate.adapter.options import merge_operate_args

    section = merge_operate_args(args, section)
    from vllm_output_rate.stores.config import merge_store_args

    try:
        section = merge_store_args(args, section)
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


#: Every refused mode, in the order they are checked.  One message format:
#: "per-user output rate limiting does not support MODE: WHY".
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "data_parallel_size > 1",
        "each data-parallel rank has its own scheduler, so every user would "
        "get one quota per rank",
        on_args=lambda a: (a.data_parallel_size or 1) > 1,
        on_config=lambda c: c.parallel_config.data_parallel_size > 1,
    ),
    Refusal(
        "pipeline_parallel_size > 1",
        "several micro-batches in flight are not covered by the skip/refund logic",
        on_args=lambda a: (a.pipeline_parallel_size or 1) > 1,
        on_config=lambda c: c.parallel_config.pipeline_parallel_size > 1,
    ),
    Refusal(
        "speculative decoding",
        "one step can emit several tokens per request but is charged once",
        on_args=lambda a: a.speculative_config,
        on_config=lambda c: c.speculative_config is not None,
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
        "LoRA adapters",
        "requests out of quota leave vLLM's running list during a step, so "
        "vLLM's max_loras check does not count their adapters (the engine "
        "then fails its own assertion)",
        on_args=lambda a: a.enable_lora,
        on_config=lambda c: c.lora_config is not None,
    ),
    Refusal(
        "a custom scheduler_cls",
        "the rate limit is implemented by its own scheduler class",
        on_args=lambda a: a.scheduler_cls is not None,
    ),
    Refusal("pooling models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.runner_type == "pooling"),
    Refusal("encoder-decoder models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.is_encoder_decoder),
    Refusal("multimodal models", _MODEL_KIND_WHY, on_config=lambda c: c.model_config.is_multimodal_model),
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
            sched.scheduler_cls = (
                ASYNC_SCHEDULER_CLS if sched.async_scheduling else SCHEDULER_CLS
            )
            _set_frontend_active(True)
            logger.info(
                "vllm-output-rate: per-user output rate limiting on (default %s tok/s, "
                "%d override(s), %s scheduling)",
                settings.default_rate,
                len(settings.user_rates),
                "async" if sched.async_scheduling else "sync",
            )
            return vllm_config

        return create_engine_config

    _install(EngineArgs, "create_engine_config", make)


# -- engine_core.idle_wait ---------------------------------------------------------


def _patch_engine_idle_wait() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_output_rate.adapter.compat import installed_series

    # vLLM 0.33+ feeds a stack-dump watchdog at the start of each step and
    # switches it off around its own blocking input-queue wait; ours gets
    # the same treatment, so a throttled-only engine never looks stuck.
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

    _install(EngineCoreProc, "_process_engine_step", make)


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

    _install(SamplingParams, "_verify_extra_args", make)

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

    _install(InputProcessor, "_validate_params", make_validate)


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

    _install(ChatCompletionRequest, "to_beam_search_params", make_online)
    _install(CompletionRequest, "to_beam_search_params", make_online)
    _install(BeamSearchOfflineMixin, "beam_search", make_offline)


def _operate(module: str) -> Any:
    """Engineer C's operate modules (identity, metrics, admin), imported on use."""
    import importlib

    return importlib.import_module(f"vllm_output_rate.adapter.{module}")


PATCHES: dict[str, Callable[[], None]] = {
    "engine_args.cli": _patch_engine_args_cli,
    "engine_args.config": _patch_create_engine_config,
    "engine_core.idle_wait": _patch_engine_idle_wait,
    "sampling_params.identity": _patch_identity_validation,
    "beam_search": _patch_beam_search,
    "worker.idle_spin": patch_worker_idle,
    "metrics.scheduler_stats": lambda: _operate("metrics").patch_scheduler_stats(),
    "metrics.prometheus": lambda: _operate("metrics").patch_prometheus_logger(),
    "engine_core.admin_utility": lambda: _operate("admin").patch_engine_core_utility(),
}


def apply_all() -> None:
    for name, patch in PATCHES.items():
        try:
            patch()
        except Exception as exc:  # a missing attribute means an unexpected vLLM
            raise RuntimeError(
                f"vllm-output-rate: cannot install patch {name!r} on this vLLM ({exc})"
            ) from exc


__all__ = [
    "apply_all",
    "check_engine_args",
    "check_vllm_config",
    "frontend_active",
    "merge_cli_into_engine_args",
]
