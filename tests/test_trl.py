"""TRL 1.16's AsyncGRPOTrainer trains through a cbpause engine on the CPU (issue 28): PauseWeightSync as its
weight_transfer, CBRolloutWorker as its rollout_worker, in every pause mode; a failing sync and a dead loop make
train() raise, never hang, and leave a manager that stops cleanly."""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("torch")  # the light environment (nox -s core) collects this module too
if not os.environ.get("CI"):
    pytest.importorskip("trl")  # CI's full environment installs the extra: there a missing TRL fails

import torch  # noqa: E402

from cbpause.integrations.transformers import init_continuous_batching  # noqa: E402
from cbpause.integrations.trl import (  # noqa: E402
    AsyncGRPOTrainer,  # noqa: E402
    CBRolloutWorker,
    PartialSync,
    PauseWeightSync,
    check_trl_version,
    engine_name,
)
from cbpause.testing import HANG_S, JOIN_TIMEOUT  # noqa: E402
from cbpause.testing.trl_cpu import tiny_task, trl_on_cpu, varlen_attention  # noqa: E402

pytestmark = pytest.mark.layer("system")


@pytest.fixture
def task(tmp_path):
    return tiny_task(tmp_path, steps=20)


def engine_for(task, **kwargs):
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(task.model_dir).eval()
    manager = init_continuous_batching(engine, task.generation_config, task.batching_config, **kwargs)
    manager.start()
    return engine, manager


def trainer_for(task, sync, worker):
    return AsyncGRPOTrainer(model=str(task.model_dir), reward_funcs=task.reward, args=task.args,
                            train_dataset=task.dataset, processing_class=task.tokenizer, rollout_worker=worker,
                            weight_transfer=sync)  # fmt: skip


def worker_for(task, manager, **kwargs):
    """The rollout worker; its thread must end when stopped, however slow the machine (``join_timeout``)."""
    return CBRolloutWorker(manager, task.dataset, task.reward, num_generations=task.num_generations,
                           max_new_tokens=task.max_new_tokens, processing_class=task.tokenizer,
                           **{"join_timeout": JOIN_TIMEOUT, **kwargs})  # fmt: skip


def first_logged(trainer, key):
    return next(h[key] for h in trainer.state.log_history if key in h)


# keep in CI's selection; the other modes in nox -s system (CI has every mode on the real loop: tests/test_modes.py)
_LATER = [pytest.mark.extended]


@pytest.mark.parametrize(
    "mode, steps",
    [("keep", 20), pytest.param("retract", 20, marks=_LATER), pytest.param("drain", 6, marks=_LATER),
     pytest.param("abort", 6, marks=_LATER)],
)  # fmt: skip
def test_async_grpo_trains_through_the_paused_loop(tmp_path, mode, steps):
    task = tiny_task(tmp_path, steps=steps, max_staleness=1)
    # the engine's staleness bound is the trainer's: nothing is generated for a sample it would drop
    engine, manager = engine_for(task, max_staleness=task.args.max_staleness, on_stale="abort")
    sync = PauseWeightSync(manager, mode=mode, timeout=HANG_S)  # every sync must pause
    worker = worker_for(task, manager)
    try:
        with trl_on_cpu():
            trainer = trainer_for(task, sync, worker)
            initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.train()
        assert trainer.state.global_step == steps
        # the cold sync at train begin, then one per step: the trainer's version, the syncs and the engine's agree
        assert trainer.model_version == sync.syncs == manager.weight_version == steps + 1
        policy = dict(trainer.model.named_parameters())
        assert set(policy) == {n for n, _ in engine.named_parameters()}
        assert all(torch.equal(p, policy[n]) for n, p in engine.named_parameters())
        assert any(not torch.equal(initial[n], p) for n, p in policy.items())  # it trained
        # step 1 trains on samples of the policy it scores: the engine's log-probabilities are the trainer's
        assert abs(first_logged(trainer, "ratio") - 1.0) < 1e-4
        assert first_logged(trainer, "kl") == pytest.approx(0.0, abs=1e-4)
        if mode == "abort":
            assert worker.resubmitted > 0  # the pauses ended requests in flight; the worker sampled them again
        assert all(h.get("sample/staleness_max", 0) <= 1 for h in trainer.state.log_history)
        assert not worker._thread.is_alive()  # TRL's train() ends with rollout_worker.stop()
        assert manager.is_running() and not manager.background_thread_status.state.paused
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not manager.is_running()


