"""TRL's AsyncGRPOTrainer with its engines in other processes (issue 42): two ``cbpause serve`` processes (or the two
ranks of a TP engine), their weights sent by broadcast over gloo at every sync (``FleetWeightSync``), the rollouts
generated on them (``CBRolloutWorker`` over a ``FleetEngine``).  The trainer trains its steps; every server ends with
the trainer's weights and version; the servers' log-probabilities are the trainer's."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
if not os.environ.get("CI"):
    pytest.importorskip("trl")

import httpx  # noqa: E402
import torch  # noqa: E402

from cbpause.client import Fleet  # noqa: E402
from cbpause.integrations.trl import CBRolloutWorker  # noqa: E402
from cbpause.integrations.trl_fleet import FleetEngine, FleetWeightSync  # noqa: E402
from cbpause.testing import HANG_S, JOIN_TIMEOUT  # noqa: E402
from cbpause.testing.servers import serve_process, serve_tp_processes  # noqa: E402
from cbpause.testing.trl_cpu import tiny_task, trl_on_cpu  # noqa: E402

from .test_trl import trainer_for  # noqa: E402

pytestmark = pytest.mark.layer("system")
STEPS = 12


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's log-probabilities of ``tokens`` after ``prompt`` (temperature 1, as the servers sample)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def train(task, ranks: list[str], engine_urls: list[str], steps: int):
    """Train ``steps`` steps with the sync's fleet of ``ranks`` and the rollouts from ``engine_urls``; then every
    rank holds the trainer's version, and the engine's servers answer with the trainer's log-probabilities."""
    with Fleet(ranks, request_timeout=HANG_S) as fleet:
        sync = FleetWeightSync(fleet, timeout=HANG_S, ttl=HANG_S, group_timeout=HANG_S)
        engine = FleetEngine(engine_urls, max_in_flight=8)
        worker = CBRolloutWorker(engine, task.dataset, task.reward, num_generations=task.num_generations,
                                 max_new_tokens=task.max_new_tokens, processing_class=task.tokenizer,
                                 join_timeout=JOIN_TIMEOUT)  # fmt: skip
        try:
            with trl_on_cpu():
                trainer = trainer_for(task, sync, worker)
                trainer.train()
        finally:
            engine.close()
        assert trainer.state.global_step == steps
        # the cold sync at train begin, then one per step, each by broadcast to every rank
        assert trainer.model_version == sync.syncs == steps + 1
        assert fleet.weight_group is None  # TRL's destroy() at the end of train() ended the group
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(task.model_dir).eval()  # the trainer's runs TRL's attention
    trained.load_state_dict(trainer.model.state_dict())
    for url in ranks:
        assert httpx.get(url + "/weight_info", timeout=HANG_S).json()["weight_version"] == steps + 1
    for url in engine_urls:
        body = {"prompt": "t3 t4 t9", "max_tokens": 6, "logprobs": 0, "return_token_ids": True}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S).json()["choices"][0]
        assert choice["weight_versions"] == [[0, steps + 1]]
        # the server generates with the trainer's weights: its log-probabilities are the trained model's
        mine = logprobs_of(trained, choice["prompt_token_ids"], choice["token_ids"])
        assert torch.allclose(mine, torch.tensor(choice["logprobs"]["token_logprobs"]), atol=1e-4), (mine, choice)
    # step 1 trains on samples of the policy it scores: the servers' log-probabilities were the trainer's then too
    ratio = next(h["ratio"] for h in trainer.state.log_history if "ratio" in h)
    assert abs(ratio - 1.0) < 1e-4


FLAGS = ("--num-blocks", "64", "--default-ttl", str(HANG_S))


# CI trains 4 steps, as against the TP engine below: every assertion of train() holds from the first sync on (a
# module of 160 s of CPU at 12 steps, the most of any in CI's run); the 12 steps run in `nox -s system`.
@pytest.mark.parametrize("steps", [4, pytest.param(STEPS, marks=pytest.mark.extended)])
def test_async_grpo_trains_with_its_rollouts_from_two_servers(tmp_path, steps):
    task = tiny_task(tmp_path, steps=steps, max_staleness=1)
    task.generation_config.save_pretrained(task.model_dir)  # the servers sample as the trainer expects
    with serve_process(task.model_dir, *FLAGS) as (a, _), serve_process(task.model_dir, *FLAGS) as (b, _):
        train(task, [a, b], [a, b], steps)


def test_async_grpo_trains_with_an_engine_of_two_tp_ranks(tmp_path):
    """The relay (docs/serving.md, "An engine of tensor-parallel ranks"): the sync's fleet lists both ranks, the
    rollouts come from the driver; every rank receives each whole tensor and copies its shard."""
    steps = 4
    task = tiny_task(tmp_path, steps=steps, max_staleness=1)
    task.generation_config.save_pretrained(task.model_dir)
    with serve_tp_processes(task.model_dir, 2, *FLAGS) as ranks:
        urls = [url for url, _ in ranks]
        train(task, urls, urls[:1], steps)
