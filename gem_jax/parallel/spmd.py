"""The SPMD train and eval steps: the whole model inside one shard_map over the five mesh axes.

Placement (`plan`): every parameter's logical axis names (nnx `out_sharding` metadata) go through the
rules table to a PartitionSpec. A dim whose size does not divide over its mesh axes stays whole
(replicated) and the plan says so in `notes`; nothing is padded behind the user's back.

Inside the step, one device (replica r, fsdp f, sparse s, context c, tensor t) holds data shard (r, f, s)
of the batch and:
  dense params  HSDP. Each is all-gathered over the axes that shard it (fsdp) just before use; a dim
                sharded over `tensor` alone is a tensor-parallel slice and stays one (the model's
                column / row parallel layers sum their partial products with a psum over `tensor`).
                JAX transposes that all-gather into a reduce-scatter of the gradient; the block is
                first marked as varying over every other mesh axis, so the reduce-scatter runs first and
                the all-reduce over the other axes then moves 1/fsdp of the bytes: the HSDP order.
  tables        row blocks over `sparse` (2D sparse: replicated over the other axes). Lookups go through
                gem_jax/parallel/sparse.py: ids to their owners and rows back with all-to-all, never the
                table. Gradients reach the owning block; the block is marked varying up front too, so
                the gradients of all lookups of a table add up locally and its sum over the other axes
                is one all-reduce of the block.
  loss          per-task BCE sums and counts are summed over the mesh before dividing, so the loss is that
                of the global batch. Devices along context and tensor hold the same data shard, so the
                sum over them counts it ctx * tensor times and is divided back; with that, every gradient
                is the gradient of the global loss (tests/test_spmd.py compares with one device).
  context       the HSTU layers split their token slots over `context` (gem_jax/model/hstu.py): each
                device projects and attends for its slice, keys / values / outputs are all-gathered;
                everything else runs on the whole layout.
The gradient is taken outside the shard_map and the optimizer update runs in the same jit on the sharded
state (element-wise and per-row, so it partitions without moving parameters).

This module must never gather a table, and never let two meshes compute different functions: the loss
of a mesh run equals the one-device loss up to the order of additions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax import runtime
from gem_jax.data.batch import Batch
from gem_jax.data.spec import FeatureSpec
from gem_jax.model import embeddings as embeddings_lib
from gem_jax.model.heads import loss_from_sums, multitask_sums
from gem_jax.parallel import data as pdata
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import sparse
from gem_jax.parallel.mesh import MeshSpec
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES, Rules, logical_to_spec
from gem_jax.train.step import TrainState, guarded_update
from pallas_kernels import vma


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where every parameter lives on the mesh."""
  mesh: Mesh
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
      if not _is_var(x):
        return P()
      if isinstance(x, embeddings_lib.Table) and str(_path_names(path)[-1]) in self.replicated_tables:
        return P()  # tables and their row-wise optimizer state alike
      return self.spec_for(x.get_metadata().get("out_sharding"), np.shape(x.get_value()))
    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_var)

  def shardings(self, tree) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), self.tree_specs(tree),
                                  is_leaf=lambda x: isinstance(x, P))


def _path_names(path) -> list:
  return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]


TP_AXIS = "tensor"  # a dim sharded over exactly this axis is a tensor-parallel slice (layers.py)
TP_NAMES = ("mlp", "heads")  # the logical axes the model computes on as slices


# Tables at most this large are replicated instead of row sharded: an all-to-all round costs two
# collective latencies per lookup, while a replicated small table costs only its (small) gradient sum.
REPLICATE_TABLE_BYTES = 16 * 1024


def plan(params, mesh: Mesh, mesh_spec: MeshSpec, replicate_table_bytes: int = REPLICATE_TABLE_BYTES) -> Plan:
  """The placement of `params` (nnx.State of nnx.Param, tables included) on `mesh`.

  Tables: row sharded by the rules (default over `sparse`) when the rows divide over those axes and the
  table is larger than `replicate_table_bytes`; otherwise replicated (and said so in `notes`).
  Table-wise placement (a mid-size table whole on one shard group) is not implemented.
  """
  rules = mesh_spec.rules
  notes = []
  table_axes = {}
  probe = Plan(mesh, mesh_spec, rules, {}, ())
  for path, var in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var):
    names = var.get_metadata().get("out_sharding")
    shape = np.shape(var.get_value())
    key = jax.tree_util.keystr(path)
    spec = probe.spec_for(names, shape)
    value = var.get_value()
    if isinstance(var, embeddings_lib.Table) and np.size(value) * value.dtype.itemsize <= replicate_table_bytes:
      table_axes[str(_path_names(path)[-1])] = ()
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
      name = str(_path_names(path)[-1])
      first = spec[0] if len(spec) else None
      table_axes[name] = () if first is None else (first,) if isinstance(first, str) else tuple(first)
  small = sorted(t for t, axes in table_axes.items() if not axes)
  if small:
    notes.append(f"tables {small} are <= {replicate_table_bytes} bytes or do not divide: replicated")
  return Plan(mesh, mesh_spec, rules, table_axes, tuple(notes), frozenset(small))




