"""``python -m cbpause.apps.demo --rl``: a small reinforcement-learning loop on transformers' continuous batching.

A tiny random Llama (16-token vocabulary, built from a config: no download) is the policy.  It samples completions
through the continuous-batching loop; the reward of a completion is how often it contains a chosen token.  After
each batch the trainer pauses the loop and, inside the pause, runs its real optimizer step on the same parameters
(forward, backward, ``optimizer.step()``), then declares the new weights with ``set_weight_version(step)``.  The
next batch is already in flight while the trainer updates (rollouts and training overlap, as in asynchronous RL),
so the pause mode matters: ``keep`` lets those requests go on with their KV, ``retract`` recomputes it with the new
weights, ``drain`` finishes them first, ``abort`` ends them (they are resubmitted).  The demo runs each mode in
turn, prints the reward per update, shows a progress bar, and writes a PNG of reward and tokens/s per update per
mode (with matplotlib: ``pip install 'cbpause[bench]'``).  Exits 1 if the reward did not rise in some mode.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ...core import transitions as t

MODE_NAMES = tuple(t.MODE_NAMES.values())  # keep, retract, drain, abort
VOCAB = 16
TARGET = 3  # the token the reward counts
PROMPT_LEN = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.demo --rl", description=__doc__.split("\n\n")[1])
    p.add_argument("--rl", action="store_true", help="(selects this demo)")
    p.add_argument("--updates", type=int, default=20, help="optimizer steps per mode (default 20)")
    p.add_argument("--batch", type=int, default=16, help="completions per update (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens per completion (default 8)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate (default 0.01)")
    p.add_argument("--modes", default=",".join(MODE_NAMES), help="comma-separated pause modes (default: all four)")
    p.add_argument("--png", type=Path, default=Path("rl-demo.png"), help="where to write the plot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODE_NAMES] or [n for n in ("updates", "batch", "max_new_tokens")
                                                          if getattr(args, n) < 1]  # fmt: skip
    if bad or not args.modes or args.lr <= 0:
        p.error(f"bad value(s): {bad or 'lr' if args.lr <= 0 else 'modes'}")
    return args


def _collect(manager, ids: list[str], resubmit, aborted: list[int]) -> list:
    """The finished output of each of ``ids``; an aborted one (mode abort) is resubmitted and waited for again
    (counted in ``aborted[0]``)."""
    outs: dict[str, object] = {}
    waiting = {i: i for i in ids}  # current id -> the id it stands for
    while waiting:
        out = manager.get_result(timeout=60)
        if out is None:
            raise RuntimeError("the generation loop stopped") from manager.background_thread_status.fatal_error
        origin = waiting.pop(out.request_id, None)
        if origin is None:
            continue
        if out.error:  # aborted by a pause: sample it again
            waiting[resubmit(out.prompt_ids)] = origin
            aborted[0] += 1
        else:
            outs[origin] = out
    return [outs[i] for i in ids]


def _loss(torch, model, outs, rewards, max_new: int):
    """REINFORCE with the batch's mean reward as baseline."""
    seqs = torch.tensor([list(o.prompt_ids) + list(o.generated_tokens) for o in outs], device=model.device)
    logits = model(seqs[:, :-1], use_cache=False).logits.float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0][:, -max_new:].sum(-1)
    advantage = rewards - rewards.mean()
    return -(advantage * logprobs).mean()


