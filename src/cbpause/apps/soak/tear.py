"""The HTTP soak's hostile sender (R-TORN-HOLD): a server's weights torn by a short bucket, then mended."""

from __future__ import annotations

import random
from typing import Any

import httpx

from ...client import Fleet, FleetError
from ...testing import HANG_S

__all__ = ["tear"]


def tear(url: str, tensors: list[dict], ledger: Any, rng: random.Random, ttl: float, group_timeout: float) -> None:
    """A hostile sender (R-TORN-HOLD): under its own lease on one server, a broadcast whose second bucket is short.
    The server copies the first bucket as it arrives, so its weights are torn: it must refuse completions (503) and
    step nothing while they are (a label ``PartialSync`` in any answer is wrong: the check of every answer), and be
    mended by a complete update, which this sender then writes, a whole policy under a version of its own.  Skipped
    when the lease cannot write now (another trainer's write stands: the fence)."""
    state = tensors[rng.randrange(len(tensors))]
    version = 10_000 + rng.randrange(10_000)
    with ledger.lock:
        ledger.versions.add(version)
    try:
        with Fleet([url], holder="tearer", bucket_bytes=64 * 1024) as fleet:
            fleet.init_weights_update_group("127.0.0.1", group_name="tearer", timeout=group_timeout)
            group, sent = fleet.weight_group, []
            broadcast = group.broadcast

            def short(tensor: Any) -> None:  # bucket 1's bytes (the fourth broadcast: header, bytes, header, bytes)
                sent.append(tensor)
                broadcast(tensor[: tensor.numel() // 2] if len(sent) == 4 else tensor)

            group.broadcast = short
            with fleet.pause(timeout=30, ttl=ttl):
                try:
                    fleet.update_weights_from_distributed(state.items(), f"torn-{version}")
                    ledger.problem(f"{url}: a broadcast with a short bucket was taken whole")
                    return
                except FleetError as error:
                    if "torn" not in str(error):
                        print(f"soak-http: tear skipped: {error}", flush=True)
                        return
                with ledger.lock:  # (the server counts it, refused: the ledger must too)
                    ledger.sent[url] += 1
                refused = httpx.post(url + "/v1/completions", json={"prompt": "t3", "max_tokens": 2},
                                     timeout=HANG_S)  # fmt: skip
                if refused.status_code != 503 or "torn" not in refused.text:
                    ledger.problem(f"{url}: a torn server answered {refused.status_code} {refused.text[:100]}")
                fleet.init_weights_update_group("127.0.0.1", group_name="tearer", timeout=group_timeout)
                fleet.update_weights_from_distributed(state.items(), version)
            fleet.destroy_weights_update_group()
        ledger.count("torn")
    except FleetError as error:  # a lease lost on a loaded machine: reported, as it must be
        print(f"soak-http: tear reported: {error}", flush=True)
        ledger.count("missed")
