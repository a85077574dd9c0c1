"""``python -m cbpause.apps.bench --weights`` (``nox -s bench -- --weights``): a full weight update by broadcast
against one from disk, on the CPU over gloo (issue 42).

This process is the trainer (rank 0 of the weight-update group); two ``cbpause serve`` processes on localhost are the
servers.  For each of ``--repeats`` interleaved rounds, under one ``Fleet.pause()`` each:

* **broadcast**: ``Fleet.update_weights_from_distributed(model.named_parameters())``, every tensor of the model;
* **disk**: ``save_file`` of the same tensors into the servers' ``--weights-dir`` (timed apart), then
  ``Fleet.update_weights_from_disk``.

For each: the update's seconds and GB/s (the bytes of one copy of the model over the update's seconds), and the pause
from the call that enters it to the end of the resume.  Then, as ratios of one run:

* **raw**: the transport's limit, one ``torch.distributed`` broadcast of a single flat buffer of the update's bytes from
  this process to two receiving processes of the kind the servers use (``cbpause.serve.receiver``), nothing checked
  or copied; ``broadcast / raw`` (goal: at most 1.5);
* ``broadcast / (disk_save + disk)``: the disk path as a trainer pays it (goal: at most 0.5);
* **memory**: how far a server's resident memory rose during a broadcast above what it was when the broadcast began
  (its peak, ``VmHWM``, reset then), the most over the rounds and the servers, over the update's bytes (goal: at most
  0.5); and each server's receiving process's peak.

The model is a random Llama whose size ``--weights-hidden`` sets (stated in the output). Writes ``weights.json`` and
``weights.md`` under ``--out``. No GPU figure is claimed here: ``cbpause.apps.bench.gpu`` runs :func:`measure` where a
device is lent, with the servers on it (over NCCL where three devices hold the trainer and the two servers, one each:
NCCL takes no two ranks on one device; over gloo, the tensors through the host, on a machine of one or two).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

VOCAB = 32


def checkpoint_of(hidden: int, directory: Path) -> tuple[Path, object]:
    """A random Llama of width ``hidden`` saved as a checkpoint the servers load, and the trainer's copy of it."""
    from transformers import GenerationConfig

    from ...testing.llama import tiny_llama
    from ...testing.trl_cpu import tiny_tokenizer

    shape = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": 4,
             "num_attention_heads": max(hidden // 64, 1), "num_key_value_heads": max(hidden // 128, 1)}  # fmt: skip
    model = tiny_llama(seed=0, vocab_size=VOCAB, **shape)
    model.generation_config = GenerationConfig(eos_token_id=-1, pad_token_id=0)
    model.save_pretrained(directory)
    tiny_tokenizer(VOCAB).save_pretrained(directory)
    return directory, model


def figures(samples: list[float]) -> dict:
    return {"n": len(samples), "median_s": round(statistics.median(samples), 4), "min_s": round(min(samples), 4),
            "max_s": round(max(samples), 4)}  # fmt: skip


def rounds(fleet: object, model: object, weights_dir: Path, repeats: int, backend: str = "gloo",
           pids: tuple[int, ...] = ()) -> dict:  # fmt: skip
    """The interleaved rounds on ``fleet`` (its servers started with ``--weights-dir weights_dir`` and a checkpoint
    of ``model``'s shapes, its weight-update group initialised): the figures of each kind, and the model's size; with
    the servers' ``pids``, how far each one's resident memory rose during a broadcast (``broadcast_growth``)."""
    import torch
    from safetensors.torch import save_file

    runs: dict[str, list[float]] = {"broadcast": [], "broadcast_pause": [], "disk": [], "disk_pause": [],
                                    "disk_save": []}  # fmt: skip
    growths = []
    first = None
    if pids:
        # Before the rounds: one update from disk writes every parameter once (a checkpoint loaded from safetensors is
        # mapped copy-on-write, so the first write of each page adds it to the server's memory, whatever the
        # transport: measured, the model's size), then one broadcast, whose growth includes mapping the receiving
        # slots (two buckets, kept for the next updates): ``first_broadcast_growth``.
        state = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}
        save_file(state, str(weights_dir / "policy.safetensors"))
        with fleet.pause(ttl=300):
            fleet.update_weights_from_disk("policy.safetensors", weight_version="warm-disk")
        with fleet.pause(ttl=300):
            resident = [reset_peak(pid) for pid in pids]
            fleet.update_weights_from_distributed(list(state.items()), weight_version="warm-broadcast")
            first = max((_status(pid, "VmHWM") - r for pid, r in zip(pids, resident, strict=True)), default=0)
        del state
    for round_ in range(repeats):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)  # a new policy each round
        state = {k: v.detach().clone().contiguous() for k, v in model.named_parameters()}
        started = time.perf_counter()
        with fleet.pause(ttl=300):
            resident = [reset_peak(pid) for pid in pids]
            t0 = time.perf_counter()
            fleet.update_weights_from_distributed(list(state.items()), weight_version=f"b{round_}")
            runs["broadcast"].append(time.perf_counter() - t0)
            growth = max((_status(pid, "VmHWM") - r for pid, r in zip(pids, resident, strict=True)), default=0)
        runs["broadcast_pause"].append(time.perf_counter() - started)
        growths.append(growth)
        t0 = time.perf_counter()
        save_file(state, str(weights_dir / "policy.safetensors"))
        runs["disk_save"].append(time.perf_counter() - t0)
        started = time.perf_counter()
        with fleet.pause(ttl=300):
            t0 = time.perf_counter()
            fleet.update_weights_from_disk("policy.safetensors", weight_version=f"d{round_}")
            runs["disk"].append(time.perf_counter() - t0)
        runs["disk_pause"].append(time.perf_counter() - started)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"parameters": sum(p.numel() for p in model.parameters()), "bytes": nbytes, "servers": len(fleet.urls),
              "repeats": repeats, "backend": backend, **{k: figures(v) for k, v in runs.items()}}  # fmt: skip
    for kind in ("broadcast", "disk"):
        result[kind]["gb_per_s"] = round(nbytes / 1e9 / result[kind]["median_s"], 3)
    if pids:
        result["broadcast_growth"] = max(growths)
        result["first_broadcast_growth"] = first
    return result


