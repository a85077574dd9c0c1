"""``cbpause serve CHECKPOINT`` (the console script) and ``python -m cbpause.serve CHECKPOINT``."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

from ..core.rank import PEER_PARK_TIMEOUT_S
from . import MIN_PEER_JOIN_GRACE_S, PEER_JOIN_GRACE_S
from .capacity import CPU_KV_BYTES, CPU_SEQUENCES
from .guard import MAX_BODY_BYTES
from .leases import MAX_LEASES


def parser() -> argparse.ArgumentParser:
    description = ("Serve a local checkpoint with the OpenAI requests RL rollout clients send (per-request sampling, "
                   "seeds, log-probabilities, token ids) on a cbpause manager, with leased pauses over HTTP "
                   "(docs/serving.md).")  # fmt: skip
    p = argparse.ArgumentParser(prog="cbpause serve", description=description)
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
    p.add_argument("--max-stale-restarts", type=int, default=3, help="times one request may be restarted by the "
                   "staleness bound before it ends with a stale error (default 3)")  # fmt: skip
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks of --page-size tokens (default: on "
                   f"the CPU, {CPU_SEQUENCES} sequences of --max-model-len tokens, at most {CPU_KV_BYTES >> 30} GiB; "
                   "on a GPU, transformers' choice, a share of the device's free memory)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per KV cache block (default: transformers')")
    p.add_argument("--max-model-len", type=int, default=None, help="the most tokens a request may have, prompt and "
                   "answer (default: the model's max_position_embeddings, lowered to what the KV cache holds for one "
                   "request)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $CBPAUSE_API_KEY; use one whenever the port is reachable from another machine)")
    p.add_argument("--served-model-name", default=None, help="the model's name for clients, in /v1/models and in "
                   "requests (default: the checkpoint as given)")  # fmt: skip
    p.add_argument("--max-leases", type=int, default=MAX_LEASES, help=f"leases waiting or held at once (default "
                   f"{MAX_LEASES}); more is a 429")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help=f"the longest request body (default "
                   f"{MAX_BODY_BYTES}); longer is a 413")  # fmt: skip
    p.add_argument("--lease-log", default=None, help="append every action of the lease table to this file, one JSON "
                   "record a line (python -m cbpause.tlc.fleet_traces FILE validates it against tla/FleetPause.tla)")
    p.add_argument("--staging", choices=("bounded", "full"), default="bounded", help="how an update by broadcast is "
                   "received: each bucket copied into the model as it arrives, two buckets held, a transfer torn "
                   "half-way refused until a complete update (bounded, the default); or the whole update staged "
                   "first, a copy of the model's size held while it arrives (full)")
    p.add_argument("--tp-size", type=int, default=None, help="this server is one rank of a tensor-parallel engine "
                   "of this many ranks, one cbpause serve each; only rank 0 takes generation requests")
    p.add_argument("--tp-rank", type=int, default=None, help="this server's rank in the engine (with --tp-size)")
    p.add_argument("--tp-init-method", default=None, help="where the ranks meet: tcp://HOST:PORT, the same on every "
                   "rank (with --tp-size)")
    p.add_argument("--tp-backend", choices=("gloo", "nccl"), default=None, help="the ranks' process group (gloo, the "
                   "default, on the CPU; nccl on CUDA devices)")
    p.add_argument("--tp-timeout", type=float, default=None, help="seconds a rank waits for the others at start-up "
                   "(at least: torch's own connection retries may take longer), and each collective's deadline on the "
                   "ranks' groups, the loop's included (with --tp-size; default 600)")
    p.add_argument("--peer-park-timeout", type=float, default=PEER_PARK_TIMEOUT_S, help="seconds a TP rank parked "
                   f"for a peer's pause waits for a holder of its own before every rank fails (D3; default "
                   f"{PEER_PARK_TIMEOUT_S:g})")
    p.add_argument("--peer-join-grace", type=float, default=None, help="seconds a TP rank parked for a peer's "
                   "pause with no holder of its own waits before it joins that pause with an empty window (with "
                   f"--tp-size; at least {MIN_PEER_JOIN_GRACE_S:g} and below --peer-park-timeout; default "
                   f"{PEER_JOIN_GRACE_S:g}, or half of --peer-park-timeout where that is shorter)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import uvicorn
    from transformers import ContinuousBatchingConfig

    try:
        from . import build_app
    except ImportError as error:  # a transformers whose server is not supported: the message says what to install
        sys.exit(f"cbpause serve: {error}")

    try:
        tensor_parallel = _tensor_parallel(args)
        for name in ("num_blocks", "page_size", "max_model_len"):  # transformers' own failures are a traceback
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    except ValueError as error:
        sys.exit(f"cbpause serve: {error}")
    # With TP, --tp-timeout bounds the loop's own collectives too (the CPU group's all-reduce, broadcast and barrier)
    fields = {"num_blocks": args.num_blocks, "page_size": args.page_size,
              "cpu_group_timeout": None if tensor_parallel is None else tensor_parallel.timeout}  # fmt: skip
    fields = {k: v for k, v in fields.items() if v is not None}
    config = ContinuousBatchingConfig(**fields) if fields else None
    api_key = args.api_key if args.api_key is not None else os.environ.get("CBPAUSE_API_KEY") or None
    if args.served_model_name is not None and not args.served_model_name.strip():  # before a TP rank joins its peers
        sys.exit(f"cbpause serve: served_model_name must be a non-empty string, not {args.served_model_name!r}")
    grace = {} if args.peer_join_grace is None else {"peer_join_grace": args.peer_join_grace}
    try:
        app = build_app(args.checkpoint, weights_dir=args.weights_dir, default_ttl=args.default_ttl,
                        device=args.device, dtype=args.dtype, continuous_batching_config=config,
                        while_paused=args.while_paused, max_staleness=args.max_staleness, on_stale=args.on_stale,
                        max_stale_restarts=args.max_stale_restarts,
                        api_key=api_key, served_model_name=args.served_model_name, max_leases=args.max_leases,
                        max_body_bytes=args.max_body_bytes, lease_log=args.lease_log, staging=args.staging,
                        max_model_len=args.max_model_len,
                        tensor_parallel=tensor_parallel, peer_park_timeout=args.peer_park_timeout,
                        **grace)  # fmt: skip
    except ValueError as error:
        sys.exit(f"cbpause serve: {error}")
    except RuntimeError as error:
        from ..integrations.serving import JoinFailed

        if not isinstance(error, JoinFailed):
            raise
        sys.exit(f"cbpause serve: {error}")  # a rank whose peers never came
    print(f"cbpause serve: {app.state.cache.describe(app.state.served.max_model_len)}", file=sys.stderr, flush=True)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"cbpause serve: warning: listening on {args.host} without --api-key: anyone who reaches the port can "
              "pause this server and load weights into it", file=sys.stderr)  # fmt: skip
    server = StoppingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=GRACE_S))  # fmt: skip
    server.run()


def _tensor_parallel(args: Any) -> Any:
    """The ``--tp-*`` options as a :class:`~cbpause.integrations.serving.TensorParallel`, or None without
    ``--tp-size``; ``ValueError`` for a partial or bad set."""
    given = [n for n in ("tp_rank", "tp_init_method", "tp_backend", "tp_timeout", "peer_join_grace")
             if getattr(args, n) is not None]  # fmt: skip
    if args.tp_size is None:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --tp-size")
        return None
    if args.tp_rank is None or args.tp_init_method is None:
        raise ValueError("--tp-size needs --tp-rank and --tp-init-method")
    from ..integrations.serving import TensorParallel

    optional = {"backend": args.tp_backend, "timeout": args.tp_timeout}
    return TensorParallel(size=args.tp_size, rank=args.tp_rank, init_method=args.tp_init_method,
                          **{k: v for k, v in optional.items() if v is not None})  # fmt: skip


GRACE_S = 10  # after a signal, the longest uvicorn waits for the connections it has before it closes them


def _stopping_server() -> type:
    import uvicorn

    class Stopping(uvicorn.Server):
        """uvicorn's server, which on SIGTERM or Ctrl-C first ends the leases and stops the manager (in a thread:
        the signal's handler must return), so that the requests it holds are answered before uvicorn, which waits
        for its connections to close, would otherwise wait for a lease's ttl (issue 39, point 6)."""

        _stopping: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: object) -> None:
            if self._stopping is None:
                self._stopping = threading.Thread(target=self.config.app.state.shutdown, name="cbpause-shutdown",
                                                  daemon=True)  # fmt: skip
                self._stopping.start()
            super().handle_exit(sig, frame)

    return Stopping


def StoppingServer(config: object) -> object:  # noqa: N802 -- a class, built once uvicorn is imported
    return _stopping_server()(config)


def cli() -> None:
    """The ``cbpause`` console script: ``cbpause serve ...``."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "serve":
        sys.exit("usage: cbpause serve CHECKPOINT [options]  (cbpause serve --help)")
    main(argv[1:])


if __name__ == "__main__":
    main()