@pytest.mark.extended  # 20 more steps of training: nox -s system
def test_the_reward_rises_from_chance(tmp_path):
    task = tiny_task(tmp_path, steps=24)
    _, manager = engine_for(task)
    try:
        with trl_on_cpu():
            trainer = trainer_for(task, PauseWeightSync(manager, timeout=HANG_S), worker_for(task, manager))
            trainer.train()
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert sum(rewards[-4:]) / 4 > 3 * (1 / 16)  # chance is 1 in 16; the tiny task is learnt within 24 steps


class FailingSync(PauseWeightSync):
    """A transfer whose third sync fails after copying one parameter."""

    def send_weights(self, iterator):
        if self.syncs < 2:
            return super().send_weights(iterator)

        def broken():
            for i, item in enumerate(iterator):
                if i == 1:
                    raise OSError("the transfer broke")
                yield item

        return super().send_weights(broken())


def test_a_failing_weight_sync_makes_train_raise_and_the_manager_stops_cleanly(task):
    _, manager = engine_for(task)
    sync, worker = FailingSync(manager, timeout=HANG_S), worker_for(task, manager)
    done = threading.Event()
    try:
        with trl_on_cpu(), pytest.raises(OSError, match="the transfer broke"):
            trainer_for(task, sync, worker).train()
        done.set()
        assert sync.syncs == 2 and manager.weight_version == PartialSync(3)  # never a policy's number
        assert not manager.background_thread_status.state.paused  # destroy() released the pause
        assert not worker._thread.is_alive()
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert done.is_set() and not manager.is_running() and manager.background_thread_status.fatal_error is None


def test_a_dead_loop_makes_train_raise(task):
    _, manager = engine_for(task)
    sync, worker = PauseWeightSync(manager, timeout=HANG_S), worker_for(task, manager)

    class StopAtSecondSync(PauseWeightSync):
        def pause(self):
            if self.syncs == 2:
                manager.stop(block=True, timeout=JOIN_TIMEOUT)
            super().pause()

    sync = StopAtSecondSync(manager, timeout=HANG_S)
    with trl_on_cpu(), pytest.raises(RuntimeError, match="no generation loop is running"):
        trainer_for(task, sync, worker).train()
    assert sync.syncs == 2 and not manager.is_running() and not worker._thread.is_alive()


def test_a_pause_that_times_out_raises(task):
    _, manager = engine_for(task)
    inside, leave = threading.Event(), threading.Event()

    def other_holder():  # keeps the loop paused in keep mode...
        with manager.pause(timeout=HANG_S):
            inside.set()
            leave.wait(JOIN_TIMEOUT)

    holder = threading.Thread(target=other_holder)
    holder.start()
    try:
        assert inside.wait(JOIN_TIMEOUT)
        sync = PauseWeightSync(manager, mode="abort", timeout=0.2)  # ...so a stronger mode waits, then gives up
        with pytest.raises(TimeoutError):
            sync.pause()
        assert sync._pause is None
    finally:
        leave.set()
        holder.join(JOIN_TIMEOUT)
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not holder.is_alive()


