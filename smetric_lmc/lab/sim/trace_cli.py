"""`smetric trace`: the workload package's trace commands, with `trace presets` sized by the
default engine profile (the simulator's: workload sits below the simulator and never imports it)."""

from __future__ import annotations

import argparse

from smetric_lmc.lab.sim.profile import load_profile
from smetric_lmc.lab.workload import cli as workload_cli

#: The engine profile whose KV capacity `trace presets` compares each preset's sessions with.
PRESETS_PROFILE = "qwen3-30b-a3b-h20"


def add_trace_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    workload_cli.add_trace_subcommands(subparsers, presets_kv_tokens=_kv_tokens)


def _kv_tokens() -> int:
    return load_profile(PRESETS_PROFILE).kv_capacity_tokens()
