"""``python -m cbpause.apps.demo``: see the protocol work on transformers' real continuous-batching loop.

A tiny random Llama (built from a config: no download) serves a stream of requests while a "trainer"
thread pauses the loop every few forward steps and perturbs the weights in place, as an RL trainer
pushing new weights would.  A progress bar shows the requests coming back; the summary at the end gives
requests finished, tokens, pauses, how long a pause took to enter (p50/p99) and how many requests were
lost (always 0: R-NOTHING-LOST-DELIVERED).  Exits 1 if a request was lost or failed.

``python -m cbpause.apps.demo --rl`` runs a small reinforcement-learning loop instead (:mod:`cbpause.apps.demo.rl`),
``python -m cbpause.apps.demo --trl`` trains with TRL's ``AsyncGRPOTrainer`` on a cbpause engine
(:mod:`cbpause.apps.demo.grpo`, the ``trl`` extra).

Needs the ``transformers`` extra (torch and transformers 5.23-5.25).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from ...testing import percentile

PROMPT_LEN = 8


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--requests", type=_positive, default=192, help="requests to serve (default 192)")
    p.add_argument("--in-flight", type=_positive, default=12, help="requests submitted ahead (default 12)")
    p.add_argument("--max-new-tokens", type=_positive, default=32, help="tokens per request (default 32)")
    p.add_argument("--pause-every", type=_positive, default=8, help="forward steps between pauses (default 8)")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda (default: cuda if any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    return p.parse_args(argv)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.started = total, enabled, time.monotonic()

    def show(self, done: int, tokens: int, pauses: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        rate = tokens / max(1e-9, time.monotonic() - self.started)
        bar = "#" * filled + "." * (width - filled)
        print(f"\r[{bar}] {done}/{self.total} requests  {tokens} tokens  {pauses} pauses  {rate:,.0f} tok/s",
              end="", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


class Trainer(threading.Thread):
    """Pauses the loop every ``every`` forward steps and perturbs the weights in place, as an RL trainer
    pushing new weights would; records how long each pause took to enter."""

    def __init__(self, manager, model, probe, every: int, seed: int):
        super().__init__(name="demo-trainer", daemon=True)
        self.manager, self.model, self.probe, self.every, self.seed = manager, model, probe, every, seed
        self.done = threading.Event()
        self.latencies: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        import torch

        generator = torch.Generator(device=self.model.device).manual_seed(self.seed + 1)
        next_at = self.every
        try:
            while not self.done.is_set():
                if not self.probe.wait_until(next_at, timeout=1.0) or self.done.is_set():
                    continue
                asked = time.perf_counter()
                with self.manager.pause(timeout=60.0), torch.no_grad():
                    self.latencies.append(time.perf_counter() - asked)
                    for p in self.model.parameters():  # a small in-place update, as a trainer's step would make
                        p.add_(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * 1e-4)
                next_at = self.probe.forwards + self.every
        except BaseException as error:  # noqa: BLE001 - reported in the summary
            self.error = error


def _serve(args: argparse.Namespace, manager, vocab_size: int) -> tuple[set[str], dict[str, str], int]:
    """Submit ``args.requests`` requests, ``args.in_flight`` ahead, and collect their outputs."""
    import torch

    progress = Progress(args.requests, not args.no_progress)
    submitted: set[str] = set()
    outcomes: dict[str, str] = {}
    tokens = 0
    rng = torch.Generator().manual_seed(args.seed)
    try:
        while len(outcomes) < args.requests:
            while len(submitted) < args.requests and len(submitted) - len(outcomes) < args.in_flight:
                prompt = torch.randint(1, vocab_size, (PROMPT_LEN,), generator=rng).tolist()
                submitted.add(manager.add_request(prompt, max_new_tokens=args.max_new_tokens))
            out = manager.get_result(timeout=60.0)
            if out is None:
                break  # the loop died or stalled: what is missing is counted as lost
            if out.request_id in outcomes:
                outcomes[out.request_id] = "duplicate"
                continue
            outcomes[out.request_id] = out.status.name
            tokens += len(out.generated_tokens)
            progress.show(len(outcomes), tokens, manager.background_thread_status.metrics().pauses_taken)
    finally:
        progress.close()
    return submitted, outcomes, tokens


def run(args: argparse.Namespace) -> dict:
    """Serve ``args.requests`` requests under periodic pauses; the summary as a dict."""
    try:
        from transformers.utils import logging as hf_logging

        from ...integrations.transformers import init_continuous_batching
        from ...testing import ForwardProbe, batching_config, cache_blocks, greedy_config, tiny_llama
    except ImportError as exc:
        raise SystemExit(f"the demo needs the transformers extra: pip install 'cbpause[transformers]' ({exc})") from exc

    hf_logging.set_verbosity_error()
    model = tiny_llama(
        args.device, args.seed, vocab_size=256, hidden_size=128, intermediate_size=256, max_position_embeddings=1024
    )
    blocks = cache_blocks(args.in_flight, PROMPT_LEN + args.max_new_tokens)
    cb = batching_config(num_blocks=blocks, max_batch_tokens=512)
    manager = init_continuous_batching(model, greedy_config(args.max_new_tokens), cb, peer_park_timeout=60.0)
    probe = ForwardProbe()
    hook = probe.attach(model)
    trainer = Trainer(manager, model, probe, args.pause_every, args.seed)
    started = time.perf_counter()
    manager.start()
    trainer.start()
    try:
        submitted, outcomes, tokens = _serve(args, manager, model.config.vocab_size)
    finally:
        trainer.done.set()
        trainer.join(70.0)
        manager.stop(block=True, timeout=60.0)
        hook.remove()
    status = manager.background_thread_status
    metrics = status.metrics()
    statuses = list(outcomes.values())
    return {
        "device": args.device,
        "requests": args.requests,
        "finished": statuses.count("FINISHED"),
        "failed": sum(s not in ("FINISHED", "duplicate") for s in statuses),
        "duplicates": statuses.count("duplicate"),
        "lost": len(submitted - set(outcomes)) + (args.requests - len(submitted)),
        "tokens": tokens,
        "seconds": time.perf_counter() - started,
        "forward_steps": probe.forwards,
        "pauses": metrics.pauses_taken,
        "paused_s": metrics.total_paused_s,
        "entry_p50_ms": 1e3 * percentile(trainer.latencies, 50),
        "entry_p99_ms": 1e3 * percentile(trainer.latencies, 99),
        "trainer_error": repr(trainer.error) if trainer.error else None,
        "loop_error": repr(status.fatal_error) if status.fatal_error is not None else None,
    }


def format_summary(s: dict) -> str:
    lines = [
        f"cbpause demo on {s['device']}: {s['requests']} requests, {s['seconds']:.1f} s",
        f"  requests finished   {s['finished']}  (failed {s['failed']}, duplicated {s['duplicates']})",
        f"  tokens generated    {s['tokens']}  in {s['forward_steps']} forward steps",
        f"  pauses              {s['pauses']}  (loop paused {1e3 * s['paused_s']:.1f} ms in all)",
        f"  pause entry         p50 {s['entry_p50_ms']:.2f} ms  p99 {s['entry_p99_ms']:.2f} ms",
        f"  lost                {s['lost']}",
    ]
    if s["trainer_error"]:
        lines.append(f"  trainer error       {s['trainer_error']}")
    if s["loop_error"]:
        lines.append(f"  loop error          {s['loop_error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if "--rl" in given:
        from . import rl

        return rl.main(argv)
    if "--trl" in given:
        from . import grpo

        return grpo.main(argv)
    summary = run(parse_args(argv))
    print(format_summary(summary))
    ok = summary["lost"] == 0 and summary["failed"] == 0 and summary["duplicates"] == 0
    ok = ok and summary["finished"] == summary["requests"] and not summary["trainer_error"]
    return 0 if ok else 1
