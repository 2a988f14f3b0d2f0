"""Wall time and peak memory of a callable, on CUDA or on CPU.

CUDA: CUDA events around each call and the caching allocator's peak counter.
CPU: perf_counter around each call, and the peak of the running sum of the allocations and
frees that PyTorch's profiler records (CPU tensors have no allocator peak counter). The memory
figure is what `fn` allocates beyond what was live when it started: inputs are not counted.
"""

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fns: dict[str, Callable],
    device: torch.device,
    reps: int,
    warmup: int,
    prepare: dict[str, Callable[[], object]] | None = None,
    budget_ms: float = 300.0,
) -> dict[str, float]:
    """Median milliseconds per call of each of `fns`, after `warmup` calls each (which absorb
    compilation). With `prepare`, each call is `fn(prepare[name]())` and only `fn` is timed (a
    backward after its untimed forward). Fast calls get more than `reps` samples, up to about
    `budget_ms` each, so a short burst of load does not decide the median. The calls are
    interleaved round-robin, so drift in the machine's load hits every implementation alike
    instead of favouring whichever ran first."""

    def call_ms(name: str) -> float:
        fn = fns[name]
        if prepare:
            state = prepare[name]()
            return _one_call_ms(lambda: fn(state), device)
        return _one_call_ms(fn, device)

    for _ in range(warmup):
        for name in fns:
            call_ms(name)
    probe = {name: call_ms(name) for name in fns}
    slowest = max(probe.values())
    reps = max(reps, min(50 * reps, int(budget_ms / max(slowest, 1e-3))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name in fns:
            samples[name].append(call_ms(name))
    return {name: statistics.median(times) for name, times in samples.items()}


def _one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated on `device` by one call of `fn`, above what was allocated before."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with (
        _native_stderr_silenced(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's C++ side logs start/stop lines on fd 2 at every use; they are not ours."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
