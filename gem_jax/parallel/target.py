"""Compile targets: the hardware a step is built for, which need not be the hardware this process runs on.

  target = get("h200")                      # gem_jax/parallel/targets/h200.yaml (or a path to such a file)
  devices = topology_devices(target, spec)  # compile-only devices: the mesh file's nodes x GPUs per node
  of(mesh, spec) -> Target | None           # what a step over `mesh` is built for

A target file holds the facts the GPU compiler needs (compute capability, SMs, shared memory, registers,
L2, device memory) as the CUDA runtime reports them; `gpu_target_config` writes them as XLA's
GpuTargetConfig text, which `jax.experimental.topologies.get_topology_desc` takes to make compile-only
devices. A jax.sharding.Mesh of those devices lowers and compiles like a real one, so the train step of a
1024-GPU mesh file can be compiled on a laptop ("deviceless AOT"): XLA:GPU's own program, memory and
collectives, with no timing.

That needs the CUDA plugin of the installed jax (`pip install -e '.[aot]'`, about 4 GB) and, on a machine
without a GPU, JAX_PLATFORMS=cpu before jax starts its backends (the plugin then skips its driver check and
still registers its compiler). `topology_devices` says so when either is missing.

Kernel, interpret-mode and FP8 choices read `of(mesh, spec)` through the runtime (gem_jax/runtime.py,
installed by parallel/spmd.py around every step trace): a program built for an H200 topology contains the
H200's kernels whatever the host's default backend is. This module must never decide from
jax.default_backend() what a program built for a given mesh contains.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

_DIR = pathlib.Path(__file__).resolve().parent / "targets"
_INT_KEYS = ("sm_count", "threads_per_sm", "registers_per_sm", "registers_per_block", "shared_memory_per_block",
             "shared_memory_per_block_optin", "shared_memory_per_sm", "l2_cache_bytes", "device_memory_bytes")
_KEYS = ("name", "device", "compute_capability", "clock_ghz", "memory_bandwidth") + _INT_KEYS


class TargetError(ValueError):
  """A target file or a compile-only target that cannot work; the message names the file or what to install."""


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str                                  # "gpu" | "cpu" | "tpu": the platform of its devices
  device: str                                    # the device kind, as jax.Device.device_kind reads it
  compute_capability: tuple[int, int] | None = None
  sm_count: int = 0
  clock_ghz: float = 0.0
  threads_per_sm: int = 0
  registers_per_sm: int = 0
  registers_per_block: int = 0
  shared_memory_per_block: int = 0
  shared_memory_per_block_optin: int = 0
  shared_memory_per_sm: int = 0
  l2_cache_bytes: int = 0
  device_memory_bytes: int = 0
  memory_bandwidth: float = 0.0
  compile_only: bool = False                     # built from a target file, not read off a live device

  @property
  def has_mx_tensor_cores(self) -> bool:
    """Block-scaled (MX) FP8 matmuls in hardware: Blackwell (compute capability 10) and later."""
    return self.platform == "gpu" and (self.compute_capability or (0, 0)) >= (10, 0)

  @property
  def has_fp8_tensor_cores(self) -> bool:
    """float8 x float8 matmuls in hardware (Ada 8.9, Hopper 9.0 and later)."""
    return self.platform == "gpu" and (self.compute_capability or (0, 0)) >= (8, 9)

  def gpu_target_config(self) -> str:
    """XLA's GpuTargetConfig (stream_executor/device_description.proto) as text proto."""
    if self.platform != "gpu" or self.compute_capability is None:
      raise TargetError(f"target {self.name!r} is not a GPU with a compute capability")
    major, minor = self.compute_capability
    fields = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": self.shared_memory_per_block,
        "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
        "shared_memory_per_core": self.shared_memory_per_sm, "threads_per_core_limit": self.threads_per_sm,
        "core_count": self.sm_count, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "memory_bandwidth": int(self.memory_bandwidth),
        "l2_cache_size": self.l2_cache_bytes, "clock_rate_ghz": self.clock_ghz,
        "device_memory_size": self.device_memory_bytes, "registers_per_core_limit": self.registers_per_sm,
        "registers_per_block_limit": self.registers_per_block,
    }
    info = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{info}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndevice_description_str: "{self.device}"\n')


CPU = Target(name="cpu", platform="cpu", device="cpu")


def names() -> tuple[str, ...]:
  """The shipped target files' names."""
  return tuple(sorted(p.stem for p in _DIR.glob("*.yaml")))


