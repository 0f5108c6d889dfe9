"""The options the benchmark scripts share (benchmarks/reports.py), parsed as the runtime parses
them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import reports  # noqa: E402


def test_the_benchmarks_parse_gamma_as_the_runtime_does(capsys):
    """--gamma through decode.gamma.parse_gamma: an integer or AUTO; anything else is an
    argparse error (exit 2) that names the value."""
    import argparse

    import pair
    from spec_runtime.decode.gamma import AUTO

    assert reports.gamma("3") == 3 and reports.gamma("auto") is AUTO
    assert reports.gammas("1, 4,auto") == [1, 4, AUTO]
    for bad in ("x", "-1", "2.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="use an integer or 'auto'"):
            reports.gamma(bad)
    assert pair.parse_args(["--gamma", "auto"]).gamma is AUTO
    with pytest.raises(SystemExit) as e:
        pair.parse_args(["--gamma", "three"])
    assert e.value.code == 2 and "'three'" in capsys.readouterr().err
