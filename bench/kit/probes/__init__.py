"""One-question probes, run as modes of the bench script whose question they belong to:

    python bench/controller.py --probe index_stalls|load_scans|gc_pauses|inflight_bytes [ARGS]
    python bench/decide.py --probe est_hit_error [ARGS]

Each keeps its own arguments and ends with its own JSON line, as it did as a script.
"""

from __future__ import annotations

import importlib
import sys


def run(argv: list[str], names: tuple[str, ...], script: str) -> int | None:
    """``--probe NAME ARGS...`` runs that probe's ``main(ARGS)``; None when no probe was asked."""
    if not argv or argv[0] != "--probe":
        return None
    if len(argv) < 2 or argv[1] not in names:
        print(f"{script} --probe NAME [ARGS]: NAME is one of {', '.join(names)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"kit.probes.{argv[1]}")
    return mod.main(argv[2:]) or 0
