"""Probes of the requests: the iterators and queues inside one's own pause, all-or-nothing submission, bad requests,
many holders with many requests, stops that do not wait, an exit without a stop, start-stop cycles."""

from __future__ import annotations

import queue
import subprocess
import sys

from .support import WAIT, Wrong, _expect, _manager, _outputs, _serves, _thread


def iterators_inside_ones_pause() -> None:
    """5: request_id_iter and iter(manager) inside one's own pause raise instead of waiting for ever."""
    manager = _manager()
    rid = manager.add_request([1, 2, 3])
    for make in (lambda: manager.request_id_iter(rid), lambda: iter(manager)):
        with manager.pause(timeout=WAIT):
            try:
                for out in make():
                    if out.is_finished() and out.request_id == rid:
                        break
            except RuntimeError as error:
                if "inside a pause" not in str(error):
                    raise Wrong(str(error)) from error


def add_requests_all_or_nothing() -> None:
    """6: a pause asked while add_requests enqueues (reject mode): the whole batch goes in, every output comes."""
    manager = _manager(while_paused="reject", num_blocks=512, max_new=4)
    status, enqueue, holds = manager.background_thread_status, manager.enqueue, []

    def enqueue_then_pause(*args, **kwargs):
        if len(manager._live_ids) == 100 and not holds:
            holds.append(status.request_pause(manager._wake_up_loop))
        return enqueue(*args, **kwargs)

    manager.enqueue = enqueue_then_pause
    ids = manager.add_requests([[1 + i % 7, 2, 3] for i in range(400)])
    status.interrupt(holds[0])
    _outputs(manager, ids)


def max_new_tokens_none() -> None:
    """9: max_new_tokens=None in the generation config: the request stops at EOS, as upstream."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    model = tiny_llama()
    first = cbt.init_continuous_batching(model, greedy_config(8), batching_config())
    first.start()
    eos = _outputs(first, [first.add_request([1, 2, 3])])
    first.stop(block=True, timeout=WAIT)
    config = greedy_config(8)
    config.max_new_tokens, config.eos_token_id = None, next(iter(eos.values())).generated_tokens[2]
    manager = cbt.init_continuous_batching(model, config, batching_config())
    manager.start()
    (out,) = _outputs(manager, [manager.add_request([1, 2, 3])]).values()
    if out.error:
        raise Wrong(out.error)


def full_queue_inside_ones_pause() -> None:
    """11: a bounded input queue full inside one's own pause: queue.Full at once, not after 10 s (its message says it
    is cbpause's refusal, made before any put: upstream's put waits 10 s under the submit lock, then raises an empty
    one)."""
    manager = _manager(max_queue_size=2)
    with manager.pause(timeout=WAIT):
        ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
        _expect(queue.Full, lambda: manager.add_request([1, 2, 3]), "inside a pause")
    _outputs(manager, ids)


def exit_without_stop() -> None:
    """A script that ends without stop(), requests in flight: the interpreter exits (atexit hard stop)."""
    script = (
        "from cbpause.integrations import transformers as cbt\n"
        "from cbpause.testing import batching_config, greedy_config, tiny_llama\n"
        "m = cbt.init_continuous_batching(tiny_llama(), greedy_config(400), batching_config(num_blocks=256))\n"
        "m.start()\n"
        "ids = [m.add_request([1, 2, 3]) for _ in range(3)]\n"
        "print('submitted', len(ids), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    if "submitted 3" not in done.stdout:
        raise Wrong(f"the script failed: {done.stderr[-300:]}")


def stop_without_blocking_keeps_requests() -> None:
    """stop(block=False) while requests run: they finish; nothing is torn down under the loop."""
    manager = _manager(max_new=24)
    ids = [manager.add_request([1, 2, 3]) for _ in range(4)]
    manager.stop(block=False)
    for out in _outputs(manager, ids).values():
        if out.error:
            raise Wrong(f"a flush stop failed a request: {out.error}")


def bad_requests_at_the_door() -> None:
    """Bad prompts and a duplicate id are refused at the door; the others are served."""
    manager = _manager()
    for prompt, error in (([], ValueError), ([10**9], ValueError), ("abc", TypeError), ([1.5], TypeError)):
        _expect(error, lambda p=prompt: manager.add_request(p))
    with manager.pause(timeout=WAIT):
        manager.add_request([1, 2], request_id="mine")
        _expect(ValueError, lambda: manager.add_request([1, 2], request_id="mine"), "in use")
    _outputs(manager, ["mine"])
    _serves(manager)


def many_holders_many_requests() -> None:
    """50 holder threads pausing while 200 requests run: nothing lost."""
    manager = _manager()
    ids = [manager.add_request([1 + i % 9, 2]) for i in range(200)]

    def hold():
        for _ in range(3):
            with manager.pause(timeout=WAIT):
                pass

    threads = [_thread(hold, f"holder-{i}") for i in range(50)]
    for thread, box in threads:
        thread.join(WAIT)
        if "error" in box:
            raise Wrong(repr(box["error"]))
    _outputs(manager, ids)


def start_stop_cycles() -> None:
    """20 start/stop cycles with a request each: every one answered."""
    manager = _manager()
    for _ in range(20):
        _outputs(manager, [manager.add_request([1, 2, 3])])
        manager.stop(block=True, timeout=WAIT)
        manager.start()
