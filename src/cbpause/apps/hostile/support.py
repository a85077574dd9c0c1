"""What the probes share: the verdicts a probe raises, a manager on the tiny model, and the checks they repeat."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...testing import HANG_S

WAIT = HANG_S  # the bound on what must happen (an output, a pause, a thread's end): a hang, not slowness


class Wrong(AssertionError):
    """The library answered, but not as it must (WRONG ERROR)."""


class Silent(AssertionError):
    """The library accepted something and went wrong without a word (SILENT)."""


class Lost(AssertionError):
    """A request got no terminal output, or two (LOST)."""


VERDICTS = {Wrong: "WRONG ERROR", Silent: "SILENT", Lost: "LOST"}


def _manager(max_new: int = 8, **options):
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    config = {k: options.pop(k) for k in list(options) if k in ("max_queue_size", "num_blocks")}
    manager = cbt.init_continuous_batching(tiny_llama(), greedy_config(max_new), batching_config(**config), **options)
    manager.start()
    return manager


def _outputs(manager, ids: list[str]) -> dict:
    """One terminal output per id, or Lost."""
    outs: dict = {}
    while len(outs) < len(ids):
        out = manager.get_result(timeout=WAIT)
        if out is None:
            raise Lost(f"no output within {WAIT} s; have {len(outs)} of {len(ids)}")
        if out.is_finished():
            if out.request_id in outs:
                raise Lost(f"two terminal outputs for {out.request_id}")
            outs[out.request_id] = out
    if sorted(outs) != sorted(ids):
        raise Lost(f"outputs for {sorted(set(outs) - set(ids))}, none for {sorted(set(ids) - set(outs))}")
    return outs


def _serves(manager, n: int = 2) -> None:
    outs = _outputs(manager, [manager.add_request([1, 2, 3]) for _ in range(n)])
    if any(o.error for o in outs.values()):
        raise Wrong(f"the loop no longer serves: {[o.error for o in outs.values()]}")


def _expect(error: type[BaseException], call: Callable[[], object], match: str = "") -> BaseException:
    try:
        call()
    except error as caught:
        if match not in str(caught):
            raise Wrong(f"{error.__name__} without {match!r}: {caught}") from caught
        return caught
    except BaseException as other:
        raise Wrong(f"{type(other).__name__} instead of {error.__name__}: {other}") from other
    raise Silent(f"no {error.__name__}")


def _nothing_held(manager) -> None:
    s = manager.background_thread_status.state
    if s.count or not manager.is_running():
        raise Wrong(f"after the probe: {s.count} holds, loop running: {manager.is_running()}")


def _thread(target: Callable[[], object], name: str) -> tuple[threading.Thread, dict]:
    from cbpause.testing import run_thread

    return run_thread(target, name=name)

