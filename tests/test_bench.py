"""``python -m cbpause.apps.bench``: the table, the ratios and the arguments; one cheap case end to end."""

import math

import pytest

pytest.importorskip("transformers")

from cbpause.apps.bench import Row, format_table, parse_args  # noqa: E402
from cbpause.testing import percentile  # noqa: E402

pytestmark = pytest.mark.layer("system")


def test_ratio_is_cbpause_cost_over_upstream_cost():
    cost = Row("1", "x", "ns", reps={"upstream": [100.0, 200.0], "cbpause": [50.0, 300.0]})
    assert cost.ratios() == [0.5, 1.5]
    rate = Row("5", "y", "tokens/s", reps={"upstream": [100.0], "cbpause": [200.0]}, higher_is_better=True)
    assert rate.ratios() == [0.5]  # twice the rate is half the cost
    table = format_table([cost, rate])
    assert "1.00 (0.50-1.50)" in table and "0.50 (0.50-0.50)" in table


def test_distribution_rows_report_p50_and_p99():
    row = Row("2", "entry", "ms", samples={"upstream": [float(i) for i in range(1, 101)], "cbpause": [1.0]})
    summary = row.summary()
    assert summary["upstream"]["p50"] == 50.0 and summary["upstream"]["p99"] == 99.0
    assert "50.000 / 99.000" in format_table([row])
    assert math.isnan(percentile([], 50))


def test_bad_arguments_are_refused(capsys):
    for argv in (["--cases", "overhead,nope"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
    assert "unknown case(s): nope" in capsys.readouterr().err


def test_repetitions_alternate_the_order_of_the_implementations():
    from cbpause.apps.bench.harness import IMPLS, order

    assert order(0) == IMPLS and order(1) == IMPLS[::-1] and order(2) == IMPLS


def test_entry_splits_at_the_group_step_the_all_reduce_and_the_window():
    from cbpause.apps.bench.tp import PHASES, split_entry

    clocks = {"group": [0.5, 10.0, 20.0], "reduce_start": [0.6, 10.1, 20.1], "reduce_end": [0.7, 10.4, 20.2],
              "window": [10.6]}  # fmt: skip
    parts = split_entry(asked=2.0, entered=11.0, clocks=clocks)
    assert len(parts) == len(PHASES)
    assert parts == pytest.approx([8.0, 0.1, 0.3, 0.2, 0.4])
    assert sum(parts) == pytest.approx(11.0 - 2.0)
    # A request that landed in the group step itself has no split (no group step starts within its entry).
    assert split_entry(asked=10.05, entered=10.9, clocks=clocks) is None


def test_entry_beyond_the_step_in_flight_starts_at_the_next_group_step():
    from argparse import Namespace

    from cbpause.apps.bench.harness import Bench

    bench = Bench.__new__(Bench)  # no model: only the clocks
    bench.args = Namespace()
    bench.group_steps, bench.forward_ends = [1.0, 5.0, 9.0], [0.9, 4.5, 8.5]
    beyond, forward = bench.beyond_the_step(asked=3.0, entered=5.2)
    assert beyond == pytest.approx(0.2) and forward == pytest.approx(1.5)
    # Asked during the group step that then saw it: all of the entry is the protocol's.
    beyond, forward = bench.beyond_the_step(asked=5.05, entered=5.25)
    assert beyond == pytest.approx(0.2) and forward is None


def test_the_scaling_plot_draws_one_panel_per_axis_and_metric(tmp_path):
    pytest.importorskip("matplotlib")
    from cbpause.apps.bench.plot import plot_scaling

    rows = [Row("10", f"{k} holders at once: to the last inside", "ms", scale=("holders", k),
                samples={"upstream": [1.0 * k], "cbpause": [1.1 * k]}) for k in (1, 4, 16)]  # fmt: skip
    assert plot_scaling(rows, tmp_path / "scaling.png") and (tmp_path / "scaling.png").stat().st_size > 0
    assert not plot_scaling([Row("2", "entry", "ms")], tmp_path / "none.png")
