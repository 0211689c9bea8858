"""Cluster simulator: per-device comm bytes, step time, MFU and memory of a config on a mesh file, without
compiling or allocating anything (the model is built with nnx.eval_shape), for 8 to 8192 devices.

  simulate(cfg, mesh_spec, batch_size=None, mean_history=None, capacity_slack=1.05, overlap=0.9,
           efficiency=0.5, shapes=None) -> dict
  model_shapes(cfg) -> ModelShapes     the abstract params and optimizer state (nnx.eval_shape, ~2 s on
                                       `large`): build once and pass as `shapes` to time many meshes
  retime(sim, mesh_spec, overlap, efficiency) -> the "time" of a result on a mesh of the same axis sizes
                                       with another intra-node placement or hardware (no re-simulation)
  host_tier(...)                       host tables (train.host_tables): caches, stores, host link bytes

Bytes per device per train step, in the key format of gem_jax/observe/hlo.summarize ("by_kind",
"by_axis" keyed "fsdp", "replica,sparse", ...; traffic model of hlo.py: ring all-gather / reduce-scatter
(n-1)/n of the full buffer, all-reduce 2(n-1)/n, all-to-all (n-1)/n), from four parts:
  params           the HSDP placement of parallel/spmd.py (`plan`, `analytic_comm`): forward all-gather and
                   backward reduce-scatter over the axes sharding a parameter, all-reduce of the block
                   over every other axis > 1; tables all-reduce their row block's gradient.
  embedding        per lookup call of a row-sharded table (parallel/sparse.py round 1): a [P, C] int32 id
                   buffer and a [P, C, E] row buffer forward, the [P, C, E] row cotangents backward. The
                   fallback rounds (lax.cond, rarely run) are not counted.
  embedding_update with train.embedding_update = "sparse" (gem_jax/run/table_update.py) in place of the
                   tables' gradient all-reduce and the lookups' backward: per table, an all-reduce of C_u
                   summed f32 rows over context x tensor, the (id, row) all-to-all of C_o slots per owner,
                   and the all-gather over the table's copies of C_r received rows (C_u rows for a
                   replicated table, or its V x E all-reduce where table_update.dense_sync says so). The
                   slots are lookups.sync_capacities' on the sample shards, extrapolated as C below when
                   the mesh has more data shards than samples. Spill rounds are not counted.
  tensor_parallel  every row-parallel layer psums its f32 output over `tensor` (HSTU output T x D and its
                   norm's two T x 1 statistics, Wukong's FM MLP output b x n_f E, the heads' towers b x R x
                   G); the backward has one all-reduce of the same size.
  context_parallel each HSTU layer all-gathers k, v and its output over `context` (reduce-scatter back).

Capacity estimate C (ids per destination of one lookup call; gem_jax/parallel/lookups.py measures it on
the first batch of a run): the lookup calls and the ids each reads on a data shard of b rows are read off
the model's trace on sample batches from the source (ModelShapes.lookups: 8 sample shards), so they follow
the data, not a law of the synthetic stream. With at most 8 data shards, C is what the run itself would
compute on those shards (sparse.capacity_for: slack x the largest count of distinct ids one shard sends
one owner). With more, the largest of P x S buckets is extrapolated: the sample's D distinct ids per shard
spread over P owners, mu = D / P per destination, and Poisson fluctuations put the largest bucket near
mu + sqrt(2 ln(P S) mu); C = slack x that, at most the ids of the call.

Times (None with null hardware, e.g. the CPU mesh files): a collective over a set of axes uses the
intra-node bandwidth if every one of its axes lies wholly inside a node (size == intra_node), else the
inter-node bandwidth; collectives run one after another (times add). Compute = 3 x model FLOPs
(observe/flops.py at the source's sequence lengths) / devices / (peak_bf16_flops x efficiency). Overlap
model: parameter collectives (gathers, reduce-scatters, gradient all-reduces) hide behind compute up to
`overlap` x compute; lookups and the tensor / context-parallel sums sit on the critical path (exposed).
  step = compute + exposed + max(0, params_comm - overlap x compute);  MFU = model FLOPs / (step x peak x N)

Memory (estimates, bytes per device): params and optimizer state are exact shard sizes of the
placement; gradients = param shards; gathered = the whole dense params (a tensor slice each) that the
HSDP gather keeps alive for the backward; activations = what a layer keeps for its backward, as XLA:GPU's
buffer assignment of compiled train steps showed it (HSTU per token slot: the uvqk projection's float32
output, which SiLU's backward reads, q, k, v and the output as the attention kernel gets them, and _D_WIDE
model-width tensors; Wukong: ~3 inputs and outputs plus the MLP hidden; embedding rows), no attention
matrices (the kernels keep them on chip); embedding_update (sparse engine) = the largest table's largest
merge: its (id, row) input slots, f32, twice the rows they sum into (the zeros and the sums) and twice the
rows of the merge before it (table_sync: the slots are static, set by the ids read, not the rows touched). total = params + optimizer + gradients + the larger
of the backward's (gathered + activations) and the update's working set, which never overlap. Compiled
memory (experiments/compile_for.py) is the check: within 10% on base / h200_8 and large / h200_1024_5d.

This module must never compile, allocate a parameter, or touch a device.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import jax
import numpy as np
from flax import nnx

from gem_jax.observe import flops as flops_lib
from gem_jax.parallel import lookups, placement, sparse
from gem_jax.parallel.mesh import MeshSpec, check_batch
from gem_jax.parallel.rules import MESH_AXES

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
# Read off XLA:GPU's buffer assignment at the peak of a compiled train step (experiments/compile_for.py;
# 2026-12-03, base on h200_8, jax 0.10.2):
_D_WIDE = 10       # model-width (T x D) tensors in the compute dtype an HSTU layer keeps live across the
                   # backward: its input, norms, u * norm(a), output and residual, and the masked / broadcast
                   # copies XLA materializes of them (base: ~10 per layer)
_SAMPLES = 8192  # history lengths sampled from the source to average FLOPs and token counts over
_LOOKUP_SAMPLE_SHARDS = 8  # sample data shards of b rows whose lookup ids size the capacities


# ------------------------------------------------------------------------------------------ helpers

def _key(axes, shape) -> str:
  """hlo.summarize's axis key: the axes of size > 1, in mesh order."""
  return ",".join(a for a in MESH_AXES if a in set(axes) and shape[a] > 1)


