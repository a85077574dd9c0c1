"""``python -m cbpause.demo`` serves every request under pauses and says so; bad arguments are refused."""

import math

import pytest

from cbpause.demo import main, parse_args
from cbpause.testing import percentile

pytest.importorskip("transformers")


def test_demo_serves_every_request_under_pauses(capsys):
    argv = ["--requests", "12", "--in-flight", "4", "--max-new-tokens", "8", "--pause-every", "2", "--no-progress"]
    assert main(argv + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines()[1:]]
    value = {" ".join(r[:2]) if r[0] in ("requests", "tokens", "pause") else r[0]: r for r in rows}
    assert value["requests finished"][2] == "12"
    assert value["tokens generated"][2] == str(12 * 8)
    assert int(value["pauses"][1]) >= 1
    assert value["lost"] == ["lost", "0"]


def test_demo_refuses_bad_arguments(capsys):
    for argv in (["--requests", "0"], ["--pause-every", "-1"], ["--in-flight", "x"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_percentile_by_nearest_rank():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
