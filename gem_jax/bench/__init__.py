"""Benchmarks and the prepared GPU check; experiments/bench_*.py and experiments/gpu_check.py call these.

  timing.py        medians of timed calls, a measured GEMM peak, the peak a device is judged against
  attention.py     jagged attention impls side by side with padded baselines (dense softmax, cuDNN flash)
  fp8.py           bf16 vs FP8 GEMMs (every recipe and impl), the quantized matmul's train cost, step time
  gpu_check.py     the one-command GPU check: sections in subprocesses under a time budget, JSON + markdown
  gpu_sections.py  the sections themselves (environment, correctness, kernel and FP8 speed, train step)

Every speed number here is a median of timed runs after a warm-up call, and every kernel result is also
checked against its reference in the same run, so a fast wrong kernel cannot win a table.
"""
