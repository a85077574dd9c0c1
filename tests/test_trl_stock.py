"""TRL's own rollout worker trains against ``cbpause serve`` unchanged (docs/trl.md, "TRL's own rollout worker"):
``AsyncGRPOTrainer(..., rollout_worker=None, weight_transfer=FleetWeightSync(...))`` with ``vllm_server_base_url`` a
``cbpause serve`` URL.  TRL's ``AsyncRolloutWorker`` (a spawned process) sends its completions over HTTP as it sends
them to vLLM (a token-id prompt, its own sampling, a fresh seed, ``logprobs: 0``, ``return_token_ids``); the weights
go by broadcast under the fleet's pause.  (TRL's ``VLLMClient`` reading the server, ``max_model_len`` included, is
tests/test_serve_openai.py's.)"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
if not os.environ.get("CI"):
    pytest.importorskip("trl")
    pytest.importorskip("aiohttp")

import httpx  # noqa: E402
import torch  # noqa: E402

from cbpause.client import Fleet  # noqa: E402
from cbpause.integrations.trl import AsyncGRPOTrainer, without_vllm  # noqa: E402
from cbpause.integrations.trl_fleet import FleetWeightSync  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.servers import serve_process  # noqa: E402
from cbpause.testing.trl_cpu import chat_dataset, tiny_task, trl_on_cpu  # noqa: E402

from .test_trl_fleet import logprobs_of  # noqa: E402

pytestmark = pytest.mark.layer("system")
STEPS = 4


def test_trl_s_own_rollout_worker_trains_against_cbpause_serve(tmp_path):
    task = tiny_task(tmp_path, steps=STEPS, max_staleness=1, max_inflight_tasks=8)
    task.generation_config.save_pretrained(task.model_dir)
    with serve_process(task.model_dir, "--default-ttl", str(HANG_S)) as (url, _):
        task.args.vllm_server_base_url = url
        with Fleet([url], request_timeout=HANG_S) as fleet:
            sync = FleetWeightSync(fleet, timeout=HANG_S, ttl=HANG_S, group_timeout=HANG_S)
            with trl_on_cpu(), without_vllm():
                trainer = AsyncGRPOTrainer(model=str(task.model_dir), reward_funcs=task.reward, args=task.args,
                                           train_dataset=chat_dataset(), processing_class=task.tokenizer,
                                           weight_transfer=sync)  # fmt: skip
            with trl_on_cpu():
                trainer.train()
        assert trainer.state.global_step == STEPS
        assert trainer.model_version == sync.syncs == STEPS + 1  # the cold sync, then one per step
        # step 1 trains on samples of the policy it scores: the server's log-probabilities were the trainer's
        ratio = next(h["ratio"] for h in trainer.state.log_history if "ratio" in h)
        assert abs(ratio - 1.0) < 1e-4
        # the server holds the trained policy after the last sync: its log-probabilities are the trained model's
        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(task.model_dir).eval()
        trained.load_state_dict(trainer.model.state_dict())
        assert httpx.get(url + "/weight_info", timeout=HANG_S).json()["weight_version"] == STEPS + 1
        body = {"prompt": [3, 4, 9], "max_tokens": 6, "logprobs": 0, "return_token_ids": True, "temperature": 1.0}
        choice = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S).json()["choices"][0]
        assert choice["weight_versions"] == [[0, STEPS + 1]]
        mine = logprobs_of(trained, [3, 4, 9], choice["token_ids"])
        assert torch.allclose(mine, torch.tensor(choice["logprobs"]["token_logprobs"]), atol=1e-4), (mine, choice)
