"""``GET /metrics`` of ``cbpause serve``: Prometheus exposition through ``prometheus_client``.

Each server has its own registry.  Counts that only grow are counters (``_total``), read from where they are kept at
scrape time (a collector of their own: the requests' outcomes are counted by the generation engine, the pauses by the
protocol, the expired leases by the lease table); the gauges are read from the manager at scrape time; the pause
entry and each weight update are observed as they happen, into histograms.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

__all__ = ["OUTCOMES", "ServerMetrics", "UPDATE_SOURCES"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UPDATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = ("finished", "failed", "cancelled", "rejected", "aborted")
UPDATE_SOURCES = ("disk", "broadcast")


class _Counts:
    """The counters whose values live elsewhere, as Prometheus counters at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        m = self.metrics
        requests = CounterMetricFamily("cbpause_requests", "Generation requests by outcome (each choice of a request "
                                       "is one)", labels=["outcome"])  # fmt: skip
        for outcome in OUTCOMES:
            requests.add_metric([outcome], m.generate.outcomes[outcome])
        yield requests
        snapshot = m.manager.background_thread_status.metrics()
        yield CounterMetricFamily("cbpause_pause_entries", "Pauses entered since start", value=snapshot.pauses_taken)
        yield CounterMetricFamily("cbpause_leases_expired", "Leases that expired since start", value=m.leases.expired)
        yield CounterMetricFamily("cbpause_prompt_tokens", "Prompt tokens of the generation requests taken",
                                  value=m.prompt_tokens)  # fmt: skip
        yield CounterMetricFamily("cbpause_generation_tokens", "Tokens generated in the answers delivered",
                                  value=m.generation_tokens)  # fmt: skip


class ServerMetrics:
    """The metrics of one server: ``manager`` its cbpause manager, ``leases`` its lease table, ``generate`` the
    generation engine that counts the requests by outcome.  The OpenAI routes add to ``prompt_tokens`` and
    ``generation_tokens``; the weight routes call :meth:`weight_update`."""

    def __init__(self, manager: Any, leases: Any, generate: Any) -> None:
        self.manager, self.leases, self.generate = manager, leases, generate
        self.prompt_tokens = self.generation_tokens = 0  # written on the event loop only
        self.registry = registry = CollectorRegistry()
        registry.register(_Counts(self))
        self.paused = Gauge("cbpause_paused", "1 while the loop's pause window is open", registry=registry)
        self.window_age = Gauge("cbpause_open_window_age_seconds", "How long the open window has been open (0 when "
                                "none is)", registry=registry)  # fmt: skip
        self.holders = Gauge("cbpause_holders", "Holders waiting for or inside a pause", registry=registry)
        self.leases_held = Gauge("cbpause_leases", "Leases held", registry=registry)
        self.pause_latency = Histogram("cbpause_pause_latency_seconds", "POST /pause: from the request to the open "
                                       "window (the pause's entry)", buckets=LATENCY_BUCKETS, registry=registry)
        self.update_seconds = Histogram("cbpause_weight_update_seconds", "A weight update that committed: from its "
                                        "request to its answer, by source", ["source"], buckets=UPDATE_BUCKETS,
                                        registry=registry)  # fmt: skip
        for source in UPDATE_SOURCES:  # each series exists from the start, at 0
            self.update_seconds.labels(source)
        self.in_flight = Gauge("cbpause_requests_in_flight", "Generation requests added and not yet answered (queued "
                               "or running)", registry=registry)  # fmt: skip
        self.version = Gauge("cbpause_weight_version", "The weight version in force (-1 when it is not an integer)",
                             registry=registry)  # fmt: skip
        self.scrapes = Counter("cbpause_scrapes", "Scrapes of /metrics", registry=registry)

    def weight_update(self, source: str, seconds: float) -> None:
        """A weight update from ``source`` (one of :data:`UPDATE_SOURCES`) committed after ``seconds``."""
        self.update_seconds.labels(source).observe(seconds)

    def exposition(self) -> bytes:
        status = self.manager.background_thread_status
        snapshot = status.metrics()
        self.paused.set(1 if status.state.paused else 0)
        self.window_age.set(snapshot.open_window_s or 0.0)
        self.holders.set(snapshot.holders_inside + snapshot.holders_waiting)
        self.leases_held.set(len(self.leases.held()))
        self.in_flight.set(len(self.manager._live_ids))
        version = self.manager.weight_version
        integer = isinstance(version, int) and not isinstance(version, bool) and abs(version) < 2**63
        self.version.set(version if integer else -1)  # (an int past 1e308 would end the scrape)
        self.scrapes.inc()
        return generate_latest(self.registry)
