"""Mesh files (meshes/*.yaml) -> a validated MeshSpec -> a jax.sharding.Mesh laid out on the topology.

A mesh file names the size of each of the five axes (replica, fsdp, sparse, context, tensor), how many
devices a node holds, how much of each axis lives inside a node, and the hardware. Everything is checked
before anything is compiled; an error names the field or axis that is wrong.

Schema (meshes/README.md has the prose):

  name: h200_8
  description: one line on what it is for
  axes: {replica: 1, fsdp: 4, sparse: 2, context: 1, tensor: 1}
  devices_per_node: 8
  intra_node: {fsdp: 4, sparse: 2}     # per axis, the part of its size laid out inside one node
  hardware: {device, peak_bf16_flops, peak_fp8_flops, hbm_bytes, hbm_bandwidth,
             intra_node_bandwidth, inter_node_bandwidth,
             host_link_bandwidth}                          # per device, bytes and bytes/s
  rules: {logical_name: mesh axis | [mesh axes] | null}    # optional overrides of parallel/rules.py
                                                            # (parameter axes only: the batch always
                                                            # splits over the data axes)
  target: h200                         # optional: the compile target (gem_jax/parallel/targets/, or a
                                       # path): what experiments/compile_for.py compiles for without a GPU

Device order: the product of the intra_node sizes must equal devices_per_node. Devices are grouped into
nodes of consecutive devices (on CPU these are virtual nodes; on multi-process GPU runs
mesh_utils.create_hybrid_device_mesh groups them by process), and mesh axis a, of size
inter_a x intra_a, takes index inter_index * intra_a + intra_index: neighbours along an intra-node axis
share a node, so collectives over that axis stay on the fast links.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import numpy as np

from gem_jax.parallel.rules import DATA_AXES, DEFAULT_RULES, MESH_AXES, Rules

HARDWARE_KEYS = ("device", "peak_bf16_flops", "peak_fp8_flops", "hbm_bytes", "hbm_bandwidth",
                 "intra_node_bandwidth", "inter_node_bandwidth", "host_link_bandwidth")
TOP_KEYS = ("name", "description", "axes", "devices_per_node", "intra_node", "hardware", "rules", "target")


class MeshFileError(ValueError):
  """A mesh file or mesh request that cannot work; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Hardware:
  device: str
  peak_bf16_flops: float | None     # per device; None: measure (CPU)
  peak_fp8_flops: float | None
  hbm_bytes: float | None
  hbm_bandwidth: float | None
  intra_node_bandwidth: float | None  # bytes/s per device over the node's links
  inter_node_bandwidth: float | None  # bytes/s per device across nodes
  host_link_bandwidth: float | None = None  # bytes/s per device, each way, between host and device memory


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  name: str
  description: str
  axes: tuple[tuple[str, int], ...]        # in MESH_AXES order
  devices_per_node: int
  intra_node: tuple[tuple[str, int], ...]  # in MESH_AXES order, 1 where the axis spans nodes only
  hardware: Hardware
  rules: Rules = DEFAULT_RULES
  target: str | None = None                # a compile target's name or file (gem_jax/parallel/target.py)

  @property
  def shape(self) -> dict[str, int]:
    return dict(self.axes)

  @property
  def num_devices(self) -> int:
    return math.prod(size for _, size in self.axes)

  @property
  def num_nodes(self) -> int:
    return self.num_devices // self.devices_per_node

  @property
  def data_shards(self) -> int:
    """How many ways the batch is split (every data axis)."""
    return math.prod(self.shape[a] for a in DATA_AXES)


