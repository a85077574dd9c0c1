"""``python -m cbpause.demo``: see the protocol work on transformers' real continuous-batching loop.

A tiny random Llama (built from a config: no download) serves a stream of requests while a "trainer"
thread pauses the loop every few forward steps and perturbs the weights in place, as an RL trainer
pushing new weights would.  A progress bar shows the requests coming back; the summary at the end gives
requests finished, tokens, pauses, how long a pause took to enter (p50/p99) and how many requests were
lost (always 0: R-NOTHING-LOST-DELIVERED).  Exits 1 if a request was lost or failed.

Needs the ``transformers`` extra (torch and transformers 5.23.x).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from .bench import percentile


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.demo", description=__doc__.split("\n\n")[1])
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


def run(args: argparse.Namespace) -> dict:
    """Serve ``args.requests`` requests under periodic pauses; the summary as a dict."""
    try:
        import torch
        from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        from .integrations.transformers import init_continuous_batching
    except ImportError as exc:
        raise SystemExit(f"the demo needs the transformers extra: pip install 'cbpause[transformers]' ({exc})") from exc

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(args.device).eval()
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompt_len = 8
    blocks = args.in_flight * -(-(prompt_len + args.max_new_tokens) // 16) + 16
    cb = ContinuousBatchingConfig(
        use_cuda_graph=False, use_async_batching=False, num_blocks=blocks, page_size=16, max_batch_tokens=512
    )
    manager = init_continuous_batching(model, gen, cb, peer_park_timeout=60.0)

    steps = [0]
    stepped = threading.Condition()

    def count_step(module, inputs):
        with stepped:
            steps[0] += 1
            stepped.notify_all()

    hook = model.register_forward_pre_hook(count_step)
    done = threading.Event()
    latencies: list[float] = []
    trainer_errors: list[BaseException] = []

    def trainer() -> None:
        generator = torch.Generator(device=args.device).manual_seed(args.seed + 1)
        next_at = args.pause_every
        try:
            while not done.is_set():
                with stepped:
                    stepped.wait_for(lambda at=next_at: steps[0] >= at or done.is_set(), timeout=1.0)
                if done.is_set():
                    return
                if steps[0] < next_at:
                    continue
                asked = time.perf_counter()
                with manager.pause(timeout=60.0), torch.no_grad():
                    latencies.append(time.perf_counter() - asked)
                    for p in model.parameters():  # a small in-place update, as a trainer's step would make
                        p.add_(torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) * 1e-4)
                next_at = steps[0] + args.pause_every
        except BaseException as error:  # noqa: BLE001 - reported in the summary
            trainer_errors.append(error)

    progress = Progress(args.requests, not args.no_progress)
    submitted: set[str] = set()
    outcomes: dict[str, str] = {}
    tokens = 0
    started = time.perf_counter()
    manager.start()
    thread = threading.Thread(target=trainer, name="demo-trainer", daemon=True)
    thread.start()
    try:
        rng = torch.Generator().manual_seed(args.seed)
        while len(outcomes) < args.requests:
            while len(submitted) < args.requests and len(submitted) - len(outcomes) < args.in_flight:
                prompt = torch.randint(1, config.vocab_size, (prompt_len,), generator=rng).tolist()
                submitted.add(manager.add_request(prompt, max_new_tokens=args.max_new_tokens))
            out = manager.get_result(timeout=60.0)
            if out is None:
                break  # the loop died or stalled: what is missing is counted as lost below
            if out.request_id in outcomes:
                outcomes[out.request_id] = "duplicate"
                continue
            outcomes[out.request_id] = out.status.name
            tokens += len(out.generated_tokens)
            progress.show(len(outcomes), tokens, len(latencies))
    finally:
        done.set()
        with stepped:
            stepped.notify_all()
        thread.join(70.0)
        manager.stop(block=True, timeout=60.0)
        hook.remove()
        progress.close()
    elapsed = time.perf_counter() - started
    metrics = manager.background_thread_status.metrics()
    statuses = list(outcomes.values())
    return {
        "device": args.device,
        "requests": args.requests,
        "finished": statuses.count("FINISHED"),
        "failed": sum(s not in ("FINISHED", "duplicate") for s in statuses),
        "duplicates": statuses.count("duplicate"),
        "lost": len(submitted - set(outcomes)) + (args.requests - len(submitted)),
        "tokens": tokens,
        "seconds": elapsed,
        "forward_steps": steps[0],
        "pauses": metrics.pauses_taken,
        "paused_s": metrics.total_paused_s,
        "entry_p50_ms": 1e3 * percentile(latencies, 50),
        "entry_p99_ms": 1e3 * percentile(latencies, 99),
        "trainer_error": repr(trainer_errors[0]) if trainer_errors else None,
        "loop_error": repr(manager.background_thread_status.fatal_error)
        if manager.background_thread_status.fatal_error is not None
        else None,
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
    summary = run(parse_args(argv))
    print(format_summary(summary))
    ok = summary["lost"] == 0 and summary["failed"] == 0 and summary["duplicates"] == 0
    ok = ok and summary["finished"] == summary["requests"] and not summary["trainer_error"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
