"""Offline throughput, limits never hit vs feature off, in one process.

Both engines (``LLM(...)`` with and without ``additional_config["output_rate"]``)
live in this one process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model
runs in-process: no engine-core/worker processes spinning against each other on
a small machine.  ``generate()`` calls alternate between the two engines, so
drift and background load hit both alike.  Reported: output tok/s per call,
mean / stdev / min / max per side, and the ratio of means.

Usage: ``python benchmarks/offline_throughput.py`` (writes
``docs/benchmarks/offline_throughput.json``; ``--out PREFIX`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-offline-throughput/1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(benchkit.RESULTS_DIR / "offline_throughput"), metavar="PREFIX",
                    help="writes PREFIX.json (default: %(default)s)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--reps", type=int, default=6, help="generate() calls per engine")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    doc = benchkit.start_report(SCHEMA, args)

    from vllm import LLM, SamplingParams

    limits = {"output_rate": {"default_user_output_tokens_per_second": 1e6}}
    engines = {
        "stock": LLM(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs),
        "plugin": LLM(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs,
                      additional_config=limits),
    }
    params = [
        SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                       extra_args={"output_rate_user": f"user-{i % args.users}"})
        for i in range(args.requests)
    ]
    prompts = [f"Request {i}: tell me a long story about rivers." for i in range(args.requests)]
    for llm in engines.values():  # warm up
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)

    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            start = time.perf_counter()
            outputs = engines[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert tokens == args.requests * args.max_tokens
            rates[name].append(tokens / elapsed)
            print(f"rep {rep} {name:6s} {tokens / elapsed:8.1f} tok/s", flush=True)

    summary = {
        name: {
            "n": len(v), "mean": statistics.mean(v), "stdev": statistics.stdev(v) if len(v) > 1 else 0.0,
            "min": min(v), "max": max(v), "values": v,
        }
        for name, v in rates.items()
    }
    ratio = summary["plugin"]["mean"] / summary["stock"]["mean"]
    print(f"ratio of means (plugin / stock): {ratio:.3f} (target >= 0.98)")
    doc.update({"summary": summary, "ratio_of_means": ratio})
    benchkit.write_outputs(benchkit.finish_report(doc), args.out)


if __name__ == "__main__":
    main()