def history_lengths(shapes: ModelShapes, mean_history: float | None, max_len: int) -> np.ndarray:
  """Sequence lengths of a sample of the source's rows, or all equal to `mean_history` when given."""
  if mean_history is not None:
    if not 0 <= mean_history <= max_len:
      raise ValueError(f"mean_history={mean_history} must lie in [0, max_len={max_len}]")
    return np.full(_SAMPLES, float(mean_history))
  return shapes.lengths()


def _capacity(uniq: list[np.ndarray], ids: int, num_rows: int, owners: int, shards: int, slack: float) -> int:
  """C of one lookup call on a mesh of `shards` data shards from the distinct valid ids of each sample shard
  (`ids` per shard in all; module docstring)."""
  if shards <= len(uniq):
    return sparse.capacity_for(uniq[:shards], num_rows, owners, slack, multiple=1)
  mu = float(np.mean([u.size for u in uniq])) / owners
  worst = mu + math.sqrt(2.0 * math.log(max(owners * shards, 2)) * mu)
  return sparse.round_capacity(worst, slack, at_most=ids)


def _bucket(tokens: float, batch: int, pipeline, spec) -> int:
  """The history capacity of a data shard of `batch` rows holding `tokens` (pipeline's bucket rule)."""
  import dataclasses
  caps = dataclasses.replace(pipeline, batch_size=batch).history_buckets(spec)
  return next((c for c in caps if c >= tokens), caps[-1])


class _Comm:
  """Collects (part, kind, axes key, bytes) and totals them hlo.summarize-style."""

  def __init__(self, shape):
    self.shape, self.items = shape, []

  def add(self, part, kind, axes, moved):
    key = _key(axes, self.shape)
    if key and moved > 0:
      self.items.append((part, kind, key, float(moved)))

  def ring(self, part, kind, axes, full_bytes):
    """A collective over `axes` on a buffer of `full_bytes` (result for gathers, operand otherwise)."""
    n = math.prod(self.shape[a] for a in axes)
    if n > 1:
      self.add(part, kind, axes, (2.0 if kind == "all-reduce" else 1.0) * full_bytes * (n - 1) / n)

  def summary(self, part=None) -> dict:
    by_kind, by_axis = {}, {}
    for p, kind, key, b in self.items:
      if part is None or p == part:
        by_kind[kind] = by_kind.get(kind, 0.0) + b
        by_axis[key] = by_axis.get(key, 0.0) + b
    return {"by_kind": by_kind, "by_axis": by_axis, "total": float(sum(by_kind.values()))}