def _gather_param(x, spec: P, vary_axes: tuple[str, ...], gather: bool = True):
  """The whole parameter from this device's block (HSDP all-gather; see the module docstring).

  The block is first marked varying over every other active axis: JAX then transposes the gather into
  reduce-scatter(block) followed by one all-reduce of the block over the other axes, instead of summing
  the whole gathered gradient over them first (n_s times the bytes)."""
  own = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
  vary = tuple(a for a in vary_axes if a not in own)
  if vary:
    x = jax.lax.pcast(x, vary, to="varying")
  if not gather:
    return x
  for dim, entry in enumerate(spec):
    if entry is not None and entry != TP_AXIS:  # a tensor-parallel slice stays a slice
      x = jax.lax.all_gather(x, entry, axis=dim, tiled=True)
  return x


def _local(batch: Batch) -> Batch:
  return jax.tree_util.tree_map(lambda x: x[0], batch)


def _lookup_fn(p: Plan, capacities: dict[str, int], stats: dict):
  """The distributed lookup installed into the model while the step is traced."""
  active = tuple(a for a in MESH_AXES if p.mesh.shape[a] > 1)

  def fn(table: str, rows_VlxE, ids):
    axes = p.table_axes.get(table, ())
    if not axes:
      return jnp.take(rows_VlxE, jnp.where(ids < 0, rows_VlxE.shape[0], ids), axis=0, mode="fill",
                      fill_value=jnp.nan)
    flat = ids.reshape(-1)
    num_rows = rows_VlxE.shape[0] * math.prod(p.mesh.shape[a] for a in axes)
    # Sized per (table, ids per call) by batch_capacities; an unknown call gets room for all its ids.
    call = f"{table}/{flat.shape[0]}"  # a lookup call: its table and how many ids it reads
    with jax.named_scope(f"table={call}"):  # HLO op names say which call a collective serves
      rows_NxE, st = sparse.sharded_lookup(rows_VlxE, flat, axes=axes, num_rows=num_rows,
                                           capacity=capacities.get(call, flat.shape[0]), uniform_axes=active)
    stats.setdefault(call, []).append(st)
    return rows_NxE.reshape(ids.shape + rows_VlxE.shape[1:])

  return fn


def _tensor_sum(x):
  """psum over the tensor axis, cast back to varying here, so that its transpose (the backward psum of
  the column-parallel input gradient) is named with it in the HLO instead of appearing later unnamed."""
  return jax.lax.pcast(jax.lax.psum(x, TP_AXIS), TP_AXIS, to="varying")


CP_AXIS = "context"


def _context(mesh: Mesh) -> runtime.ContextParallel:
  """Token slices over the context axis (a no-op for the model when the axis has size 1)."""

  def gather(x):
    with jax.named_scope("context_parallel"):
      return jax.lax.all_gather(x, CP_AXIS, axis=0, tiled=True)

  return runtime.ContextParallel(mesh.shape[CP_AXIS], lambda: jax.lax.axis_index(CP_AXIS), gather)


def _forward(graphdef, rest, params, specs, batch: Batch, p: Plan, capacities, stats, dropout_rng=None):
  """The model on this device's data shard; `specs` are the global parameter specs (inside shard_map
  the arrays are local blocks, so specs cannot be recomputed from their shapes).

  dropout_rng (training): one key for the mesh; each device folds in its data shard and tensor slice,
  so no two devices draw the same mask (the context-parallel HSTU path folds in its slice itself). The
  masks therefore depend on the mesh: with dropout on, two meshes train equally well but not on the
  same random numbers (with dropout off, the default, they compute the same function)."""
  if dropout_rng is not None:
    for axis in (*DATA_AXES, TP_AXIS):
      dropout_rng = jax.random.fold_in(dropout_rng, jax.lax.axis_index(axis))
  # Every axis, size 1 included: then all parameters enter the model with one vma type (varying over the
  # whole mesh), which custom_vjp kernels need (their cotangents must match their inputs' types).
  active = MESH_AXES

  def prepare(var, spec):
    if isinstance(var, embeddings_lib.Table):
      # Varying from the start, so that the gradients of all lookups of a table add up locally and its
      # cross-replica sum is one all-reduce at the end (not one per lookup, nor one in the fallback).
      return var.replace(value=_gather_param(var.get_value(), P(spec[0]) if len(spec) else P(), active,
                                             gather=False))
    return var.replace(value=_gather_param(var.get_value(), spec, active))

  full = jax.tree_util.tree_map(prepare, params, specs, is_leaf=_is_var)
  with runtime.using(lookup=_lookup_fn(p, capacities, stats), tensor_sum=_tensor_sum, context=_context(p.mesh)):
    model = nnx.merge(graphdef, full, rest)
    return model(batch, dropout_rng=dropout_rng)


