"""The C boundary (kernels/abi.py): the library exports the layout of every structure
Python fills (csrc/abi.c), and loading refuses a mirror that differs, naming the field."""

from __future__ import annotations

import ctypes
from ctypes import c_double, c_float, c_int, c_int64, c_void_p

import pytest

from pagellm.kernels import abi
from pagellm.kernels.build import load_kernels

library = load_kernels()
needs_library = pytest.mark.skipif(library is None, reason="needs a C compiler for the kernel library")


@needs_library
def test_the_library_and_the_mirrors_agree():
    layout = abi.library_layout(library)
    assert set(abi.STRUCTS) <= set(layout)  # every structure's size is exported
    assert layout["Weight"] == ctypes.sizeof(abi.Weight) and layout["LayerShape.linear_impl"] > 0
    assert abi.layout_differences(layout, abi.mirror_layout(abi.STRUCTS)) == []
    abi.check_layout(library)  # what loading runs


class ShapeWithADoubleEps(ctypes.Structure):  # eps retyped on the Python side only
    _fields_ = [
        ("hidden", c_int64),
        ("num_heads", c_int), ("num_kv_heads", c_int), ("head_dim", c_int), ("block_size", c_int),
        ("eps", c_double), ("scale", c_float), ("num_threads", c_int), ("cache_type", c_int),
        ("linear_impl", c_int * 4),
    ]  # fmt: skip


class ExpertsWithoutRenormalize(ctypes.Structure):  # a field the C side has, dropped here
    _fields_ = [
        ("router", c_void_p), ("gate_up", c_void_p), ("down", c_void_p), ("impls", c_void_p),
        ("shared_gate", c_void_p), ("num_experts", c_int64), ("width", c_int64), ("top_k", c_int),
    ]  # fmt: skip


@needs_library
def test_a_wrong_mirror_is_refused_by_name():
    with pytest.raises(abi.KernelABIError) as error:
        abi.check_layout(library, {**abi.STRUCTS, "LayerShape": ShapeWithADoubleEps})
    message = str(error.value)
    assert "LayerShape.scale: offset" in message and "LayerShape: size" in message
    assert "Experts" not in message  # the others still agree
    with pytest.raises(abi.KernelABIError, match="Experts.renormalize is in the library but not in the Python mirror"):
        abi.check_layout(library, {**abi.STRUCTS, "Experts": ExpertsWithoutRenormalize})


def test_differences_are_listed_both_ways():
    library_side = {"S": 16, "S.a": 0, "S.b": 8, "Other": 4}
    mirror_side = {"S": 16, "S.a": 0, "S.c": 8}
    assert abi.layout_differences(library_side, mirror_side) == [
        "S.b is in the library but not in the Python mirror",
        "S.c is in the Python mirror but not in the library",
    ]
    assert abi.layout_differences(library_side, {"S": 24, "S.a": 0, "S.b": 8}) == [
        "S: size 16 in the library, 24 in the Python mirror",
    ]


def test_every_signature_names_a_function_the_library_exports():
    if library is None:
        pytest.skip("needs a C compiler for the kernel library")
    for name in abi.SIGNATURES:
        assert getattr(library, name).argtypes is not None, name
