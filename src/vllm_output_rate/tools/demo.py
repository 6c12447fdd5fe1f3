"""``vllm-output-rate demo``: the same workload on stock vLLM and with the plugin.

Runs the bench twice on the tiny model, each time against a fresh server on
127.0.0.1 (a free port, stopped by PID afterwards):

1. **stock**: no rate flags, so vLLM runs its own scheduler;
2. **plugin**: the heavy user limited (default 30 tok/s), everybody else at a
   default limit the light user never reaches (1000 tok/s).

Workload (both runs): a heavy user keeping many short streams in flight
(default 12 x 40 tokens) beside a light user with one stream of 200-token
answers, for ``--duration`` seconds.  Writes ``OUT-stock.{json,png}``,
``OUT-plugin.{json,png}`` (the bench's own outputs), ``OUT.json`` (both runs
plus the workload) and ``OUT.png`` (the comparison figure).

The bench runs in a session of its own and asks for CPU priority
(:func:`~.runkit.in_own_session`): on a small machine the engine it measures
would otherwise leave it too little CPU, and it would time its own stalls.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from vllm_output_rate.tools import bench, runkit, serverproc

SCHEMA = "vllm-output-rate-demo/1"
HEAVY, LIGHT = "heavy", "light"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-output-rate demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(serverproc.DEFAULT_MODEL_DIR))
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    p.add_argument("--heavy-streams", type=int, default=12)
    p.add_argument("--heavy-max-tokens", type=int, default=40,
                   help="short answers, so the heavy user's requests finish and are re-issued")
    p.add_argument("--light-max-tokens", type=int, default=200)
    p.add_argument("--heavy-limit", type=float, default=30.0)
    p.add_argument("--default-limit", type=float, default=1000.0,
                   help="limit of every other user (the light user): high, so it is not throttled")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-active-seqs", type=int, default=8)
    p.add_argument("--only", choices=("stock", "plugin"), help="run one side only (no comparison)")
    p.add_argument("--out", default="results/demo", help="prefix of the .json/.png/.log outputs")
    return p


def common_server_args(args: argparse.Namespace) -> list[str]:
    return [
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-active-seqs", str(args.max_num_active_seqs),
        "--max-model-len", "1024",
        # Short startup; scheduling is the same with or without compilation.
        "--enforce-eager",
        # The server's own first/last token times per request: the bench uses
        # them to measure delivery stalls.
        "--enable-per-request-metrics",
    ]


def plugin_server_args(args: argparse.Namespace) -> list[str]:
    return [
        "--default-user-output-tokens-per-second", f"{args.default_limit:g}",
        "--user-output-tokens-per-second", json.dumps({HEAVY: args.heavy_limit}),
    ]


def run_side(side: str, args: argparse.Namespace, out: Path) -> dict:
    server_args = common_server_args(args) + (plugin_server_args(args) if side == "plugin" else [])
    print(f"[{side}] starting server: vllm-output-rate serve {args.model} {shlex.join(server_args)}",
          flush=True)
    prefix = out.with_name(f"{out.name}-{side}")
    with serverproc.running_server(server_args, out.parent, f"demo-{side}", model=args.model) as srv:
        print(f"[{side}] server ready at {srv.base_url} (pid {srv.pid}); bench for {args.duration:g} s",
              flush=True)
        bench_args = [
            "--url", srv.base_url,
            "--user", f"{HEAVY}:{args.heavy_streams}:{args.heavy_max_tokens}",
            "--user", f"{LIGHT}:1:{args.light_max_tokens}",
            "--duration", f"{args.duration:g}",
            "--json", f"{prefix}.json",
            "--plot", f"{prefix}.png",
            "--no-progress",
        ]
        if side == "plugin":
            bench_args += ["--limit", f"{HEAVY}={args.heavy_limit:g}",
                           "--default-limit", f"{args.default_limit:g}"]
        document = bench.main(bench_args)
    print(f"[{side}] server stopped", flush=True)
    return document


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # The bench shares the machine with the servers it measures: in the caller's session
    # beside a busy engine it stalled up to 0.8 s, and its first-token times were its own
    # lag.  In a session of its own at a higher priority it reads what the server did.
    code = runkit.in_own_session(lambda: run_demo(argv, args))
    if code:
        raise SystemExit(code)


def run_demo(argv: list[str], args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    sides = [args.only] if args.only else ["stock", "plugin"]
    runs = {side: run_side(side, args, out) for side in sides}
    if args.only:
        return 0
    demo = {
        "schema": SCHEMA,
        "command": shlex.join(["vllm-output-rate", "demo", *argv]),
        "started_at": started_at,
        "machine": runkit.machine_facts(),
        "client_priority": runkit.client_priority,
        "heavy_user": HEAVY,
        "light_user": LIGHT,
        "workload": {
            "heavy_streams": args.heavy_streams, "heavy_max_tokens": args.heavy_max_tokens,
            "light_streams": 1, "light_max_tokens": args.light_max_tokens,
            "heavy_limit": args.heavy_limit, "default_limit": args.default_limit,
            "duration_s": args.duration,
        },
        "common_server_args": common_server_args(args),
        "plugin_server_args": plugin_server_args(args),
        **runs,
    }
    path = out.with_name(out.name + ".json")
    path.write_text(json.dumps(demo, indent=1) + "\n")
    from vllm_output_rate.tools.report import demo_headline, draw_demo

    png = out.with_name(out.name + ".png")
    draw_demo(demo, png)
    print(demo_headline(demo).replace("`", ""))
    print(f"wrote {path} and {png}")
    return 0
