"""The C heap of a process that runs XLA:CPU programs: freed buffers stay in the process for the next step.

An XLA:CPU step allocates its buffers when it starts and frees them when it ends. With glibc's defaults a
buffer above the mmap threshold (128 KiB, rising to at most 32 MiB as larger ones are freed) is a mapping
of its own: freeing it unmaps it, and the next step maps it again and faults it in page by page, 4 KiB at a
time, every step; free memory at the top of the heap beyond the trim threshold goes back to the kernel and
faults in again the same way. Three settings keep the memory instead:
  M_MMAP_MAX 0            no allocation is a mapping of its own (the main heap grows with brk)
  M_TRIM_THRESHOLD never  free memory at the top of a heap stays there (a process keeps its peak heap)
  M_TOP_PAD 256 MiB       a heap grows 256 MiB beyond each request, so it does not grow in small steps
A 96 MiB buffer allocated and freed in a loop faults in every page each time without them and none with them
(tests/test_malloc_env.py).

Which thread allocates matters as much. jax runs a CPU program on a worker thread by default (async
dispatch), and glibc gives a thread other than the main one heaps of at most 64 MiB (an "arena"): anything
larger is mapped on its own whatever the settings, and unmapped when freed. So the settings also turn
jax's async dispatch off (`jax_cpu_enable_async_dispatch`, a jax flag that no environment variable sets):
a program on one local device then runs on the thread that called it, which in this project's scripts is
the main thread, whose heap the settings keep. A program over several local devices (a mesh of virtual
CPU devices) is dispatched asynchronously either way; a multi-process run with one device per process
runs its steps, collectives included, on the calling thread, in step with its peers as before.
GEM_JAX_ASYNC_DISPATCH=1 keeps jax's async dispatch. For this, importing gem_jax imports jax (after
gem_jax/xla_env.py has decided the variables jax reads when it is imported), and the flag counts only
until jax starts its CPU backend: a process that started a backend before importing gem_jax keeps the
dispatch it started with.
Measured side by side (2026-12-07, quiet, one-off scripts timing `gem_jax.bench.hstu_stack` steps, medians
of 4-8): stack M's dense `reference` 1,375-1,383 ms a step and 9-13 page faults (2 MiB pages) against
1,860-2,100 ms and 1,480 with async dispatch (its temporaries are 2.3 GB; the 1 GiB trim threshold the
settings had before gave them back at every step even from the main heap); stack M's `xla` 191-195
against 211-244 ms. The main job (`experiments/train.py --config small --set
train.steps=300`, alternating processes) 2,012 and 1,880 examples/s against 1,990 and 1,891 with async
dispatch kept, the same NE.

Measured on this project's 2-core machine (2026-12-05, quiet, side by side in one script each):
- Sports' next-item step (`bench_seqrec_step.py --dataset sports --variant preset --steps 20`): 36-40 ms
  against 50-52 ms at the commit before (717,000 minor page faults per process against 218,000 with the
  trim threshold and pad); ML-1M's step, whose arithmetic is ten times larger, is unchanged (340-360 ms);
- `bench_hstu_stack.py --stacks S M --impls xla` against the trim threshold and pad alone: S 1.22-1.25x
  tokens/s; M 1.05x;
- the main job (`ab_trees.compare`, 300 steps of `small`, one run each): 1,359 examples/s against 1,362.
Not kept: M_ARENA_MAX 1 (one heap for every thread), which kept the worker threads' large buffers too
(stack M 1.23x, 62,000 page faults a step gone), but made the main job's threads wait on its lock: 0.91x
examples/s. Synchronous dispatch keeps them without the lock.

Transparent huge pages. This machine's kernel gives a 2 MiB page only where a program asks for one
(/sys/kernel/mm/transparent_hugepage/enabled: madvise), and glibc asks for its heap only when its tunable
glibc.malloc.hugetlb=1 is in GLIBC_TUNABLES at the start of the process; it cannot be set later. So
`apply` adds it to os.environ for every process this one starts (the test suite's workers, a benchmark's
rounds, a multi-process run), and `relaunch_with_huge_pages()`, the first thing the main scripts
(experiments/train.py, experiments/seqrec.py) do, starts the script again with it when this process began
without it. Measured side by side, quiet (2026-12-05): stack M 224-227 ms a step against 251-304 ms, 128,000
page faults per process against 655,000, stack S within noise; the main job (`small`, 300 steps) 1,592 and
1,716 examples/s against 1,210 and 1,433 (1.20-1.32x, both orders).

The cost is resident memory: a process keeps its peak heap plus the pad. GEM_JAX_MALLOC=0 leaves glibc's
defaults. A C library without mallopt, or not Linux: nothing is changed. Applied when gem_jax is imported
(gem_jax/__init__.py); mallopt governs later allocations, so it needs no particular order against jax.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

VAR = "GEM_JAX_MALLOC"
TUNABLES, HUGE_PAGES = "GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"
_STARTED_WITH = os.environ.get(TUNABLES, "")   # read before apply() adds to it
# glibc's <malloc.h> parameters and the values set. mallopt takes an int and glibc stores the trim threshold
# as a size_t: -1 is the largest threshold there is, which no heap reaches.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
NEVER = -1
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER), (M_TOP_PAD, 256 << 20))
KEEP_ASYNC = "GEM_JAX_ASYNC_DISPATCH"   # "1": jax keeps its async CPU dispatch


def apply(environ=os.environ) -> str:
  """Sets SETTINGS on glibc's allocator; returns "set", "off" (GEM_JAX_MALLOC=0) or "unavailable" (not Linux,
  or a C library without mallopt)."""
  if environ.get(VAR, "").strip() == "0":
    return "off"
  if not sys.platform.startswith("linux"):
    return "unavailable"
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return "unavailable"
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # mallopt returns 1 on success; C libraries that only stub it return 0.
  if not all([mallopt(param, value) == 1 for param, value in SETTINGS]):
    return "unavailable"
  if HUGE_PAGES not in environ.get(TUNABLES, ""):   # for the processes this one starts
    environ[TUNABLES] = ":".join(t for t in (environ.get(TUNABLES, ""), HUGE_PAGES) if t)
  if environ.get(KEEP_ASYNC, "").strip() != "1":
    _run_on_the_calling_thread()
  return "set"


def _run_on_the_calling_thread() -> None:
  """jax's CPU programs on the thread that calls them (module docstring); a jax without the option keeps its
  own dispatch."""
  import jax
  try:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  except (AttributeError, KeyError):
    pass


def without_huge_pages(environ=os.environ) -> dict:
  """A copy of `environ` without the huge-page tunable (other tunables kept): the environment a process gets
  when a user starts it, for side-by-side tools that start another checkout's code and must let that
  checkout's own entry point decide (an older one does not ask for huge pages)."""
  env = dict(environ)
  rest = [t for t in env.get(TUNABLES, "").split(":") if t and t != HUGE_PAGES]
  if rest:
    env[TUNABLES] = ":".join(rest)
  else:
    env.pop(TUNABLES, None)
  return env


def started_with_huge_pages() -> bool:
  return HUGE_PAGES in _STARTED_WITH


def relaunch_with_huge_pages(environ=os.environ) -> None:
  """Starts this script again (same interpreter, same command line: sys.orig_argv) with glibc's huge-page
  tunable, when this process began without it and the settings are on; otherwise returns. Call it first
  thing in a script's main block, before the work that would be lost. Only where `apply` set the allocator
  (it exports the tunable then): not with GEM_JAX_MALLOC=0, not on another C library or system."""
  if started_with_huge_pages() or HUGE_PAGES not in environ.get(TUNABLES, ""):
    return
  env = dict(environ)
  env[TUNABLES] = ":".join(t for t in (_STARTED_WITH, HUGE_PAGES) if t)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)
