"""Measure this host's offloaded optimizer update, so the planner prices ``parallel.offload_optimizer`` from it.

    rate = measure_host_update(processes=8)         # on one node of the cluster, as its 8 GPUs' ranks would run
    cluster = rate.applied_to(preset("h100", 64))   # host_efficiency measured instead of assumed

The cost model prices the CPU's part of an offloaded step at the host's DRAM bandwidth times
``Cluster.host_efficiency``, an assumption (0.5 of the spec) until measured. This runs what the
CPU does in a CUDA run (moecompile.optimizer_offload.update_on_host, then the new values staged
for the copy up; freed host memory kept, as the step keeps it), in ``processes`` concurrent
processes (the GPUs one host serves: their updates contend for its cores and DRAM as a real
job's do), each with its share of the cores, and keeps the fastest of several runs. The copies over PCIe are not the CPU's work (DMA) and are not timed.
The figure is this machine's: run it on a node of the cluster you plan for.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import torch
import torch.nn as nn

from ..errors import MoecompileError
from ..grad_sync import Shard
from ..host_memory import keep_freed_memory
from ..optimizer_offload import to_host, update_on_host
from .cluster import GB, Cluster
from .cost_model import host_update_bytes
from .microbench import run_ranks, threads_per_rank


@dataclasses.dataclass(frozen=True)
class HostRate:
    """What :func:`measure_host_update` measured: elements each process updated per second, all at once."""

    processes: int
    threads: int  # torch threads in each process
    elements: int  # per process and update
    seconds: float  # the slowest process's fastest update
    bytes_per_element: float  # DRAM traffic of one element's update (cost_model.host_update_bytes)
    dtype: torch.dtype
    moment_dtype: torch.dtype
    host: str  # where it ran

    @property
    def bandwidth_per_gpu(self) -> float:
        """Bytes/s one process's update streams (each process stands for one GPU)."""
        return self.elements * self.bytes_per_element / self.seconds

    def efficiency(self, cluster: Cluster) -> float:
        """The measured bandwidth as a share of the cluster's host DRAM bandwidth per GPU."""
        if cluster.host_bandwidth <= 0:
            raise MoecompileError(f"cluster {cluster.name!r} has no host_bandwidth to compare the measured host "
                                  "update with: set Cluster.host_bandwidth (bytes/s of DRAM per GPU)")
        return self.bandwidth_per_gpu / cluster.host_bandwidth

    def applied_to(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the measured host_efficiency; an error where it is not a host of that cluster."""
        if self.processes != cluster.host_gpus:
            raise MoecompileError(f"the host update was measured with {self.processes} processes, and one host of "
                                  f"{cluster.name!r} serves {cluster.host_gpus} GPUs: measure with "
                                  f"processes={cluster.host_gpus}")
        eff = self.efficiency(cluster)
        if eff > 1:
            raise MoecompileError(
                f"this host ({self.host}) updated {self.bandwidth_per_gpu / GB:.1f} GB/s per GPU, more than "
                f"{cluster.name!r}'s host DRAM spec of {cluster.host_bandwidth / GB:.1f} GB/s per GPU: it is not a "
                "host of that cluster; measure on one of its nodes, or build a Cluster with this host's figures")
        return dataclasses.replace(cluster, host_efficiency=eff)

    def describe(self, cluster: Cluster | None = None) -> str:
        moments = str(self.moment_dtype).removeprefix("torch.")
        line = (f"host update measured on {self.host}: {self.processes} processes x {self.threads} threads, "
                f"{self.elements / 1e6:.1f} M {str(self.dtype).removeprefix('torch.')} elements each "
                f"(AdamW, {moments} moments) in {self.seconds * 1e3:.1f} ms = "
                f"{self.bandwidth_per_gpu / GB:.2f} GB/s per GPU at {self.bytes_per_element:g} B an element")
        if cluster is not None and cluster.host_bandwidth > 0:
            line += (f", {self.efficiency(cluster):.2f} of {cluster.name}'s {cluster.host_bandwidth / GB:.1f} GB/s "
                     f"(assumed: {cluster.host_efficiency:.2f})")
        return line


def _optimizer(params: list[nn.Parameter], moment_dtype: torch.dtype) -> torch.optim.Optimizer:
    """The optimizer the planner prices: torch's AdamW (fused on the host), or moecompile's for other moments."""
    if moment_dtype == torch.float32:
        return torch.optim.AdamW(params, lr=1e-4)
    from ..adamw import AdamW

    return AdamW(params, lr=1e-4, moment_dtype=moment_dtype)


def _update_rank(rank: int, world: int, elements: int, dtype: torch.dtype, moment_dtype: torch.dtype,
                 repeats: int) -> float:
    """One process: an offloaded tensor of ``elements``, its fastest host update (all processes start each run
    together)."""
    import torch.distributed as dist

    keep_freed_memory()  # as build_train_step does with the optimizer offloaded: temporaries reuse the heap
    param = nn.Parameter(torch.randn(elements, dtype=dtype))
    grad = torch.randn(elements, dtype=dtype)
    update = to_host(Shard("bench", param, 0, elements, grad, ((0, elements),)), torch.device("cpu"), buffers=True)
    update.load_grad()
    optimizer = _optimizer([update.tensor], moment_dtype)
    best = float("inf")
    for i in range(repeats + 1):  # the first run builds the optimizer's state: not timed
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        update_on_host(optimizer, [update])
        update.stage()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def measure_host_update(processes: int, elements: int = 32 * 2**20, dtype: torch.dtype = torch.bfloat16,
                        moment_dtype: torch.dtype = torch.float32, repeats: int = 5, threads: int | None = None,
                        timeout_s: float = 600.0) -> HostRate:
    """Time the CPU's part of an offloaded step: ``processes`` at once (the GPUs one host serves), ``elements`` each
    (default 32 M, well past the caches), gradients and values in ``dtype``, AdamW moments in ``moment_dtype``."""
    if processes < 1 or elements < 1 or repeats < 1:
        raise MoecompileError(f"measure_host_update: processes={processes}, elements={elements} and "
                              f"repeats={repeats} must be >= 1")
    threads = threads or threads_per_rank(processes)
    times = run_ranks(_update_rank, processes, (elements, dtype, moment_dtype, repeats), threads=threads,
                      timeout_s=timeout_s)
    size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    per = host_update_bytes(size(dtype), size(dtype), size(moment_dtype))
    return HostRate(processes, threads, elements, max(times), per, dtype, moment_dtype,
                    f"{socket.gethostname()} ({os.cpu_count()} cores)")
