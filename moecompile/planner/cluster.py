"""What a cluster can do, as the cost model sees it: one dataclass and a few presets.

    cluster = preset("h100", gpus=256)
    cluster.span(ep=16)            # 'inter' : a 16-rank EP group leaves the 8-GPU node
    cluster.link("intra").bandwidth

Numbers are per GPU and per direction. ``gpus_per_node`` is the size of the fast
(NVLink) domain, which is the rack for GB200 NVL72, not the 4-GPU compute tray.
Peaks are the vendors' *dense* (no 2:4 sparsity) tensor-core figures; the cost
model multiplies them by the cluster's achieved-efficiency factors, stated once
below and overridable per cluster. ``moecompile.planner.microbench`` builds a
CPU "cluster" from measurements instead of a spec sheet.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..errors import MoecompileError

GiB = 2**30
GB = 10**9

# Achieved fractions of the spec-sheet peaks, stated once. They are assumptions, not fits:
# - GEMM: large bf16/FP8 GEMMs reach ~60-75% of dense peak with cuBLAS on H100; grouped GEMMs of
#   fine-grained experts less (the GB200 DeepSeek-V3 write-up measures 2,672 TFLOP/s MXFP8 grouped
#   GEMM at K=7168, N=2048, i.e. ~53% of 5 PFLOP/s). We take 0.6 for all matmul FLOPs.
# - HBM: streaming kernels reach ~80% of the datasheet bandwidth.
# - Links: NCCL all-to-all / ring collectives reach ~80% of the per-direction link rate at MB sizes.
SPEC_GEMM_EFFICIENCY = 0.6
SPEC_HBM_EFFICIENCY = 0.8
SPEC_LINK_EFFICIENCY = 0.8
# - Host (parallel.offload_optimizer): a fused CPU AdamW (torch's fused=True, DeepSpeed's CPUAdam) streams
#   its bytes at about half of the sockets' DRAM bandwidth once every core is busy; we take 0.5. Transfers
#   over PCIe take the link efficiency. 0.8 of the host memory per GPU is usable: the rest is the OS, the
#   data loader and the processes' own memory.
SPEC_HOST_EFFICIENCY = 0.5
SPEC_HOST_USABLE_FRACTION = 0.8

Span = Literal["local", "intra", "inter"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One fabric: per-direction bandwidth per GPU (bytes/s) and a per-message latency (s)."""

    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: ``gpus`` devices, ``gpus_per_node`` of them per fast domain."""

    name: str
    gpus: int
    gpus_per_node: int
    memory_bytes: float  # per GPU
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    fp8_flops: float  # dense FP8 peak, FLOP/s (== bf16_flops where FP8 has no fast path)
    hbm_bandwidth: float  # bytes/s
    intra: Link  # inside the node / NVLink domain
    inter: Link  # between nodes (one NIC per GPU)
    gemm_efficiency: float = SPEC_GEMM_EFFICIENCY
    hbm_efficiency: float = SPEC_HBM_EFFICIENCY
    link_efficiency: float = SPEC_LINK_EFFICIENCY
    op_overhead_s: float = 0.0  # host time per op (kernel launch / eager dispatch); 0: hidden by async GPUs
    usable_memory_fraction: float = 0.9  # the rest goes to the CUDA context, NCCL buffers, fragmentation
    # the host side, for parallel.offload_optimizer (0 host memory: nothing to offload to, e.g. a CPU "cluster")
    host_memory_bytes: float = 0.0  # per GPU: the node's DRAM / its GPUs
    host_bandwidth: float = 0.0  # per GPU: the node's DRAM bandwidth / its GPUs, bytes/s
    pcie_bandwidth: float = 0.0  # per GPU and direction, bytes/s (GB200: NVLink-C2C)
    host_efficiency: float = SPEC_HOST_EFFICIENCY
    host_usable_fraction: float = SPEC_HOST_USABLE_FRACTION
    gpus_per_host: int = 0  # GPUs whose optimizers share one host's DRAM and cores (0: a node's, gpus_per_node)
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise MoecompileError(f"cluster {self.name!r}: gpus ({self.gpus}) and gpus_per_node "
                                  f"({self.gpus_per_node}) must be >= 1")
        if self.gpus_per_host < 0:
            raise MoecompileError(f"cluster {self.name!r}: gpus_per_host={self.gpus_per_host} must be >= 1 (or 0: "
                                  "a node's GPUs share one host)")
        for f in ("gemm_efficiency", "hbm_efficiency", "link_efficiency", "usable_memory_fraction",
                  "host_efficiency", "host_usable_fraction"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise MoecompileError(f"cluster {self.name!r}: {f}={v} must be in (0, 1]")

    @property
    def nodes(self) -> int:
        """Fast domains in use (a partly filled last one counts; groups are assumed aligned to domains)."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def peak(self, fp8: bool = False) -> float:
        """Achieved matmul FLOP/s (peak x gemm_efficiency)."""
        return (self.fp8_flops if fp8 else self.bf16_flops) * self.gemm_efficiency

    @property
    def memory_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.hbm_efficiency

    @property
    def can_offload(self) -> bool:
        """Whether the cluster has host memory and a path to it to offload the optimizer to."""
        return self.host_memory_bytes > 0 and self.host_bandwidth > 0 and self.pcie_bandwidth > 0

    @property
    def host_gpus(self) -> int:
        """GPUs one host serves: their offloaded optimizers step side by side on its cores and DRAM."""
        return self.gpus_per_host or self.gpus_per_node

    @property
    def usable_host_memory(self) -> float:
        return self.host_memory_bytes * self.host_usable_fraction

    @property
    def host_stream_bandwidth(self) -> float:
        """Achieved bytes/s of a CPU optimizer step, per GPU (host bandwidth x host_efficiency)."""
        return self.host_bandwidth * self.host_efficiency

    @property
    def host_link_bandwidth(self) -> float:
        """Achieved bytes/s per direction between a GPU and host memory (PCIe x link_efficiency)."""
        return self.pcie_bandwidth * self.link_efficiency

    def link(self, span: Span) -> Link:
        """The fabric a group of that span is limited by, with the link efficiency applied."""
        raw = self.inter if span == "inter" else self.intra
        return Link(raw.bandwidth * self.link_efficiency, raw.latency)

    def span(self, size: int, stride: int = 1) -> Span:
        """Where a group of ``size`` ranks, ``stride`` apart, lives: one rank, one node, or several."""
        if size <= 1:
            return "local"
        return "intra" if size * stride <= self.gpus_per_node else "inter"

    def peers_off_node(self, size: int, stride: int = 1) -> float:
        """Share of a group's ``size`` members (``stride`` ranks apart) that sit on other nodes than a given rank."""
        if size <= 1:
            return 0.0
        on_node = max(1, min(size, self.gpus_per_node // max(1, stride)))
        return (size - on_node) / size

    def with_gpus(self, gpus: int) -> "Cluster":
        return dataclasses.replace(self, gpus=gpus)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.gpus} GPUs ({self.nodes} x {self.gpus_per_node}), "
            f"{self.memory_bytes / GiB:.0f} GiB, bf16 {self.bf16_flops / 1e12:.0f} / fp8 {self.fp8_flops / 1e12:.0f} "
            f"TFLOP/s dense, HBM {self.hbm_bandwidth / 1e12:.2f} TB/s, intra {self.intra.bandwidth / GB:.0f} GB/s, "
            f"inter {self.inter.bandwidth / GB:.0f} GB/s per direction"
            + (f"; host {self.host_memory_bytes / GB:.0f} GB at {self.host_bandwidth / GB:.0f} GB/s, "
               f"{self.pcie_bandwidth / GB:.0f} GB/s to it" if self.can_offload else "")
        )


