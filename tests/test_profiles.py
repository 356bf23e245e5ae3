"""The packaged hardware/model profiles load by name (dots included) and hold KV; a typo is one error."""

from __future__ import annotations

import pytest

from smetric_lmc.lab.sim.profile import load_profile, profile_names


def test_every_packaged_profile_loads_and_holds_a_long_prompt() -> None:
    names = profile_names()
    assert {"qwen3-30b-a3b-h20", "qwen3-30b-a3b-h100", "llama-3.1-8b-a100", "llama-3.1-8b-l40s"} <= set(names)
    for n in names:
        p = load_profile(n)
        assert p.name == n
        assert p.kv_capacity_tokens() > 100_000, n  # a long agentic prompt fits every profile's GPU KV


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no hardware profile 'h100' \(cannot read profiles/h100.yaml\); the profiles that exist: .*qwen3-30b-a3b-h100"):
        load_profile("h100")
