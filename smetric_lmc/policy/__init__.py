"""Routing policies: small pure functions of a ``ClusterView`` returning a ``Choice``.

Each policy module registers its policies (``registry.register``); importing this package imports
every module in it, so a new policy is one new file. The controller and the simulator both build
policies through ``make_policy``.
"""

from __future__ import annotations

import importlib
import pkgutil

from smetric_lmc.policy import smetric as _smetric  # noqa: F401  (first: the default policy leads the list)
from smetric_lmc.policy.registry import Policy, PolicyFn, make_policy, policy_names, register
from smetric_lmc.policy.view import Choice, ClusterView, rr_argmin

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name not in ("registry", "view"):
        importlib.import_module(f"{__name__}.{_m.name}")

POLICY_NAMES: tuple[str, ...] = policy_names()

__all__ = ["Choice", "ClusterView", "POLICY_NAMES", "Policy", "PolicyFn", "make_policy", "policy_names",
           "register", "rr_argmin"]
