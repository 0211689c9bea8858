"""build(cfg) -> Run: the only place that assembles a run from its config.

  run = build(cfg)                   # data source, task, model, optimizer, mesh, placement, state, steps
  run = build(cfg, abstract=True)    # the same with nothing allocated: shapes, shardings, the steps to trace
                                     # with jax.eval_shape (an abstract mesh and no steps when the mesh has
                                     # more devices than this process: the simulator, the planner)
  run = build(cfg, target="h200")    # compile-only: the mesh file's nodes x GPUs as devices of that target
                                     # (gem_jax/parallel/target.py), nothing allocated, the train and eval
                                     # steps ready to lower and compile for it without a GPU
                                     # (gem_jax/observe/compiled.py); the lookup capacities come from the
                                     # source's first batch, as in a real run

Order: the config, the mesh file and the devices are checked (gem_jax/check.py) before anything is built;
then the source (gem_jax/data/sources.py, by cfg.data's type), the task (gem_jax/run/tasks.py, by
cfg.task's type) and its selection metric, the model's shapes (jax.eval_shape) and its tensor-parallel cuts,
the model the task builds, the optimizer (gem_jax/run/optim.py), the mesh (cfg.mesh, or
the 1x1x1x1x1 mesh of one device), the placement of every parameter (gem_jax/parallel/placement.py), the
state laid out on the mesh, the lookup capacities of the first training batch, and the one train and eval
step (gem_jax/run/step.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from gem_jax import check
from gem_jax.config import Config
from gem_jax.data import sources
from gem_jax.data import shards
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import host_exchange, lookups, placement
from gem_jax.parallel import target as target_lib
from gem_jax.parallel.rules import DATA_AXES
from gem_jax.run import host_tables as host_tables_lib, optim, step as step_lib, tasks
from gem_jax.run.state import TrainState, init_state

# Registers the next-item task and source and the Parquet source with their registries (their own files).
from gem_jax.data import parquet_source, seqrec_source  # noqa: F401  isort: skip
from gem_jax.run import next_item  # noqa: F401  isort: skip


@dataclasses.dataclass
class Run:
  """What a config builds: everything the trainer, the meter and the simulator need (module docstring)."""
  cfg: Config
  source: sources.Source
  task: tasks.Task
  mesh_spec: mesh_lib.MeshSpec
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh   # abstract for a cluster larger than this process
  plan: placement.Placement
  optimizer: optim.Optimizer
  graphdef: nnx.GraphDef
  rest: nnx.State                # the model's non-parameter state
  state: TrainState              # placed on the mesh, or ShapeDtypeStructs with their shardings
  capacities: dict[str, int]
  sync_capacities: dict[str, dict[str, int]]  # the sparse engine's, per table (lookups.sync_capacities)
  lookups: lookups.LookupTrace   # the model's lookup calls per batch shape, one count-only trace each
  train_step: Callable | None = None   # jitted (gem_jax/run/step.py); None on an abstract mesh
  eval_step: Callable | None = None
  tables: host_tables_lib.HostTables | None = None   # train.host_tables (gem_jax/run/host_tables.py)
  _exchange: host_exchange.Exchange = dataclasses.field(default_factory=lambda: host_exchange.Exchange("feed"),
                                                        repr=False)
  # (the Part, real row lengths, every row's lengths) of the last step feed exchanged: the whole step's rows
  _step_lengths: tuple | None = dataclasses.field(default=None, repr=False)

  @property
  def num_devices(self) -> int:
    return self.mesh_spec.num_devices

  @property
  def data_shards(self) -> int:
    return self.plan.num_data_shards

  def model(self, params=None):
    """The model with `params` (default: the state's)."""
    return nnx.merge(self.graphdef, self.state.params if params is None else params, self.rest)

  def shard(self, host_batch):
    """A host batch split into the mesh's data shards (leading dim), still on the host."""
    return self.source.shard(host_batch, self.data_shards)

  def place(self, sharded):
    """A sharded host batch on the mesh: leading dim over the data axes. Each process of a multi-process
    run transfers only its own devices' shards (make_array_from_callback)."""
    return shards.place(sharded, self.mesh, DATA_AXES)

  def batch_struct(self, host_batch):
    """ShapeDtypeStructs of a host batch as placed on the mesh (what a compile-only step is lowered with)."""
    sharding = NamedSharding(self.mesh, jax.sharding.PartitionSpec(DATA_AXES))
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding),
                                  self.shard(host_batch))

  def device_batch(self, host_batch):
    return self.feed(host_batch)[0]

  def train_iterator(self):
    """The source's training batches. A source read by several readers (data.readers) gives this process
    the Parts of the readers whose data shards its devices hold, and only those (gem_jax/data/shards.py)."""
    R = getattr(self.source, "num_readers", 1)
    if R == 1:
      return self.source.train_iterator()
    S = self.data_shards
    if S % R:
      raise ValueError(f"data.readers={R} does not divide the mesh's {S} data shards (replica x fsdp x sparse)")
    mine, per = shards.local_data_shards(self.mesh, S, DATA_AXES), S // R
    readers = tuple(sorted({d // per for d in mine}))
    split = [r for r in readers if not set(range(r * per, (r + 1) * per)) <= set(mine)]
    if split:
      raise ValueError(f"data.readers={R}: reader {split[0]}'s data shards span processes on this mesh; choose "
                       f"readers so that each process holds whole readers (a multiple of {jax.process_count()})")
    return self.source.train_iterator(readers=readers)

  def feed(self, host_batch) -> tuple[Any, dict]:
    """(the device batch, the task's host counters of the whole step) of a training batch; for a Part, the
    processes agree on the history capacity and sum their counters in one exchange."""
    if not isinstance(host_batch, shards.Part):
      sharded = self.shard(host_batch)
      if self.tables is not None:  # ids to cache slots; the rows they miss staged for the step's swap
        sharded = self.tables.remap(sharded)
      return self.place(sharded), self.task.count(host_batch)
    if self.tables is not None:
      raise NotImplementedError("host tables with several data readers (data.readers > 1) are not supported yet")
    counts: dict = {}
    for b in host_batch.batches:
      for k, v in self.task.count(b).items():
        counts[k] = counts.get(k, 0) + np.asarray(v)
    # Each reader's row lengths and example mask, for the meter on process 0 (lengths): the whole step's rows.
    rows = [[int(r), self.source.lengths(b, real=False).tolist(), np.asarray(b.example_mask_B).tolist()]
            for r, b in zip(host_batch.readers, host_batch.batches)]

    def agree(fullest: int) -> int:
      every = self._exchange.all({"tokens": fullest, "counts": {k: v.tolist() for k, v in counts.items()},
                                  "rows": rows})
      for k in counts:
        counts[k] = sum(np.asarray(e["counts"][k], counts[k].dtype) for e in every)
      pieces = sorted((p for e in every for p in e["rows"]), key=lambda p: p[0])   # reader order = shard order
      lengths = np.concatenate([np.asarray(p[1], np.int64) for p in pieces])
      mask = np.concatenate([np.asarray(p[2]) for p in pieces])
      self._step_lengths = (host_batch, lengths[mask > 0], lengths)
      return max(e["tokens"] for e in every)

    src = self.source
    sharded, ids = shards.shard_part(host_batch, src.spec, src.pipe, self.data_shards, agree)
    return shards.place(sharded, self.mesh, DATA_AXES, ids, self.data_shards), counts

  def lengths(self, host_batch, real: bool = True) -> np.ndarray:
    """Row lengths of a training batch (real rows only, or every row): for a Part, which holds this process's
    readers' rows, those of the whole step, as feed exchanged them (the meter's FLOPs and examples are the
    step's, over the whole mesh's peak)."""
    held = self._step_lengths
    if held is not None and held[0] is host_batch:
      return held[1] if real else held[2]
    return self.source.lengths(host_batch, real)

  def input_counters(self) -> dict[str, int]:
    """What the source's tolerating input policies did, summed over the processes that read disjoint rows."""
    mine = getattr(self.source, "counters", dict)()
    if getattr(self.source, "num_readers", 1) == 1:
      return mine
    every = self._exchange.all(mine)
    return {k: sum(e.get(k, 0) for e in every) for k in sorted({k for e in every for k in e})}

  def abstract_state(self) -> TrainState:
    """The restore target: shapes, dtypes and this run's shardings (a checkpoint from any mesh fits)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)

  def whole_params(self, params):
    """`params` with host tables whole (a view of their stores, for an evaluation now); else `params`."""
    return params if self.tables is None else self.tables.whole_params(params)

  def eval_params(self, state):
    """The parameters an evaluation of `state` reads: the dense parameters' moving average where the
    optimizer keeps one (train.ema_decay), with host tables whole (whole_params)."""
    return self.whole_params(self.optimizer.averaged(state.params, state.opt_state))

  def restore_target(self):
    """The checkpoint restore target: abstract_state(), with host tables whole (checkpoints hold them so)."""
    target = self.abstract_state()
    return target if self.tables is None else self.tables.whole_target(target)

  def load_whole(self, state):
    """A restored state (host tables whole) as this run trains it: host tables into their stores, empty
    caches placed on the mesh. Without host tables, `state` itself."""
    if self.tables is None:
      return state
    return placement.place_state(self.tables.load_whole(state), self.plan)

  def whole(self, state):
    """`state` with host tables whole (their stores, flushed and copied): what a checkpoint or a kept set of
    parameters holds. Without host tables, `state` itself."""
    return state if self.tables is None else self.tables.full_state(state)

  def eval_batches(self, split: str) -> list:
    """The split's host batches, sharded (cached by the source's list; the shards are cheap to redo)."""
    return [self.shard(b) for b in self.source.eval_batches(split)]


def mesh_spec_of(cfg) -> mesh_lib.MeshSpec:
  return mesh_lib.load(cfg.mesh) if cfg.mesh is not None else mesh_lib.ONE_DEVICE


def build(cfg, *, abstract: bool = False, devices=None, source=None, first_batch=None,
          capacity_slack: float = 1.05, capacity_multiple: int = 1, target=None) -> Run:
  """The run of `cfg` (module docstring). devices: the devices of the mesh (default: all of this process's
  view, jax.devices(); one device without a mesh file; an abstract run checks the mesh against them only
  when given). source: a built source to reuse (the one-device
  baseline of a mesh run). first_batch: the host batch the lookup capacities are sized on (default the
  source's first training batch). target: a target name, file or target_lib.Target to build for with
  compile-only devices (the mesh file's topology; nothing is allocated and the steps are for .lower())."""
  mesh_spec = mesh_spec_of(cfg)
  compile_only = target is not None
  if compile_only:
    devices, mesh_spec = _compile_only(target, mesh_spec, devices, abstract)
  if devices is None and not abstract:
    devices = jax.devices() if cfg.mesh is not None else jax.devices()[:1]
  check.check_config(cfg, None if cfg.mesh is None else mesh_spec,
                     mesh_spec.num_devices if devices is None else len(devices))
  source = source or sources.make(cfg)
  task = tasks.make(cfg.task, source)
  check.check_selection(cfg.train.select_metric, task.selectable())
  seed = cfg.train.seed
  # The model's shapes first (nothing allocated): the tensor-parallel check reads them before a real build.
  make_model = lambda: task.build_model(cfg, source, nnx.Rngs(seed))
  model = nnx.eval_shape(make_model)
  check.check_tensor_parallel(nnx.state(model, nnx.Param), mesh_spec)
  check.check_precision_rules(cfg, model)
  allocate = not (abstract or compile_only)
  host_names, on_host = _host_tables(cfg, task, source, allocate)
  if allocate:
    # Initialized by one compiled program: eager init compiles every initializer op on its own (about 90
    # small programs for GEM, most of a small run's start-up), and one program is also what the persistent
    # compilation cache can keep.
    with on_host:
      model = nnx.merge(nnx.split(model)[0], jax.jit(lambda: nnx.state(make_model()))())
  per_epoch = source.steps_per_epoch()
  total = cfg.train.epochs * per_epoch if cfg.train.epochs and per_epoch else cfg.train.steps
  optimizer = optim.make_optimizer(cfg.train, nnx.state(model, nnx.Param), total_steps=total)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  del model
  # An abstract run on no more devices than this process has gets a real mesh (nothing is placed on it, and
  # its steps can be traced with jax.eval_shape); a larger one (the simulator's clusters) an abstract mesh.
  local = abstract and mesh_spec.num_devices <= len(jax.devices())
  if not allocate:
    mesh = (mesh_lib.build_mesh(mesh_spec, devices) if compile_only else
            mesh_lib.build_mesh(mesh_spec, jax.devices()[:mesh_spec.num_devices]) if local
            else mesh_lib.build_abstract_mesh(mesh_spec))
    state = jax.eval_shape(lambda p: init_state(p, optimizer, task.train_key(seed)), params)
  else:
    mesh = mesh_lib.build_mesh(mesh_spec, devices)
    # One program for the optimizer state and the key too (eagerly, each leaf's zeros would compile alone).
    with on_host:
      state = jax.jit(lambda p: init_state(p, optimizer, task.train_key(seed)))(params)
  p = placement.of(state.params, mesh, mesh_spec)  # host tables placed as their whole selves would be
  stores, state = (host_tables_lib.make(cfg, state, p, source.spec, dict(mesh.shape)) if host_names else ({}, state))
  if not allocate:
    shardings = placement.state_shardings(state, p)
    state = jax.tree_util.tree_map(
        lambda s, sub: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub),
        shardings, state, is_leaf=lambda x: isinstance(x, NamedSharding))
  else:
    state = placement.place_state(state, p)
  capacities, sync_capacities = {}, {}
  lookup_trace = lookups.LookupTrace(graphdef, rest, state.params, task)
  if not abstract:  # an abstract run (the simulator) reads its lookups off samples of its own
    first = first_batch if first_batch is not None else source.first_batch()
    capacities, sync_capacities = _capacities(lookup_trace, source, p, first, capacity_slack, capacity_multiple,
                                              cfg.train.embedding_update)
  run = Run(cfg, source, task, mesh_spec, mesh, p, optimizer, graphdef, rest, state, capacities,
            sync_capacities, lookup_trace)
  if not abstract or local:  # compile-only builds included
    run.train_step = step_lib.make_train_step(graphdef, rest, optimizer, task, p, state, capacities,
                                              cfg.train.embedding_update, sync_capacities, lookup_trace,
                                              {n: source.spec.table(n).vocab_size for n in host_names})
    run.eval_step = step_lib.make_eval_step(graphdef, rest, task, p, state.params, capacities)
  if stores:  # the step swaps each batch's rows into the caches first
    run.tables = host_tables_lib.HostTables(stores, source.spec, mesh, placement.state_shardings(state, p))
    run.train_step = host_tables_lib.SwappingStep(run.train_step, run.tables)
  return run


def _compile_only(target, mesh_spec, devices, abstract: bool):
  """(the compile-only devices of `target` for the mesh file's topology, the mesh spec naming the target)."""
  if devices is not None or abstract:
    raise ValueError("build: target= makes its own compile-only devices; give neither devices nor abstract")
  name = target_lib.register(target) if isinstance(target, target_lib.Target) else target
  return target_lib.topology_devices(target_lib.get(name), mesh_spec), dataclasses.replace(mesh_spec, target=name)


def _host_tables(cfg, task, source, allocate: bool):
  """(cfg.train.host_tables, the context to make the state in) after the checks that need the task and the
  source (and, for a run that allocates, that the tables fit this host's memory). With host tables the whole
  state is made in host memory first: their rows never have to fit a device."""
  names = tuple(cfg.train.host_tables)
  if names and not isinstance(task, tasks.AdsMultiTask):
    raise ValueError(f"train.host_tables={list(names)}: host tables need the ads task (its batches read tables "
                     f"only through lookups); this config's task is {type(task).__name__}")
  if names and cfg.train.embedding_update != "sparse":
    raise ValueError(f"train.host_tables={list(names)} need train.embedding_update=sparse: the dense form "
                     "differentiates and updates every row of a table, which a cache does not hold")
  if not (names and allocate):
    return names, contextlib.nullcontext()
  host_tables_lib.check_host_memory(cfg, source.spec)
  return names, jax.default_device(jax.local_devices(backend="cpu")[0])


def _capacities(lookup_trace, source, p, first, slack, multiple, engine: str):
  """(all-to-all capacities of the model's lookups, the sparse engine's sync capacities per table), read off
  the model's trace on the first batch: none where nothing is row sharded, or on one device."""
  row_sharded = any(p.table_axes.values())
  sync = engine == "sparse" and any(n > 1 for n in p.mesh.shape.values())
  if not (row_sharded or sync):
    return {}, {}
  calls = lookup_trace.ids(source.shard(first, p.num_data_shards))
  vocab_of = lambda table: source.spec.table(table).vocab_size
  return (lookups.capacities(calls, p, vocab_of, slack, multiple) if row_sharded else {},
          lookups.sync_capacities(calls, p, vocab_of, slack, multiple) if sync else {})
