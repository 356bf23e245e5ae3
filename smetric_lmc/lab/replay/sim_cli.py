"""`smetric sim` as the command line sees it: the simulator's CLI plus the calibrate and validate
subcommands, which drive real engines and therefore live in the replay package (above the
simulator, which never imports it). Kept light: `smetric sim` pays for the replay client only when
one of those two runs."""

from __future__ import annotations

import argparse

from smetric_lmc.lab.sim import cli as sim_cli


def _run_calibration(args: argparse.Namespace) -> int:
    from smetric_lmc.lab.replay.cli import run_calibration_action

    return run_calibration_action(args)


def _calibrate_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--engine", help="base URL of the engine")
    c.add_argument("--model-dir", help="the served model's folder (its config.json gives the model's shape)")
    c.add_argument("--engine-log", help="the engine's startup log (its scheduler limits are read there)")
    c.add_argument("--max-num-seqs", type=int, help="the engine's --max-num-seqs (from --engine-log when not given, else vLLM's CPU default)")
    c.add_argument("--max-num-batched-tokens", type=int, help="the engine's --max-num-batched-tokens (as --max-num-seqs when not given)")
    c.add_argument("--out", help="the profile YAML to write")
    c.add_argument("--profile", help="base profile for the constants the engine cannot measure")


def _validate_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("--engines", type=int, default=2, help="vLLM CPU engines to start")
    v.add_argument("--repeats", type=int, default=3, help="replays of each policy, in a balanced order (forward, reversed, forward, ...)")
    v.add_argument("--kv-blocks", type=int, default=320, help="KV blocks per engine (32 tokens each; vLLM's --num-gpu-blocks-override)")
    v.add_argument("--policies", help="comma list of policies (the validation's default set when not given)")
    v.add_argument("--out", help="output folder (validate-out when not given)")


#: The subcommands this package adds to `smetric sim`, in the order its help lists them.
CALIBRATION = (
    sim_cli.ExtraAction("validate", "Replay the same workload on real vLLM CPU engines and in the simulator, "
                        "side by side.", _validate_arguments, _run_calibration),
    sim_cli.ExtraAction("calibrate", "Profile a running, idle vLLM engine and write a simulator profile YAML.",
                        _calibrate_arguments, _run_calibration),
)


def add_sim_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim_cli.add_subcommands(subparsers, CALIBRATION)