_REGISTERED: dict[str, Target] = {}


def register(target: Target) -> str:
  """Makes a Target built in code (not read from a file) known to `get` by its name; -> the name."""
  if not target.compile_only or target.platform != "gpu":
    raise TargetError(f"target {target.name!r}: only compile-only GPU targets can be registered")
  _REGISTERED[target.name] = target
  return target.name


def get(name_or_path: str) -> Target:
  """A registered or shipped target by name ("h200"), or a target file by path; every problem names the
  file and field."""
  return _REGISTERED.get(name_or_path) or _load(name_or_path)


@functools.lru_cache(maxsize=None)
def _load(name_or_path: str) -> Target:
  import yaml

  from gem_jax import yamlfile
  path = pathlib.Path(name_or_path)
  if path.suffix not in (".yaml", ".yml"):
    path = _DIR / f"{name_or_path}.yaml"
    if not path.exists():
      raise TargetError(f"unknown target {name_or_path!r}; shipped: {list(names())} (or a path to a target file)")
  try:
    data = yamlfile.load(path.read_text())
  except FileNotFoundError:
    raise TargetError(f"target file {path} does not exist") from None
  except yaml.YAMLError as e:
    raise TargetError(f"{path}: not valid YAML: {e}") from None
  if not isinstance(data, dict):
    raise TargetError(f"{path}: a target file is a mapping with keys {list(_KEYS)}")
  missing, unknown = [k for k in _KEYS if k not in data], sorted(set(data) - set(_KEYS))
  if missing or unknown:
    raise TargetError(f"{path}: " + (f"missing keys {missing}" if missing else f"unknown keys {unknown}"))
  cc = data["compute_capability"]
  if not (isinstance(cc, list) and len(cc) == 2 and all(isinstance(v, int) and v >= 0 for v in cc)):
    raise TargetError(f"{path}: compute_capability must read [major, minor], got {cc!r}")
  for k in _INT_KEYS:
    if isinstance(data[k], bool) or not isinstance(data[k], int) or data[k] < 1:
      raise TargetError(f"{path}: {k} must be a positive integer, got {data[k]!r}")
  for k in ("clock_ghz", "memory_bandwidth"):
    try:
      value = float(data[k])
    except (TypeError, ValueError):
      value = -1.0
    if not value > 0:
      raise TargetError(f"{path}: {k} must be a positive number, got {data[k]!r}")
    data[k] = value
  return Target(platform="gpu", compute_capability=(cc[0], cc[1]), compile_only=True,
                **{k: data[k] for k in _KEYS if k != "compute_capability"})


def topology(spec) -> str:
  """The topology string of a mesh file: slices x hosts x devices per host (one host per node)."""
  return f"1x{spec.num_nodes}x{spec.devices_per_node}"


def topology_devices(target: Target, spec) -> list:
  """Compile-only devices of `target` laid out as the mesh file's nodes (process i holds node i's GPUs)."""
  import jax
  from jax.experimental import topologies
  if target.platform != "gpu":
    raise TargetError(f"target {target.name!r}: compile-only devices are made for GPU targets only")
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=target.gpu_target_config(),
                                        topology=topology(spec))
  except NotImplementedError as e:
    raise TargetError(
        f"cannot make compile-only {target.device} devices: jax {jax.__version__} has no CUDA compiler in this "
        f"process ({e}). Install the CUDA plugin of this jax (pip install -e '.[aot]', or "
        f"pip install 'jax[cuda13]=={jax.__version__}') and, without a GPU, start with JAX_PLATFORMS=cpu "
        f"(now {os.environ.get('JAX_PLATFORMS')!r}).") from None
  devices = list(topo.devices)
  if len(devices) != spec.num_devices:
    raise TargetError(f"topology {topology(spec)} gave {len(devices)} devices, mesh {spec.name!r} needs "
                      f"{spec.num_devices}")
  return devices


def of(mesh, spec=None) -> Target | None:
  """The target of a step over `mesh`: the CPU, a live GPU (its own compute capability), or compile-only
  GPU devices (the target the mesh file names). None for an abstract mesh (no devices: the host decides)."""
  import jax
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return None
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return CPU
  named = getattr(spec, "target", None)
  if named is not None:
    return get(named)
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or cc is None:
    return Target(name=device.device_kind, platform=device.platform, device=device.device_kind)
  major, _, minor = str(cc).partition(".")
  return Target(name=device.device_kind, platform="gpu", device=device.device_kind,
                compute_capability=(int(major), int(minor or 0)))
