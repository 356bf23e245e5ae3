"""Write tests/data/vllm_hash_vectors.json with vLLM's own block-hash functions.

Run with the engine venv's Python (vLLM CPU 0.32 installed; see .ci/engine-venv.sh):

    <engine-venv>/bin/python tests/make_hash_vectors.py

Each vector is a token list hashed block by block with ``vllm.v1.core.kv_cache_utils``'s
``hash_block_tokens`` under ``init_none_hash``, exactly as the engine's prefix cache does, and
``maybe_convert_block_hash`` for the 64-bit hash its KV events publish.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "vllm_hash_vectors.json"
TOKENS = list(range(500, 580))
BLOCK = 16
# Tagged extra keys as vLLM builds them: a LoRA adapter, a multimodal item, a cache salt.
EXTRA = [(("lora", "ad", "/adapters/ad"),), None, (("mm", "img0", 3),), None, (("cache_salt", "s1"),)]


def vectors() -> list[dict]:
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    out = []
    for algo in ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor"):
        for seed in ("0", None):
            if seed is None and algo.startswith("xxhash"):
                continue  # random per process without PYTHONHASHSEED
            for extra in (None, EXTRA):
                if seed is None:
                    os.environ.pop("PYTHONHASHSEED", None)
                else:
                    os.environ["PYTHONHASHSEED"] = seed
                fn = get_hash_fn_by_name(algo)
                kcu.init_none_hash(fn)
                parent = None
                digests = []
                for j in range(len(TOKENS) // BLOCK):
                    keys = None if extra is None else extra[j]
                    parent = kcu.hash_block_tokens(fn, parent, TOKENS[j * BLOCK : (j + 1) * BLOCK], keys)
                    digests.append(bytes(parent))
                out.append({
                    "vllm": vllm.__version__,
                    "algo": algo,
                    "seed": kcu.get_none_hash_seed(),
                    "block_size": BLOCK,
                    "token_ids": TOKENS,
                    "extra_keys": extra,
                    "none_hash_hex": bytes(kcu.NONE_HASH).hex(),
                    "digests_hex": [d.hex() for d in digests],
                    "event_hashes": [kcu.maybe_convert_block_hash(d) for d in digests],
                })
    return out


if __name__ == "__main__":
    data = vectors()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data)} vectors -> {OUT}", file=sys.stderr)
