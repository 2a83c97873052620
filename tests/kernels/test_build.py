"""The kernel builds per instruction-set level (kernels/build.py): CPUID picks one, each the
host runs loads and names itself, a level asked for that cannot run is a clear error, and a
level that fails to build falls back to the next one down."""

from __future__ import annotations

import pytest

from pagellm.errors import ConfigError
from pagellm.kernels import build


def test_each_level_the_host_runs_loads_and_names_itself(kernel_isa):
    library = build.load_kernels()
    assert library is not None and library.isa_level.name == kernel_isa
    assert build.native_isa() == kernel_isa
    assert kernel_isa in build.describe_isa()
    assert bool(library.amx_supported()) <= (kernel_isa == "amx")  # only the AMX build has tiles


def test_levels_are_a_prefix_of_the_table_and_auto_takes_the_highest(monkeypatch):
    levels = build.host_isa_levels()
    names = [level.name for level in build.ISA_LEVELS]
    assert list(levels) == names[: len(levels)]  # each level includes the ones below it
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", "auto")
    selected = build.selected_isa_level()
    assert (selected is None) == (not levels)
    if levels:
        assert selected.name == levels[-1]


def test_a_level_that_cannot_run_or_does_not_exist_is_named(monkeypatch):
    monkeypatch.setattr(build, "host_isa_levels", lambda: ("avx2",))
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", "amx")
    with pytest.raises(ConfigError, match="PAGELLM_KERNEL_ISA=amx: this CPU cannot run that build \\(it runs avx2\\)"):
        build.load_kernels()
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", "sse4")
    with pytest.raises(ConfigError, match="must be auto or one of avx2, avx512, avx512_bf16, amx"):
        build.load_kernels()


def test_a_level_that_fails_to_build_falls_back_to_the_next_one_down(monkeypatch):
    # A compiler too old for AMX's flags: auto takes the AVX-512 BF16 build instead.
    monkeypatch.setattr(build, "host_isa_levels", lambda: ("avx2", "avx512", "avx512_bf16", "amx"))
    built = {"avx512_bf16": "the avx512_bf16 library"}
    tried: list[str] = []

    def fake_load(level):  # noqa: ANN001, ANN202
        tried.append(level.name)
        return built.get(level.name)

    monkeypatch.setattr(build, "_load_level", fake_load)
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", "auto")
    assert build.load_kernels() == "the avx512_bf16 library" and tried == ["amx", "avx512_bf16"]
    tried.clear()
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", "amx")  # pinned: no silent substitute
    assert build.load_kernels() is None and tried == ["amx"]
