"""Every vLLM member the adapter reads, overrides or relies on, per series.

vLLM does not promise to keep any of these stable: most are private
(``_name``) or internal to its V1 scheduler and engine core.  An upgrade that
renames, removes or re-signs one breaks the adapter, often in ways that only
show as wrong scheduling.  :data:`TOUCHPOINTS` lists them all with the kind
and parameter names the adapter expects, and :func:`problems` checks them
against the installed vLLM (``tests/adapter/test_touchpoints.py`` runs it for the
installed series; each failure names the member and the series).

Kinds:

``class`` / ``function`` / ``module``
    the object exists (a class, a plain function, an importable module);
``method`` / ``classmethod`` / ``staticmethod``
    defined on the class (or a base) as that kind of callable; with
    ``params``, its parameter names after ``self`` / ``cls`` are exactly
    those, in order (``*args`` and ``**kwargs`` are written ``*name`` /
    ``**name``);
``own method``
    like ``method``, but the class must define it itself (not inherit it):
    the adapter overrides it on exactly that class;
``property``
    a ``property`` or ``functools.cached_property`` of the class;
``field``
    a field of the class (dataclass or ``msgspec.Struct``);
``instance attribute``
    assigned as ``self.NAME`` in the source of the class or a vLLM base
    class (set in ``__init__``, not visible on the class);
``enum member``
    a member of the enum class;
``free name``
    a name vLLM does not use on the class (neither a member nor a dataclass
    field), or one the plugin itself added there: a patch adds it.

Adding a touch-point: add a row where the adapter starts to use the member;
``series`` lists the series it holds for (default: every supported series).
A member that differs between series gets one row per series.  A patch of
the registry (:data:`.patches.PATCHES`) names the rows it relies on by
:attr:`TouchPoint.name`; :func:`problems_of` checks them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any, Iterable

from vllm_output_rate.adapter.install import field_is_ours, is_ours, unwrap
from vllm_output_rate.adapter.series import ALL_SERIES

KINDS = (
    "module",
    "class",
    "function",
    "method",
    "own method",
    "classmethod",
    "staticmethod",
    "property",
    "field",
    "instance attribute",
    "enum member",
    "free name",
)


@dataclass(frozen=True)
class TouchPoint:
    """One vLLM member the adapter depends on."""

    #: ``package.module`` or ``package.module:Class``.
    where: str
    #: Attribute name on the class or module; ``""`` for the class or module itself.
    member: str
    kind: str
    #: How the adapter uses it (one line).
    use: str
    #: Parameter names after self/cls, checked for callables when given.
    params: tuple[str, ...] | None = None
    #: Series this row holds for.
    series: tuple[str, ...] = ALL_SERIES

    @property
    def name(self) -> str:
        module, _, cls = self.where.partition(":")
        owner = cls or module
        return f"{owner}.{self.member}" if self.member else owner

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert set(self.series) <= set(ALL_SERIES), self.series


def _tp(where: str, member: str, kind: str, use: str, params: Iterable[str] | None = None,
        series: Iterable[str] = ALL_SERIES) -> TouchPoint:
    return TouchPoint(where, member, kind, use, None if params is None else tuple(params), tuple(series))


SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
ASYNC_SCHED = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"
REQUEST = "vllm.v1.request:Request"
STATUS = "vllm.v1.request:RequestStatus"
ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
VLLM_CONFIG = "vllm.config.vllm:VllmConfig"
MODEL_CONFIG = "vllm.config.model:ModelConfig"
ENGINE_CORE = "vllm.v1.engine.core:EngineCoreProc"
SHM = "vllm.distributed.device_communicators.shm_broadcast"

#: The table.  Grouped by the adapter module that uses the members.
TOUCHPOINTS: tuple[TouchPoint, ...] = (
    # -- adapter/scheduler.py: the Scheduler / AsyncScheduler subclasses ------------
    _tp(SCHED, "", "class", "base class of OutputRateScheduler"),
    _tp(ASYNC_SCHED, "", "class", "base class of OutputRateAsyncScheduler"),
    _tp(SCHED, "schedule", "method", "wrapped: plan before, settle after vLLM's step",
        ["throttle_prefills"]),
    _tp(SCHED, "add_request", "method", "wrapped: the gate tracks each new request", ["request"]),
    _tp(SCHED, "update_from_output", "method",
        "overridden: draft refunds (speculative decoding), residency of streaming-input "
        "sessions",
        ["scheduler_output", "model_runner_output"]),
    _tp(SCHED, "_reserve_prefill_lookahead", "method",
        "overridden and called: the charge at the sampling position",
        ["request", "num_computed_tokens", "num_new_tokens"]),
    _tp(SCHED, "_free_request", "method", "overridden: the gate forgets the request",
        ["request", "delay_free_blocks"]),
    _tp(SCHED, "_preempt_request", "method", "overridden and called: release, evict",
        ["request", "timestamp", "drop_stale_output"]),
    _tp(SCHED, "_handle_blocked_waiting_request", "method",
        "overridden: skip a waiting request whose user cannot pay (a new one of a user in "
        "prompt debt before vLLM's prefix-cache lookup)", ["request"]),
    _tp(SCHED, "_ec_transfer_pending", "method",
        "overridden: skip after the prefix-cache lookup when only the sampled position is left",
        ["request", "num_computed_tokens"]),
    _tp(SCHED, "lora_config", "instance attribute",
        "read: max_loras, for hidden requests' adapters (StepDecision.adapter_fits)"),
    _tp("vllm.config.lora:LoRAConfig", "max_loras", "field",
        "read: adapters a batch may hold"),
    _tp(REQUEST, "mm_features", "instance attribute",
        "read: a chunk cut short for quota never splits a multimodal item"),
    _tp("vllm.multimodal.inputs:MultiModalFeatureSpec", "mm_position", "field",
        "read: where a multimodal item sits in the prompt"),
    *(
        _tp("vllm.multimodal.inputs:PlaceholderRange", name, "field",
            "read: a multimodal item's place in the prompt")
        for name in ("offset", "length")
    ),
    _tp("vllm.config.scheduler:SchedulerConfig", "disable_chunked_mm_input", "field",
        "read: chunks must not end inside a multimodal item"),
    _tp(REQUEST, "lora_request", "instance attribute",
        "read: a waiting request's adapter against those of hidden requests"),
    _tp("vllm.lora.request:LoRARequest", "lora_int_id", "field",
        "read: the adapter's id, as vLLM counts adapters"),
    _tp(SCHED, "_request_blocks_can_be_freed", "method", "called: eviction victim filter",
        ["request"]),
    _tp(SCHED, "has_requests", "method", "read by the engine step (idle wait test)", []),
    _tp(SCHED, "finish_requests", "method", "aborts reach _free_request through it",
        ["request_ids", "finished_status"]),
    _tp(SCHED, "make_stats", "method", "wrapped (operate.py): per-user figures in the stats",
        ["spec_decoding_stats", "kv_connector_stats", "cudagraph_stats", "perf_stats",
         "ec_connector_stats"]),
    _tp(SCHED, "shutdown", "method", "wrapped (operate.py): stops the config watcher", []),
    _tp(SCHED, "max_num_active_reqs", "instance attribute",
        "shadowed by a property: vLLM's __init__ assigns it, its waiting loop reads it"),
    _tp(SCHED, "max_num_running_reqs", "instance attribute", "read: resident cap"),
    _tp(SCHED, "num_waiting_for_streaming_input", "instance attribute",
        "read: slots held by streaming-input sessions"),
    _tp(SCHED, "running", "instance attribute", "swapped for the visible requests during a step"),
    _tp(SCHED, "waiting", "instance attribute", "read; evicted requests re-queued at its head"),
    _tp(SCHED, "requests", "instance attribute", "read: request id -> Request"),
    _tp(SCHED, "kv_cache_manager", "instance attribute",
        "swapped for a stand-in whose allocate_slots evicts throttled requests"),
    _tp(SCHED, "policy", "instance attribute", "read: PRIORITY policy limits eviction"),
    _tp(SCHED, "block_size", "instance attribute",
        "read: KV an evicted request needs to come back"),
    _tp("vllm.v1.core.kv_cache_manager:KVCacheManager", "block_pool", "instance attribute",
        "read: free KV before an evicted request comes back"),
    _tp("vllm.v1.core.block_pool:BlockPool", "get_num_free_blocks", "method",
        "called: free KV before an evicted request comes back", []),
    _tp(SCHED, "scheduler_config", "instance attribute", "read: chunked prefill on/off"),
    _tp(SCHED, "max_num_scheduled_tokens", "instance attribute",
        "read: the step's token budget, what the borrowing demand's admissions share"),
    _tp("vllm.config.scheduler:SchedulerConfig", "long_prefill_token_threshold", "field",
        "read: the longest chunk an admission takes of the step's token budget"),
    _tp("vllm.config.scheduler:SchedulerConfig", "long_prefill_token_threshold_adaptive",
        "field", "read: the threshold is floored inside vLLM's step (no cap assumed)"),
    _tp(SCHED, "vllm_config", "instance attribute", "read: additional_config['output_rate']"),
    _tp("vllm.v1.core.kv_cache_manager:KVCacheManager", "allocate_slots", "method",
        "wrapped by the stand-in: retried after evicting a throttled request",
        ["request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
         "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
         "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks",
         "has_scheduled_reqs", "skip_zeroing_group_ids"]),
    _tp("vllm.v1.core.sched.request_queue:FCFSRequestQueue", "prepend_request", "method",
        "called: an evicted request goes back to the head", ["request"]),
    _tp("vllm.v1.core.sched.request_queue:FCFSRequestQueue", "remove_request", "method",
        "called: keep an evicted request out until the step ends", ["request"]),
    _tp("vllm.v1.core.sched.request_queue:PriorityRequestQueue", "prepend_request", "method",
        "called: an evicted request goes back (priority policy)", ["request"]),
    _tp("vllm.v1.core.sched.request_queue:PriorityRequestQueue", "remove_request", "method",
        "called: keep an evicted request out until the step ends (priority policy)",
        ["request"]),
    _tp("vllm.v1.core.sched.request_queue:SchedulingPolicy", "PRIORITY", "enum member",
        "compared with Scheduler.policy"),
    _tp("vllm.v1.core.sched.utils", "remove_all", "function",
        "called: drop preempted requests from the resident list", ["lst", "items_to_remove"]),
    _tp(REQUEST, "request_id", "instance attribute", "read"),
    _tp(REQUEST, "status", "instance attribute", "read"),
    _tp(REQUEST, "priority", "instance attribute", "read: eviction under PRIORITY"),
    _tp(REQUEST, "sampling_params", "instance attribute", "read: extra_args['output_rate_user']"),
    _tp(REQUEST, "num_computed_tokens", "instance attribute", "read: charge position"),
    _tp(REQUEST, "num_prompt_tokens", "instance attribute",
        "read (prompt_cost.py): prompt positions charged at the input token weight"),
    _tp(REQUEST, "num_output_placeholders", "instance attribute",
        "read: async-scheduling tokens in flight count towards the sampling position"),
    _tp(REQUEST, "is_prefill_chunk", "instance attribute",
        "read: was the request scheduled at a sampling position"),
    _tp(REQUEST, "resumable", "instance attribute", "read: streaming-input session"),
    _tp(REQUEST, "num_tokens", "property", "read: sampling position"),
    _tp(STATUS, "RUNNING", "enum member", "compared"),
    _tp(STATUS, "WAITING", "enum member", "compared"),
    _tp(STATUS, "PREEMPTED", "enum member", "compared"),
    _tp(STATUS, "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "enum member",
        "compared: a request held by vLLM itself disables the idle wait"),
    _tp(STATUS, "FINISHED_ABORTED", "enum member", "tests abort through it"),
    _tp("vllm.v1.core.sched.output:SchedulerOutput", "num_scheduled_tokens", "field",
        "read: what vLLM scheduled"),
    _tp("vllm.v1.core.sched.output:SchedulerOutput", "total_num_scheduled_tokens", "field",
        "read: an empty step arms the idle wait"),
    # -- adapter/scheduler.py: speculative decoding (SpecDecodeHooks) ----------------
    _tp(SCHED, "num_spec_tokens", "instance attribute",
        "read: drafts per step; non-zero installs the draft-charging hook"),
    _tp("vllm.v1.core.sched.output:SchedulerOutput", "scheduled_spec_decode_tokens", "field",
        "read: drafts dispatched per request (kept charged until the output)"),
    _tp(REQUEST, "max_tokens", "instance attribute",
        "read: drafts past max_tokens cannot be emitted and are not charged; what a "
        "borrower's request may still output orders its admission"),
    _tp(REQUEST, "num_output_tokens", "property", "read: tokens left before max_tokens"),
    _tp("vllm.v1.outputs:ModelRunnerOutput", "req_id_to_index", "field",
        "read: a request's row of sampled_token_ids"),
    _tp("vllm.v1.outputs:ModelRunnerOutput", "sampled_token_ids", "field",
        "read: accepted drafts + 1 per request; the rest of its drafts are refunded"),
    # -- adapter/patches.py: engine_args.cli -----------------------------------------
    _tp(ENGINE_ARGS, "add_cli_args", "staticmethod", "wrapped: adds the OutputRate group",
        ["parser"]),
    _tp(ENGINE_ARGS, "from_cli_args", "classmethod",
        "wrapped: flags -> additional_config['output_rate']", ["args"]),
    _tp(ENGINE_ARGS, "additional_config", "field", "read and written"),
    _tp("vllm.entrypoints.launchers.cli_args", "make_arg_parser", "function",
        "vllm serve's parser (series.cli_args_module)", ["parser"], series=["0.32"]),
    _tp("vllm.entrypoints.common.cli_args", "make_arg_parser", "function",
        "vllm serve's parser (series.cli_args_module)", ["parser"], series=["0.33"]),
    _tp("vllm.entrypoints.cli.main", "main", "function",
        "`vllm-output-rate serve` runs vLLM's own CLI in-process", []),
    # -- adapter/patches.py: engine_args.config (refusals, scheduler selection) --------
    _tp(ENGINE_ARGS, "create_engine_config", "method",
        "wrapped: refusals, then selects our scheduler class", ["usage_context", "headless"]),
    *(
        _tp(ENGINE_ARGS, name, "field", "read by a refusal (patches.REFUSALS)")
        for name in (
            "data_parallel_size", "pipeline_parallel_size", "speculative_config",
            "kv_transfer_config", "ec_transfer_config", "kv_offloading_size",
            "scheduler_cls",
        )
    ),
    *(
        _tp(VLLM_CONFIG, name, "field", "read by a refusal or the scheduler selection")
        for name in (
            "model_config", "parallel_config", "scheduler_config", "speculative_config",
            "kv_transfer_config", "ec_transfer_config", "additional_config",
        )
    ),
    _tp(MODEL_CONFIG, "runner_type", "instance attribute", "read: pooling models are refused"),
    *(
        _tp(MODEL_CONFIG, name, "property", "read: model kinds that are refused")
        for name in ("is_encoder_decoder", "is_hybrid", "is_attention_free")
    ),
    _tp("vllm.config.parallel:ParallelConfig", "data_parallel_size", "field",
        "read by a refusal (without a store) and by the scheduler (no idle wait on a DP rank)"),
    _tp("vllm.config.parallel:ParallelConfig", "pipeline_parallel_size", "field",
        "read by a refusal"),
    _tp("vllm.config.scheduler:SchedulerConfig", "scheduler_cls", "field",
        "written: our class when the feature is on"),
    _tp("vllm.config.scheduler:SchedulerConfig", "async_scheduling", "field",
        "read: sync or async subclass"),
    _tp("vllm.config.scheduler:SchedulerConfig", "enable_chunked_prefill", "field",
        "read: how an out-of-quota prefill is cut"),
    # -- adapter/patches.py: engine_core.idle_wait -------------------------------------
    _tp(ENGINE_CORE, "_process_engine_step", "own method",
        "wrapped: wait on the input queue after a step that ran nothing", []),
    _tp(ENGINE_CORE, "_handle_client_request", "method",
        "called with a request that arrived during the idle wait", ["request_type", "request"]),
    _tp(ENGINE_CORE, "input_queue", "instance attribute", "waited on (with a timeout)"),
    _tp(ENGINE_CORE, "scheduler", "instance attribute", "read: output_rate_idle_wait_s"),
    _tp("vllm.utils.watch_dog", "get_watch_dog", "function",
        "the engine watchdog, disabled around the idle wait", [], series=["0.33"]),
    _tp("vllm.utils.watch_dog:WatchDog", "disable", "method",
        "context manager around the idle wait", [], series=["0.33"]),
    # -- adapter/worker_idle.py: worker.idle_spin -------------------------------------
    _tp("vllm.v1.executor.multiproc_executor:WorkerProc", "_init_message_queues", "own method",
        "wrapped: shortens the worker input queue's busy window",
        ["input_shm_handle", "vllm_config"]),
    _tp("vllm.v1.executor.multiproc_executor:WorkerProc", "rpc_broadcast_mq",
        "instance attribute", "read: the worker's input MessageQueue"),
    _tp(SHM + ":MessageQueue", "_spin_condition", "instance attribute",
        "read: the reader's SpinCondition"),
    _tp(SHM + ":SpinCondition", "is_reader", "instance attribute", "read"),
    _tp(SHM + ":SpinCondition", "busy_loop_s", "instance attribute", "written: the spin window"),
    _tp(SHM + ":SpinCondition", "last_read", "instance attribute",
        "written: the busy window counts from the first wait after a read"),
    _tp(SHM, "time", "module", "its monotonic() is the clock SpinCondition.wait compares with"),
    _tp(SHM + ":SpinCondition", "wait", "method", "wrapped per instance", ["timeout_ms"]),
    _tp(SHM + ":SpinCondition", "record_read", "method", "wrapped per instance", []),
    # -- adapter/metrics.py, adapter/admin.py: metrics.*, engine_core.admin_utility ---
    _tp("vllm.v1.metrics.stats:SchedulerStats", "", "class",
        "a dataclass field `output_rate` is added to it"),
    _tp("vllm.v1.metrics.loggers:PrometheusStatLogger", "record", "own method",
        "wrapped: exports the per-user report (engine_idx read: data-parallel ranks' "
        "gauges are summed)",
        ["scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"]),
    _tp("vllm.v1.metrics.loggers:PrometheusStatLogger", "vllm_config", "instance attribute",
        "read: served model name"),
    _tp(MODEL_CONFIG, "served_model_name", "field", "read: metrics label"),
    _tp("vllm.v1.metrics.stats:SchedulerStats", "output_rate", "free name",
        "the field the plugin adds (metrics.scheduler_stats)"),
    _tp("vllm.v1.engine.core:EngineCore", "scheduler", "instance attribute",
        "read by the admin utility method added to EngineCore"),
    _tp("vllm.v1.engine.core:EngineCore", "output_rate_users", "free name",
        "the utility method the plugin adds (engine_core.admin_utility)"),
    _tp("vllm.v1.engine.async_llm:AsyncLLM", "engine_core", "instance attribute",
        "read by the admin route: the client to the engine core"),
    _tp("vllm.v1.engine.core_client:AsyncMPClient", "call_utility_async", "method",
        "called by the admin route", ["method", "*args"]),
    _tp("vllm.plugins.endpoint_plugins.interface:EndpointPlugin", "attach_router", "method",
        "implemented by admin.OutputRateAdminPlugin", ["app"]),
    _tp("vllm.plugins.endpoint_plugins.interface:EndpointPlugin", "init_state", "method",
        "implemented by admin.OutputRateAdminPlugin", ["engine_client", "state", "args"]),
    # -- adapter/patches.py: sampling_params.identity ----------------------------------
    _tp("vllm.sampling_params:SamplingParams", "_verify_extra_args", "own method",
        "wrapped: malformed output_rate_user -> validation error", []),
    _tp("vllm.sampling_params:SamplingParams", "extra_args", "field", "read: the user"),
    _tp("vllm.v1.engine.input_processor:InputProcessor", "_validate_params", "own method",
        "wrapped: the engine checks the user again", ["params", "supported_tasks"]),
    _tp("vllm.v1.engine.input_processor:InputProcessor", "vllm_config", "instance attribute",
        "read: is the feature on"),
    _tp("vllm.exceptions", "VLLMValidationError", "class",
        "raised: becomes HTTP 400 (keyword `parameter`)"),
    # -- adapter/patches.py: beam_search ----------------------------------------------
    _tp("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        "to_beam_search_params", "own method", "wrapped: refused while the feature is on",
        ["max_tokens", "default_sampling_params"]),
    _tp("vllm.entrypoints.openai.completion.protocol:CompletionRequest",
        "to_beam_search_params", "own method", "wrapped: refused while the feature is on",
        ["max_tokens", "default_sampling_params"]),
    _tp("vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin",
        "beam_search", "own method", "wrapped: LLM.beam_search refused while the feature is on",
        ["prompts", "params", "lora_request", "use_tqdm", "concurrency_limit"],
        series=["0.32"]),
    _tp("vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin",
        "beam_search", "own method", "wrapped: LLM.beam_search refused while the feature is on",
        ["prompts", "params", "lora_request", "use_tqdm", "concurrency_limit", "priority"],
        series=["0.33"]),
    _tp("vllm.entrypoints.llm:LLM", "llm_engine", "instance attribute",
        "read by the offline beam-search refusal: is the feature on"),
    _tp("vllm.v1.engine.llm_engine:LLMEngine", "vllm_config", "instance attribute",
        "read by the offline beam-search refusal"),
)


# -- checking ------------------------------------------------------------------------


def _resolve(where: str) -> Any:
    module_name, _, attr = where.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def _class_sources(cls: type) -> str:
    """Source of ``cls`` and its vLLM base classes."""
    texts = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm"):
            continue
        try:
            texts.append(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
    return "\n".join(texts)


def _param_names(func: Any, drop_first: bool) -> tuple[str, ...]:
    params = list(inspect.signature(func).parameters.values())
    if drop_first and params:
        params = params[1:]
    names = []
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            names.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            names.append("**" + p.name)
        else:
            names.append(p.name)
    return tuple(names)


def check(tp: TouchPoint) -> str | None:
    """None if ``tp`` holds for the installed vLLM, else what is wrong."""
    try:
        owner = _resolve(tp.where)
    except (ImportError, AttributeError) as exc:
        return f"{tp.where} cannot be imported ({exc})"
    if not tp.member:
        if tp.kind == "module":
            return None if isinstance(owner, types.ModuleType) else "is not a module"
        if tp.kind == "class":
            return None if isinstance(owner, type) else f"is {type(owner).__name__}, not a class"
        return f"kind {tp.kind!r} needs a member name"

    kind = tp.kind
    if kind == "instance attribute":
        if not isinstance(owner, type):
            return f"{tp.where} is not a class"
        if tp.member in getattr(owner, "__slots__", ()):
            return None
        pattern = rf"\bself\.{re.escape(tp.member)}\s*(:[^=\n]*)?="
        if re.search(pattern, _class_sources(owner)):
            return None
        return "is no longer assigned as self.%s in %s or its vLLM bases" % (
            tp.member, owner.__name__)
    if kind == "field":
        if dataclasses.is_dataclass(owner):
            names = {f.name for f in dataclasses.fields(owner)}
        elif hasattr(owner, "__struct_fields__"):  # msgspec.Struct
            names = set(owner.__struct_fields__)
        else:
            return f"{tp.where} is no longer a dataclass or msgspec.Struct"
        return None if tp.member in names else "is no longer a field"
    if kind == "free name":
        return _free_name_problem(owner, tp.member)
    if kind == "enum member":
        if not (isinstance(owner, type) and issubclass(owner, enum.Enum)):
            return f"{tp.where} is no longer an enum"
        return None if tp.member in owner.__members__ else "is no longer an enum member"

    if isinstance(owner, type):
        if kind == "own method":
            if tp.member not in owner.__dict__:
                return f"is no longer defined by {owner.__name__} itself"
            raw = owner.__dict__[tp.member]
        else:
            raw = inspect.getattr_static(owner, tp.member, _MISSING)
    else:
        raw = getattr(owner, tp.member, _MISSING)
    if raw is _MISSING:
        return "does not exist"

    if kind == "property":
        if isinstance(raw, (property, functools.cached_property)):
            return None
        return f"is {type(raw).__name__}, not a property"
    if kind == "class":
        return None if isinstance(raw, type) else f"is {type(raw).__name__}, not a class"
    if kind == "module":
        return None if isinstance(raw, types.ModuleType) else "is not a module"

    expected_type = {
        "staticmethod": staticmethod,
        "classmethod": classmethod,
    }.get(kind)
    if expected_type is not None:
        if not isinstance(raw, expected_type):
            return f"is {type(raw).__name__}, not a {kind}"
        func = raw.__func__
        drop_first = kind == "classmethod"
    elif kind in ("method", "own method"):
        if not inspect.isfunction(unwrap(raw)):
            return f"is {type(raw).__name__}, not a plain method"
        func = raw
        drop_first = True
    elif kind == "function":
        if not callable(raw) or isinstance(raw, type):
            return f"is {type(raw).__name__}, not a function"
        func = raw
        drop_first = False
    else:  # pragma: no cover - guarded by TouchPoint.__post_init__
        return f"unknown kind {kind!r}"

    if tp.params is not None:
        got = _param_names(unwrap(func), drop_first)
        if got != tp.params:
            return "has parameters (%s), expected (%s)" % (", ".join(got), ", ".join(tp.params))
    return None


_MISSING = object()


def _free_name_problem(owner: Any, name: str) -> str | None:
    if not isinstance(owner, type):
        return "is not a class"
    if name in getattr(owner, "__dataclass_fields__", {}):
        return None if field_is_ours(owner, name) else "is already a field in this vLLM"
    raw = inspect.getattr_static(owner, name, _MISSING)
    if raw is _MISSING or is_ours(raw):
        return None
    return "is already defined in this vLLM"


def for_series(series: str) -> tuple[TouchPoint, ...]:
    """The rows that hold for ``series`` (``"0.33"``)."""
    return tuple(tp for tp in TOUCHPOINTS if series in tp.series)


def problems(series: str) -> list[str]:
    """One line per touch-point of ``series`` that does not hold on the installed vLLM."""
    out = []
    for tp in for_series(series):
        why = check(tp)
        if why is not None:
            out.append(f"vLLM {series}: {tp.name} ({tp.kind}) {why}; used for: {tp.use}")
    return out


def problems_of(names: Iterable[str], series: str) -> list[str]:
    """Like :func:`problems`, for the rows a patch relies on (by ``TouchPoint.name``).

    A name with no row at all is a problem; a name whose rows are all for
    other series is not relied on in ``series``.
    """
    out = []
    for name in names:
        rows = [tp for tp in TOUCHPOINTS if tp.name == name]
        if not rows:
            out.append(f"{name}: no row in touchpoints.TOUCHPOINTS")
        for tp in rows:
            if series in tp.series:
                why = check(tp)
                if why is not None:
                    out.append(f"vLLM {series}: {tp.name} ({tp.kind}) {why}; used for: {tp.use}")
    return out