def nbytes(x) -> float:
  return float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _shard_bytes(tree, specs, shape) -> float:
  total = 0.0
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=placement.is_variable)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  for leaf, spec in zip(leaves, spec_leaves):
    for arr in jax.tree_util.tree_leaves(leaf.get_value() if placement.is_variable(leaf) else leaf):
      own = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
      total += nbytes(arr) / math.prod(shape[a] for a in own)
  return total


# ---------------------------------------------------------------------------------------- simulate

@dataclasses.dataclass(eq=False)
class ModelShapes:
  """The abstract run of a config (build(cfg, abstract=True)): everything simulate() needs that no mesh
  changes, and what it reads off the model and the source once. Building it is most of a simulate() call,
  so a caller timing many layouts of one config builds it once (`model_shapes`) and passes it as `shapes`."""
  cfg: Any
  run: Any
  _flops: Any = None
  _lengths: Any = None
  _lookups: dict = dataclasses.field(default_factory=dict)
  _uniques: dict = dataclasses.field(default_factory=dict)
  _memos: dict = dataclasses.field(default_factory=dict)

  @property
  def params(self):
    return self.run.state.params

  @property
  def opt_state(self):
    return self.run.state.opt_state

  def check(self, cfg) -> None:
    if (self.cfg.model, self.cfg.data, self.cfg.train, self.cfg.task) != (cfg.model, cfg.data, cfg.train, cfg.task):
      raise ValueError(f"simulate: `shapes` were built for another model, data or train config than config "
                       f"{cfg.name!r}; build them with model_shapes(cfg)")

  def flop_model(self):
    """The run's FLOP model (observe/flops.py, traced once)."""
    if self._flops is None:
      self._flops = flops_lib.FlopModel(self.run)
    return self._flops

  def lengths(self) -> np.ndarray:
    """Sequence lengths of a sample of the source's training rows (source.stats)."""
    if self._lengths is None:
      self._lengths = np.asarray(self.run.source.stats(_SAMPLES)["lengths"], np.float64)
    return self._lengths

  def lookups(self, rows: int) -> list[tuple[str, np.ndarray]]:
    """[(call key, ids of each sample shard: S x N)] of the model's lookups on data shards of `rows` rows:
    read off the model's trace (parallel/lookups.py) on sample batches from the source."""
    if rows not in self._lookups:
      source = self.run.source
      sample = source.shard(source.sample(rows * _LOOKUP_SAMPLE_SHARDS, index=0), _LOOKUP_SAMPLE_SHARDS)
      self._lookups[rows] = self.run.lookups.ids(sample)
    return self._lookups[rows]

  def uniques(self, rows: int) -> tuple[list, dict]:
    """([(call key, distinct valid ids of each sample shard, ids per shard)] in lookups(rows) order,
    {table: (distinct valid ids of each sample shard over all its calls, ids per shard)}), computed once
    per row count: every layout the planner simulates reads the same sample."""
    if rows not in self._uniques:
      spec = self.run.source.spec
      valid = lambda x, v: np.unique(x[(x >= 0) & (x < v)])
      calls, by_table = [], {}
      for key, ids_SxN in self.lookups(rows):
        table = lookups.table_of(key)
        v = spec.table(table).vocab_size
        ids_SxN = np.asarray(ids_SxN).reshape(len(ids_SxN), -1)
        calls.append((key, [valid(row, v) for row in ids_SxN], ids_SxN.shape[1]))
        by_table.setdefault(table, []).append(ids_SxN)
      tables = {}
      for table, parts in by_table.items():
        ids_SxN = np.concatenate(parts, axis=1)
        tables[table] = ([valid(row, spec.table(table).vocab_size) for row in ids_SxN], ids_SxN.shape[1])
      self._uniques[rows] = (calls, tables)
    return self._uniques[rows]

  def memo(self, rows: int) -> dict:
    """A cache for results derived from the sample shards of `rows` rows (table_sync's unions)."""
    return self._memos.setdefault(rows, {})


