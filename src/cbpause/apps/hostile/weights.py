"""Probes of the weights: bad versions, a model moved inside a pause, retract's metadata, the weight sync misused,
stale requests in every mode."""

from __future__ import annotations

from .support import WAIT, Lost, Silent, Wrong, _expect, _manager, _nothing_held, _outputs, _serves


def bad_weight_versions() -> None:
    """7: a tensor or NaN version is refused; the loop lives."""
    import torch

    manager = _manager()
    ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
    with manager.pause(timeout=WAIT):
        for version in (torch.tensor([1, 2]), float("nan")):
            _expect(TypeError, lambda v=version: manager.set_weight_version(v))
    _outputs(manager, ids)
    _serves(manager)


def weights_changed_not_a_bool() -> None:
    """8: pause(weights_changed=None) is refused, not read as "unchanged"."""
    manager = _manager()
    for value in (None, 0, "no"):
        _expect(TypeError, lambda v=value: manager.pause(weights_changed=v).__enter__(), "weights_changed")
    _nothing_held(manager)


def retract_keeps_metadata() -> None:
    """10: a retracted request keeps its timestamps, created time and lifespan."""
    manager = _manager(max_new=24)
    ids = [manager.add_request([i, 2, 3], record_timestamps=True) for i in range(1, 4)]
    with manager.pause(timeout=WAIT, mode="retract"):
        pass
    for out in _outputs(manager, ids).values():
        if out.timestamps is None or len(out.timestamps) != len(out.generated_tokens):
            raise Silent(f"{len(out.timestamps or [])} timestamps for {len(out.generated_tokens)} tokens")


def float64_lm_head() -> None:
    """13: a float64 lm_head swapped in inside a pause: a clear error naming it, the request failed, not lost."""
    import torch

    manager = _manager()
    model = manager.model
    head = model.lm_head
    with manager.pause(timeout=WAIT):
        model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.float64)
    rid = manager.add_request([1, 2, 3])
    manager._generation_thread.join(WAIT)
    _outputs(manager, [rid])
    error = manager.background_thread_status.fatal_error
    if error is None or "lm_head.weight" not in str(error):
        raise Wrong(f"the loop's error does not name the parameter: {error!r}")


def model_change_the_step_survives() -> None:
    """A parameter no forward step reads, moved to float64 inside a pause, with a request in flight and one queued
    in the pause: the first step after the window runs without an error of its own, and the check after its launch
    (issue 38) must still end the loop naming the parameter, each request failed with the tokens it had before the
    window: none of that step's reaches either."""
    import torch

    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    model = tiny_llama()
    model.unused = torch.nn.Linear(2, 2)  # in the loop's snapshot of the model; no forward step reads it
    manager = cbt.init_continuous_batching(model, greedy_config(400), batching_config())
    manager.start()
    rid = manager.add_request([1, 2, 3], streaming=True)
    if manager.get_result(request_id=rid, timeout=WAIT) is None:
        raise Lost("no first token")
    with manager.pause(timeout=WAIT):
        model.unused.to(torch.float64)
        queued = manager.add_request([4, 5, 6], streaming=True)  # so that a step follows the window in any case
        state = manager.batch_processor.scheduler.active_requests.get(rid)
        before = {queued: [], **({} if state is None else {rid: list(state.generated_tokens)})}
    manager._generation_thread.join(WAIT)
    error = manager.background_thread_status.fatal_error
    if error is None or "unused.weight" not in str(error):
        raise Wrong(f"the loop's error does not name the parameter: {error!r}")
    last = {}
    while (out := manager.get_result(timeout=0)) is not None:  # the loop has ended: every output is queued
        last[out.request_id] = out
    for request, tokens in before.items():
        if request not in last:
            raise Lost(request)
        if list(last[request].generated_tokens) != tokens:
            got = len(last[request].generated_tokens) - len(tokens)
            raise Wrong(f"{request} got {got} tokens of the step after the window")


