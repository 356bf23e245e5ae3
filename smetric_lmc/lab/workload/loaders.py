"""Pick the right loader for a trace path from its content and name."""

from __future__ import annotations

from pathlib import Path

import msgspec

from smetric_lmc.lab.workload.jsonl import load_bailian, load_mooncake
from smetric_lmc.lab.workload.model import Workload
from smetric_lmc.lab.workload.native import is_native, load_native
from smetric_lmc.lab.workload.weka import load_weka


def detect_format(path: str | Path) -> str:
    """One of "native", "weka", "bailian", "mooncake"; ValueError when unrecognised."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(p)
    if p.is_dir():
        return "weka"
    if is_native(p):
        return "native"
    name = p.name.lower()
    if name.endswith((".tar", ".tar.xz", ".txz", ".tar.gz", ".tgz", ".tar.bz2", ".tar.zst")):
        return "weka"
    with open(p, "rb") as fh:
        head = fh.readline(1 << 20).strip()
    try:
        first = msgspec.json.decode(head)
    except msgspec.DecodeError:
        first = None
    if isinstance(first, dict):
        if "chat_id" in first:
            return "bailian"
        if "hash_ids" in first and "timestamp" in first:
            return "mooncake"
        if "requests" in first:
            return "weka"
    if name.endswith(".json"):
        return "weka"  # a pretty-printed conversation does not parse from its first line
    raise ValueError(f"{p}: unrecognised trace format")


def load_any(path: str | Path, *, shared_prefix: bool = False, progress: bool = True) -> Workload:
    """Load any supported trace or a native workload file. `shared_prefix` applies to WEKA only."""
    fmt = detect_format(path)
    if fmt == "native":
        return load_native(path)
    if fmt == "weka":
        return load_weka(path, shared_prefix=shared_prefix, progress=progress)
    if fmt == "bailian":
        return load_bailian(path)
    return load_mooncake(path)
