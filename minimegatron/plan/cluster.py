"""A cluster, as the planner sees it: nodes of GPUs, each GPU's memory and peak arithmetic, and
two bandwidths, inside a node and between nodes.

    cluster = CLUSTERS["h100-sxm"]
    cluster.group_bandwidth(stride=1, size=8)      # a tp group of 8: inside one node, NVLink
    cluster.group_bandwidth(stride=8, size=128)    # a dp group across nodes: InfiniBand

Ranks follow parallel_state.rank_groups' order ("tp-cp-ep-dp-pp", tp fastest): a group of
`size` ranks `stride` apart lies inside one node when stride * size <= gpus_per_node (and its
block does not straddle nodes); tests/test_plan.py checks the rule against rank_groups.
Bandwidths are per GPU and direction, bytes/s; leaving the node means inter-node bandwidth."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import ConfigError

__all__ = ["Cluster", "CLUSTERS", "GiB"]

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    """One kind of machine, repeated: `gpus_per_node` GPUs of `memory_bytes` each, `peak_flops`
    bf16 dense FLOP/s each, NVLink-class `intra_node_bandwidth` and network
    `inter_node_bandwidth` (bytes/s per GPU, one direction)."""

    name: str
    gpus_per_node: int
    memory_bytes: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    def validate(self) -> "Cluster":
        for field in fields(self)[1:]:                        # every number after the name
            value = getattr(self, field.name)
            if not value > 0:
                raise ConfigError(f"cluster {self.name!r}: {field.name}={value} must be positive")
        return self

    def check_gpus(self, gpus: int) -> None:
        """ConfigError unless `gpus` fills whole nodes (or divides one node: a part of it)."""
        n = self.gpus_per_node
        if gpus < 1:
            raise ConfigError(f"gpus={gpus} must be positive")
        if gpus % n and n % gpus:
            raise ConfigError(f"gpus={gpus} is not a multiple of the {n} GPUs per node of cluster {self.name!r} "
                              f"(nor a divisor of one node): use {gpus // n * n or n} or {(gpus // n + 1) * n}")

    def intra_node(self, stride: int, size: int) -> bool:
        """Do the `size` ranks r, r + stride, ..., r + (size - 1) stride of a group (r a multiple
        of stride * size) share one node?"""
        block = stride * size
        return size == 1 or (block <= self.gpus_per_node and self.gpus_per_node % block == 0)

    def group_bandwidth(self, stride: int, size: int) -> float:
        """Bytes/s per GPU for the collectives of that group."""
        return self.intra_node_bandwidth if self.intra_node(stride, size) else self.inter_node_bandwidth


CLUSTERS: dict[str, Cluster] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s BF16 dense (1979 "with
    # sparsity"), 80 GB HBM3, NVLink 900 GB/s total = 450 GB/s each way. DGX H100 user guide:
    # eight ConnectX-7 400 Gb/s InfiniBand ports, one per GPU: 50 GB/s each way.
    "h100-sxm": Cluster("h100-sxm", gpus_per_node=8, memory_bytes=80 * GiB, peak_flops=989e12,
                        intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s BF16 dense, NVLink 600 GB/s
    # total = 300 GB/s each way. DGX A100: eight 200 Gb/s HDR InfiniBand ports: 25 GB/s each way.
    "a100-80gb": Cluster("a100-80gb", gpus_per_node=8, memory_bytes=80 * GiB, peak_flops=312e12,
                         intra_node_bandwidth=300e9, inter_node_bandwidth=25e9),
}
