"""The builds of the native kernels this CPU can execute (kernels/build.py ISA_LEVELS), lowest
first: tests run each of them (the kernel_isa fixture in conftest.py), so an AVX-512 machine
tests the AVX2 build too."""

from pagellm.kernels.build import host_isa_levels

KERNEL_ISA_LEVELS: list[str] = list(host_isa_levels())
