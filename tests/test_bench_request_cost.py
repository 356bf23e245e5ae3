"""bench/request_cost.py: the controller's CPU per request by policy and size (a smoke run)."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from helpers import load_bench


def _bench() -> ModuleType:
    return load_bench("request_cost")


def test_prints_a_row_per_cell_then_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(["--policies", "smetric,smetric_ect", "--instances", "2,4", "--requests", "40",
                          "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert set(out["route_us"]) == set(out["done_us"]) == {"smetric@2", "smetric@4", "smetric_ect@2", "smetric_ect@4"}
    assert all(v > 0 for v in (*out["route_us"].values(), *out["done_us"].values()))
    assert sum("[" in ln and "/4]" in ln for ln in lines) == 4  # progress with its total


@pytest.mark.parametrize("args", [["--instances", "eight"], ["--instances", "0"], ["--requests", "0"],
                                  ["--policies", "no_such_policy", "--instances", "2", "--requests", "5"]])
def test_bad_arguments_are_refused_in_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("request_cost: ") and "Traceback" not in err
