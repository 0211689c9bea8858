"""Process setup before the first jax call: multi-process initialization and CPU device counts.

A run is multi-process when it is given a coordinator (flags of experiments/train.py, or the
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables) or launched by a cluster
manager JAX detects itself (SLURM with more than one task, Open MPI, Kubernetes with JAX's env). Every
process then calls `jax.distributed.initialize` before touching a device; on CPU, collectives between
processes go through gloo. Each process feeds the data shards of its own devices
(gem_jax/parallel/data.py places only addressable shards).

This module must be used before any jax computation: the backend reads these settings once.
"""

from __future__ import annotations

import dataclasses
import os


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


def setup(s: ProcessSetup) -> None:
  """Applies `s`: CPU device count, then jax.distributed.initialize when the run is multi-process."""
  import jax
  if s.cpu_devices is not None:
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
      pass  # the environment already fixed it (tests, users who know what they want)
    else:
      jax.config.update("jax_num_cpu_devices", int(s.cpu_devices))
  explicit = s.coordinator is not None
  if explicit and (s.num_processes is None or s.process_id is None):
    raise ValueError("a coordinator address needs --num-processes and --process-id (or JAX_NUM_PROCESSES "
                     "and JAX_PROCESS_ID)")
  if not explicit and not _cluster_launched():
    return
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or not _has_accelerator():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if explicit:
    jax.distributed.initialize(s.coordinator, s.num_processes, s.process_id)
  else:
    jax.distributed.initialize()


def _has_accelerator() -> bool:
  # Without touching the backend (that would freeze the settings): a CUDA-enabled jaxlib plugin present.
  import importlib.util
  return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
