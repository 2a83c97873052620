"""Sim stage: GPU-to-GPU interconnect presets for tensor parallelism, each figure
with its source.

Datasheets print NVLink as the total of both directions over all of a GPU's links
("900 GB/s" on an H100 SXM is 450 GB/s out and 450 GB/s in at once), and PCIe x16 per
direction or as both together. The ring all-reduce formula (tensor_parallel_costs.py) needs
what one GPU can send while it also receives: the per-direction (unidirectional)
bandwidth, which is what nccl-tests reports as bus bandwidth ("The measurement is of a
unidirectional bandwidth", NVIDIA/nccl-tests doc/PERFORMANCE.md). So
`unidirectional_gbs`, half of the bidirectional figure, is the number the formula uses;
the all-reduce efficiency flag then scales it to what NCCL reaches.

`latency_us` is an assumption, not a datasheet figure: the fixed cost of one small
all-reduce (kernel launch, synchronisation between GPUs, protocol steps), the alpha of
the alpha-beta model. nccl-tests' smallest all_reduce_perf messages on one node take on
the order of 10 us over NVLink and some tens of us over PCIe; --allreduce-latency-us
replaces it with a measured value.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.errors import ConfigError
from pagellm.sim.gpu_presets import GpuSpec

_RING_NOTE = "; per direction = half (what nccl-tests' busbw measures)"


@dataclass(frozen=True)
class InterconnectSpec:
    name: str
    bidirectional_gbs: float  # per GPU, both directions together, 1e9 bytes/s
    latency_us: float  # assumed fixed cost of one all-reduce (alpha)
    source: str

    @property
    def unidirectional_gbs(self) -> float:
        """What one GPU sends per second while receiving as much: the ring's bandwidth."""
        return self.bidirectional_gbs / 2

    @property
    def unidirectional_bandwidth(self) -> float:
        """Bytes per second, one direction."""
        return self.unidirectional_gbs * 1e9


INTERCONNECT_PRESETS: dict[str, InterconnectSpec] = {
    spec.name: spec
    for spec in (
        InterconnectSpec(
            "NVLink3", 600.0, 10.0,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4): third-generation NVLink "
            "600 GB/s per GPU, both directions together (12 links x 50 GB/s)" + _RING_NOTE,
        ),
        InterconnectSpec(
            "NVLink4", 900.0, 10.0,
            "NVIDIA H100 and H200 Tensor Core GPU datasheets (SXM): fourth-generation "
            "NVLink 900 GB/s per GPU, both directions together (18 links x 50 GB/s)" + _RING_NOTE,
        ),
        InterconnectSpec(
            "NVLink5", 1800.0, 10.0,
            "NVIDIA HGX B200 / DGX B200 datasheets: fifth-generation NVLink 1.8 TB/s "
            "per GPU, both directions together (18 links x 100 GB/s)" + _RING_NOTE,
        ),
        InterconnectSpec(
            "PCIe4", 64.0, 25.0,
            "PCI Express 4.0 x16: 16 GT/s per lane, 128b/130b encoding = 31.5 GB/s per "
            "direction, 64 GB/s both directions together as NVIDIA datasheets print it "
            "(A100 PCIe, L4)" + _RING_NOTE,
        ),
        InterconnectSpec(
            "PCIe5", 128.0, 25.0,
            "PCI Express 5.0 x16: 32 GT/s per lane = 63 GB/s per direction, 128 GB/s both "
            "directions together as the H100 datasheet prints it (H100 PCIe)" + _RING_NOTE,
        ),
    )
}  # fmt: skip


def get_interconnect_preset(name: str) -> InterconnectSpec:
    """The preset named `name` (case-insensitive)."""
    for key, spec in INTERCONNECT_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(
        f"unknown interconnect {name!r}; presets: {', '.join(INTERCONNECT_PRESETS)}"
    )


def default_interconnect(gpu: GpuSpec) -> InterconnectSpec:
    """The link a GPU preset's tensor-parallel group talks over (SXM parts: their NVLink,
    PCIe cards: PCIe)."""
    if gpu.interconnect is None:
        raise ConfigError(
            f"{gpu.name} names no interconnect: give --interconnect "
            f"({', '.join(INTERCONNECT_PRESETS)}) for --tensor-parallel-size > 1"
        )
    return get_interconnect_preset(gpu.interconnect)
