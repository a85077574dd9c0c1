"""Per-iteration protocol overhead: PauseProtocol against transformers 5.23.0's BackgroundThreadStatus.

What the generation loop pays every iteration for being pausable, with no pause pending: the calls that
``ContinuousBatchProcessor._update_tp_group_state`` makes (``is_pause_requested()`` before the all-reduce,
``update_with_tp_status()`` after it, the hard-stop check).  Both implementations run interleaved in one
process, several repetitions each; the ratio is what counts (absolute nanoseconds on a shared machine are
noisy).  Usage: ``python benchmarks/iteration_overhead.py [--iterations N] [--repeats R]``.
"""

import argparse
import platform
import statistics
import timeit

from cbpause import PauseProtocol


def iteration(status):
    def one():
        status.is_pause_requested()
        status.update_with_tp_status(status.local_status)
        if status.tp_status == status.HARD_STOP:
            raise AssertionError("unexpected stop")

    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    impls = {"upstream": BackgroundThreadStatus(), "cbpause": PauseProtocol()}
    for status in impls.values():
        status.clear()
    samples = {name: [] for name in impls}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        for name, status in impls.items():
            seconds = timeit.timeit(iteration(status), number=args.iterations)
            samples[name].append(seconds / args.iterations * 1e9)
    up, ours = samples["upstream"], samples["cbpause"]
    ratios = [o / u for o, u in zip(ours, up, strict=True)]
    print(f"machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}")
    print(f"{'':10} {'min ns':>8} {'median ns':>10} {'max ns':>8}")
    for name, xs in samples.items():
        print(f"{name:10} {min(xs):8.0f} {statistics.median(xs):10.0f} {max(xs):8.0f}")
    print(
        f"ratio cbpause/upstream: median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {args.repeats} interleaved repetitions)"
    )
    explicit_api_trace_cost(args)


def explicit_loop(status):
    def one():
        status.observe()
        status.all_reduce(status.DONT_STOP, False)
        status.no_pause()
        status.start_step()
        status.end_step()

    return one


def explicit_api_trace_cost(args) -> None:
    """The explicit loop API with trace recording off (the default) and on (TraceRecorder)."""
    from cbpause.traces import TraceRecorder

    n = args.iterations // 10
    variants = {"trace off": PauseProtocol(), "trace on": PauseProtocol(trace=TraceRecorder())}
    samples = {name: [] for name in variants}
    for status in variants.values():
        status.clear()
    for _ in range(args.repeats):
        for name, status in variants.items():
            if status._trace is not None:
                status._trace.events.clear()
            samples[name].append(timeit.timeit(explicit_loop(status), number=n) / n * 1e9)
    off, on = statistics.median(samples["trace off"]), statistics.median(samples["trace on"])
    print(f"explicit loop API, 5 transitions per iteration: trace off {off:.0f} ns, trace on {on:.0f} ns")


if __name__ == "__main__":
    main()
