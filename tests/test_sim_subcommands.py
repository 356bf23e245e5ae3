"""`smetric sim` as real subcommands: run (also plain `sim`), report, map, validate, calibrate, paper."""

from __future__ import annotations

import argparse

import pytest

from smetric_lmc.cli import Parser
from smetric_lmc.lab.replay.sim_cli import CALIBRATION
from smetric_lmc.lab.sim import cli

SUBS = ("run", "report", "map", "validate", "calibrate", "paper")


def _parser() -> argparse.ArgumentParser:
    """`smetric sim` as the smetric command builds it: the replay package adds calibrate and validate."""
    ap = Parser(prog="smetric sim")
    cli.add_arguments(ap, CALIBRATION)
    return ap


def _subparser(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    act = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))  # argparse keeps it private
    return act.choices[name]


def test_plain_sim_is_sim_run() -> None:
    ap = _parser()
    plain = vars(ap.parse_args(["--rate", "0.1", "--policies", "smetric"]))
    run = vars(ap.parse_args(["run", "--rate", "0.1", "--policies", "smetric"]))
    assert plain.pop("action") is None and run.pop("action") == "run"
    assert plain == run


def test_each_subcommand_has_only_its_options_and_no_rst_backticks() -> None:
    ap = _parser()
    for name in SUBS:
        text = _subparser(ap, name).format_help()
        assert "``" not in text and "`" not in text, name
    assert "--xs" not in _subparser(ap, "paper").format_help()
    assert "--engine " not in _subparser(ap, "map").format_help()
    assert "--kv-blocks" in _subparser(ap, "validate").format_help()
    assert "``" not in ap.format_help()
    with pytest.raises(SystemExit):
        ap.parse_args(["paper", "--xs", "0.1"])  # a map option is not a paper option


def test_unknown_profile_or_fetch_path_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, what in ((["--profile", "h100-typo"], "no hardware profile"), (["--fetch-path", "nvme"], "unknown fetch_path")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        msg = str(e.value)
        assert what in msg and ("known:" in msg or "exist:" in msg) and "\n" not in msg