def _total(x, mesh: Mesh):
  """The sum of x over data shards, once per shard. Devices along context / tensor that hold the same
  shard may carry copies (typed varying once a tensor-sharded parameter touched them); psum adds the
  copies too, so they are divided back out. Axes x does not vary over need no sum at all."""
  axes = tuple(a for a in MESH_AXES if a in vma.varying_axes(x))
  if not axes:
    return x
  copies = math.prod(mesh.shape[a] for a in axes if a not in DATA_AXES)
  return jax.lax.psum(x, axes) / copies


def _stat_metrics(stats: dict, p: Plan) -> dict:
  """Per lookup call ("table/N"): which fallback rounds ran anywhere, and per-device means of the counts."""
  out = {}
  for call, items in stats.items():
    unique = sum(s["unique"] for s in items).astype(jnp.float32)
    remote = sum(s["remote_unique"] for s in items).astype(jnp.float32)
    for key in ("overflow", "spill", "second", "last_resort"):
      ran = sum(s[key] for s in items)
      vary = tuple(a for a in MESH_AXES if a in vma.varying_axes(ran))
      out[f"emb/{call}/{key}"] = jax.lax.pmax(ran, vary) if vary else ran
    out[f"emb/{call}/unique"] = _total(unique, p.mesh) / p.num_data_shards
    out[f"emb/{call}/remote_unique"] = _total(remote, p.mesh) / p.num_data_shards
  return out


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, spec: FeatureSpec, p: Plan,
                    state: TrainState, capacities: dict[str, int] | None = None) -> Callable:
  """train_step(state, sharded batch) -> (state, metrics); `state` (placed by `place_state`) is donated.

  capacities: per table, the per-destination slots of the lookup's all-to-all (sparse.capacity_for);
  a lookup that needs more runs an exact fallback round and says so in `emb/<table>/overflow`.
  """
  capacities = dict(capacities or {})
  param_specs = p.tree_specs(state.params)
  batch_spec = P(DATA_AXES)

  def body(params, batch, dropout_rng):
    stats: dict = {}
    logits_BxK = _forward(graphdef, rest, params, param_specs, _local(batch), p, capacities, stats, dropout_rng)
    sum_K, examples, counts_K = multitask_sums(logits_BxK, _local(batch), spec)
    total = lambda x: _total(x, p.mesh)
    loss, per_task = loss_from_sums(total(sum_K), total(examples), total(counts_K), spec)
    return loss, {**per_task, **_stat_metrics(stats, p)}

  sharded_loss = jax.shard_map(body, mesh=p.mesh, in_specs=(param_specs, batch_spec, P()), out_specs=(P(), P()))

  def train_step(state: TrainState, batch: Batch):
    rng, dropout_rng = jax.random.split(state.rng)
    (loss, aux), grads = jax.value_and_grad(sharded_loss, has_aux=True)(state.params, batch, dropout_rng)
    new_state, metrics = guarded_update(optimizer, state, loss, grads, rng)
    return new_state, {**metrics, **aux}

  shardings = state_shardings(state, p)
  return jax.jit(train_step, in_shardings=(shardings, NamedSharding(p.mesh, batch_spec)),
                 out_shardings=(shardings, NamedSharding(p.mesh, P())), donate_argnums=0)


def make_eval_step(graphdef, rest, p: Plan, params, capacities: dict[str, int] | None = None) -> Callable:
  """eval_step(params, sharded batch) -> probs (S, b, K) float32, in the batch's shard order."""
  capacities = dict(capacities or {})
  param_specs = p.tree_specs(params)

  def body(params, batch):
    logits_BxK = _forward(graphdef, rest, params, param_specs, _local(batch), p, capacities, {})
    return jax.nn.sigmoid(logits_BxK.astype(jnp.float32))[None]

  # Every device returns its shard's probabilities (context/tensor copies included); keep one copy each.
  per_device = jax.shard_map(body, mesh=p.mesh, in_specs=(param_specs, P(DATA_AXES)), out_specs=P(MESH_AXES))
  shape = tuple(p.mesh.shape[a] for a in MESH_AXES)

  def eval_step(params, batch):
    probs = per_device(params, batch)
    probs = probs.reshape(shape + probs.shape[1:])[:, :, :, 0, 0]
    return probs.reshape((-1,) + probs.shape[3:])

  # Replicated output: every process of a multi-process run can read all probabilities.
  return jax.jit(eval_step, out_shardings=NamedSharding(p.mesh, P()))


