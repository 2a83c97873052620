"""The startup log's account of resident memory, and the pages the engine gives back."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _mapped_resident_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
        for line in smaps:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and line.startswith("Rss:"):
                total += int(fields[1]) * 1024
    return total


_STAGE_SCRIPT = """
import numpy as np
from pagellm.metrics.resident_memory import StartupMemory, read_resident_memory, return_freed_heap
memory = StartupMemory()
held = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
memory.mark("a 64 MiB array")
print(memory.describe())
reading = read_resident_memory()
assert reading is not None and reading.total >= held.nbytes and reading.peak >= reading.total
return_freed_heap()  # callable anywhere: glibc's trim, or nothing
"""


@linux_only
def test_stages_add_up_to_the_last_reading():
    # In a process of its own: in a test worker, memory other tests' threads free meanwhile
    # would be counted against the stage.
    done = subprocess.run([sys.executable, "-c", _STAGE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    assert "a 64 MiB array +" in text, text
    added = int(text.split("a 64 MiB array +")[1].split(" MiB")[0])
    assert 56 <= added <= 80, text  # the array, give or take the allocator's own pages


@linux_only
def test_a_loaded_gguf_leaves_no_resident_pages(tmp_path):
    # After the weights are copied out, the loader drops the file's pages from the RSS: the
    # mapping stays usable (a later read pages back in what it reads).
    import gguf

    from pagellm.model.checkpoint.gguf_reader import open_gguf, release_resident_pages

    path = tmp_path / "weights.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    values = np.arange(8 * 2**20 // 4, dtype=np.float32).reshape(-1, 1024)  # 8 MiB
    writer.add_tensor("blk.0.ffn_up.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    tensor = reader.tensors[0]
    assert float(np.asarray(tensor.data, dtype=np.float64).sum()) == float(values.astype(np.float64).sum())
    real = str(path.resolve())
    assert _mapped_resident_bytes(real) >= values.nbytes
    release_resident_pages(reader)
    assert _mapped_resident_bytes(real) < values.nbytes // 8
    assert float(tensor.data[3, 5]) == float(values[3, 5])  # still readable
