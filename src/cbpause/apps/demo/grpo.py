"""``python -m cbpause.apps.demo --trl``: TRL's ``AsyncGRPOTrainer`` trains a tiny policy through a cbpause engine.

The task of :func:`cbpause.testing.trl_cpu.tiny_task` (a tiny random Llama, 16 prompts of 3 tokens, a reward for
the share of one token in 8 generated; chance is 1 in 16): the trainer steps while :class:`~cbpause.integrations.trl.
CBRolloutWorker` keeps groups of completions in flight on the engine, and :class:`~cbpause.integrations.trl.
PauseWeightSync` copies the new weights in place inside a pause after every step.  Prints the reward per step and
how stale the samples were, writes the reward curve (``--png``, with matplotlib), and exits 1 if the reward did not
rise.  Runs on the CPU (with the test-only workarounds of :mod:`cbpause.testing.trl_cpu`); needs the ``trl`` extra.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from ...core import transitions as t

MODE_NAMES = tuple(t.MODE_NAMES.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.demo --trl", description=__doc__.split("\n\n")[0])
    p.add_argument("--trl", action="store_true", help="(selects this demo)")
    p.add_argument("--steps", type=int, default=36, help="optimizer steps (default 36)")
    p.add_argument("--mode", default="keep", choices=MODE_NAMES, help="the weight sync's pause mode (default keep)")
    p.add_argument("--png", type=Path, default=Path("trl-demo.png"), help="where to write the reward curve")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def train(args: argparse.Namespace, scratch: Path) -> tuple[list[float], list[float], int]:
    """The reward and the staleness of each step, and the syncs made."""
    from transformers import AutoModelForCausalLM

    from ...integrations.transformers import init_continuous_batching
    from ...integrations.trl import AsyncGRPOTrainer, CBRolloutWorker, PauseWeightSync
    from ...testing.trl_cpu import tiny_task, trl_on_cpu

    task = tiny_task(scratch, steps=args.steps, seed=args.seed)
    engine = AutoModelForCausalLM.from_pretrained(task.model_dir).eval()
    manager = init_continuous_batching(engine, task.generation_config, task.batching_config,
                                       max_staleness=task.args.max_staleness)  # fmt: skip
    manager.start()
    sync = PauseWeightSync(manager, mode=args.mode)
    worker = CBRolloutWorker(manager, task.dataset, task.reward, num_generations=task.num_generations,
                             max_new_tokens=task.max_new_tokens, processing_class=task.tokenizer)  # fmt: skip
    try:
        with trl_on_cpu():
            trainer = AsyncGRPOTrainer(model=str(task.model_dir), reward_funcs=task.reward, args=task.args,
                                       train_dataset=task.dataset, processing_class=task.tokenizer,
                                       rollout_worker=worker, weight_transfer=sync)  # fmt: skip
            trainer.train()
    finally:
        manager.stop(block=True, timeout=60)
    logs = [h for h in trainer.state.log_history if "reward" in h and "loss" in h]
    return [h["reward"] for h in logs], [h.get("sample/staleness_mean", 0.0) for h in logs], sync.syncs


def write_png(rewards: list[float], path: Path, mode: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(rewards) + 1), rewards, marker=".", label=f"AsyncGRPOTrainer on cbpause ({mode})")
    ax.axhline(1 / 16, color="grey", linestyle=":", label="chance (1 in 16)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as scratch:
        rewards, staleness, syncs = train(args, Path(scratch))
    for step, (reward, stale) in enumerate(zip(rewards, staleness, strict=True), 1):
        print(f"step {step:3}  reward {reward:.3f}  staleness {stale:.1f}")
    q = max(1, len(rewards) // 4)
    first, last = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    print(f"reward {first:.3f} (first quarter) -> {last:.3f} (last quarter); {syncs} weight syncs ({args.mode})")
    print(f"plot: {args.png}" if write_png(rewards, args.png, args.mode) else "plot: skipped (no matplotlib)")
    return 0 if last > first else 1
