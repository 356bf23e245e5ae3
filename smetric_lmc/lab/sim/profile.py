"""Hardware/model profile: the constants behind the simulator's iteration-time and memory model.

Every constant is documented with its source in docs/simulator.md. Profiles live in
``configs/profiles/*.yaml``; the default is Qwen3-30B-A3B on one H20 per instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

GIB = 1024**3


DEFAULT_PROFILE = "qwen3-30b-a3b-h20"


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    # model
    total_params: float  # resident weights (all experts of a MoE)
    active_params: float  # params touched per token (MoE: shared + routed experts)
    bytes_per_param: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_elem: float
    max_model_len: int
    # accelerator
    hbm_gib: float
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    hbm_bw: float  # bytes/s of one GPU
    compute_eff: float  # achieved fraction of peak_flops (GEMM + attention kernels)
    mem_eff: float  # achieved fraction of hbm_bw
    # engine
    tp: int
    tp_eff: float  # scaling efficiency of tensor parallelism (1 at tp=1)
    gpu_memory_utilization: float
    reserve_gib: float  # activations, CUDA graphs, allocator slack (per GPU)
    max_num_batched_tokens: int  # chunked-prefill token budget per iteration
    max_num_seqs: int
    iter_overhead_s: float  # scheduler + launch overhead per iteration
    local_cpu_gib: float  # optional LMCache local CPU tier per instance, counted in the local tier
    # cluster
    gpus_per_node: int
    link_gbps: float  # per-node RDMA NIC, each direction (shared by the node's instances)
    link_eff: float  # achieved share of the NIC's line rate
    host_link_gbs: float  # GPU <-> host link (PCIe), GB/s each direction
    host_link_eff: float  # achieved share of it for KV copies
    host_pool_gib_per_node: float  # host memory each node lends to the global tier's pool

    # ---- derived -------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def flops_per_token(self) -> float:
        return 2 * self.active_params

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query token, context token) pair: QK^T and AV, 2 FLOPs per MAC each."""
        return 4 * self.layers * self.q_heads * self.head_dim

    @property
    def weight_bytes_read(self) -> float:
        """Weight bytes streamed per iteration (active params: the MoE experts a batch touches)."""
        return self.active_params * self.bytes_per_param

    @property
    def instance_flops(self) -> float:
        return self.peak_flops * self.compute_eff * self.tp * self.tp_eff

    @property
    def instance_bw(self) -> float:
        return self.hbm_bw * self.mem_eff * self.tp * self.tp_eff

    @property
    def kv_capacity_bytes(self) -> float:
        usable = self.tp * (self.hbm_gib * self.gpu_memory_utilization - self.reserve_gib) * GIB
        return max(0.0, usable - self.total_params * self.bytes_per_param)

    def kv_capacity_tokens(self) -> int:
        return int(self.kv_capacity_bytes // self.kv_bytes_per_token)

    def local_capacity_blocks(self, block_size: int) -> int:
        """Local tier (GPU KV + optional local CPU tier), in blocks."""
        cpu = self.local_cpu_gib * GIB / self.kv_bytes_per_token
        return int((self.kv_capacity_tokens() + cpu) // block_size)

    def gpu_capacity_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens() // block_size

    @property
    def instances_per_node(self) -> int:
        return max(1, self.gpus_per_node // self.tp)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8 * self.link_eff

    @property
    def host_link_bytes_per_s(self) -> float:
        return self.host_link_gbs * 1e9 * self.host_link_eff

    def host_pool_blocks_per_node(self, block_size: int) -> int:
        return int(self.host_pool_gib_per_node * GIB / self.kv_bytes_per_token // block_size)

    def max_context(self, block_size: int) -> int:
        """Longest input+output a request may have: the model's limit and what the GPU KV holds."""
        return min(self.max_model_len, self.gpu_capacity_blocks(block_size) * block_size)

    def iteration_time(self, prefill: list[tuple[int, int]], n_decode: int, decode_ctx: int) -> float:
        """One engine iteration: prefill chunks [(tokens, context before them)] + ``n_decode`` decodes
        whose contexts sum to ``decode_ctx``. max(compute, memory) + a fixed overhead."""
        p_tokens = 0
        attn_pairs = decode_ctx
        kv_read = decode_ctx
        for n, ctx in prefill:
            p_tokens += n
            attn_pairs += n * ctx + n * (n + 1) // 2  # causal: token k sees ctx + k
            kv_read += ctx + n
        flops = self.flops_per_token * (p_tokens + n_decode) + self.attn_flops_per_pair * attn_pairs
        mem = self.weight_bytes_read + self.kv_bytes_per_token * (kv_read + p_tokens + n_decode)
        return max(flops / self.instance_flops, mem / self.instance_bw) + self.iter_overhead_s

    def decode_run_times(self, n_decode: int, decode_ctx: int, k: int) -> Any:
        """Cumulative end times (relative) of ``k`` pure-decode iterations; contexts grow by one
        token per decoder per iteration. Returns a numpy float array of length k."""
        import numpy as np

        j = np.arange(k, dtype=np.float64)
        ctx = decode_ctx + j * n_decode
        flops = self.flops_per_token * n_decode + self.attn_flops_per_pair * ctx
        mem = self.weight_bytes_read + self.kv_bytes_per_token * (ctx + n_decode)
        t = np.maximum(flops / self.instance_flops, mem / self.instance_bw) + self.iter_overhead_s
        return np.cumsum(t)

    def with_overrides(self, **kw: Any) -> Profile:
        return replace(self, **kw)


_FLOAT_FIELDS = {f.name for f in fields(Profile) if f.type in ("float", float)}
_INT_FIELDS = {f.name for f in fields(Profile) if f.type in ("int", int)}


def profile_from_dict(data: dict[str, Any], source: str = "<profile>") -> Profile:
    """Build a profile from a mapping (nested sections are flattened; unknown keys are errors)."""
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise ValueError(f"{source}: unknown profile keys {unknown}")
    missing = sorted(known - set(flat))
    if missing:
        raise ValueError(f"{source}: missing profile keys {missing}")
    out: dict[str, Any] = {}
    for k, v in flat.items():
        # YAML reads "30.5e9" as a string: convert explicitly.
        if k in _FLOAT_FIELDS:
            out[k] = float(v)
        elif k in _INT_FIELDS:
            out[k] = int(float(v))
        else:
            out[k] = str(v)
    prof = Profile(**out)
    if not math.isfinite(prof.kv_capacity_bytes) or prof.kv_capacity_bytes <= 0:
        raise ValueError(f"{source}: weights do not fit in GPU memory: no KV capacity")
    return prof


def profile_names() -> list[str]:
    """The hardware profiles shipped in the package (``--profile NAME``)."""
    from smetric_lmc.config import packaged_config

    return sorted(f.name.removesuffix(".yaml") for f in packaged_config("profiles").iterdir()
                  if f.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> Profile:
    """Load a profile by name (the packaged ``configs/profiles/<name>.yaml``) or path."""
    from smetric_lmc.config import ConfigError, packaged_config, read_yaml

    p = Path(name_or_path)
    names = profile_names()
    if str(name_or_path) in names:  # a name (names may hold dots: llama-3.1-8b-...)
        return profile_from_dict(read_yaml(packaged_config(f"profiles/{name_or_path}.yaml")), f"{name_or_path}.yaml")
    if p.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"no hardware profile {str(name_or_path)!r} (cannot read profiles/{name_or_path}.yaml); "
                          f"the profiles that exist: {', '.join(names)}, or a path to a profile .yaml")
    return profile_from_dict(read_yaml(p), p.name)