def _status(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` figure in bytes (``VmHWM``, ``VmRSS``); 0 where ``/proc`` does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak(pid: int) -> int:
    """Reset the process's peak resident memory to its resident memory now (Linux: ``clear_refs`` 5); returns that."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    return _status(pid, "VmRSS")


def raw_rounds(nbytes: int, repeats: int) -> dict:
    """The transport's limit: one broadcast of a flat buffer of ``nbytes`` from this process to two receiving
    processes (:class:`~cbpause.serve.receiver.ReceivingGroup`), each taking the bytes in its slot and nothing more."""
    import threading

    import torch

    from ...client.weight_group import WeightGroup
    from ...serve.receiver import ReceivingGroup
    from ...testing.servers import free_port

    port, receivers, errors = free_port(), [], []

    def join(rank: int) -> None:
        receiver = ReceivingGroup("127.0.0.1", port, rank, 3, group_name="raw", timeout_s=300)
        receiver.join()
        receivers.append(receiver)

    joins = [threading.Thread(target=join, args=(rank,)) for rank in (1, 2)]
    for thread in joins:
        thread.start()
    trainer = WeightGroup("127.0.0.1", port, 0, 3, group_name="raw", timeout_s=300)
    for thread in joins:
        thread.join(300)
    flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    manifest = [("flat", (nbytes,), torch.uint8)]
    samples = []
    try:
        for _ in range(repeats):
            def take(receiver: ReceivingGroup) -> None:
                try:
                    receiver.receive(manifest, load=lambda name, tensor: None)
                except Exception as error:  # noqa: BLE001 -- reported below
                    errors.append(error)

            threads = [threading.Thread(target=take, args=(r,)) for r in receivers]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            trainer.broadcast(flat)
            for thread in threads:
                thread.join(300)
            samples.append(time.perf_counter() - t0)
    finally:
        trainer.destroy()
        for receiver in receivers:
            receiver.destroy()
    if errors:
        raise RuntimeError(f"the raw broadcast failed: {errors[0]}")
    return figures(samples)


def measure(hidden: int, repeats: int, devices: tuple[str, str, str] = ("cpu", "cpu", "cpu"),
            backend: str = "gloo", staging: str = "bounded", raw: bool = True) -> dict:  # fmt: skip
    """The rounds with the trainer's model on ``devices[0]`` and the two servers on ``devices[1:]``, over
    ``backend``, the servers receiving with ``--staging staging``; ``raw``: the raw broadcast too (over gloo)."""
    from ...client import Fleet
    from ...testing.servers import child_processes, serve_process

    with tempfile.TemporaryDirectory(prefix="cbpause-bench-weights-") as tmp:
        checkpoint, model = checkpoint_of(hidden, Path(tmp) / "ckpt")
        model.to(devices[0])
        weights_dir = Path(tmp) / "weights"
        weights_dir.mkdir()
        flags = ("--weights-dir", str(weights_dir), "--num-blocks", "64", "--default-ttl", "300", "--staging", staging)
        with serve_process(checkpoint, *flags, "--device", devices[1]) as (a, pa), \
                serve_process(checkpoint, *flags, "--device", devices[2]) as (b, pb), \
                Fleet([a, b], request_timeout=300) as fleet:  # fmt: skip
            fleet.init_weights_update_group("127.0.0.1", backend=backend, timeout=300)
            result = rounds(fleet, model, weights_dir, repeats, backend, pids=(pa.pid, pb.pid))
            receiving = [max((_status(c, "VmHWM") for c in child_processes(p.pid)), default=0) for p in (pa, pb)]
            fleet.destroy_weights_update_group()
        if backend == "gloo" and raw:
            result["raw"] = raw_rounds(result["bytes"], repeats)
    result["memory"] = {"broadcast_growth_bytes": result.pop("broadcast_growth"), "receiver_peak_bytes": receiving,
                        "first_broadcast_growth_bytes": result.pop("first_broadcast_growth")}  # fmt: skip
    result["memory"]["growth_over_update"] = round(result["memory"]["broadcast_growth_bytes"] / result["bytes"], 3)
    result["memory"]["first_growth_over_update"] = round(
        result["memory"]["first_broadcast_growth_bytes"] / result["bytes"], 3)  # fmt: skip
    result["ratios"] = {"broadcast_over_disk_as_paid": round(result["broadcast"]["median_s"] / (
        result["disk_save"]["median_s"] + result["disk"]["median_s"]), 3)}  # fmt: skip
    if "raw" in result:
        result["ratios"]["broadcast_over_raw"] = round(result["broadcast"]["median_s"] / result["raw"]["median_s"], 3)
    return {"hidden": hidden, "devices": list(devices), "staging": staging, **result}


def report(result: dict) -> str:
    size = f"{result['parameters'] / 1e6:.1f} M parameters, {result['bytes'] / 1e6:.0f} MB in float32"
    rows = [f"A full update of a random Llama ({size}) to {result['servers']} `cbpause serve` processes on this "
            f"machine's CPU, {result['repeats']} interleaved rounds (median, min-max):", "",
            "| update | seconds | GB/s | pause entry to resume, s |", "|---|---:|---:|---:|"]  # fmt: skip
    broadcast = f"by broadcast ({result.get('backend', 'gloo')})"
    for kind, name in (("broadcast", broadcast), ("disk", "from disk (`/update_weights_from_disk`)")):
        f, p = result[kind], result[f"{kind}_pause"]
        rows.append(f"| {name} | {f['median_s']} ({f['min_s']}-{f['max_s']}) | {f['gb_per_s']} | "
                    f"{p['median_s']} ({p['min_s']}-{p['max_s']}) |")  # fmt: skip
    save = result["disk_save"]
    rows.append(f"| the trainer's `save_file` before the disk update (outside the pause) | {save['median_s']} | | |")
    if "raw" in result:
        raw = result["raw"]
        rows.append(f"| one raw broadcast of a flat buffer of the same bytes (the transport's limit) | "
                    f"{raw['median_s']} ({raw['min_s']}-{raw['max_s']}) | "
                    f"{round(result['bytes'] / 1e9 / raw['median_s'], 3)} | |")  # fmt: skip
    ratios, memory = result.get("ratios"), result.get("memory")
    if ratios is None or memory is None:  # (rounds alone, as a test runs them: no ratio measured)
        return "\n".join(rows) + "\n"
    rows += ["", "| ratio | measured | goal |", "|---|---:|---:|"]
    if "broadcast_over_raw" in ratios:
        rows.append(f"| broadcast / raw broadcast | {ratios['broadcast_over_raw']} | at most 1.5 |")
    rows.append(f"| broadcast / (save + update from disk) | {ratios['broadcast_over_disk_as_paid']} | at most 0.5 |")
    growth = memory["growth_over_update"]
    rows.append(f"| a server's peak memory growth during a broadcast / the update's bytes | {growth} | at most 0.5 |")
    rows.append(f"| the same for its first broadcast (its receiving slots mapped) | "
                f"{memory['first_growth_over_update']} | at most 0.5 |")  # fmt: skip
    if "full_staging" in result:
        full = result["full_staging"]
        rows += ["", f"With `--staging full` (the whole update staged first): a broadcast takes "
                     f"{full['broadcast']['median_s']} s ({full['broadcast']['min_s']}-{full['broadcast']['max_s']}), "
                     f"and a server's memory grows by {full['memory']['growth_over_update']} of the update's bytes "
                     f"({full['memory']['first_growth_over_update']} at its first broadcast)."]  # fmt: skip
    return "\n".join(rows) + "\n"


def main(out: Path, hidden: int, repeats: int) -> int:
    import threading

    result = measure(hidden, repeats)
    full = measure(hidden, repeats, staging="full", raw=False)  # the option's cost, stated beside the default's
    result["full_staging"] = {"broadcast": full["broadcast"], "memory": full["memory"]}
    for thread in threading.enumerate():  # groups freed on threads of their own: a process that ends under one aborts
        if thread.name.startswith("cbpause-group-"):
            thread.join(60)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "weights.md").write_text(report(result))
    print(report(result), end="")
    return 0
