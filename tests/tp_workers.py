"""Tensor-parallel worker processes for ``test_integration_tp`` (spawned; one function per scenario).

Each rank loads the same tiny checkpoint with ``DistributedConfig(tp_size=2)`` over gloo on the CPU (NCCL on
CUDA devices), drives transformers' loop through ``cbpause.integrations.transformers``, and writes what it
saw to ``<outdir>/rank<r>.json`` for the parent to assert on.  Skews between ranks are made with work, not
sleeps: the protocol must pair the pauses whatever the timing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import traceback
from pathlib import Path

from cbpause.testing import HANG_S

WAIT = HANG_S  # a hang, not slowness (cbpause.testing)
N_REQUESTS = 6
# The product's bounds on a peer, in the fault scenarios, where a peer never comes and the bound running out is what
# they check.  A healthy scenario's peer is only ever slow (still loading, descheduled on a loaded machine): there the
# bounds are HANG_S, so that they never run out.
PEER_PARK_TIMEOUT = 3.0
CPU_GROUP_TIMEOUT = 10.0


def _setup(rank: int, world: int, port: int, ckpt: str, backend: str, fault: bool = False):
    import torch
    import torch.distributed as dist

    from cbpause.integrations.transformers import init_continuous_batching
    from cbpause.testing import ForwardProbe, batching_config, greedy_config, join_tp_group, load_tp_model

    from .conftest import MAX_NEW

    join_tp_group(rank, world, port, backend)
    model = load_tp_model(ckpt, world)
    manager = init_continuous_batching(
        model, greedy_config(MAX_NEW), batching_config(cpu_group_timeout=CPU_GROUP_TIMEOUT if fault else HANG_S),
        peer_park_timeout=PEER_PARK_TIMEOUT if fault else HANG_S,
    )  # fmt: skip
    probe = ForwardProbe()
    probe.attach(model)
    return torch, dist, manager, probe


def _submit(manager, rank: int) -> list[str]:
    from .conftest import MAX_NEW, PROMPT

    if rank != 0:  # only the TP driver takes requests; the group shares them
        return []
    return [manager.add_request([*PROMPT, i + 1], max_new_tokens=MAX_NEW) for i in range(N_REQUESTS)]


def _collect(manager) -> dict[str, dict]:
    outs = {}
    for _ in range(N_REQUESTS):
        out = manager.get_result(timeout=WAIT)
        if out is None:
            break
        outs[out.request_id] = {"tokens": list(out.generated_tokens), "status": out.status.name, "error": out.error}
    return outs


def _skew(torch, amount: int) -> None:
    x = torch.ones(64, 64)
    for _ in range(amount * 20):
        x = (x @ x).clamp_(max=1.0)


def _write(outdir: str, rank: int, record: dict) -> None:
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(record))


def run(rank: int, world: int, port: int, ckpt: str, scenario: str, outdir: str, backend: str = "gloo") -> None:
    record: dict = {"rank": rank}
    record_dir[0] = outdir
    try:
        SCENARIOS[scenario](rank, world, port, ckpt, backend, record)
    except BaseException:  # noqa: BLE001 - the parent reads the failure from the record
        record["worker_error"] = traceback.format_exc()
    _write(outdir, rank, record)
    # The fault scenarios leave the process group broken; tearing it down could block on a dead peer.
    os._exit(0)


def pauses(rank, world, port, ckpt, backend, record):
    """Test 8: five pauses per rank, skewed, with an all_reduce probe on the TP group inside each."""
    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend)
    manager.start()
    ids = _submit(manager, rank)
    probes = []
    for i in range(5):
        _skew(torch, (rank + i) % 3)
        with manager.pause(timeout=WAIT):
            probe.inside += 1
            x = torch.tensor([float(rank + 1), float(i)])
            dist.all_reduce(x, group=manager.distributed_helper.tp_group)  # pairs only if both ranks are inside
            probes.append(x.tolist())
            probe.inside -= 1
    record["probes"] = probes
    record["outputs"] = _collect(manager)
    record["ids"] = ids
    record["violations"] = probe.violations
    record["metrics"] = manager.background_thread_status.metrics().pauses_taken
    manager.stop(block=True, timeout=WAIT)
    record["running_after_stop"] = manager.is_running()
    dist.barrier()


def modes(rank, world, port, ckpt, backend, record):
    """Issue 14 under TP: both ranks pause in keep, retract, drain and abort in turn, each setting the weight version
    inside; both must see the same agreed mode in each window, and identical outputs and version spans."""
    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend)
    manager.start()
    ids = _submit(manager, rank)
    agreed = []
    for i, mode in enumerate(("keep", "retract", "drain", "abort")):
        _skew(torch, (rank + i) % 3)
        with manager.pause(timeout=WAIT, mode=mode):
            probe.inside += 1
            agreed.append(manager.background_thread_status.state.tp_pause)
            x = torch.tensor([1.0])
            dist.all_reduce(x, group=manager.distributed_helper.tp_group)  # pairs only if both ranks are inside
            manager.set_weight_version(i + 1)
            probe.inside -= 1
    outs = {}
    for _ in range(N_REQUESTS):
        out = manager.get_result(timeout=WAIT)
        if out is None:
            break
        outs[out.request_id] = {"tokens": list(out.generated_tokens), "status": out.status.name,
                                "error": out.error, "spans": [list(s) for s in out.weight_versions]}  # fmt: skip
    later = manager.add_request([3, 1, 4], max_new_tokens=4) if rank == 0 else None
    out = manager.get_result(timeout=WAIT)  # every rank's copy of the request after the last update
    record.update(agreed=agreed, outputs=outs, ids=ids, violations=probe.violations, later=later,
                  later_spans=None if out is None else [list(s) for s in out.weight_versions])  # fmt: skip
    manager.stop(block=True, timeout=WAIT)
    dist.barrier()


def versions_differ(rank, world, port, ckpt, backend, record):
    """Issue 26, point 12 (issue 42): the ranks set different weight versions in one window (rank 0 "a", rank 1 "b"),
    then the same one ("c"): each rank logs an error for the first, and both label the tokens between with
    PartialSync of the driver's, then "c"."""
    import logging

    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend)
    errors: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: errors.append(r.getMessage()) if r.levelno >= logging.ERROR else None
    logging.getLogger("cbpause").addHandler(handler)
    manager.start()
    ids = _submit(manager, rank)
    between = None
    for version in ("ab"[rank], "c"):
        with manager.pause(timeout=WAIT):
            manager.set_weight_version(version)
        if between is None:
            with manager.pause(timeout=WAIT):  # the window after the barrier that compared the versions
                between = manager.weight_version
    outs = {}
    for _ in range(N_REQUESTS):
        out = manager.get_result(timeout=WAIT)
        if out is None:
            break
        outs[out.request_id] = [[i, v if v is None or isinstance(v, str) else repr(v)] for i, v in out.weight_versions]
    errors = [e for e in errors if "different weight versions" in e]
    record.update(ids=ids, spans=outs, after=manager.weight_version, errors=errors,
                  between=repr(between))  # fmt: skip
    manager.stop(block=True, timeout=WAIT)
    dist.barrier()


