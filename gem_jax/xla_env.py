"""XLA settings that must be in place before jax starts its backends; `apply()` runs when gem_jax is imported.

Float atomics for scatter-add on NVIDIA GPUs. jaxlib 0.10.2 to 0.11.0 compile a float32 scatter-add to a
compare-and-swap loop (`atom.global.cas.b32` retried until no other thread wrote in between) instead of
the native `atom.global.add.f32` (jax-ml/jax#38806, openxla/xla#46225; fixed in 0.11.1). Under index
contention, which is what an embedding gradient is (many lookups of one hot row), the loop was measured
450-2000x slower in those reports. Rows of 30 or 128 floats use vector atomics either way; a
one-float-per-row update (the row-wise Adagrad accumulator) takes the loop. The LLVM option
`-nvptx-allow-ftz-atomics` lets the NVPTX backend use the native instruction again (it flushes subnormal
results to zero, as the pre-regression code did). XLA reads XLA_FLAGS once, when its backends start, and
a per-compile option cannot carry it, so it goes into the environment here: on an affected jaxlib with a
CUDA plugin installed, before any backend exists. `experiments/compile_for.py` reads the compiled PTX
and reports `scatter_atomics` ("native" or "cas"), so the effect is checked, not assumed.

GEM_JAX_FTZ_ATOMICS=0 turns the guard off (to see the loop come back).

A CUDA plugin on a machine without an NVIDIA driver (the `aot` extra, installed to compile for GPUs
without one) fails its start-up check with a traceback on every start before jax falls back to the CPU;
`cpu_without_driver` sets JAX_PLATFORMS=cpu there first (unless JAX_PLATFORMS is set), which is also what
the plugin needs to register its compiler for deviceless compiles.

This module must never import jax before deciding: importing it is what the flags have to precede.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import warnings

FTZ_ATOMICS = "-nvptx-allow-ftz-atomics"
_EXTRA = "--xla_backend_extra_options="
AFFECTED = ((0, 10, 2), (0, 11, 0))   # jaxlib versions with the CAS loop, both ends included


def _version(text: str) -> tuple[int, ...]:
  parts = []
  for piece in text.split(".")[:3]:
    digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts)


def affected(jaxlib_version: str) -> bool:
  return AFFECTED[0] <= _version(jaxlib_version) <= AFFECTED[1]


def cuda_plugin_installed() -> bool:
  return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13)) \
      if importlib.util.find_spec("jax_plugins") is not None else False


def with_ftz_atomics(xla_flags: str) -> str:
  """XLA_FLAGS with the option added (merged into an existing --xla_backend_extra_options list)."""
  flags = xla_flags.split()
  for i, flag in enumerate(flags):
    if flag.startswith(_EXTRA):
      options = [o for o in flag[len(_EXTRA):].split(",") if o]
      if FTZ_ATOMICS not in options:
        flags[i] = _EXTRA + ",".join(options + [FTZ_ATOMICS])
      return " ".join(flags)
  return " ".join(flags + [_EXTRA + FTZ_ATOMICS])


def without_ftz_atomics(xla_flags: str) -> str:
  """XLA_FLAGS with the option taken out (the flag dropped if it carried nothing else)."""
  out = []
  for flag in xla_flags.split():
    if flag.startswith(_EXTRA):
      options = [o for o in flag[len(_EXTRA):].split(",") if o and o != FTZ_ATOMICS]
      if not options:
        continue
      flag = _EXTRA + ",".join(options)
    out.append(flag)
  return " ".join(out)


def has_ftz_atomics(xla_flags: str) -> bool:
  return any(f.startswith(_EXTRA) and FTZ_ATOMICS in f[len(_EXTRA):].split(",") for f in xla_flags.split())


def _backends_started() -> bool:
  if "jax" not in sys.modules:
    return False
  try:   # jax has no public query for this; without it, assume they started (the safe answer)
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return True


def apply(environ=os.environ) -> str:
  """Puts the scatter-add workaround into XLA_FLAGS where it is needed; -> what it did: "not needed",
  "off" (GEM_JAX_FTZ_ATOMICS=0), "present", "set", or "too late" (backends already running on the CPU: a
  deviceless GPU compile in this process keeps the CAS loop). Raises if a GPU backend already runs
  without it."""
  if environ.get("GEM_JAX_FTZ_ATOMICS", "1") == "0":
    return "off"
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return "not needed"
  if not (affected(version) and cuda_plugin_installed()):
    return "not needed"
  flags = environ.get("XLA_FLAGS", "")
  if has_ftz_atomics(flags):
    return "present"
  if not _backends_started():
    environ["XLA_FLAGS"] = with_ftz_atomics(flags)
    return "set"
  import jax
  message = (f"jaxlib {version} compiles float32 scatter-adds on NVIDIA GPUs to a compare-and-swap loop "
             f"(jax-ml/jax#38806), and jax started its backends before gem_jax could add the workaround. Import "
             f"gem_jax before using jax, or start Python with XLA_FLAGS='{with_ftz_atomics(flags)}'.")
  if jax.default_backend() == "gpu":
    raise RuntimeError(message)
  warnings.warn(message + " GPU programs compiled in this process keep the loop.", RuntimeWarning, stacklevel=3)
  return "too late"


def has_nvidia_driver() -> bool:
  return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def cpu_without_driver(environ=os.environ) -> bool:
  """Sets JAX_PLATFORMS=cpu where a CUDA plugin is installed but no NVIDIA driver is (module docstring);
  -> whether it did."""
  if "JAX_PLATFORMS" in environ or not cuda_plugin_installed() or has_nvidia_driver() or _backends_started():
    return False
  environ["JAX_PLATFORMS"] = "cpu"
  return True
