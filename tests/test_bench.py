"""``python -m cbpause.bench``: the table, the ratios and the arguments; one cheap case end to end."""

import json
import math

import pytest

pytest.importorskip("transformers")

from cbpause.bench import Row, format_table, main, parse_args  # noqa: E402
from cbpause.testing import percentile  # noqa: E402


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


def test_overhead_case_end_to_end(tmp_path, capsys):
    assert main(["--quick", "--cases", "overhead", "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per-iteration checks" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert [row["case"] for row in rows] == ["1", "1b"]
    for row in rows:
        assert row["upstream"]["median"] > 0 and row["cbpause"]["median"] > 0 and "ratio" in row
