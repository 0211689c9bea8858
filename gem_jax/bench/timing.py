"""Timing helpers shared by the benchmarks: medians of blocked calls, the best measured GEMM peak over
sizes, and the peak FLOP/s a device is judged against."""

from __future__ import annotations

import statistics
import time

import jax

# Datasheet peaks (dense, no sparsity) by device kind, the same numbers as the mesh files' hardware blocks.
DATASHEET_PEAKS = {"H200": {"bf16": 9.89e14, "fp8": 1.979e15}, "H100": {"bf16": 9.89e14, "fp8": 1.979e15}}


def median_ms(fn, *args, reps: int) -> float:
  """Median milliseconds of fn(*args) over `reps` blocked calls, after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def interleaved_medians(calls: list, *, reps: int, deadline: float | None = None) -> list:
  """Median milliseconds of each (fn, args) in `calls`, their reps interleaved: one warm-up (compile) call
  each, then `reps` rounds that time every call once, in reverse order every other round, so a machine that
  speeds up or slows down during the run moves every call's median alike instead of favouring the ones timed
  first. An entry whose warm-up raises gets the exception instead of a median; one whose warm-up starts after
  `deadline` (time.time()) gets None."""
  out: list = [None] * len(calls)
  live = []
  for i, (fn, args) in enumerate(calls):
    if deadline is not None and time.time() > deadline:
      continue
    try:
      jax.block_until_ready(fn(*args))
      live.append(i)
    except Exception as e:  # noqa: BLE001 - one call that fails is its own result
      out[i] = e
  times = {i: [] for i in live}
  for r in range(reps):
    for i in (live if r % 2 == 0 else live[::-1]):
      fn, args = calls[i]
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[i].append(time.perf_counter() - t)
  for i in live:
    out[i] = statistics.median(times[i]) * 1e3
  return out


def best_gemm_peak(dtype, sizes: tuple[int, ...], reps: int = 5) -> tuple[float, int]:
  """(FLOP/s, n): the fastest of n x n x n GEMMs over `sizes` (observe/report.measure_gemm_peak, f32
  accumulation). One size alone can sit in a bad spot of the BLAS's blocking or the caches, and then "% of
  the GEMM peak" moves with the size as much as with the kernel being judged."""
  from gem_jax.observe.report import measure_gemm_peak
  return max((measure_gemm_peak(dtype, n, reps), n) for n in sizes)


def datasheet_peak(kind: str = "bf16") -> float | None:
  """The datasheet peak of this process's first device ("bf16" or "fp8"), None when it is not known."""
  device_kind = jax.devices()[0].device_kind
  for name, peaks in DATASHEET_PEAKS.items():
    if name in device_kind:
      return peaks[kind]
  return None
