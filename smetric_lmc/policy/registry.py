"""The policy registry: each policy declares its name, what it needs from the view, and how a
``PolicyConfig`` parameterises it, in its own module. Adding a policy is one new file in this
package (``smetric_lmc.policy`` imports every module in it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from smetric_lmc.policy.view import Choice, ClusterView

#: A ``smetric_lmc.config.PolicyConfig``. Not imported, even for type checking: config imports
#: this package to check policy names, and the two must not import each other.
PolicyConfig = Any

PolicyFn = Callable[[ClusterView], Choice]
#: Optional view fields a policy may ask for; the router fills only what the active policy needs.
Need = Literal["unprefilled", "in_flight", "prices"]


@dataclass(frozen=True, slots=True)
class Policy:
    """A policy bound to its parameters: call it on a view."""

    name: str
    decide: PolicyFn
    needs: frozenset[Need] = frozenset()

    def __call__(self, view: ClusterView) -> Choice:
        return self.decide(view)


@dataclass(frozen=True, slots=True)
class _Entry:
    build: Callable[[PolicyConfig], PolicyFn]
    needs: frozenset[Need]


_REGISTRY: dict[str, _Entry] = {}


def register(
    name: str, *, needs: Iterable[Need] = (), params: Callable[[PolicyConfig], dict[str, Any]] | None = None
) -> Callable[[PolicyFn], PolicyFn]:
    """Register ``fn(view, **params(cfg))`` as the policy ``name``."""

    def deco(fn: Callable[..., Choice]) -> PolicyFn:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")

        def build(cfg: PolicyConfig) -> PolicyFn:
            if params is None:
                return fn
            kw = params(cfg)
            return lambda view: fn(view, **kw)

        _REGISTRY[name] = _Entry(build, frozenset(needs))
        return fn

    return deco


def policy_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_policy(cfg: PolicyConfig) -> Policy:
    """The policy a config names, with its parameters bound."""
    try:
        entry = _REGISTRY[cfg.name]
    except KeyError:
        raise ValueError(f"unknown policy {cfg.name!r}; expected one of {', '.join(_REGISTRY)}") from None
    return Policy(cfg.name, entry.build(cfg), entry.needs)
