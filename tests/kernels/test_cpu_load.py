"""The share of the CPUs other processes used (kernels/cpu_load.py), read from /proc/stat."""

from __future__ import annotations

import os

import pytest

from pagellm.kernels.cpu_load import LoadReading, others_share, read_load, system_busy_seconds


def test_busy_seconds_count_steal_but_not_idle_or_iowait(tmp_path):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {tick} {tick} {tick} {50 * tick} {7 * tick} {tick} {tick} {3 * tick} 0 0\ncpu0 1 2 3\n")
    assert system_busy_seconds(str(stat)) == pytest.approx(8.0)
    stat.write_text("intr 1 2 3\n")
    assert system_busy_seconds(str(stat)) is None
    assert system_busy_seconds(str(tmp_path / "missing")) is None


def test_others_share_subtracts_our_own_cpu_time():
    before = LoadReading(wall=10.0, own_cpu=1.0, system_busy=500.0)
    after = LoadReading(wall=12.0, own_cpu=4.0, system_busy=505.0)  # we used 3 s, others 2 s
    assert others_share(before, after, num_cpus=2) == pytest.approx(0.5)
    assert others_share(before, LoadReading(12.0, 4.0, 502.0), num_cpus=2) == 0.0  # clock-tick grain
    assert others_share(before, LoadReading(12.0, 4.0, None), num_cpus=2) is None
    assert others_share(before, before, num_cpus=2) is None
    assert others_share(before, LoadReading(10.01, 1.0, 505.0), num_cpus=2) is None  # 10 ms: a tick or two


def test_a_real_reading_on_this_machine():
    first, second = read_load(), read_load()
    assert second.wall >= first.wall and second.own_cpu >= first.own_cpu
    share = others_share(first, second)
    if os.path.exists("/proc/stat"):
        assert first.system_busy is not None
    assert share is None or 0.0 <= share <= 1.0