def model_shapes(cfg) -> ModelShapes:
  """The abstract run of `cfg` (nothing allocated; a mesh is given to simulate() separately)."""
  from gem_jax.run.build import build
  return ModelShapes(cfg, build(dataclasses.replace(cfg, mesh=None), abstract=True))


def simulate(cfg, mesh_spec: MeshSpec, *, batch_size: int | None = None, mean_history: float | None = None,
             capacity_slack: float = 1.05, overlap: float = 0.9, efficiency: float = 0.5,
             shapes: ModelShapes | None = None) -> dict:
  """Per-device, per-step prediction for `cfg` (gem_jax.config.Config) on `mesh_spec` (module docstring).

  batch_size: global batch (default cfg.data.pipeline.batch_size); must divide over the data axes.
  mean_history: use this history length for every row instead of the synthetic stream's law.
  overlap: the fraction of compute time parameter collectives may hide behind (0..1).
  efficiency: the fraction of peak bf16 FLOPs the compute reaches.
  shapes: model_shapes(cfg), when the caller already has it (same results, without the ~2 s rebuild).
  """
  _check_time_args(overlap, efficiency)
  if capacity_slack < 1:
    raise ValueError(f"capacity_slack must be >= 1, got {capacity_slack}")
  spec, model_cfg, pipeline = cfg.data.spec, cfg.model, cfg.data.pipeline
  batch = int(batch_size or pipeline.batch_size)
  check_batch(mesh_spec, batch)
  shape = mesh_spec.shape
  shards, t, cp = mesh_spec.data_shards, shape["tensor"], shape["context"]
  b = batch // shards

  if shapes is None:
    shapes = model_shapes(cfg)
  shapes.check(cfg)
  params = shapes.params
  p = placement.of(params, types.SimpleNamespace(shape=shape), mesh_spec)
  comm = _Comm(shape)
  sparse_engine = cfg.train.embedding_update == "sparse"

  # Parameters: per leaf for the axis split; totals must equal placement.analytic_comm.
  specs = p.tree_specs(params)
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  for var, ps in zip(jax.tree_util.tree_leaves(params, is_leaf=placement.is_variable), spec_leaves):
    w = nbytes(var.get_value())
    own = {a for e in ps if e is not None for a in ((e,) if isinstance(e, str) else e)}
    n_s = math.prod(shape[a] for a in own)
    rest = [a for a in MESH_AXES if a not in own]
    if not (sparse_engine and isinstance(var, placement.embeddings_lib.Table)):
      comm.ring("params", "all-reduce", rest, w / n_s)
    if not isinstance(var, placement.embeddings_lib.Table):
      n_t = t if placement.TP_AXIS in own else 1
      gather = [a for a in own if a != placement.TP_AXIS]
      comm.ring("params", "all-gather", gather, w / n_t)
      comm.ring("params", "reduce-scatter", gather, w / n_t)
  analytic = placement.analytic_comm(p, params)
  mine = comm.summary("params")
  if not math.isclose(mine["total"], analytic["dense_total"] + (0.0 if sparse_engine else analytic["table_grad_sync"]),
                      rel_tol=1e-6):
    raise AssertionError(f"simulate: parameter bytes {mine['total']} disagree with placement.analytic_comm {analytic}")

  # History token counts of one data shard.
  lengths = history_lengths(shapes, mean_history, spec.sequence.max_len)
  keep = model_cfg.hstu.keep_last
  cap = _bucket(b * float(lengths.mean()), b, pipeline, spec)

  # Embedding all-to-all, round 1 of every lookup call of a row-sharded table: the calls and their distinct
  # ids read off the model on sample shards of b rows; the worst of P x S buckets is near mu + sqrt(2 ln(PS) mu).
  capacities = {}
  call_uniques, table_uniques = shapes.uniques(b)
  for key, uniq, n in call_uniques:
    table = lookups.table_of(key)
    axes = p.table_axes.get(table, ())
    if axes:
      owners = math.prod(shape[a] for a in axes)
      c = _capacity(uniq, n, spec.table(table).vocab_size, owners, shards, capacity_slack)
      capacities[key] = max(c, capacities.get(key, 0))
  n_hist = min(cap, b * keep[0])
  for key, c in capacities.items():
    table = lookups.table_of(key)
    axes = p.table_axes[table]
    owners = math.prod(shape[a] for a in axes)
    row = owners * c * spec.table(table).dim * np.dtype(model_cfg.params_dtype).itemsize
    for _ in range(sum(1 for k, _, _ in call_uniques if k == key)):
      comm.ring("embedding_forward", "all-to-all", axes, owners * c * 4 + row)
      if not sparse_engine:
        comm.ring("embedding_backward", "all-to-all", axes, row)
  update_bytes = 0.0
  if sparse_engine:
    from gem_jax.observe import table_sync
    syncs, merges = table_sync.sync_collectives(table_uniques, p.table_axes, spec, shape, shards, capacity_slack,
                                                _capacity, shapes.memo(b))
    for kind, axes, full in syncs:
      comm.ring("embedding_update", kind, axes, full)
    # The tables are updated one after another; the largest merge sets the update's peak.
    # A merge holds its input slots (id and row), the zeros it scatter-adds them into and their sums; the
    # merge before it (the owner's received rows, and their slice to the block) is still live.
    update_bytes = float(max(((slots * (spec.table(table).dim + 1) + 2 * (min(slots, rows + 1) + held)
                               * spec.table(table).dim) * 4 for table, (slots, rows, held) in merges.items()),
                             default=0))

  # Tensor- and context-parallel activations, per HSTU / Wukong layer and the heads.
  h = model_cfg.hstu
  act = np.dtype(model_cfg.dtype).itemsize
  d, e, c_tok = model_cfg.model_dim, model_cfg.embed_dim, h.num_contextual
  hdv, uvqk = h.num_heads * h.value_dim, 2 * h.num_heads * (h.value_dim + h.head_dim)
  hstu_tp = t > 1 and hdv % t == 0 and uvqk % t == 0
  hist_cap, rows_per_layer = n_hist, []
  for k in keep:
    hist_cap = min(hist_cap, b * k)
    rows_per_layer.append(c_tok * b + hist_cap + b)
  for rows in rows_per_layer:
    local = -(-rows // cp)  # this device's token slots under context parallelism
    if hstu_tp:
      for _ in range(2):  # forward psum, backward all-reduce
        comm.ring("tensor_parallel", "all-reduce", ["tensor"], local * (d + 2) * 4)
    if cp > 1:
      heads = h.num_heads // t if hstu_tp else h.num_heads
      full = cp * local * (heads * (h.head_dim + h.value_dim) + d) * act
      comm.ring("context_parallel", "all-gather", ["context"], full)
      comm.ring("context_parallel", "reduce-scatter", ["context"], full)
  w = model_cfg.wukong
  tp_b = (model_cfg.num_layers * (w.fm_outputs * e if w.mlp_hidden % t == 0 else 0)
          + (len(spec.domains) * model_cfg.tower_hidden if model_cfg.tower_hidden % t == 0 else 0))
  if t > 1:
    for _ in range(2):
      comm.ring("tensor_parallel", "all-reduce", ["tensor"], b * tp_b * 4)

  # Compute.
  n_dev = mesh_spec.num_devices
  fwd_per_example = shapes.flop_model().forward(np.rint(lengths).astype(np.int64)) / len(lengths)
  step_flops = 3.0 * fwd_per_example * batch
  hw = mesh_spec.hardware

  # Memory per device.
  opt_state = shapes.opt_state
  param_bytes = _shard_bytes(params, specs, shape)
  dense_full = sum(nbytes(v.get_value()) / (t if placement.TP_AXIS in str(ps) else 1)
                   for v, ps in zip(jax.tree_util.tree_leaves(params, is_leaf=placement.is_variable), spec_leaves)
                   if not isinstance(v, placement.embeddings_lib.Table))
  hist_dims = sum(spec.table(fld.table).dim for fld in spec.sequence.fields)
  activations = float(n_hist * hist_dims * 4 + n_hist * d * act)
  tp = t if hstu_tp else 1
  kernel_width = h.num_heads * (2 * h.head_dim + 2 * h.value_dim)  # q, k, v and the output, every head
  for rows in rows_per_layer:
    local = -(-rows // cp)
    activations += local * (4 * uvqk + act * kernel_width) / tp + act * _D_WIDE * rows * d
  f_in = len(spec.sparse) + (1 if spec.dense_dim else 0) + model_cfg.hstu.num_contextual + 1 + model_cfg.num_recent
  activations += model_cfg.num_layers * act * b * (
      3 * f_in * e + 3 * (w.fm_outputs + w.lcb_outputs) * e + f_in * w.fm_rank + 2 * w.mlp_hidden / t)
  # The sparse engine differentiates the rows a batch read, never a table (their sinks are activations).
  dense_params = nnx.split_state(params, placement.embeddings_lib.Table, ...)[1]
  grad_bytes = _shard_bytes(dense_params, p.tree_specs(dense_params), shape) if sparse_engine else param_bytes
  memory = {"params": param_bytes, "optimizer": _shard_bytes(opt_state, p.tree_specs(opt_state), shape),
            "gradients": grad_bytes, "gathered_params": dense_full, "activations": activations,
            "embedding_update": update_bytes}
  # The forward/backward and the table update do not overlap: the activations are gone when the update runs.
  memory["total"] = float(memory["params"] + memory["optimizer"] + grad_bytes
                          + max(dense_full + activations, update_bytes))
  memory["hbm_bytes"] = hw.hbm_bytes
  memory["fits"] = None if hw.hbm_bytes is None else memory["total"] <= hw.hbm_bytes

  summary = comm.summary()
  parts = {name: comm.summary(name) for name in
           ("params", "embedding_forward", "embedding_backward", "embedding_update", "tensor_parallel",
            "context_parallel")}
  out = {
      "mesh": mesh_spec.name, "devices": n_dev, "batch_size": batch, "rows_per_shard": b,
      "embedding_update": cfg.train.embedding_update,
      "mean_history": float(lengths.mean()), "history_capacity": cap,
      "comm": {**summary, "parts": parts, "capacities": capacities,
               "analytic_params": analytic, "placement_notes": list(p.notes)},
      "flops": {"model_flops_per_step": step_flops, "per_device": step_flops / n_dev},
      "memory": memory,
      "time": _times([(part, key, moved) for part, _, key, moved in comm.items], mesh_spec,
                     step_flops / n_dev, overlap, efficiency),
  }
  if cfg.train.host_tables:
    out["host_tables"] = host_tier(cfg, shapes, table_uniques, p.table_axes, mesh_spec)
    out["time"] = _with_host_wait(out["time"], out["host_tables"], hw)
  out["mfu"] = (None if out["time"] is None
                else step_flops / (out["time"]["step_s"] * hw.peak_bf16_flops * n_dev))
  return out


def host_tier(cfg, shapes: ModelShapes, table_uniques: dict, table_axes: dict, mesh_spec: MeshSpec) -> dict:
  """Per host table (gem_jax/run/host_tables.py) of a step on `mesh_spec`: the device cache (already what
  the memory counts: the abstract run's table leaves are its caches), the host store, and the rows each
  device's cache takes in and writes back per step. The misses are a bound: every distinct row a step
  reads missing (a cold cache; no row reused from the step before), with each data shard's distinct rows
  counted apart (no overlap between shards), spread evenly over the owner shards; each miss evicts a row
  whose values go back to the host. A warm cache's hit rate (report.json's host_tables, or
  experiments/bench_cache.py on the ids) scales the bytes down."""
  from gem_jax.run import host_tables as host_lib
  shape, shards = mesh_spec.shape, mesh_spec.data_shards
  leaves = host_lib.host_leaves(shapes.run.state, list(cfg.train.host_tables))
  tables = {}
  for name, xs in leaves.items():
    vocab = cfg.data.spec.table(name).vocab_size
    row_bytes = sum(math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize for x in xs)
    owners = math.prod(shape[a] for a in table_axes.get(name, ()))
    per_owner = host_lib.cache_rows(cfg.train, vocab, owners)
    distinct = min(vocab, shards * float(np.mean([len(u) for u in table_uniques[name][0]])))
    misses = min(float(per_owner), distinct / owners)
    tables[name] = {"rows": vocab, "row_bytes": row_bytes, "owners": owners, "cache_rows_per_owner": per_owner,
                    "device_cache_bytes": per_owner * row_bytes, "host_store_bytes": vocab * row_bytes,
                    "distinct_rows_per_step": distinct, "misses_per_step_per_device": misses,
                    "h2d_bytes_per_step": misses * row_bytes, "d2h_bytes_per_step": misses * row_bytes}
  return {"tables": tables, "bound": "every distinct row of a step a miss, each evicting a dirty row",
          "h2d_bytes_per_step": sum(t["h2d_bytes_per_step"] for t in tables.values()),
          "d2h_bytes_per_step": sum(t["d2h_bytes_per_step"] for t in tables.values()),
          # Every process keeps a whole copy of each store today (gem_jax/run/host_tables.py).
          "host_bytes_per_process": sum(t["host_store_bytes"] for t in tables.values())}


def _with_host_wait(time_: dict | None, host: dict, hw) -> dict | None:
  """`time_` with the host link's share: a step's misses and write-backs cross it while the step before
  runs (the host plans a step ahead), so the step waits only for what exceeds it. No time without the
  mesh file's host_link_bandwidth."""
  if time_ is None or hw.host_link_bandwidth is None:
    return time_
  link_s = max(host["h2d_bytes_per_step"], host["d2h_bytes_per_step"]) / hw.host_link_bandwidth  # both ways at once
  wait = max(0.0, link_s - time_["step_s"])
  return {**time_, "host_link_s": link_s, "host_wait_s": wait, "step_s": time_["step_s"] + wait}


def _check_time_args(overlap: float, efficiency: float) -> None:
  if not 0 <= overlap <= 1 or not 0 < efficiency <= 1:
    raise ValueError(f"need 0 <= overlap <= 1 and 0 < efficiency <= 1, got overlap={overlap}, "
                     f"efficiency={efficiency}")


def _times(items, mesh_spec: MeshSpec, device_flops: float, overlap: float, efficiency: float):
  """Seconds per step (module docstring) of the collectives `items` = (part, axes key, bytes); None when the
  mesh file gives no peak FLOPs or bandwidths."""
  hw = mesh_spec.hardware
  if None in (hw.peak_bf16_flops, hw.intra_node_bandwidth, hw.inter_node_bandwidth):
    return None
  shape, intra = mesh_spec.shape, dict(mesh_spec.intra_node)
  by_axis, hidden, exposed = {}, 0.0, 0.0
  for part, key, moved in items:
    inside = all(shape[a] == intra[a] for a in key.split(","))
    s = moved / (hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth)
    by_axis[key] = by_axis.get(key, 0.0) + s
    if part == "params":
      hidden += s
    else:
      exposed += s
  compute = device_flops / (hw.peak_bf16_flops * efficiency)
  step = compute + exposed + max(0.0, hidden - overlap * compute)
  return {"compute_s": compute, "comm_s_by_axis": by_axis, "params_comm_s": hidden, "exposed_comm_s": exposed,
          "step_s": step, "bandwidth_by_axis": {k: ("intra" if all(shape[a] == intra[a] for a in k.split(","))
                                                     else "inter") for k in by_axis}}


def retime(sim: dict, mesh_spec: MeshSpec, *, overlap: float = 0.9, efficiency: float = 0.5):
  """The "time" entry of `sim` (a simulate() result) recomputed for `mesh_spec`, which must have the axis
  sizes and rules `sim` was simulated with and may differ in its intra-node placement or hardware: bytes
  and memory depend only on the sizes, the seconds on where each axis lies. None without hardware numbers.
  Sums per (part, axes) instead of per collective, so it can differ from simulate's own "time" in the last
  bits of a float."""
  _check_time_args(overlap, efficiency)
  if sim["devices"] != mesh_spec.num_devices:
    raise ValueError(f"retime: {sim['mesh']!r} was simulated on {sim['devices']} devices, mesh "
                     f"{mesh_spec.name!r} has {mesh_spec.num_devices}")
  shape = mesh_spec.shape
  items = []
  for part, summary in sim["comm"]["parts"].items():
    for key, moved in summary["by_axis"].items():
      if any(shape[a] == 1 for a in key.split(",")):
        raise ValueError(f"retime: {sim['mesh']!r} moved bytes over {key!r}, an axis of which has size 1 on "
                         f"mesh {mesh_spec.name!r}: the axis sizes differ")
      items.append((part, key, moved))
  time_ = _times(items, mesh_spec, sim["flops"]["per_device"], overlap, efficiency)
  return _with_host_wait(time_, sim["host_tables"], mesh_spec.hardware) if "host_tables" in sim else time_
