"""Sim stage: GPU presets for the roofline cost model, each figure with its source.

Peak FLOP/s are the dense (no 2:4 sparsity) BF16/FP16 tensor-core figures; vendor
datasheets usually print the sparse figure, twice the dense one. Bandwidths are in
10^9 bytes per second as printed. Memory sizes are the datasheet capacity read as GiB:
HBM and GDDR capacities are binary-sized, and the driver exposes slightly less (an
H100 80GB reports 79.2 GiB), which the headroom of gpu_memory_utilization absorbs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.units import GiB
from pagellm.errors import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_tflops: float  # dense BF16/FP16 tensor-core TFLOP/s
    memory_bandwidth_gbs: float  # device memory, 1e9 bytes/s
    memory_gib: float  # device memory capacity
    host_link_gbs: float  # host <-> device, one direction, 1e9 bytes/s (swap copies)
    source: str
    # The interconnect preset (interconnect_presets.py) a tensor-parallel group of this
    # part talks over by default: SXM parts their NVLink, PCIe cards PCIe.
    interconnect: str | None = None

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Bytes per second."""
        return self.memory_bandwidth_gbs * 1e9

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    @property
    def host_link_bandwidth(self) -> float:
        return self.host_link_gbs * 1e9


_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM4): BF16 tensor 312 TFLOPS dense "
    "(624 with sparsity); PCIe Gen4 64 GB/s in both directions together"
)
_HOPPER_LINK = "PCIe Gen5 128 GB/s in both directions together"

GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            "A100-40GB", 312.0, 1555.0, 40.0, 32.0,
            _A100_DATASHEET + "; A100 40GB: HBM2 1,555 GB/s, 40 GB", "NVLink3",
        ),
        GpuSpec(
            "A100-80GB", 312.0, 2039.0, 80.0, 32.0,
            _A100_DATASHEET + "; A100 80GB: HBM2e 2,039 GB/s, 80 GB", "NVLink3",
        ),
        GpuSpec(
            "H100-SXM", 989.0, 3350.0, 80.0, 64.0,
            "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 tensor 1,979 TFLOPS "
            "with sparsity (989 dense), HBM3 3.35 TB/s, 80 GB; " + _HOPPER_LINK, "NVLink4",
        ),
        GpuSpec(
            "H200", 989.0, 4800.0, 141.0, 64.0,
            "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 tensor 1,979 TFLOPS "
            "with sparsity (989 dense), HBM3e 4.8 TB/s, 141 GB; " + _HOPPER_LINK, "NVLink4",
        ),
        GpuSpec(
            "L4", 121.0, 300.0, 24.0, 32.0,
            "NVIDIA L4 Tensor Core GPU datasheet: BF16 tensor 242 TFLOPS with sparsity "
            "(121 dense), GDDR6 300 GB/s, 24 GB; PCIe Gen4 x16 64 GB/s in both directions",
            "PCIe4",
        ),
        GpuSpec(
            "A10G", 70.0, 600.0, 24.0, 32.0,
            "AWS G5's A10G has no NVIDIA datasheet: 24 GB GDDR6 at 600 GB/s as the A10 "
            "(NVIDIA A10 datasheet); 70 TFLOPS dense FP16/BF16 tensor as reported for the "
            "A10G in Baseten's 'NVIDIA A10 vs A10G for ML model inference' (the A10 has "
            "125); PCIe Gen4. The least certain preset: check it against your instance",
            "PCIe4",
        ),
    )
}  # fmt: skip


def get_gpu_preset(name: str) -> GpuSpec:
    """The preset named `name` (case-insensitive)."""
    for key, spec in GPU_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(f"unknown GPU {name!r}; presets: {', '.join(GPU_PRESETS)}")
