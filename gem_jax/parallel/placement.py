"""Where every parameter of a run lives on the mesh: logical axis names -> PartitionSpecs, and the state laid
out accordingly.

`plan`: every parameter's logical axis names (nnx `out_sharding` metadata) go through the rules table to a
PartitionSpec. A dim whose size does not divide over its mesh axes stays whole (replicated) and the plan
says so in `notes`; nothing is padded behind the user's back. Tables are row sharded over the rules' axes
(default `sparse`) or, when small or indivisible, replicated. `analytic_comm` is the parameter traffic a
placement implies (the simulator and the mesh sweep compare it with the compiled HLO).

The mesh may be abstract (jax.sharding.AbstractMesh: shapes only, for the simulator and planner); only
`place_state` needs real devices. This module never moves a table, and never decides anything from a
parameter's name (only its logical axes and its nnx type).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.model import embeddings as embeddings_lib
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.mesh import MeshSpec
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES, Rules, logical_to_spec


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where every parameter lives on the mesh."""
  mesh: Any                               # jax.sharding.Mesh, or an AbstractMesh (shapes only)
  spec: MeshSpec
  rules: Rules
  table_axes: dict[str, tuple[str, ...]]  # table name -> mesh axes sharding its rows; () = replicated
  notes: tuple[str, ...]                  # placement decisions a user should know about
  replicated_tables: frozenset = frozenset()

  @property
  def num_data_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in DATA_AXES)

  def spec_for(self, names, shape) -> P:
    """PartitionSpec for an array with logical `names`; dims that do not divide stay whole."""
    if names is None or len(names) != len(shape):
      return P()
    out = []
    for dim, entry in zip(shape, logical_to_spec(names, self.rules)):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      size = math.prod(self.mesh.shape[a] for a in axes)
      out.append(entry if size > 1 and dim % size == 0 else None)
    return P(*out)

  def tree_specs(self, tree) -> Any:
    """PartitionSpecs (a pytree prefix of `tree`) for params, optimizer state, or anything holding nnx
    Variables; plain arrays (step counters) are replicated."""
    def one(path, x):
      if not is_variable(x):
        return P()
      if isinstance(x, embeddings_lib.Table) and str(path_names(path)[-1]) in self.replicated_tables:
        return P()  # tables and their row-wise optimizer state alike
      return self.spec_for(x.get_metadata().get("out_sharding"), np.shape(x.get_value()))
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_variable)

  def shardings(self, tree) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.tree_specs(tree),
                                  is_leaf=lambda x: isinstance(x, P))


def path_names(path) -> list:
  return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]


TP_AXIS = "tensor"  # a dim sharded over exactly this axis is a tensor-parallel slice (layers.py)
TP_NAMES = ("mlp", "heads")  # the logical axes the model computes on as slices


@dataclasses.dataclass(frozen=True)
class Part:
  """One parameter dim the model computes on as a tensor-parallel slice when its rule puts it on `tensor`:
  `path` in the model, its logical `names`, the `dim` and its `size`; `group` is the module of its column /
  row parallel pair (the parameters of one pair must all be cut, or all stay whole)."""
  path: str
  names: tuple[str | None, ...]
  dim: int
  size: int
  group: str


def tensor_parallel_parts(params) -> tuple[Part, ...]:
  """Every dim of `params` (the built or abstract model's nnx.Param state) whose logical axis is one of
  TP_NAMES, read off the parameters' own metadata. A pair lives inside one module: a parameter of a layer
  (a Dense or LayerNorm: kernel, bias, scale) belongs to the module holding that layer, a direct parameter
  (HSTU's rel_bias) to its own module."""
  out = []
  for path, var in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_variable):
    names = tuple(var.get_metadata().get("out_sharding") or ())
    parts = [str(n) for n in path_names(path)]
    owner = parts[:-2] if parts[-1] in ("kernel", "bias", "scale") else parts[:-1]
    for dim, name in enumerate(names):
      if name in TP_NAMES:
        out.append(Part(".".join(parts), names, dim, int(np.shape(var.get_value())[dim]), ".".join(owner)))
  return tuple(out)


def tensor_slices(part: Part, spec: MeshSpec) -> int:
  """How many slices the step leaves `part` cut into: the tensor size when its rule entry is exactly
  `tensor` and the size divides (Placement.spec_for), else 1 (whole, or gathered back before use)."""
  entry = logical_to_spec(part.names, spec.rules)[part.dim]
  t = spec.shape[TP_AXIS]
  return t if entry == TP_AXIS and t > 1 and part.size % t == 0 else 1


# Tables at most this large are replicated instead of row sharded: an all-to-all round costs two
# collective latencies per lookup, while a replicated small table costs only its (small) gradient sum.
REPLICATE_TABLE_BYTES = 16 * 1024


