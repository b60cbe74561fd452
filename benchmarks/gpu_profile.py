"""Where a GPU call's time goes: kernel time by category from torch.profiler, the GPU's busy share, its
idle gaps and the host ops with the most self time. Used by decode_profile.py and train_speed.py.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def category(name: str, categories: list[tuple[str, re.Pattern]]) -> str:
    """The first category whose pattern matches the kernel's name (the last should match anything)."""
    return next(label for label, pattern in categories if pattern.search(name))


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(events) -> float:
    """Union of the kernels' [start, end) intervals: time the GPU ran something."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0.0 if cur_end is None else cur_end - cur_start)


def idle_gaps(events, at_least_us: float = 200.0) -> tuple[int, float]:
    """(count, total us) of the GPU's idle gaps of at least `at_least_us` between kernels: long gaps are
    host work the GPU waits for (a host sync, an eager prefill), short ones launch latency."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    count, total, end = 0, 0.0, None
    for start, stop in spans:
        if end is not None and start - end >= at_least_us:
            count, total = count + 1, total + start - end
        end = stop if end is None else max(end, stop)
    return count, total


def host_ops(prof, top: int) -> list[tuple[str, float, int]]:
    """(op, self CPU us, calls) of the host-side ops with the most self time: where the host's time goes."""
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CPU]
    return sorted(rows, key=lambda r: -r[1])[:top]


def ops_by_shape(prof, top: int) -> list[tuple[str, str, float, int]]:
    """(op, its input shapes, self GPU us, calls) of the ops whose own kernels take the most GPU time."""
    rows = [(e.key, str(e.input_shapes), e.self_device_time_total, e.count)
            for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])[:top]


def profile_call(fn, top: int, shapes: int = 0) -> tuple[list, float, list, list]:
    """The kernels of one call, its wall time in us, its top host-side ops and (shapes > 0) the
    `shapes` ops with the most GPU time by input shape (recording shapes costs host time)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes > 0) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return kernel_events(prof), wall * 1e6, host_ops(prof, top), ops_by_shape(prof, shapes) if shapes else []


def report(title: str, events: list, wall_us: float, steps: int, top: int, host: list,
           categories: list[tuple[str, re.Pattern]]) -> dict:
    """Print kernel time per category and per kernel, the GPU's idle time and the top host ops, each per
    step (`steps` steps in the profiled call); returns the figures for a summary table."""
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in events:
        us = e.time_range.elapsed_us()
        by_cat[category(e.name, categories)] += us
        by_name[e.name] += us
        count[e.name] += 1
    busy = busy_us(events)
    total = max(sum(by_cat.values()), 1e-9)
    print(f"\n## {title}: wall {wall_us / steps:.0f} us / step, kernels {sum(by_cat.values()) / steps:.0f} us / step,"
          f" busy {100 * busy / wall_us:.0f}%, {len(events) / steps:.0f} kernels / step")
    print("| category | us / step | share of kernel time |\n|---|---:|---:|")
    for label, _ in categories:
        if by_cat[label]:
            print(f"| {label} | {by_cat[label] / steps:.0f} | {100 * by_cat[label] / total:.1f}% |")
    print(f"| top {top} kernels | us / step | calls / step |\n|---|---:|---:|")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name[:90]}` | {us / steps:.1f} | {count[name] / steps:.1f} |")
    gaps, gap_us = idle_gaps(events)
    print(f"GPU idle gaps >= 200 us: {gaps} in the call, {gap_us / steps:.0f} us / step; idle in all: "
          f"{(wall_us - busy) / steps:.0f} us / step")
    print(f"| top {top} host ops (self CPU) | us / step | calls / step |\n|---|---:|---:|")
    for name, us, calls in host:
        print(f"| `{name[:90]}` | {us / steps:.1f} | {calls / steps:.1f} |")
    return dict(title=title, wall_us=wall_us / steps, busy=busy / wall_us,
                categories={k: v / steps for k, v in by_cat.items()})