def model_change_between_kept_sessions() -> None:
    """A manager stopped with keep_for_next_session=True, its model moved to float64 before the next session: start()
    refuses at once, naming the change and what to do, and starts nothing; the cached manager destroyed, a new one on
    the float64 model serves."""
    import torch

    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    model = tiny_llama()
    manager = cbt.init_continuous_batching(model, greedy_config(8), batching_config())
    manager.start()
    _outputs(manager, [manager.add_request([1, 2, 3])])
    manager.stop(block=True, timeout=WAIT, keep_for_next_session=True)
    model.to(torch.float64)
    again = cbt.init_continuous_batching(model, greedy_config(8), batching_config())
    _expect(RuntimeError, again.start, "keep_for_next_session=True")
    if again.is_running():
        raise Wrong("start() refused and yet started the loop")
    model.destroy_cached_continuous_batching_manager()
    fresh = cbt.init_continuous_batching(model, greedy_config(8), batching_config())
    if fresh is again:
        raise Wrong("the destroyed manager came back")
    fresh.start()
    try:
        _serves(fresh)
    finally:
        fresh.stop(block=True, timeout=WAIT)


def weight_sync_misuse() -> None:
    """TRL's weight transfer misused: a second pause, a copy or a resume outside one, a bad name after a good one, a
    KeyboardInterrupt in the middle of a copy, destroy twice, a pause of a stopped loop.  Each raises at once and
    holds nothing; a half-done copy labels the weights ``PartialSync``, never a policy's number."""
    from cbpause.integrations.trl import PartialSync, PauseWeightSync

    manager = _manager()
    params = dict(manager.model.named_parameters())
    names = list(params)
    sync = PauseWeightSync(manager, timeout=WAIT)
    _expect(RuntimeError, lambda: sync.send_weights([]), "outside pause()")
    _expect(RuntimeError, sync.resume, "without pause()")
    sync.pause()
    _expect(RuntimeError, sync.pause, "holds a pause already")
    _expect(KeyError, lambda: sync.send_weights([(names[0], params[names[0]]), ("ghost", params[names[1]])]), "ghost")
    if manager.weight_version != PartialSync(1):
        raise Silent(f"a half-done copy left the version {manager.weight_version!r}")

    def interrupted():
        yield names[0], params[names[0]].detach().clone()
        raise KeyboardInterrupt

    _expect(KeyboardInterrupt, lambda: sync.send_weights(interrupted()))
    sync.destroy()
    sync.destroy()  # nothing held: a no-op
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)
    _expect(RuntimeError, PauseWeightSync(manager, timeout=WAIT).pause, "no generation loop")


def stale_requests_in_every_mode() -> None:
    """``max_staleness=0``: every window that sets a new version makes every request in flight stale, in every mode,
    while requests keep coming.  Each gets one terminal output; a finished one carries one version on all its tokens
    (it restarted at the last), and all its tokens."""
    manager = _manager(max_new=12, max_staleness=0)
    ids = [manager.add_request([1, 2, 3 + i % 5]) for i in range(12)]
    for version, mode in enumerate(("keep", "retract", "drain", "abort", "keep", "retract"), 1):
        with manager.pause(timeout=WAIT, mode=mode):
            manager.set_weight_version(version)
        ids.append(manager.add_request([4, 5, 6]))
    for request_id, out in _outputs(manager, ids).items():
        if out.error:
            if "aborted by a pause" not in out.error:
                raise Wrong(f"{request_id}: {out.error}")
            continue
        if len(out.generated_tokens) != 12 or len({v for _, v in out.weight_versions + out.kv_versions}) != 1:
            raise Silent(f"{request_id}: {len(out.generated_tokens)} tokens, {out.weight_versions}, {out.kv_versions}")
    if manager.versions.stale == 0:
        raise Wrong("no request was ever stale: the probe did not reach the bound")
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)
