"""The parallel runtime: what the model reads from its surroundings while it is traced.

  Runtime(tensor_sum, context, lookup, probe, recorder, count_only, target)
  with runtime.using(lookup=..., tensor_sum=...):   # the SPMD step, a probe or a FLOP count installs
    model(batch)                                    # the model reads runtime.current().<field>

Fields (None: the one-device behaviour):
  tensor_sum  x -> sum of x over the tensor-parallel slices (a psum over `tensor`); row-parallel layers
              and sliced norms add their partial results with it (gem_jax/model/layers.py)
  context     ContextParallel: how many token slices, this device's slice, how to gather all slices; the
              HSTU layer then works on its slice of the tokens (gem_jax/model/hstu.py)
  lookup      (table name, rows as this trace sees them, ids) -> rows: the distributed embedding lookup
              (gem_jax/parallel/sparse.py via the SPMD step); None reads the local table
  probe       Probe: the precision probe's interception of every Dense site (gem_jax/precision/policy.py)
  recorder    an object with record(what, **facts), told about every lookup call, attention call and row
              truncation as it is traced; what FLOP counts and lookup capacities are derived from
  count_only  the trace is only counted, never run (gem_jax/observe/flops.py): attention calls return
              zeros of their output's shape instead of tracing a kernel
  target      the hardware the traced program is built for (gem_jax/parallel/target.py Target: platform,
              compute capability), read by kernel, interpret-mode and FP8 choices through `platform()` and
              `compute_target()`; None: the host's default backend (outside a step)

This is the only ContextVar in gem_jax. Model code reads it and never installs one; whoever installs one
does so around a trace and restores the previous runtime afterwards (`using`). Imports only the standard
library, so every package may read it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  size: int                          # token slices
  index: Callable[[], Any]           # () -> this device's slice index (traced int)
  all_gather: Callable[[Any], Any]   # local slice (S x ...) -> every slice concatenated (size * S x ...)


@dataclasses.dataclass(frozen=True)
class Probe:
  """Every Dense site stores its input in `inputs[site]` and adds `taps[site]` (when given) to its output;
  `swap = (recipe, select)` replaces a site's output by its output under `recipe` where select[site];
  `recipes` {site: recipe} overrides the recipe a site was built with."""
  inputs: dict
  taps: dict
  swap: tuple | None = None
  recipes: dict | None = None


@dataclasses.dataclass(frozen=True)
class Runtime:
  tensor_sum: Callable | None = None
  context: ContextParallel | None = None
  lookup: Callable | None = None
  probe: Probe | None = None
  recorder: Any = None
  count_only: bool = False
  target: Any = None


_RUNTIME: contextvars.ContextVar[Runtime] = contextvars.ContextVar("gem_jax_runtime", default=Runtime())


def current() -> Runtime:
  return _RUNTIME.get()


@contextlib.contextmanager
def using(**fields) -> Iterator[Runtime]:
  """Inside the block the runtime is the current one with `fields` replaced."""
  token = _RUNTIME.set(dataclasses.replace(_RUNTIME.get(), **fields))
  try:
    yield _RUNTIME.get()
  finally:
    _RUNTIME.reset(token)


def record(what: str, **facts) -> None:
  """Tells the installed recorder (if any) about one traced call, e.g. record("lookup", table=..., ids=...)."""
  recorder = _RUNTIME.get().recorder
  if recorder is not None:
    recorder.record(what, **facts)


def platform() -> str:
  """"gpu", "cpu" or "tpu": the platform the current trace is built for (the installed target's, else the
  host's default backend)."""
  target = _RUNTIME.get().target
  if target is not None:
    return target.platform
  import jax
  return jax.default_backend()


def compute_target() -> Any:
  """The installed target, or None outside a step (then `platform()` is the host's default backend)."""
  return _RUNTIME.get().target
