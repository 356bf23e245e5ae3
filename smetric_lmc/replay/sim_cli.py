"""`smetric sim` as the command line sees it: the simulator's CLI plus the calibrate and validate
actions, which drive real engines and therefore live in the replay package (above the simulator,
which never imports it). Kept light: `smetric sim` pays for the replay client only when one of
those two actions runs."""

from __future__ import annotations

import argparse

from smetric_lmc.sim import cli as sim_cli


def add_sim_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim_cli.add_subcommands(subparsers, extra_arguments=add_calibration_arguments,
                            actions={"calibrate": _run_calibration, "validate": _run_calibration})


def _run_calibration(args: argparse.Namespace) -> int:
    from smetric_lmc.replay.cli import run_calibration_action

    return run_calibration_action(args)


def add_calibration_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibrate / validate")
    g.add_argument("--engine", help="calibrate: base URL of a running, idle vLLM engine")
    g.add_argument("--model-dir", help="calibrate: the served model's folder (config.json gives its shape)")
    g.add_argument("--engine-log", help="calibrate: the engine's startup log (its scheduler limits are read there)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="calibrate: the engine's --max-num-seqs (default: from --engine-log, else vLLM's CPU default)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="calibrate: the engine's --max-num-batched-tokens (default: as --max-num-seqs)")
    g.add_argument("--engines", type=int, default=2, help="validate: vLLM CPU engines to start")
    g.add_argument("--repeats", type=int, default=3,
                   help="validate: replays of each policy, in a balanced order (forward, reversed, forward, ...)")
    g.add_argument("--kv-blocks", type=int, default=320,
                   help="validate: KV blocks per engine (32 tokens each; vLLM's --num-gpu-blocks-override)")