def run_mode(mode: str, args: argparse.Namespace, progress) -> dict:
    """One RL run in ``mode``: the reward and tokens/s of each update."""
    import torch
    from transformers import GenerationConfig

    from ...integrations.transformers import init_continuous_batching
    from ...testing import batching_config, tiny_llama

    torch.manual_seed(args.seed)
    model = tiny_llama(seed=args.seed, vocab_size=VOCAB)
    sampling = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, eos_token_id=-1, pad_token_id=0)  # fmt: skip
    manager = init_continuous_batching(model, sampling, batching_config())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    prompts = [[1 + i % 5, 2 + i % 3, 5][:PROMPT_LEN] for i in range(args.batch)]

    def submit(prompt) -> str:
        return manager.add_request(list(prompt), max_new_tokens=args.max_new_tokens)

    rewards_per_update, rates, spans_seen, aborted = [], [], 0, [0]
    manager.start()
    try:
        pending = [submit(p) for p in prompts]
        cycle = time.perf_counter()
        for step in range(1, args.updates + 1):
            outs = _collect(manager, pending, submit, aborted)
            now = time.perf_counter()  # tokens/s over the whole cycle: rollouts, the pause and the update
            rate, cycle = sum(len(o.generated_tokens) for o in outs) / (now - cycle), now
            pending = [submit(p) for p in prompts]  # the next rollouts run while the trainer updates
            rewards = torch.tensor([sum(t == TARGET for t in o.generated_tokens) / len(o.generated_tokens)
                                    for o in outs])  # fmt: skip
            spans_seen += sum(len(o.weight_versions) > 1 for o in outs)
            with manager.pause(mode=mode, timeout=60):
                loss = _loss(torch, model, outs, rewards, args.max_new_tokens)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                manager.set_weight_version(step)
            rewards_per_update.append(float(rewards.mean()))
            rates.append(rate)
            progress(mode, step, rewards_per_update[-1], rate)
        _collect(manager, pending, submit, aborted)
    finally:
        manager.stop(block=True, timeout=60)
    return {"reward": rewards_per_update, "tokens_per_s": rates, "mixed_version_outputs": spans_seen,
            "aborted": aborted[0]}  # fmt: skip


def risen(rewards: list[float]) -> bool:
    """The reward rose: the mean of the last quarter of the updates is above that of the first quarter."""
    q = max(1, len(rewards) // 4)
    return sum(rewards[-q:]) / q > sum(rewards[:q]) / q


def write_png(results: dict[str, dict], path: Path) -> bool:
    """Reward and tokens/s per update, one line per mode; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for mode, r in results.items():
        steps = range(1, len(r["reward"]) + 1)
        top.plot(steps, r["reward"], marker="o", label=mode)
        bottom.plot(steps, r["tokens_per_s"], marker="o", label=mode)
    top.set_ylabel(f"reward (share of token {TARGET})")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("update")
    top.legend()
    top.set_title("cbpause RL demo: the optimizer step runs inside a pause")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    total = args.updates * len(args.modes)
    done = [0]

    def progress(mode: str, step: int, reward: float, rate: float) -> None:
        done[0] += 1
        bar = "#" * (30 * done[0] // total)
        line = f"{mode:8} update {step:3}  reward {reward:.3f}  {rate:8.0f} tokens/s"
        if args.no_progress:
            print(line)
        else:
            print(f"\r[{bar:30}] {done[0]}/{total}  {line}", end="\n" if step == args.updates else "", flush=True)

    results = {mode: run_mode(mode, args, progress) for mode in args.modes}
    print(f"\n{'mode':8} {'first':>7} {'last':>7} {'risen':>6} {'tokens/s':>9} {'over 2+ versions':>17} "
          f"{'aborted':>8}")  # fmt: skip
    ok = True
    for mode, r in results.items():
        up = risen(r["reward"])
        ok &= up
        rate = sum(r["tokens_per_s"]) / len(r["tokens_per_s"])
        print(f"{mode:8} {r['reward'][0]:7.3f} {r['reward'][-1]:7.3f} {str(up):>6} {rate:9.0f} "
              f"{r['mixed_version_outputs']:17} {r['aborted']:8}")  # fmt: skip
    if write_png(results, args.png):
        print(f"plot: {args.png}")
    else:
        print("plot: skipped (pip install 'cbpause[bench]' for matplotlib)")
    return 0 if ok else 1