def state_shardings(state: TrainState, p: Plan) -> TrainState:
  replicated = NamedSharding(p.mesh, P())
  return TrainState(p.shardings(state.params), p.shardings(state.opt_state), replicated, replicated)


def place_state(state: TrainState, p: Plan) -> TrainState:
  """The train state laid out on the mesh (from host or one-device arrays)."""
  shardings = state_shardings(state, p)

  def put(x, s):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: place its data, wrap it again
      return jax.random.wrap_key_data(put(jax.random.key_data(x), s), impl=jax.random.key_impl(x))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

  # The shardings tree is a prefix (one NamedSharding per nnx Variable): map inside each subtree.
  return jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda x: put(x, s), sub),
                                shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_capacities(sharded: Batch, spec: FeatureSpec, p: Plan, keep_last: int,
                     slack: float = 1.05, multiple: int = 1) -> dict[str, int]:
  """All-to-all capacities for one host sharded batch, keyed "table/N" by the table and the number of ids
  N of the model's lookup call (the candidate ad id and the history's ad ids read one table with very
  different counts). See sparse.capacity_for."""
  S, b = np.asarray(sharded.domain_B).shape
  calls: dict[str, list[list[np.ndarray]]] = {}

  def add(table, n, ids):
    calls.setdefault(f"{table}/{n}", []).append(ids)

  for f in spec.sparse:
    if f.multi_hot:
      jag = sharded.multi_hot[f.name]
      values, offsets = np.asarray(jag.values), np.asarray(jag.offsets)
      add(f.table, values.shape[1], [np.concatenate([values[s, :offsets[s, -1]], [0]]) for s in range(S)])
    else:
      add(f.table, b, [np.asarray(sharded.sparse[f.name])[s] for s in range(S)])
  values, offsets = np.asarray(sharded.history.values), np.asarray(sharded.history.offsets)
  n_hist = min(values.shape[1], b * keep_last)  # jagged.keep_last's capacity
  for i, field in enumerate(spec.sequence.fields):
    ids = []
    for s in range(S):
      rows = [values[s, max(lo, hi - keep_last):hi, i] for lo, hi in zip(offsets[s, :-1], offsets[s, 1:])]
      ids.append(np.concatenate(rows + [np.zeros(1, values.dtype)]))  # padding slots read id 0
    add(field.table, n_hist, ids)
  out = {}
  for key, per_call in calls.items():
    table = key.rsplit("/", 1)[0]
    axes = p.table_axes.get(table, ())
    if axes:
      owners = math.prod(p.mesh.shape[a] for a in axes)
      out[key] = max(sparse.capacity_for(ids, spec.table(table).vocab_size, owners, slack, multiple)
                     for ids in per_call)
  return out


@dataclasses.dataclass
class MeshRun:
  """What the trainer needs to run on a mesh file: placed state, steps, and host batch -> device batch."""
  plan: Plan
  state: TrainState
  train_step: Callable
  eval_step: Callable
  capacities: dict[str, int]
  pipeline_cfg: Any
  feature_spec: FeatureSpec

  @classmethod
  def create(cls, mesh_spec: MeshSpec, mesh: Mesh, graphdef, rest, optimizer, state: TrainState,
             feature_spec: FeatureSpec, pipeline_cfg, keep_last: int, first_batch: Batch,
             capacity_slack: float = 1.05, capacity_multiple: int = 1) -> "MeshRun":
    mesh_lib.check_batch(mesh_spec, first_batch.batch_size)
    p = plan(state.params, mesh, mesh_spec)
    placed = place_state(state, p)
    sharded = pdata.shard_batch(first_batch, feature_spec, pipeline_cfg, p.num_data_shards)
    caps = batch_capacities(sharded, feature_spec, p, keep_last, capacity_slack, capacity_multiple)
    train_step = make_train_step(graphdef, rest, optimizer, feature_spec, p, placed, caps)
    eval_step = make_eval_step(graphdef, rest, p, placed.params, caps)
    return cls(p, placed, train_step, eval_step, caps, pipeline_cfg, feature_spec)

  def shard(self, batch: Batch) -> Batch:
    return pdata.shard_batch(batch, self.feature_spec, self.pipeline_cfg, self.plan.num_data_shards)

  def place(self, sharded: Batch) -> Batch:
    return pdata.place(sharded, self.plan.mesh, DATA_AXES)

  def device_batch(self, batch: Batch) -> Batch:
    return self.place(self.shard(batch))


def analytic_comm(p: Plan, params) -> dict[str, float]:
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
  specs = p.tree_specs(params)
  out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0, "table_grad_sync": 0.0}
  shape = p.mesh.shape
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var)
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