def _outcome(manager, record) -> None:
    """How this rank's loop ended, and what a pause and a stop do afterwards."""
    thread = manager._generation_thread
    if thread is not None:
        thread.join(WAIT)
    status = manager.background_thread_status
    record["loop_alive"] = manager.is_running()
    record["fatal"] = type(status.fatal_error).__name__ if status.fatal_error is not None else None
    record["fatal_message"] = str(status.fatal_error)
    try:
        with manager.pause(timeout=WAIT):
            record["paused_after"] = True
    except RuntimeError as error:
        record["pause_after"] = f"{type(error).__name__}: {error}"
        record["pause_after_cause"] = type(error.__cause__).__name__ if error.__cause__ is not None else None
    stopper = threading.Thread(target=manager.stop, kwargs={"block": True, "timeout": WAIT}, daemon=True)
    stopper.start()
    stopper.join(WAIT)
    record["stop_returned"] = not stopper.is_alive()


def peer_never_pauses(rank, world, port, ckpt, backend, record):
    """Test 9a (D3): rank 0 pauses, rank 1's pauser never comes."""
    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend, fault=True)
    manager.start()
    ids = _submit(manager, rank)
    if rank == 0:
        with manager.pause(timeout=WAIT):
            record["entered"] = True
    _outcome(manager, record)
    record["outputs"] = _collect(manager) if ids else {}
    record["ids"] = ids


def rank_killed_mid_pause(rank, world, port, ckpt, backend, record):
    """Test 9b: both ranks pause; rank 1's process is killed while its holder is inside."""
    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend, fault=True)
    manager.start()
    ids = _submit(manager, rank)
    with manager.pause(timeout=WAIT):
        x = torch.ones(1)
        dist.all_reduce(x, group=manager.distributed_helper.tp_group)  # both ranks are inside now
        record["probe"] = x.item()
        if rank == 1:
            _write(record_dir[0], rank, {"rank": rank, "killed": True, "probe": x.item()})
            os.kill(os.getpid(), signal.SIGKILL)
    _outcome(manager, record)
    record["outputs"] = _collect(manager) if ids else {}
    record["ids"] = ids


def rank_killed_mid_step(rank, world, port, ckpt, backend, record):
    """Reliability: rank 1's process is killed inside a forward step (its TP collectives never come)."""
    torch, dist, manager, probe = _setup(rank, world, port, ckpt, backend, fault=True)
    if rank == 1:
        steps = [0]

        def die_in_the_fifth_step(module, args):
            steps[0] += 1
            if steps[0] == 5:
                _write(record_dir[0], rank, {"rank": rank, "killed": True})
                os.kill(os.getpid(), signal.SIGKILL)

        manager.model.register_forward_pre_hook(die_in_the_fifth_step)
    manager.start()
    ids = _submit(manager, rank)
    _outcome(manager, record)
    record["outputs"] = _collect(manager) if ids else {}
    record["ids"] = ids


record_dir: list[str] = [""]

SCENARIOS = {
    "pauses": pauses,
    "modes": modes,
    "versions_differ": versions_differ,
    "peer_never_pauses": peer_never_pauses,
    "rank_killed_mid_pause": rank_killed_mid_pause,
    "rank_killed_mid_step": rank_killed_mid_step,
}
