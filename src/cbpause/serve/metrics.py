"""``GET /metrics`` of ``cbpause serve``: Prometheus exposition through ``prometheus_client`` (issue 29).

Each server has its own registry.  The gauges are read from the manager at scrape time; the pause latency is
observed by ``POST /pause`` (from the request to the open window, as the client sees it, less the network).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The metrics of one server: ``manager`` its cbpause manager, ``leases`` its lease table, ``generate`` the
    generation manager that counts the requests by outcome."""

    def __init__(self, manager: Any, leases: Any, generate: Any) -> None:
        self.manager, self.leases, self.generate = manager, leases, generate
        self.registry = registry = CollectorRegistry()
        self.paused = Gauge("cbpause_paused", "1 while the loop's pause window is open", registry=registry)
        self.window_age = Gauge("cbpause_open_window_age_seconds", "How long the open window has been open (0 when "
                                "none is)", registry=registry)  # fmt: skip
        self.holders = Gauge("cbpause_holders", "Holders waiting for or inside a pause", registry=registry)
        self.leases_held = Gauge("cbpause_leases", "Leases held", registry=registry)
        self.leases_expired = Gauge("cbpause_leases_expired", "Leases that expired since start", registry=registry)
        self.entries = Gauge("cbpause_pause_entries", "Pauses entered since start", registry=registry)
        self.pause_latency = Histogram("cbpause_pause_latency_seconds", "POST /pause: from the request to the open "
                                       "window", buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.requests = Gauge("cbpause_requests", "Generation requests by outcome", ["outcome"], registry=registry)
        self.in_flight = Gauge("cbpause_requests_in_flight", "Generation requests added and not yet answered (queued "
                               "or running)", registry=registry)  # fmt: skip
        self.version = Gauge("cbpause_weight_version", "The weight version in force (-1 when it is not an integer)",
                             registry=registry)  # fmt: skip
        self.scrapes = Counter("cbpause_scrapes", "Scrapes of /metrics", registry=registry)

    def exposition(self) -> bytes:
        status = self.manager.background_thread_status
        snapshot = status.metrics()
        self.paused.set(1 if status.state.paused else 0)
        self.window_age.set(snapshot.open_window_s or 0.0)
        self.holders.set(snapshot.holders_inside + snapshot.holders_waiting)
        self.leases_held.set(len(self.leases.held()))
        self.leases_expired.set(self.leases.expired)
        self.entries.set(snapshot.pauses_taken)
        for outcome in ("finished", "failed", "cancelled", "rejected", "aborted"):
            self.requests.labels(outcome).set(self.generate.outcomes[outcome])
        self.in_flight.set(len(self.manager._live_ids))
        version = self.manager.weight_version
        self.version.set(version if isinstance(version, int) and not isinstance(version, bool) else -1)
        self.scrapes.inc()
        return generate_latest(self.registry)
