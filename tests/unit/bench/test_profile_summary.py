"""bench/profile_summary.py: a profile reduced to device busy time and host waits, against
hand-computed values (the GPU run reads #31's answer off these numbers)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd import DeviceType

from bench.profile_summary import summarize, union_us


@dataclass
class Span:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    name: str
    device_type: DeviceType
    time_range: Span


def gpu(name: str, start: float, end: float) -> Event:
    return Event(name, DeviceType.CUDA, Span(start, end))


def host(name: str, start: float, end: float) -> Event:
    return Event(name, DeviceType.CPU, Span(start, end))


def test_union_counts_overlaps_once() -> None:
    assert union_us([]) == 0.0
    assert union_us([(0, 10), (20, 30)]) == 20.0
    assert union_us([(0, 10), (5, 15), (12, 13), (40, 41)]) == 16.0
    assert union_us([(5, 15), (0, 100)]) == 100.0  # unsorted, one inside the other


def test_summary_of_a_pass_that_waits_on_the_device() -> None:
    events = [
        host("aten::mm", 0, 50),
        host("cudaLaunchKernel", 10, 12),
        host("cudaLaunchKernel", 20, 22),
        host("cudaLaunchKernelExC", 30, 32),
        host("cudaStreamSynchronize", 100, 400),
        host("cudaMemcpyAsync", 410, 415),  # asynchronous: not a sync by itself
        host("cudaMemcpy", 500, 520),
        host("cudaMalloc", 530, 540),
        host("cudaFree", 540, 545),
        gpu("ampere_bf16_gemm", 12, 212),
        gpu("flash_fwd_kernel", 150, 250),  # overlaps the gemm: 212-250 counts once
        gpu("Memcpy HtoD (Pageable -> Device)", 415, 425),
        gpu("Memcpy DtoH (Device -> Pageable)", 520, 530),
    ]
    out = summarize(events, wall_s=1e-3, plain_s=0.5e-3)
    busy_us = (250 - 12) + 10 + 10
    assert out["busy_s"] == round(busy_us / 1e6, 4)
    assert out["busy_frac"] == round(busy_us / 1000, 3)
    assert out["busy_frac_plain"] == round(busy_us / 500, 3)
    assert out["launches"] == 3
    assert out["syncs"] == 2  # the stream synchronize and the synchronous copy
    assert out["sync_wait_s"] == round(320 / 1e6, 4)
    assert out["pageable_copies"] == 2
    assert out["mallocs"] == 2
    assert out["wall_s"] == 1e-3 and out["plain_s"] == 0.5e-3


def test_summary_of_a_cpu_run_has_no_device_time() -> None:
    out = summarize([host("aten::mm", 0, 10)], wall_s=0.01, plain_s=0.01)
    assert out["busy_s"] == 0.0 and out["busy_frac"] == 0.0 and out["syncs"] == 0