def test_the_weight_sync_refuses_misuse_and_copies_nothing_after_a_bad_parameter(task):
    engine, manager = engine_for(task)
    try:
        sync = PauseWeightSync(manager, timeout=HANG_S)
        for call in (lambda: sync.send_weights([]), sync.resume):
            with pytest.raises(RuntimeError):
                call()
        sync.destroy()  # nothing held: nothing to do
        params = dict(engine.named_parameters())
        names = list(params)
        before = {n: p.detach().clone() for n, p in params.items()}
        sync.pause()
        with pytest.raises(RuntimeError, match="holds a pause already"):
            sync.pause()
        sent = [("module." + names[0], params[names[0]] + 1), ("nowhere.weight", params[names[1]]),
                (names[2], params[names[2]] + 1)]  # fmt: skip
        with pytest.raises(KeyError, match="nowhere.weight"):
            sync.send_weights(iter(sent))
        assert torch.equal(params[names[0]], before[names[0]] + 1)  # the prefix was stripped, the copy made
        assert torch.equal(params[names[2]], before[names[2]])  # nothing after the faulty name
        assert manager.weight_version == PartialSync(1)
        with pytest.raises(ValueError, match="the model's is"):
            sync.send_weights([(names[1], params[names[1]].double())])
        with pytest.raises(ValueError, match="the model's is"):
            sync.send_weights([(names[1], params[names[1]][:1])])
        with pytest.raises(ValueError, match="no tensor"):  # issue 39, point 14: it counted as a full sync
            sync.send_weights(iter([]))
        assert manager.weight_version == PartialSync(1) and sync.syncs == 0
        sync.send_weights([(n, p.detach().clone()) for n, p in params.items()])
        assert manager.weight_version == 1 and sync.syncs == 1
        sync.destroy()  # releases the pause
        assert not manager.background_thread_status.state.paused
        for bad in (dict(mode="pause"), dict(timeout=-1)):
            with pytest.raises(ValueError):
                PauseWeightSync(manager, **bad)
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    with pytest.raises(RuntimeError, match="start the manager"):
        PauseWeightSync(manager).init_weight_transfer()


def test_engine_names_strip_the_trainers_wrappers():
    assert engine_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") == (
        "model.layers.0.mlp.weight"
    )
    assert engine_name("lm_head.weight") == "lm_head.weight"


def test_the_rollout_worker_refuses_bad_arguments_and_reports_its_failure(task):
    _, manager = engine_for(task)
    try:
        for bad in (dict(num_generations=0), dict(max_new_tokens=True), dict(max_inflight_groups=-1)):
            with pytest.raises(ValueError):
                CBRolloutWorker(manager, task.dataset, task.reward, **{"num_generations": 2, "max_new_tokens": 2,
                                                                       **bad})  # fmt: skip
        with pytest.raises(ValueError, match="empty"):
            CBRolloutWorker(manager, [], task.reward, num_generations=2, max_new_tokens=2)

        def broken_reward(**_):
            raise ZeroDivisionError("the reward broke")

        worker = CBRolloutWorker(manager, task.dataset, broken_reward, num_generations=2, max_new_tokens=2)
        worker.start()
        worker._thread.join(JOIN_TIMEOUT)
        with pytest.raises(RuntimeError, match="see the chained exception") as raised:
            worker.check_health(stale_after_s=60)
        assert isinstance(raised.value.__cause__, ZeroDivisionError)
        worker.stop()
        assert worker._in_flight == {}

        idle = CBRolloutWorker(manager, task.dataset, task.reward, num_generations=2, max_new_tokens=2)
        with pytest.raises(RuntimeError, match="produced nothing"):
            idle.check_health(stale_after_s=-1)
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)


def test_the_rollout_worker_needs_log_probabilities(task):
    from transformers import AutoModelForCausalLM

    from cbpause.testing import batching_config

    manager = init_continuous_batching(AutoModelForCausalLM.from_pretrained(task.model_dir), task.generation_config,
                                       batching_config())  # fmt: skip
    with pytest.raises(ValueError, match="return_logprobs=True"):
        CBRolloutWorker(manager, task.dataset, task.reward, num_generations=2, max_new_tokens=2)


def test_only_the_tested_trl_minor_version_is_accepted():
    check_trl_version("1.16.3")
    for other in ("1.15.0", "1.17.0", "2.16.0"):
        with pytest.raises(ImportError, match="1.16"):
            check_trl_version(other)