# --- presets -------------------------------------------------------------------------------------
# H100 SXM5 80 GB (DGX/HGX H100): NVIDIA H100 datasheet — BF16 tensor 1,979 TFLOP/s and FP8 3,958
#   TFLOP/s *with sparsity*, i.e. 989.4 / 1,978.9 dense (the datasheet footnote: "1/2 lower without
#   sparsity"); 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s total = 450 GB/s per direction;
#   scale-out one ConnectX-7 NDR 400 Gb/s per GPU = 50 GB/s per direction (DGX H100: 8 NICs for 8 GPUs).
# H200 SXM 141 GB: NVIDIA H200 product page — same Hopper tensor cores as H100 SXM (989 / 1,979
#   dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; same NDR 400 Gb/s scale-out.
# GB200 NVL72 (per Blackwell GPU): NVIDIA GB200 NVL72 spec — 720 PFLOP/s FP8 and 360 PFLOP/s BF16
#   per 72-GPU rack with sparsity, i.e. 5.0 / 2.5 PFLOP/s dense per GPU; 13.4 TB HBM3e and 576 TB/s
#   per rack, i.e. 186 GB and 8 TB/s per GPU; NVLink 5 1.8 TB/s per GPU (900 GB/s per direction)
#   across all 72 GPUs (130 TB/s aggregate); scale-out one ConnectX-7 400 Gb/s per GPU (4 per
#   compute tray) = 50 GB/s per direction.
# Latencies: NVLink ~1-2 us, InfiniBand NDR ~1-5 us per hop for small messages (public interconnect
#   overviews); NCCL adds software latency, so we take 5 us intra and 10 us inter as the per-collective
#   floor. These are order-of-magnitude assumptions; at MB message sizes the bandwidth term dominates.
# Host side, per GPU: DGX H100 and DGX H200 (their user guides) hold 2 TB of DDR5 and two Xeon Platinum
#   8480C (8 channels of DDR5-4800 each, 307 GB/s a socket) for 8 GPUs: 256 GB and 77 GB/s per GPU; each GPU
#   sits on PCIe Gen5 x16, 64 GB/s per direction. GB200 NVL72: a Grace CPU with 480 GB LPDDR5X at up to
#   512 GB/s serves 2 GPUs over NVLink-C2C (900 GB/s bidirectional), shared: 240 GB, 256 GB/s and 225 GB/s
#   per direction per GPU. Spec-sheet figures; the efficiencies above are applied to them.
_DGX_HOST = dict(host_memory_bytes=256 * GB, host_bandwidth=76.8 * GB, pcie_bandwidth=64 * GB)
_PRESETS: dict[str, dict] = {
    "h100": dict(
        gpus_per_node=8, memory_bytes=80 * GB, bf16_flops=989.4e12, fp8_flops=1978.9e12, hbm_bandwidth=3.35e12,
        intra=Link(450 * GB, 5e-6), inter=Link(50 * GB, 10e-6), **_DGX_HOST,
        source="NVIDIA H100 SXM5 datasheet (dense = sparse/2); NVLink 4 900 GB/s bidir; ConnectX-7 400 Gb/s per GPU",
    ),
    "h200": dict(
        gpus_per_node=8, memory_bytes=141 * GB, bf16_flops=989.4e12, fp8_flops=1978.9e12, hbm_bandwidth=4.8e12,
        intra=Link(450 * GB, 5e-6), inter=Link(50 * GB, 10e-6), **_DGX_HOST,
        source="NVIDIA H200 SXM product page (141 GB HBM3e, 4.8 TB/s; Hopper tensor cores as H100)",
    ),
    "gb200": dict(
        gpus_per_node=72, memory_bytes=186 * GB, bf16_flops=2.5e15, fp8_flops=5.0e15, hbm_bandwidth=8.0e12,
        intra=Link(900 * GB, 5e-6), inter=Link(50 * GB, 10e-6),
        host_memory_bytes=240 * GB, host_bandwidth=256 * GB, pcie_bandwidth=225 * GB, gpus_per_host=2,
        source="NVIDIA GB200 NVL72 spec per GPU (rack 720/360 PF FP8/BF16 sparse, 13.4 TB, 576 TB/s, NVLink5 1.8 TB/s)",
    ),
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset(name: str, gpus: int | None = None, **overrides: float) -> Cluster:
    """A named cluster (``h100``, ``h200``, ``gb200``) of ``gpus`` GPUs (default: one node)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in _PRESETS:
        raise MoecompileError(f"unknown cluster preset {name!r}; presets: {', '.join(_PRESETS)} "
                              "(or build a moecompile.planner.Cluster yourself)")
    fields = dict(_PRESETS[key])
    fields.update(overrides)
    return Cluster(name=key, gpus=gpus or int(fields["gpus_per_node"]), **fields)
