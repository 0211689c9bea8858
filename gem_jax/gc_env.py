"""Python's garbage collector in a process that traces and compiles: GEM_JAX_GC_THRESHOLDS="g0,g1,g2".

Tracing and lowering a train step allocates millions of short-lived Python objects (tracers, jaxpr
equations, MLIR operations) while the process keeps many long-lived ones (jit caches, jaxprs, compiled
executables). At CPython's default thresholds (700, 10, 10) the collector runs thousands of times per trace
and walks the survivors again and again; none of it frees much, since reference counting frees nearly
everything. With the variable set, importing gem_jax freezes what is alive (the imported modules move to
the permanent generation) and sets the thresholds (gc.set_threshold's three numbers; fewer keep the rest).

The test suite sets "100000,50,1000" for itself and every process it starts (tests/conftest.py): the whole
suite on 2 cores took 826 s against 967 s without it, user CPU 1500 s against 1784 s. One training run
gains little (`small`, 3 steps, default XLA flags: 50-52 user-seconds with it, 52-54 without), and a long
run allocates little per step, so it keeps its memory either way. Unset: the defaults.
"""

from __future__ import annotations

import atexit
import gc
import os

VAR = "GEM_JAX_GC_THRESHOLDS"


def apply(environ=os.environ) -> tuple[int, ...] | None:
  """Freezes the collector's current objects and sets its thresholds from $GEM_JAX_GC_THRESHOLDS; returns
  the thresholds set, or None when the variable is unset or empty."""
  text = environ.get(VAR, "").strip()
  if not text:
    return None
  try:
    values = tuple(int(v) for v in text.split(","))
  except ValueError:
    values = ()
  if not 1 <= len(values) <= 3 or any(v < 0 for v in values):
    raise ValueError(f"{VAR}={text!r}: expected one to three non-negative integers separated by commas "
                     "(gc.set_threshold's generation thresholds), e.g. 100000,50,1000")
  gc.freeze()
  # Back to collectable at exit, so that extension modules' leak checks (nanobind's, in triton and jaxlib)
  # find their objects freed rather than frozen.
  atexit.register(gc.unfreeze)
  gc.set_threshold(*values)
  return values