def _positive_int(value, where: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise MeshFileError(f"{where} must be a positive integer, got {value!r}")
  return value


def _number_or_none(value, where: str):
  if value is None:
    return None
  if isinstance(value, str):  # YAML 1.1 reads 9.89e14 (no dot before the sign) as a string
    try:
      value = float(value)
    except ValueError:
      raise MeshFileError(f"{where} must be a positive number or null, got {value!r}") from None
  # NaN and .inf would turn MFU and bandwidth times into NaN or 0 in every report.
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise MeshFileError(f"{where} must be a positive number or null, got {value!r}")
  return float(value)


# Logical axes of activations whose placement the SPMD step fixes itself (the batch over every data axis):
# a mesh file's rule for them would be read by nothing.
FIXED_RULES = ("batch", "tokens")


def _rules(data, source: str) -> Rules:
  """DEFAULT_RULES with the file's `rules` overrides applied; each override is checked."""
  given = data.get("rules") or {}
  if not isinstance(given, dict):
    raise MeshFileError(f"{source}: rules must map logical axes to a mesh axis, a list of them or null, "
                        f"got {type(given).__name__}")
  rules = dict(DEFAULT_RULES)
  for logical, target in given.items():
    if logical not in rules:
      raise MeshFileError(f"{source}: rules.{logical}: unknown logical axis; known: {sorted(rules)}")
    if logical in FIXED_RULES:
      raise MeshFileError(f"{source}: rules.{logical}: the SPMD step always splits {logical} over the data axes "
                          f"{DATA_AXES}; a rule for it would be ignored")
    if target is not None and not isinstance(target, (str, list)):
      raise MeshFileError(f"{source}: rules.{logical} must be a mesh axis, a list of mesh axes or null, got "
                          f"{target!r}")
    targets = [target] if isinstance(target, str) else list(target or [])
    for t in targets:
      if t not in MESH_AXES:
        raise MeshFileError(f"{source}: rules.{logical}: {t!r} is not a mesh axis {MESH_AXES}")
    if len(set(targets)) != len(targets):
      raise MeshFileError(f"{source}: rules.{logical}: {targets} names a mesh axis twice (a sharding uses each "
                          "axis at most once)")
    if logical == "table_rows" and set(targets) - set(DATA_AXES):
      raise MeshFileError(f"{source}: rules.table_rows: {sorted(set(targets) - set(DATA_AXES))} hold copies of every "
                          f"lookup (the sparse engine sums row gradients over them before sending rows to their "
                          f"owners, so owners along them would count each gradient once per copy); table rows "
                          f"shard over the data axes {DATA_AXES} only")
    rules[logical] = None if not targets else targets[0] if len(targets) == 1 else tuple(targets)
  return tuple(rules.items())


def parse(data: Any, source: str = "<mesh>") -> MeshSpec:
  """MeshSpec from a parsed mesh file (a dict); every problem raises MeshFileError naming `source`."""
  if not isinstance(data, dict):
    raise MeshFileError(f"{source}: a mesh file is a mapping with keys {TOP_KEYS}, got {type(data).__name__}")
  unknown = sorted(set(data) - set(TOP_KEYS))
  if unknown:
    raise MeshFileError(f"{source}: unknown keys {unknown}; known: {list(TOP_KEYS)}")
  for key in ("name", "axes", "devices_per_node", "intra_node", "hardware"):
    if key not in data:
      raise MeshFileError(f"{source}: missing key {key!r}")
  if not isinstance(data["name"], str) or not data["name"]:
    raise MeshFileError(f"{source}: name must be a non-empty string, got {data['name']!r}")
  if not isinstance(data.get("description", ""), str):
    raise MeshFileError(f"{source}: description must be a string, got {data['description']!r}")
  axes = data["axes"]
  if not isinstance(axes, dict):
    raise MeshFileError(f"{source}: axes must map each of {MESH_AXES} to a size")
  bad = sorted(set(axes) - set(MESH_AXES))
  if bad:
    raise MeshFileError(f"{source}: unknown mesh axis {bad[0]!r} in axes; the axes are {MESH_AXES}")
  missing = [a for a in MESH_AXES if a not in axes]
  if missing:
    raise MeshFileError(f"{source}: axes is missing mesh axis {missing[0]!r} (give all of {MESH_AXES})")
  sizes = {a: _positive_int(axes[a], f"{source}: axes.{a}") for a in MESH_AXES}
  per_node = _positive_int(data["devices_per_node"], f"{source}: devices_per_node")
  intra = data["intra_node"] or {}
  if not isinstance(intra, dict):
    raise MeshFileError(f"{source}: intra_node must map mesh axes to the part of their size inside a node")
  bad = sorted(set(intra) - set(MESH_AXES))
  if bad:
    raise MeshFileError(f"{source}: unknown mesh axis {bad[0]!r} in intra_node")
  intra_sizes = {a: _positive_int(intra.get(a, 1), f"{source}: intra_node.{a}") for a in MESH_AXES}
  for a in MESH_AXES:
    if sizes[a] % intra_sizes[a]:
      raise MeshFileError(f"{source}: intra_node.{a} = {intra_sizes[a]} does not divide axes.{a} = {sizes[a]}")
  if math.prod(intra_sizes.values()) != per_node:
    raise MeshFileError(f"{source}: the intra_node sizes multiply to {math.prod(intra_sizes.values())}, but "
                        f"devices_per_node is {per_node}: a node must hold exactly its intra-node block")
  total = math.prod(sizes.values())
  if total % per_node:
    raise MeshFileError(f"{source}: {total} devices do not fill whole nodes of {per_node}")
  hw = data["hardware"]
  if not isinstance(hw, dict):
    raise MeshFileError(f"{source}: hardware must be a mapping with keys {HARDWARE_KEYS}")
  bad = sorted(set(hw) - set(HARDWARE_KEYS))
  if bad:
    raise MeshFileError(f"{source}: unknown hardware key {bad[0]!r}; known: {list(HARDWARE_KEYS)}")
  if not isinstance(hw.get("device"), str):
    raise MeshFileError(f"{source}: hardware.device must name the device, got {hw.get('device')!r}")
  hardware = Hardware(hw["device"], *(_number_or_none(hw.get(k), f"{source}: hardware.{k}")
                                      for k in HARDWARE_KEYS[1:]))
  return MeshSpec(name=data["name"], description=data.get("description", ""),
                  axes=tuple((a, sizes[a]) for a in MESH_AXES), devices_per_node=per_node,
                  intra_node=tuple((a, intra_sizes[a]) for a in MESH_AXES), hardware=hardware,
                  rules=_rules(data, source), target=_target(data.get("target"), source))


def _target(name, source: str) -> str | None:
  """The file's compile target, checked now: a relative path is read from the mesh file's folder."""
  if name is None:
    return None
  from gem_jax.parallel import target as target_lib
  if not isinstance(name, str) or not name:
    raise MeshFileError(f"{source}: target must name a target ({list(target_lib.names())}) or a target file")
  if name.endswith((".yaml", ".yml")) and not os.path.isabs(name):
    name = os.path.join(os.path.dirname(source), name)
  try:
    target_lib.get(name)
  except target_lib.TargetError as e:
    raise MeshFileError(f"{source}: target: {e}") from None
  return name


def load(path: str | os.PathLike) -> MeshSpec:
  import yaml

  from gem_jax import yamlfile
  try:
    with open(path) as f:
      data = yamlfile.load(f)
  except FileNotFoundError:
    raise MeshFileError(f"mesh file {path} does not exist") from None
  except yaml.YAMLError as e:
    raise MeshFileError(f"{path}: not valid YAML: {e}") from None
  return parse(data, str(path))


def check_devices(spec: MeshSpec, num_devices: int) -> None:
  """A mesh file runs on all the run's devices, which must be exactly as many as its axes multiply to."""
  if num_devices == spec.num_devices:
    return
  import jax
  raise MeshFileError(
      f"mesh {spec.name!r} needs {spec.num_devices} devices "
      f"({' x '.join(f'{a}={n}' for a, n in spec.axes)}), this run has {num_devices} "
      f"({jax.default_backend()}; {jax.process_count()} process(es), {jax.local_device_count()} in this "
      f"one); on CPU give each process {spec.num_devices // jax.process_count()} (experiments/train.py "
      "--local-devices, or XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported)")


def device_grid(spec: MeshSpec, devices: Sequence) -> np.ndarray:
  """The devices arranged as the mesh's 5-D array (see the module docstring for the order)."""
  if len(devices) != spec.num_devices:
    raise MeshFileError(f"mesh {spec.name!r} needs {spec.num_devices} devices "
                        f"({' x '.join(f'{a}={s}' for a, s in spec.axes)}), but {len(devices)} are available")
  intra = dict(spec.intra_node)
  inter_shape = [s // intra[a] for a, s in spec.axes]
  intra_shape = [intra[a] for a, _ in spec.axes]
  ordered = sorted(devices, key=lambda d: (getattr(d, "process_index", 0), d.id))
  flat = np.empty(len(ordered), dtype=object)
  flat[:] = ordered  # element-wise: np.array would unpack tuple-like devices
  grid = flat.reshape(inter_shape + intra_shape)
  n = len(MESH_AXES)
  # (inter_0..inter_4, intra_0..intra_4) -> (inter_0, intra_0, inter_1, intra_1, ...) -> axis sizes.
  grid = grid.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
  return grid.reshape([s for _, s in spec.axes])


def build_mesh(spec: MeshSpec, devices: Sequence | None = None):
  """jax.sharding.Mesh for `spec` over `devices` (default: all devices)."""
  import jax
  from jax.sharding import Mesh
  devices = list(jax.devices() if devices is None else devices)
  if jax.process_count() > 1 and jax.default_backend() == "gpu" and devices == list(jax.devices()):
    from jax.experimental import mesh_utils
    intra = dict(spec.intra_node)
    grid = mesh_utils.create_hybrid_device_mesh(
        [intra[a] for a, _ in spec.axes], [s // intra[a] for a, s in spec.axes], devices)
    return Mesh(grid, MESH_AXES)
  return Mesh(device_grid(spec, devices), MESH_AXES)


def build_abstract_mesh(spec: MeshSpec):
  """jax.sharding.AbstractMesh of `spec`: axis names and sizes without devices (the simulator, the planner
  and abstract builds of meshes larger than this host)."""
  import jax
  return jax.sharding.AbstractMesh(tuple(size for _, size in spec.axes), MESH_AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * len(spec.axes))


def check_batch(spec: MeshSpec, batch_size: int) -> None:
  """The batch must split evenly over every data axis (data.pipeline.batch_size; shards of equal rows)."""
  if batch_size % spec.data_shards:
    shards = " x ".join(f"{a}={spec.shape[a]}" for a in DATA_AXES)
    raise MeshFileError(f"batch size {batch_size} does not divide over the data axes of mesh {spec.name!r} "
                        f"({shards} = {spec.data_shards} shards): set data.pipeline.batch_size to a multiple "
                        f"of {spec.data_shards}")


# A run without a mesh file runs on this: every axis of size 1, the peak measured in the run (meshes/cpu_1.yaml
# says the same in YAML).
ONE_DEVICE = MeshSpec(name="one_device", description="one device (no mesh file)",
                      axes=tuple((a, 1) for a in MESH_AXES), devices_per_node=1,
                      intra_node=tuple((a, 1) for a in MESH_AXES),
                      hardware=Hardware("one device", None, None, None, None, None, None))
