"""Drive the real vLLM scheduler and KV cache manager without a model.

A :class:`Harness` builds vLLM's own config from the tiny model folder, a KV
cache of a chosen size, and either the stock or our scheduler class.  Each
:meth:`Harness.step` schedules, fabricates the model runner's output (one
sampled token per request that reached its sampling position) and feeds it
back; the limiter reads a fake clock that the harness advances.

With ``async_=True`` the harness runs like vLLM's async scheduling: step
N+1 is scheduled before step N's output is fed back.

With ``spec_tokens=k`` vLLM is configured for ngram speculative decoding
with ``k`` drafts: after each synchronous step the harness proposes drafts
(:attr:`Harness.draft_len` of them) as vLLM's engine would, and each step's
fabricated output holds the accepted drafts (:attr:`Harness.accepted_of`)
plus one token.

Importing this module registers the plugin's patches (as vLLM's plugin
loader would), so it belongs to tests and benchmarks, never to a server.
The model folder defaults to ``TINY_MODEL_DIR`` or ``models/tiny-llama``
relative to the working directory (only its config and tokenizer are read).
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import vllm_output_rate
from vllm_output_rate.adapter.scheduler import (
    OutputRateAsyncScheduler,
    OutputRateScheduler,
)
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR

BLOCK_SIZE = 16
TOKEN = 7  # every fabricated sampled token (never EOS of the tiny model)
STOP = 9  # emitted where a test asks for a stop (requests list it in stop_token_ids)
MS = 1_000_000

vllm_output_rate.register()  # install the patches as vLLM's plugin loader would
init_none_hash(sha256)


class FakeClock:
    def __init__(self, start_ns: int = 1_000_000_000_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> None:
        self.now_ns += ns


@dataclass
class Record:
    """What happened to one request, as seen from outside the scheduler."""

    user: str
    max_tokens: int
    prompt_len: int
    sample_times: list = field(default_factory=list)  # clock at each sampled token
    finished: bool = False


class Harness:
    def __init__(
        self,
        limits: dict | None,
        *,
        async_: bool = False,
        num_blocks: int = 2000,
        max_num_seqs: int = 16,
        max_num_active_seqs: int | None = None,
        max_num_batched_tokens: int = 512,
        chunked: bool = True,
        policy: str = "fcfs",
        max_model_len: int = 1024,
        prefix_caching: bool = True,
        model_dir: str | os.PathLike = DEFAULT_MODEL_DIR,
        max_loras: int | None = None,
        encoder_cache_size: int | None = None,
        disable_chunked_mm_input: bool = False,
        spec_tokens: int = 0,
        scheduler_cls: type | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        if not chunked:
            max_model_len = min(max_model_len, max_num_batched_tokens)
        additional = {}
        if limits is not None:
            additional["output_rate"] = limits
        args = EngineArgs(
            model=str(model_dir),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_active_seqs=max_num_active_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,
            enable_prefix_caching=prefix_caching,
            additional_config=additional,
            # LoRA on: requests may name adapters (``add(lora=...)``); only
            # the scheduler's max_loras accounting is exercised, nothing loads.
            **({} if max_loras is None else
               {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": 8}),
            disable_chunked_mm_input=disable_chunked_mm_input,
            speculative_config=(
                {"method": "ngram", "num_speculative_tokens": spec_tokens, "prompt_lookup_max": 3}
                if spec_tokens
                else None
            ),
        )
        config = args.create_engine_config()
        config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer.0"],
                    FullAttentionSpec(
                        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32
                    ),
                )
            ],
        )
        if limits is None:
            cls = AsyncScheduler if async_ else Scheduler
        else:
            cls = OutputRateAsyncScheduler if async_ else OutputRateScheduler
        cls = scheduler_cls or cls
        self.config = config
        self.num_blocks = num_blocks
        self.async_ = async_
        self.sched = cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
        )
        if encoder_cache_size is not None:
            # Multimodal requests (``add(images=...)``): an encoder cache and
            # a per-step encoder budget of that many embeddings, as vLLM sizes
            # them for a vision-language model (a text model has neither).
            self.sched.max_num_encoder_input_tokens = encoder_cache_size
            self.sched.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_cache_size)
        self.clock = clock or FakeClock()
        if limits is not None:
            self.sched.output_rate_clock = self.clock
        self._block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._ids = itertools.count()
        self._in_flight: deque = deque()
        self.records: dict[str, Record] = {}
        self.charges: dict[str, list] = defaultdict(list)  # user -> clock of each dispatched sample
        self.dispatched: dict[str, int] = defaultdict(int)  # request id -> sampling steps dispatched
        self.sampled_log: list[list[str]] = []  # per step: ids scheduled at a sampling position
        self.stop_at: dict[str, int] = {}  # request id -> output index that is the stop token
        self.step_outputs: list = []
        self.shadow = None
        self.spec_tokens = spec_tokens
        #: Speculative decoding: drafts offered per request and step, and how
        #: many of them the "model" accepts; both depend only on the request
        #: and its output position, never on the batch.
        self.draft_len = _default_draft_len
        self.accepted_of = _default_accepted
        # Tokens recomputed when preempted requests came back: vLLM's own
        # prefix-cache statistics keep re-admissions apart (queries - hits).
        self.recomputed_tokens = 0
        manager = self.sched.kv_cache_manager
        manager.log_stats = True
        manager.prefix_cache_stats = PrefixCacheStats()
        settings = None if limits is None else OutputRateSettings.from_additional_config(
            {"output_rate": limits}
        )
        if settings is not None and not settings.borrows() and not spec_tokens:
            # A limiter that only ever sees the samples that really happened
            # (with borrowing, users may go beyond their rates; with drafts a
            # charge settles only when the output arrives, and the spec-decode
            # tests check the bound on emitted tokens: no shadow).
            self.shadow = OutputRateLimiter(settings.default_rate, settings.user_rates, settings.burst_ns)

    # -- requests ------------------------------------------------------------

    def add(
        self,
        user: str | None,
        prompt_len: int = 8,
        max_tokens: int = 16,
        *,
        priority: int = 0,
        prompt: list[int] | None = None,
        request_id: str | None = None,
        lora: int | None = None,
        images: list[tuple[int, int, str]] = (),
    ) -> Request:
        extra = None if user is None else {"output_rate_user": user}
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra, stop_token_ids=[STOP]
        )
        rid = request_id or f"r{next(self._ids)}"
        tokens = prompt if prompt is not None else [(i % 50) + 100 for i in range(prompt_len)]
        request = Request(
            rid,
            tokens,
            params,
            None,
            arrival_time=self.clock.now_ns / 1e9,
            priority=priority,
            block_hasher=self._block_hasher,
            lora_request=None if lora is None else LoRARequest(f"adapter-{lora}", lora, "/unused"),
            mm_features=[
                MultiModalFeatureSpec(
                    data=None, modality="image", identifier=name,
                    mm_position=PlaceholderRange(offset=offset, length=length),
                )
                for offset, length, name in images  # identical names: one cached item
            ] or None,
        )
        self.sched.add_request(request)
        self.records[rid] = Record(user or "__anonymous__", max_tokens, len(tokens))
        return request

    def abort(self, request_id: str) -> None:
        self.sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.records[request_id].finished = True

    # -- steps ------------------------------------------------------------------

    def step(self, dt_ns: int = 10 * MS):
        """Schedule one step; feed back outputs (async: the previous step's)."""
        running_before = {r.request_id for r in self.sched.running}
        output = self.sched.schedule()
        # Drafts vLLM pads a newly admitted decode with are -1 sentinels that
        # the model never accepts.
        padded = {rid for rid in output.scheduled_spec_decode_tokens if rid not in running_before}
        stats = self.sched.kv_cache_manager.make_prefix_cache_stats()
        self.recomputed_tokens += stats.preempted_queries - stats.preempted_hits
        sampling = self._sampling_ids(output)
        for rid in sampling:
            user = self.records[rid].user
            self.charges[user].append(self.clock.now_ns)
            self.dispatched[rid] += 1
            if self.shadow is not None:
                assert self.shadow.try_take(user, self.clock.now_ns), "dispatched beyond quota"
        self.sampled_log.append(sampling)
        self._in_flight.append((output, sampling, self.clock.now_ns, padded))
        self.step_outputs.append(output)
        depth = 2 if self.async_ else 1
        while len(self._in_flight) >= depth:
            self._feed(*self._in_flight.popleft())
        self.clock.advance(dt_ns)
        return output

    def drain(self) -> None:
        while self._in_flight:
            self._feed(*self._in_flight.popleft())

    def _sampling_ids(self, output) -> list[str]:
        return [
            rid
            for rid in output.num_scheduled_tokens
            if not self.sched.requests[rid].is_prefill_chunk
        ]

    def _feed(self, output, sampling: list[str], sampled_at: int, padded: set) -> None:
        req_ids = list(output.num_scheduled_tokens)
        sampled = set(sampling)
        spec = output.scheduled_spec_decode_tokens
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[
                self._tokens_of(rid, 0 if rid in padded else len(spec.get(rid, ())))
                if rid in sampled
                else []
                for rid in req_ids
            ],
        )
        engine_outputs = self.sched.update_from_output(output, runner_output)
        if self.spec_tokens and not self.async_:
            # Sync scheduling: the engine hands the drafter's proposals to
            # the scheduler after each step (async: vLLM uses placeholders).
            proposing = [
                rid for rid in sampling
                if rid in self.sched.requests and not self.sched.requests[rid].is_finished()
            ]
            self.sched.update_draft_token_ids(
                DraftTokenIds(
                    proposing,
                    [
                        [TOKEN] * self.draft_len(rid, self.sched.requests[rid].num_output_tokens,
                                                 self.spec_tokens)
                        for rid in proposing
                    ],
                )
            )
        for client_outputs in engine_outputs.values():
            for out in client_outputs.outputs:
                record = self.records[out.request_id]
                record.sample_times.extend([sampled_at] * len(out.new_token_ids))
                if out.finish_reason is not None:
                    record.finished = True

    def _tokens_of(self, rid: str, drafts: int) -> list[int]:
        """The step's sampled tokens: the accepted drafts, then one more."""
        request = self.sched.requests.get(rid)
        produced = request.num_output_tokens if request is not None else 0
        accepted = min(drafts, self.accepted_of(rid, produced, drafts)) if drafts else 0
        stop = self.stop_at.get(rid)
        return [STOP if stop == produced + i else TOKEN for i in range(accepted + 1)]

    def check_limiter_exact(self) -> None:
        """Every charge that did not sample was refunded, exactly."""
        real = self.sched.output_rate_limiter
        now = self.clock.now_ns
        for user in set(self.charges) | {r.user for r in self.records.values()}:
            assert real.ready_at_ns(user, now) == self.shadow.ready_at_ns(user, now), user
            assert real.available(user, now) == self.shadow.available(user, now), user

    def run_until_done(self, dt_ns: int = 10 * MS, max_steps: int = 100_000) -> int:
        steps = 0
        while self.sched.has_requests() and steps < max_steps:
            self.step(dt_ns)
            steps += 1
        self.drain()
        return steps

    # -- invariants -------------------------------------------------------------

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def check_resident_consistent(self) -> None:
        """`running` holds exactly the gate's resident requests, all RUNNING."""
        sched = self.sched
        if not hasattr(sched, "output_rate_gate"):
            return
        running = set(map(id, sched.running))
        assert len(running) == len(sched.running), "duplicate in running"
        resident = set(map(id, sched.output_rate_gate.lanes.resident()))
        assert running == resident
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        assert len(sched.running) <= sched.max_num_running_reqs


def _default_draft_len(rid: str, produced: int, k: int) -> int:
    return zlib.crc32(f"d{rid}:{produced}".encode()) % (k + 1)


def _default_accepted(rid: str, produced: int, drafts: int) -> int:
    return zlib.crc32(f"a{rid}:{produced}".encode()) % (drafts + 1)


def max_in_window(times: list[int], window_ns: int) -> int:
    """Most events within any half-open window of ``window_ns``."""
    best = 0
    lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window_ns:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def limits(default: float, **users: object) -> dict:
    """The ``output_rate`` section for a default rate and per-user limits."""
    return {
        "default_user_output_tokens_per_second": default,
        "user_output_tokens_per_second": users,
    }


def bound(window_s: float, rate: float) -> int:
    """One engine's guarantee: at most (W + 0.1) x rate + 1 tokens in W seconds."""
    return int((window_s + 0.1) * rate + 1 + 1e-9)