def test_the_cpu_workarounds_are_undone_after_the_block():
    from cbpause.integrations.trl import async_grpo_trainer, packing

    before = async_grpo_trainer.get_peak_flops_per_device, packing._flash_attn
    with trl_on_cpu():
        assert packing._flash_attn().flash_attn_varlen_func is varlen_attention
        assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None
    assert (async_grpo_trainer.get_peak_flops_per_device, packing._flash_attn) == before


def test_the_cpu_attention_is_flash_attentions_bottom_right_causal_varlen():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
    out = varlen_attention(q, k, v, cu_q, cu_k, softmax_scale=0.5)
    # segment 1: its 3 queries see keys 3..7 bottom-right aligned: query j sees the first j + 2 of the 4 keys
    for j in range(3):
        keys = k[3 : 3 + j + 2].repeat_interleave(2, 1)
        values = v[3 : 3 + j + 2].repeat_interleave(2, 1)
        weights = torch.softmax((q[2 + j][None] * keys).sum(-1) * 0.5, 0)
        assert torch.allclose(out[2 + j], (weights[..., None] * values).sum(0), atol=1e-5)


def test_the_side_by_side_bench_runs_both_trainers(tmp_path):
    import json

    from cbpause.apps.bench.run import main

    assert main(["--trl", "--trl-steps", "3", "--trl-modes", "keep", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "trl.json").read_text())
    assert [r["trainer"] for r in report["results"]] == ["async (keep)", "sync (generate_batch)"]
    for r in report["results"]:
        assert r["steps"] == 3 and len(r["rewards"]) == 3 and r["tokens_per_s"] > 0 and r["s_per_step"] > 0
    assert report["results"][0]["weight_sync_s"] > 0  # four syncs (the cold one and one per step), each a pause
    assert (tmp_path / "trl.md").read_text().count("\n| ") == 2  # a row per trainer below the header


def test_the_demo_trains_and_reports_each_step(tmp_path, capsys):
    from cbpause.apps.demo import main

    main(["--trl", "--steps", "4", "--png", str(tmp_path / "curve.png")])
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4"]
    assert "5 weight syncs (keep)" in out  # the cold sync, then one per step


def test_a_token_of_a_half_done_sync_makes_the_sample_older_than_any_policy():
    from cbpause.integrations.trl import _policy

    assert [_policy(v) for v in (None, 0, 3, PartialSync(2), True, "v1")] == [0, 0, 3, -1, -1, -1]


def test_a_completion_the_staleness_bound_keeps_ending_fails_the_worker_saying_why(task):
    """Issue 40's review: the worker submitted a STALE-ended completion again for ever (a new request, with a restart
    budget of its own), so a completion that needs more steps than the updates leave it undid the engine's budget.
    Past ``MAX_STALE_RESUBMITS`` it fails, with what to change."""
    from cbpause.integrations.trl import MAX_STALE_RESUBMITS
    from cbpause.integrations.weights import STALE

    _, manager = engine_for(task)
    real = manager.get_result

    def always_stale(*args, **kwargs):  # every completion is ended by the bound, as under updates after every step
        out = real(*args, **kwargs)
        if out is not None:
            out.error = f"{STALE}: 1 versions behind (forced by the test)"
        return out

    manager.get_result = always_stale
    try:
        worker = CBRolloutWorker(manager, task.dataset, task.reward, num_generations=2, max_new_tokens=2)
        worker.start()
        worker._thread.join(JOIN_TIMEOUT)
        assert not worker._thread.is_alive(), "the worker retried for ever"
        with pytest.raises(RuntimeError, match="see the chained exception") as raised:
            worker.check_health(stale_after_s=60)
        assert "staleness bound" in str(raised.value.__cause__) and "max_staleness" in str(raised.value.__cause__)
        assert worker.resubmitted >= MAX_STALE_RESUBMITS
        worker.stop()
    finally:
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
