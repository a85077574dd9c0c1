"""``cbpause serve CHECKPOINT`` (the console script) and ``python -m cbpause.serve CHECKPOINT``."""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbpause serve", description="Serve a local checkpoint with transformers' "
                                "OpenAI-compatible routes on a cbpause manager, with leased pauses over HTTP "
                                "(docs/serving.md).")  # fmt: skip
    p.add_argument("checkpoint", help="a local model directory (config, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights-dir", default=None, help="the only directory /update_weights_from_disk may read from "
                   "(default: updates from disk disabled)")  # fmt: skip
    p.add_argument("--default-ttl", type=float, default=30.0, help="ttl (s) of a lease that names none, and of "
                   "every vLLM- or SGLang-style pause (default 30)")  # fmt: skip
    p.add_argument("--while-paused", choices=("queue", "reject"), default="queue", help="a generation request "
                   "during a pause waits (queue) or gets 503 with Retry-After (reject)")  # fmt: skip
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--on-stale", choices=("restart", "abort"), default="restart")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: transformers' choice)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import uvicorn
    from transformers import ContinuousBatchingConfig

    from . import build_app

    config = None if args.num_blocks is None else ContinuousBatchingConfig(num_blocks=args.num_blocks)
    app = build_app(args.checkpoint, weights_dir=args.weights_dir, default_ttl=args.default_ttl, device=args.device,
                    dtype=args.dtype, continuous_batching_config=config, while_paused=args.while_paused,
                    max_staleness=args.max_staleness, on_stale=args.on_stale)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def cli() -> None:
    """The ``cbpause`` console script: ``cbpause serve ...``."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "serve":
        sys.exit("usage: cbpause serve CHECKPOINT [options]  (cbpause serve --help)")
    main(argv[1:])


if __name__ == "__main__":
    main()
