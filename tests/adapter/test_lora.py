"""Why LoRA is refused while per-user rate limiting is on (every supported series).

vLLM keeps at most ``max_loras`` adapters in a batch by counting the adapters
of the requests in ``Scheduler.running`` (0.32: those scheduled in the step;
0.33: all of them) and then *asserts* the count.  During a step the plugin
hides throttled requests from ``running``, so a request of another user with
a different adapter is admitted while a throttled one holds the only slot;
when the throttled request runs again both adapters are in the batch and
vLLM's assertion stops the engine.  Until the plugin counts hidden requests'
adapters, LoRA is refused at startup (``patches.REFUSALS``); the refusal
itself is tested in ``test_cli_config.py``.

This test bypasses the refusal to show the failure it prevents: if it stops
failing on some series, LoRA can be allowed there.
"""

from __future__ import annotations

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_output_rate.tools.scheduler_sim import BLOCK_SIZE, MS, TOKEN, FakeClock
from server_harness import TINY_MODEL_DIR
from vllm_output_rate.adapter.patches import OutputRateConfigError, check_vllm_config
from vllm_output_rate.adapter.scheduler import OutputRateScheduler

LIMITS = {
    "default_user_output_tokens_per_second": 1000,
    "user_output_tokens_per_second": {"slow": 1},
}


def _lora_scheduler():
    # LoRA on, feature off: the config vLLM builds; the feature is switched
    # on afterwards to get past the startup refusal.
    config = EngineArgs(
        model=str(TINY_MODEL_DIR), max_model_len=256, max_num_seqs=8,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    ).create_engine_config()
    assert config.lora_config is not None and config.lora_config.max_loras == 1
    config.additional_config = {"output_rate": LIMITS}
    with pytest.raises(OutputRateConfigError, match="LoRA"):
        check_vllm_config(config)  # what startup would have said
    config.cache_config.num_gpu_blocks = 500
    kv = KVCacheConfig(
        num_blocks=500,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64,
                                  dtype=torch.float32),
            )
        ],
    )
    sched = OutputRateScheduler(
        vllm_config=config, kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
    )
    clock = FakeClock()
    sched.output_rate_clock = clock
    return sched, clock


def _request(rid: str, user: str, adapter: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"output_rate_user": user})
    return Request(
        rid, [100 + i for i in range(8)], params, None, arrival_time=0.0,
        lora_request=LoRARequest(f"adapter-{adapter}", adapter, "/unused"),
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def _step(sched, clock):
    output = sched.schedule()
    ids = list(output.num_scheduled_tokens)
    sched.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if sched.requests[r].is_prefill_chunk else [TOKEN] for r in ids],
    ))
    clock.advance(10 * MS)
    return output


def test_hidden_throttled_adapter_breaks_vllms_max_loras_assertion():
    sched, clock = _lora_scheduler()
    sched.add_request(_request("slow-0", "slow", adapter=1, max_tokens=50))
    _step(sched, clock)  # prefill + first token: "slow" spent its burst
    for _ in range(3):
        assert _step(sched, clock).total_num_scheduled_tokens == 0  # throttled, hidden
    sched.add_request(_request("fast-0", "fast", adapter=2, max_tokens=300))
    out = _step(sched, clock)
    # Admitted beside the hidden adapter-1 request: two adapters resident
    # although max_loras is 1.
    assert "fast-0" in out.num_scheduled_tokens
    assert {r.lora_request.lora_int_id for r in sched.running} == {1, 2}
    # "slow" gets its next token about 1 s later: vLLM's own check fails then.
    with pytest.raises(AssertionError) as info:
        for _ in range(200):
            _step(sched, clock)
    failed_at = info.traceback[-1]
    assert failed_at.path.name == "scheduler.py" and "vllm" in str(failed_at.path)
    assert "max_loras" in str(failed_at.statement), str(failed_at.statement)
