"""Process setup before the first jax call: multi-process initialization and CPU device counts.

A run is multi-process when it is given a coordinator (flags of experiments/train.py, or the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables) or launched by a cluster
manager JAX detects itself (SLURM with more than one task, Open MPI). Every process then calls
`jax.distributed.initialize` before touching a device; on CPU, collectives between processes go through
gloo. Each process feeds the data shards of its own devices (gem_jax/data/shards.py places only
addressable shards), and only process 0 writes the run folder's logs (gem_jax/train/loop.py).

On CPU, `cpu_devices` is the device count of *this* process: a 2-process run of an 8-device mesh gives
each process 4. An XLA_FLAGS=--xla_force_host_platform_device_count already in the environment wins.

This module must be used before any jax computation: the backend reads these settings once. It never
starts a single-process run when the flags ask for several processes: incomplete flags raise.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
  coordinator: str | None = None   # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  cpu_devices: int | None = None   # virtual CPU devices of this process (tests, CPU meshes)

  @classmethod
  def from_env(cls, **overrides) -> "ProcessSetup":
    env = os.environ
    num = env.get("JAX_NUM_PROCESSES")
    pid = env.get("JAX_PROCESS_ID")
    base = cls(env.get("JAX_COORDINATOR_ADDRESS"), int(num) if num else None, int(pid) if pid else None)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _cluster_launched() -> bool:
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def check(s: ProcessSetup) -> None:
  """Raises ValueError for flags that do not describe one run (without touching jax)."""
  given = "(--num-processes / --process-id, or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
  if s.coordinator is not None:
    if s.num_processes is None or s.process_id is None:
      raise ValueError(f"coordinator {s.coordinator!r} needs the number of processes and this process's id "
                       f"{given}; got num_processes={s.num_processes}, process_id={s.process_id}")
    host, _, port = s.coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"coordinator must be host:port (the address of process 0), got {s.coordinator!r}")
  elif (s.num_processes is not None or s.process_id is not None) and not _cluster_launched():
    # Without this, every process would silently train the whole run on its own.
    raise ValueError(f"num_processes={s.num_processes}, process_id={s.process_id} given without a "
                     "coordinator (--coordinator host:port, or JAX_COORDINATOR_ADDRESS)")
  if s.num_processes is not None and s.num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {s.num_processes}")
  if s.process_id is not None and s.num_processes is not None and not 0 <= s.process_id < s.num_processes:
    raise ValueError(f"process_id must be in [0, {s.num_processes}), got {s.process_id}")
  if s.cpu_devices is not None and s.cpu_devices < 1:
    raise ValueError(f"cpu_devices must be >= 1, got {s.cpu_devices}")


_DEVICE_COUNT_FLAG = re.compile(r"\s*--xla_force_host_platform_device_count=\S*")


def cpu_device_flags(xla_flags: str | None, cpu_devices: int | None = None) -> str:
  """XLA_FLAGS for a child process: `xla_flags` with its CPU device count replaced by `cpu_devices` (or
  removed, None), every other flag kept (a test session's, or a user's own)."""
  rest = _DEVICE_COUNT_FLAG.sub("", xla_flags or "").strip()
  count = f"--xla_force_host_platform_device_count={cpu_devices}" if cpu_devices is not None else ""
  return " ".join(f for f in (count, rest) if f)


def setup(s: ProcessSetup) -> None:
  """Applies `s`: CPU device count, then jax.distributed.initialize when the run is multi-process."""
  check(s)
  import jax
  forced = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  if s.cpu_devices is not None and forced is None:
    jax.config.update("jax_num_cpu_devices", int(s.cpu_devices))
  elif s.cpu_devices is not None and int(forced.group(1)) != s.cpu_devices:
    # Loud, because a launcher that passes its own XLA_FLAGS to every process silently multiplies the mesh.
    warnings.warn(f"XLA_FLAGS gives this process {forced.group(1)} CPU devices; cpu_devices={s.cpu_devices} "
                  "(--local-devices) is ignored", stacklevel=2)
  if s.coordinator is None and not _cluster_launched():
    return
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _no_persistent_cache_across_cpu_processes()
  # Unset fields (a cluster launch) are detected by JAX from the cluster manager's environment.
  jax.distributed.initialize(coordinator_address=s.coordinator, num_processes=s.num_processes,
                             process_id=s.process_id)


def _no_persistent_cache_across_cpu_processes() -> None:
  """Turns JAX's persistent compilation cache off in a multi-process CPU run. Process 0 alone writes the
  cache and every process reads it, but an XLA:CPU executable with gloo collectives is not the same program
  in another process: on jax 0.10.2, the second 2-process run of `tiny` on cpu_8 with one cache folder
  aborts in its first steps ("gloo ... Received data size doesn't match expected size. Is there a
  distributed collective mismatch"), where the first run, and every run without the cache, trains. Each
  process compiles for itself instead."""
  import jax
  if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    warnings.warn("multi-process CPU run: the persistent compilation cache is turned off (its executables do not "
                  "carry over between processes; gem_jax/parallel/distributed.py)", stacklevel=3)
  jax.config.update("jax_enable_compilation_cache", False)


def _has_accelerator() -> bool:
  # Without touching the backend (that would freeze the settings): a CUDA-enabled jaxlib plugin present.
  import importlib.util
  return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
