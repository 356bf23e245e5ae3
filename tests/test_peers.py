"""The peer harness of bench/peers.py (bench/kit/peers.py) at a reduced size: every peer finds the same best hit for every query.

Speed and memory are bench figures (``python bench/peers.py``); here only agreement, which must be
exact. Dynamo's RadixTree comes with the ``peers`` extra, LMCache's controller with the engine venv.
"""

import pytest
from kit import peers
from kit.lmcache_venv import require_lmcache_python

#: Real peer indexers (Dynamo's Rust tree, LMCache's controller in its venv).
pytestmark = pytest.mark.integration

SIZE = peers.Size(instances=8, blocks=20_000, queries=120)


def in_process(name, size):
    return getattr(peers, name)(size)


def test_ours_and_dynamos_radix_tree_agree_on_every_best_hit():
    pytest.importorskip("dynamo._core", reason="the `peers` extra (ai-dynamo-runtime) is not installed")
    got = peers.compare(SIZE, ["dynamo"], run=in_process)
    assert got["agree"] == {"generator": 1.0, "dynamo": 1.0}
    assert max(got["ours"].best) > peers.SHARED_BLOCKS  # follow-ups hit past the shared prefix


def test_ours_and_lmcache_controller_agree_on_every_best_hit():
    require_lmcache_python()
    got = peers.compare(SIZE, ["lmcache"], run=in_process)
    assert got["agree"] == {"generator": 1.0, "lmcache": 1.0, "lmcache_generator": 1.0}