def of(params, mesh, mesh_spec: MeshSpec, replicate_table_bytes: int = REPLICATE_TABLE_BYTES) -> Placement:
  """The placement of `params` (nnx.State of nnx.Param, tables included) on `mesh`.

  Tables: row sharded by the rules (default over `sparse`) when the rows divide over those axes and the
  table is larger than `replicate_table_bytes`; otherwise replicated (and said so in `notes`).
  Table-wise placement (a mid-size table whole on one shard group) is not implemented.
  """
  rules = mesh_spec.rules
  notes = []
  table_axes = {}
  probe = Placement(mesh, mesh_spec, rules, {}, ())
  for path, var in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_variable):
    names = var.get_metadata().get("out_sharding")
    shape = np.shape(var.get_value())
    key = jax.tree_util.keystr(path)
    spec = probe.spec_for(names, shape)
    value = var.get_value()
    if isinstance(var, embeddings_lib.Table) and np.size(value) * value.dtype.itemsize <= replicate_table_bytes:
      table_axes[str(path_names(path)[-1])] = ()
      continue
    wanted = logical_to_spec(names, rules) if names is not None and len(names) == len(shape) else P()
    for dim, entry in enumerate(spec):
      if entry == TP_AXIS and names[dim] not in TP_NAMES:
        raise mesh_lib.MeshFileError(
            f"{mesh_spec.name}: rules put logical axis {names[dim]!r} ({key}, dim {dim}) on {TP_AXIS!r}, which "
            f"holds tensor-parallel slices the model consumes as such; only {TP_NAMES} may map there")
    for dim, (got, want) in enumerate(zip(tuple(spec) + (None,) * len(shape), tuple(wanted))):
      if want is not None and got is None and math.prod(
          mesh.shape[a] for a in ((want,) if isinstance(want, str) else want)) > 1:
        notes.append(f"{key}: dim {dim} (size {shape[dim]}) does not divide over {want}; kept whole")
    if isinstance(var, embeddings_lib.Table):
      name = str(path_names(path)[-1])
      first = spec[0] if len(spec) else None
      table_axes[name] = () if first is None else (first,) if isinstance(first, str) else tuple(first)
  small = sorted(t for t, axes in table_axes.items() if not axes)
  if small:
    notes.append(f"tables {small} are <= {replicate_table_bytes} bytes or do not divide: replicated")
  return Placement(mesh, mesh_spec, rules, table_axes, tuple(notes), frozenset(small))


def state_shardings(state, placed: Placement):
  replicated = NamedSharding(placed.mesh, P())
  return dataclasses.replace(state, params=placed.shardings(state.params), opt_state=placed.shardings(state.opt_state),
                             step=replicated, rng=replicated)


def place_state(state, placed: Placement):
  """The train state (a dataclass of params, opt_state, step, rng: gem_jax/run/step.py) laid out on the
  mesh, from host or one-device arrays."""
  shardings = state_shardings(state, placed)

  def put(x, s):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
      # Placed already (a restored state; in a multi-process run not every part is this host's). An array
      # laid out alike under another sharding (one device's SingleDeviceSharding) takes `s` itself, without a
      # copy: jit keys its cache on the argument's sharding, so the step's first call would otherwise trace
      # and compile a second program for the state the step returns.
      return x if x.sharding == s or not x.is_fully_addressable else jax.device_put(x, s)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: place its data, wrap it again
      return jax.random.wrap_key_data(put(jax.random.key_data(x), s), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.is_fully_addressable and s.is_fully_addressable:
      return jax.device_put(x, s)  # device to device: no copy through the host (a 3 GB table took seconds)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

  # The shardings tree is a prefix (one NamedSharding per nnx Variable): map inside each subtree.
  return jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda x: put(x, s), sub),
                                shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))


def analytic_comm(placed: Placement, params) -> dict[str, float]:
  """Bytes per device per train step that the placement implies for parameters (not lookups).

  For a dense parameter of W bytes sharded over axes of total size n_s (its block is W / n_s):
    all-gather     W (n_s - 1) / n_s      the forward gather of its blocks
    reduce-scatter W (n_s - 1) / n_s      the transposed gather on its gradient
    all-reduce     2 (W / n_s)(n_r - 1) / n_r   over the n_r devices of every other mesh axis of size
                                          > 1 (data axes it is replicated on, and context / tensor,
                                          whose devices hold copies): a ring all-reduce of the block
  A row-sharded table only has the all-reduce of its block's gradient over the axes it is replicated
  on ("table_grad_sync"); a replicated table all-reduces all of it. The embedding all-to-alls are
  measured separately against the ideal ids-and-rows volume (sparse.ideal_bytes).
  """
  specs = placed.tree_specs(params)
  out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "table_grad_sync": 0.0}
  shape = placed.mesh.shape
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_variable)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  for (path, var), spec in zip(leaves, spec_leaves):
    value = var.get_value()
    w = float(np.size(value) * value.dtype.itemsize)
    own = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    n_s = math.prod(shape[a] for a in own)
    n_r = math.prod(shape[a] for a in MESH_AXES if a not in own)
    reduce = 2.0 * (w / n_s) * (n_r - 1) / n_r
    # A tensor-parallel slice is gathered over the other axes only: W / n_t bytes, n_g = n_s / n_t ways.
    n_t = shape[TP_AXIS] if TP_AXIS in tuple(spec) else 1
    n_g = n_s // n_t
    if isinstance(var, embeddings_lib.Table):
      out["table_grad_sync"] += reduce
    else:
      out["all-gather"] += (w / n_t) * (n_g - 1) / n_g
      out["reduce-scatter"] += (w / n_t) * (n_g - 1) / n_g
      out["all-reduce"] += reduce
  out["dense_total"] = out["all-gather"] + out["reduce-scatter"] + out["all-reduce"]
  return out
