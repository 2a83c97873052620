"""Memory by component: each storage counted once, however it is nested or shared."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagellm.worker.memory_report import memory_by_component, storage_bytes


def test_each_storage_is_counted_once():
    shared = torch.zeros(4, 8)  # 128 bytes, two layers' view of one cache
    state = SimpleNamespace(conv=torch.zeros(2, 3), recurrent=torch.zeros(5, dtype=torch.float64))
    assert storage_bytes([shared, shared[1:], [shared], (state,)]) == 128 + 24 + 40
    assert storage_bytes([torch.empty(0)]) == 0


def test_a_runners_components():
    model = torch.nn.Linear(4, 3)  # no weight_bytes_by_format: its parameters
    runner = SimpleNamespace(
        model=model, kv_caches=[torch.zeros(10, dtype=torch.bfloat16)] * 3, host_kv_caches=[],
        linear_states=(SimpleNamespace(conv=torch.zeros(2)),), snapshot_states=(), host_states=(),
        kv_tier=SimpleNamespace(host=SimpleNamespace(capacity_bytes=1 << 20)),
    )  # fmt: skip
    assert memory_by_component(runner) == {
        "weights": (12 + 3) * 4, "kv_cache": 20, "kv_swap_space": 0, "recurrent_state": 8, "tier_host_cache": 1 << 20,
    }  # fmt: skip
