"""Probes of the server: leases under races (resumes, writes and expiries at once)."""

from __future__ import annotations

import time

from .support import WAIT, Silent, Wrong, _manager, _nothing_held, _serves, _thread


def leases_under_races() -> None:
    """Leases over HTTP (issue 29): 40 threads resume one lease at once (exactly one resumes it); resumes and writes
    racing a lease's expiry (honoured before, refused after, never both; a write under way keeps its lease); a
    lease_id of the wrong type; 30 leases taken and ended at once.  At the end nothing is held and the loop serves."""
    from fastapi.testclient import TestClient

    from ...serve import control
    from ...serve.leases import LeaseGone, LeaseTable

    manager = _manager()
    table = LeaseTable(manager, default_ttl=WAIT)  # no lease but the racing ones may expire, however slow the machine
    lease, answers = table.pause_lease(holder="racer"), []
    threads = [_thread(lambda: answers.append(table.resume_lease(lease.id)), f"resumer-{i}")[0] for i in range(40)]
    for thread in threads:
        thread.join(timeout=WAIT)
    if sorted(answers) != [False] * 39 + [True]:
        raise Wrong(f"40 resumes of one lease answered {sorted(answers)}")
    for attempt in range(30):  # a resume or a write racing the expiry: honoured before, refused after, never both
        ttl = 0.005 + 0.001 * attempt
        lease = table.pause_lease(ttl=ttl, holder="racer")
        try:
            if attempt % 2:
                with table.write_weights(lease.id, timeout=WAIT):
                    time.sleep(2 * ttl)  # past the lease's deadline, within the write's: the write keeps its lease
                    if lease.state != "held":
                        raise Silent(f"the lease ended ({lease.state}) during a write under it")
            elif table.resume_lease(lease.id) and lease.state != "resumed":
                raise Silent(f"a resume answered True, the lease is {lease.state}")
        except LeaseGone:
            if lease.state != "expired":
                raise Wrong(f"LeaseGone for a lease that is {lease.state}") from None
        table.resume_lease(lease.id) if lease.state == "held" else None
    app = __import__("fastapi").FastAPI()
    control._weight_routes(app, manager, table, None, None)  # no weights directory, no metrics: the lease checks only
    with TestClient(app) as http:
        for bad in (123, ["x"], None):
            status = http.post("/update_weight_version", json={"lease_id": bad, "weight_version": 1}).status_code
            if status not in (404, 409):
                raise Wrong(f"lease_id={bad!r} got {status}")
    many = [_thread(lambda: table.resume_lease(table.pause_lease(holder="many").id), f"many-{i}")[0] for i in range(30)]
    for thread in many:
        thread.join(timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while manager.background_thread_status.state.count and time.monotonic() < deadline:
        time.sleep(0.05)  # the expired leases' holds are released by the loop (HOLDER_CHECK_S)
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)
