"""``cbpause serve``: transformers' OpenAI-compatible server on a cbpause manager, with pauses leased over HTTP.

The serving layer (issue 29).  :func:`build_app` assembles transformers serve's app
(:mod:`cbpause.integrations.serving`, the only module that knows its internals) with the control routes
(:mod:`.control`), the leases (:mod:`.leases`) and the metrics (:mod:`.metrics`).  ``python -m cbpause.serve
CHECKPOINT`` or ``cbpause serve CHECKPOINT`` runs it; ``docs/serving.md`` is its manual.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

__all__ = ["build_app"]


def build_app(checkpoint: str, *, weights_dir: str | Path | None = None, default_ttl: float = 30.0,
              device: str = "cpu", dtype: str = "auto", continuous_batching_config: Any = None,
              **manager_kwargs: Any) -> Any:  # fmt: skip
    """The FastAPI app serving ``checkpoint`` (a local model directory), its manager started.

    ``weights_dir``: the directory ``/update_weights_from_disk`` may read from (``None``: that route answers 403).
    ``default_ttl``: the ttl of a lease that names none, and of every pause taken by a route without leases.
    ``manager_kwargs`` go to :func:`cbpause.integrations.transformers.init_continuous_batching` (``while_paused``,
    ``max_staleness``, ``on_stale``, ``peer_park_timeout``, ``trace``).  ``app.state.manager`` and
    ``app.state.leases`` are the manager and the lease table.  The app's shutdown resumes every lease and stops the
    manager.
    """
    from ..integrations.serving import openai_app
    from .control import add_control_routes
    from .leases import LeaseTable
    from .metrics import ServerMetrics

    root = None if weights_dir is None else Path(weights_dir).resolve()
    if root is not None and not root.is_dir():
        raise ValueError(f"weights_dir {str(weights_dir)!r} is not a directory")
    config = continuous_batching_config
    app, manager, generate = openai_app(checkpoint, device=device, dtype=dtype, continuous_batching_config=config,
                                        **manager_kwargs)  # fmt: skip
    try:
        leases = LeaseTable(manager, default_ttl=default_ttl)
    except BaseException:
        manager.stop(block=True, timeout=10)
        raise
    add_control_routes(app, manager, leases, weights_dir=root, metrics=ServerMetrics(manager, leases, generate))
    app.state.manager, app.state.leases, app.state.generate = manager, leases, generate
    upstream = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> Any:
        async with upstream(app_):
            try:
                yield
            finally:
                leases.close()
                manager.stop(block=True, timeout=10)

    app.router.lifespan_context = lifespan
    return app
