"""Hot reload of the ``policy`` section.

The config file is re-read when it changes (mtime and size polled) or on SIGHUP; a bad file is
logged and ignored; other sections need a restart (a changed one is named in a warning).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import msgspec

from smetric_lmc.config import Config, ConfigError, load_config
from smetric_lmc.router import Router

log = logging.getLogger(__name__)


class PolicyReload:
    def __init__(self, cfg: Config, path: Path | None, router: Router, poll_s: float) -> None:
        self.cfg = cfg  # the config in effect: the started one with the latest accepted policy
        self.path = path
        self.router = router
        self.poll_s = poll_s
        self.counts = {"applied": 0, "rejected": 0, "unchanged": 0}
        self._stamp: tuple[int, int] | None = None

    def arm(self) -> None:
        """Take the file's stamp now: changes from here on are reloaded by ``watch``."""
        if self.path is not None:
            self._stamp = _stamp(self.path)

    async def watch(self) -> None:
        assert self.path is not None
        while True:
            await asyncio.sleep(self.poll_s)
            stamp = _stamp(self.path)
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                self.reload()

    def reload(self) -> bool:
        """Re-read the policy section; returns True when a new policy took effect."""
        if self.path is None:
            log.warning("config reload: no config file to reload")
            return False
        try:
            new = load_config(self.path)
        except ConfigError as exc:
            self.counts["rejected"] += 1
            log.error("config reload ignored: %s", exc)
            return False
        old_sections = {k: v for k, v in msgspec.structs.asdict(self.cfg).items() if k != "policy"}
        new_sections = {k: v for k, v in msgspec.structs.asdict(new).items() if k != "policy"}
        restart_needed = sorted(k for k in old_sections if old_sections[k] != new_sections[k])
        if restart_needed:
            log.warning("config reload: only the policy section hot-reloads; restart to apply sections=%s",
                        ",".join(restart_needed))
        old = self.router.policy_cfg
        if new.policy == old:
            self.counts["unchanged"] += 1
            log.info("config reload: policy unchanged")
            return False
        a, b = msgspec.structs.asdict(old), msgspec.structs.asdict(new.policy)
        changes = " ".join(f"{k}={a[k]!r}->{b[k]!r}" for k in a if a[k] != b[k])
        self.router.set_policy(new.policy)
        self.cfg = msgspec.structs.replace(self.cfg, policy=new.policy)
        self.counts["applied"] += 1
        log.info("config reload: policy changed %s", changes)
        return True


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
