"""``python -m cbpause.apps.bench --trl`` (``nox -s bench -- --trl``): TRL's two ways of generating with transformers'
continuous batching, side by side on the CPU, on the same tiny task (:func:`cbpause.testing.trl_cpu.tiny_task`: the
same model, prompts, reward, learning rate and number of optimizer steps of one group of 8 completions).

* **async**: ``AsyncGRPOTrainer`` with a cbpause engine (``PauseWeightSync`` in each pause mode asked, and
  ``CBRolloutWorker``): rollouts go on while the trainer steps; the weights are copied in place inside a pause.
* **sync**: ``GRPOTrainer(use_transformers_continuous_batching=True)``, what TRL users run today: every step calls
  ``generate_batch``, which builds a continuous-batching manager, generates the group and tears it down; the policy
  generates itself, so there is no weight sync.

Per trainer: wall time per optimizer step (the run's wall time over its steps, set-up excluded), generated tokens per
second (every completion the engine finished, dropped ones included, over the run's wall time), seconds in weight
sync (the pauses, the copy included), and the reward per step.  Writes ``trl.json``, ``trl.md`` and ``trl.png`` (the
reward curves) under ``--out``.  Needs the ``trl`` and ``bench`` extras.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

HEADER = "| trainer | steps | s per step | tokens/s | weight sync s | reward, first 5 steps | reward, last 5 steps |"


def run_async(task: Any, mode: str) -> dict:
    """``AsyncGRPOTrainer`` on a cbpause engine paused in ``mode``."""
    from transformers import AutoModelForCausalLM

    from ...integrations.transformers import init_continuous_batching
    from ...integrations.trl import AsyncGRPOTrainer, CBRolloutWorker, PauseWeightSync
    from ...testing.trl_cpu import trl_on_cpu

    engine = AutoModelForCausalLM.from_pretrained(task.model_dir).eval()
    manager = init_continuous_batching(engine, task.generation_config, task.batching_config,
                                       max_staleness=task.args.max_staleness)  # fmt: skip
    manager.start()
    sync = PauseWeightSync(manager, mode=mode, timeout=120)
    worker = CBRolloutWorker(manager, task.dataset, task.reward, num_generations=task.num_generations,
                             max_new_tokens=task.max_new_tokens, processing_class=task.tokenizer)  # fmt: skip
    try:
        with trl_on_cpu():
            trainer = AsyncGRPOTrainer(model=str(task.model_dir), reward_funcs=task.reward, args=task.args,
                                       train_dataset=task.dataset, processing_class=task.tokenizer,
                                       rollout_worker=worker, weight_transfer=sync)  # fmt: skip
            started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=60)
    return _result(f"async ({mode})", trainer, wall, worker.tokens, sync.sync_seconds)


def run_sync(task: Any) -> dict:
    """TRL's synchronous ``GRPOTrainer`` generating with ``generate_batch`` every step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in p) for p in task.dataset["prompt_ids"]]})
    a = task.args
    args = GRPOConfig(
        output_dir=a.output_dir + "-sync", max_steps=a.max_steps, per_device_train_batch_size=task.num_generations,
        num_generations=task.num_generations, max_completion_length=task.max_new_tokens,
        learning_rate=a.learning_rate, lr_scheduler_type="constant", report_to=[], logging_steps=1,
        save_strategy="no", use_cpu=True, bf16=False, temperature=1.0, top_k=0, top_p=1.0, beta=0.0, seed=a.seed,
        disable_tqdm=True, use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=dict(use_cuda_graph=False, use_async_batching=False, num_blocks=128,
                                                     block_size=16, max_batch_tokens=256),
    )  # fmt: skip
    trainer = GRPOTrainer(model=str(task.model_dir), reward_funcs=task.reward, args=args, train_dataset=prompts,
                          processing_class=task.tokenizer)  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = sum(h["completions/mean_length"] * task.num_generations for h in logs)
    return _result("sync (generate_batch)", trainer, wall, tokens, 0.0)


def _result(name: str, trainer: Any, wall: float, tokens: float, sync_s: float) -> dict:
    steps = trainer.state.global_step
    rewards = [round(h["reward"], 4) for h in trainer.state.log_history if "reward" in h and "loss" in h]
    return {"trainer": name, "steps": steps, "s_per_step": wall / max(steps, 1), "tokens_per_s": tokens / wall,
            "weight_sync_s": sync_s, "wall_s": wall, "rewards": rewards}  # fmt: skip


def table(results: list[dict]) -> str:
    rows = [HEADER, "|---|---|---|---|---|---|---|"]
    for r in results:
        first, last = r["rewards"][:5], r["rewards"][-5:]
        rows.append(f"| {r['trainer']} | {r['steps']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                    f"{r['weight_sync_s']:.2f} | {_mean(first):.2f} | {_mean(last):.2f} |")  # fmt: skip
    return "\n".join(rows)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def plot(results: list[dict], path: Path) -> bool:
    """The reward per optimizer step of each trainer; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for r in results:
        steps = range(1, len(r["rewards"]) + 1)
        by_step.plot(steps, r["rewards"], marker=".", label=r["trainer"])
        by_time.plot([k * r["s_per_step"] for k in steps], r["rewards"], marker=".", label=r["trainer"])
    for ax in (by_step, by_time):
        ax.axhline(1 / 16, color="grey", linestyle=":", label="chance (1 in 16)")
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("seconds (steps x the run's mean seconds per step)")
    by_step.set_ylabel("mean reward of the step's group")
    by_step.legend()
    fig.suptitle("TRL GRPO on the CPU: tiny task, same model, prompts, reward and steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(out: Path, steps: int, modes: list[str], seed: int = 0) -> int:
    from ... import __version__
    from ...testing.trl_cpu import tiny_task

    logging.getLogger("transformers").setLevel(logging.ERROR)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in modes:
            results.append(run_async(tiny_task(Path(scratch) / mode, steps=steps, seed=seed), mode))
            print(f"bench --trl: async ({mode}) done", flush=True)
        results.append(run_sync(tiny_task(Path(scratch) / "sync", steps=steps, seed=seed)))
        print("bench --trl: sync done", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    md = table(results)
    print(md)
    (out / "trl.json").write_text(json.dumps({"cbpause": __version__, "steps": steps, "seed": seed,
                                              "results": results}, indent=1))  # fmt: skip
    (out / "trl.md").write_text(md + "\n")
    drew = plot(results, out / "trl.png")
    print(f"wrote {out / 'trl.json'}, {out / 'trl.md'}" + (f" and {out / 'trl.png'}" if drew else " (no matplotlib)"))
    return 0
