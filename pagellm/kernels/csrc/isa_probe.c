/* Kernels, CPU: which of the kernel builds this processor can run, from CPUID and XGETBV.
 *
 * kernels/build.py compiles the kernels once per instruction-set level from the same
 * sources (ISA_LEVELS there) and loads the highest one this function allows. It is built
 * for baseline x86-64, so it runs on every x86-64 CPU, and it checks the operating system's
 * side as well: a CPU may have AVX-512 or AMX registers that the OS does not save on a
 * context switch (XCR0), and then the instructions must not be used.
 *
 * Returns the highest level index (0 AVX2+FMA+F16C, 1 AVX-512 F/BW/DQ/VL, 2 + AVX-512
 * BF16/VNNI, 3 + AMX BF16/INT8), or -1 where none runs (no AVX2, or not x86-64). ARM would
 * add its own levels (NEON, SVE) here and in build.py, with kernels written for them.
 */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

static uint64_t xcr0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

static int bit(uint32_t word, int index) { return (word >> index) & 1u; }

int cpu_isa_level(void) {
    uint32_t eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return -1;
    const int fma = bit(ecx, 12), osxsave = bit(ecx, 27), f16c = bit(ecx, 29);
    if (!osxsave) return -1;
    const uint64_t os_state = xcr0();
    if ((os_state & 0x6) != 0x6) return -1; /* XMM and YMM state saved by the OS */
    if (__get_cpuid_max(0, 0) < 7) return -1;
    uint32_t b7, c7, d7, a7_1, b7_1, c7_1, d7_1;
    __cpuid_count(7, 0, eax, b7, c7, d7);
    __cpuid_count(7, 1, a7_1, b7_1, c7_1, d7_1);
    if (!(bit(b7, 5) && fma && f16c)) return -1; /* AVX2 */
    int level = 0;
    const int avx512 = bit(b7, 16) && bit(b7, 17) && bit(b7, 30) && bit(b7, 31); /* F, DQ, BW, VL */
    if (!(avx512 && (os_state & 0xE0) == 0xE0)) return level; /* opmask, ZMM upper halves, ZMM16-31 */
    level = 1;
    if (!(bit(a7_1, 5) && bit(c7, 11))) return level; /* AVX512_BF16, AVX512_VNNI */
    level = 2;
    if (bit(d7, 22) && bit(d7, 24) && bit(d7, 25) && (os_state & 0x60000) == 0x60000) /* AMX BF16, TILE, INT8; XTILECFG, XTILEDATA */
        level = 3;
    return level;
}
#else
int cpu_isa_level(void) { return -1; }
#endif
