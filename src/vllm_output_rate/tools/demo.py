"""``vllm-output-rate demo``: one heavy limited user beside one light user.

Starts a server on the tiny model (127.0.0.1, a free port), runs the bench
for about 30 s with a heavy user holding many streams under a low limit and
a light user with a single stream, prints the bench's table, writes its JSON
and PNG, and stops the server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_output_rate.tools import bench, serverproc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-output-rate demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(serverproc.DEFAULT_MODEL_DIR))
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--heavy-streams", type=int, default=12)
    p.add_argument("--heavy-max-tokens", type=int, default=40,
                   help="short answers, so the heavy user's requests finish and are re-issued")
    p.add_argument("--heavy-limit", type=float, default=30.0)
    p.add_argument("--default-limit", type=float, default=1000.0,
                   help="limit of every other user (the light user): high, so it is not throttled")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-active-seqs", type=int, default=8)
    p.add_argument("--out", default="results/demo", help="prefix of the .json/.png/.log outputs")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    server_args = [
        "--default-user-output-tokens-per-second", str(args.default_limit),
        "--user-output-tokens-per-second", json.dumps({"heavy": args.heavy_limit}),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-active-seqs", str(args.max_num_active_seqs),
        "--max-model-len", "1024",
    ]
    print(f"starting server: vllm-output-rate serve {args.model} {' '.join(server_args)}", flush=True)
    with serverproc.running_server(server_args, out.parent, "demo-server", model=args.model) as srv:
        print(f"server ready at {srv.base_url} (pid {srv.pid}); running bench for {args.duration:.0f} s",
              flush=True)
        bench.main([
            "--url", srv.base_url,
            "--user", f"heavy:{args.heavy_streams}:{args.heavy_max_tokens}",
            "--user", "light:1",
            "--duration", str(args.duration),
            "--limit", f"heavy={args.heavy_limit}",
            "--default-limit", str(args.default_limit),
            "--json", f"{out}.json",
            "--plot", f"{out}.png",
        ])
    print(f"server stopped; wrote {out}.json and {out}.png")
