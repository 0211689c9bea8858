"""The SPMD side of the one train / eval step (gem_jax/run/step.py): what a device does inside shard_map.

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
  loss          the task's per-shard sums are summed over the mesh before the loss divides them, so the
                loss is that of the global batch. Devices along context and tensor hold the same data
                shard, so the sum over them counts it ctx * tensor times and is divided back (`total`);
                with that, every gradient is the gradient of the global loss (tests/test_spmd.py).
  context       the HSTU layers split their token slots over `context` (gem_jax/model/hstu.py): each
                device projects and attends for its slice, keys / values / outputs are all-gathered;
                everything else runs on the whole layout.
`installed` puts the lookup, the tensor sum and the context slices into the runtime (gem_jax/runtime.py)
while the model is traced; `merge` rebuilds the model from this device's parameter blocks.

This module must never gather a table, and never let two meshes compute different functions: the loss
of a mesh run equals the one-device loss up to the order of additions.

Axes of size 1 take no part: specs, vma types and collectives name only the mesh's active axes (size > 1),
so one device (the 1x1x1x1x1 mesh) runs no collective at all. A collective over one device computes
nothing, but XLA:CPU still runs it as an all-reduce: marking the parameters varying over the five axes of
size 1 made the backward all-reduce every gradient, tables included (22 MB per step for `small`).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from gem_jax import runtime, scopes
from gem_jax.model import embeddings as embeddings_lib
from gem_jax.parallel import lookups, sparse
from gem_jax.parallel import target as target_lib
from gem_jax.parallel.placement import TP_AXIS, Placement
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES
from pallas_kernels import vma


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


def active_axes(mesh, axes=MESH_AXES) -> tuple[str, ...]:
  """The axes of `axes` with more than one device, in order."""
  return tuple(a for a in axes if mesh.shape[a] > 1)


def active_spec(spec: P, mesh) -> P:
  """`spec` without its axes of size 1 (the same layout: a size-1 axis splits nothing)."""
  def entry(e):
    if e is None:
      return None
    kept = active_axes(mesh, (e,) if isinstance(e, str) else tuple(e))
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return P(*(entry(e) for e in spec))


def step_specs(placed: Placement, tree):
  """The shard_map specs of `tree` (parameters, optimizer state): its placement's specs without size-1 axes."""
  return jax.tree_util.tree_map(lambda s: active_spec(s, placed.mesh), placed.tree_specs(tree), is_leaf=lambda x: isinstance(x, P))


def data_spec(mesh) -> P:
  """The spec of a sharded batch's leading (data-shard) dim inside the step."""
  axes = active_axes(mesh, DATA_AXES)
  return P(axes if axes else None)


def local(batch):
  """This device's data shard: the batch's leading (data-shard) dim of 1 squeezed."""
  return jax.tree_util.tree_map(lambda x: x[0], batch)


def _lookup_fn(placed: Placement, capacities: dict[str, int], stats: dict):
  """The distributed lookup installed into the model while the step is traced."""
  active = active_axes(placed.mesh)

  def fn(table: str, rows_VlxE, ids):
    axes = active_axes(placed.mesh, placed.table_axes.get(table, ()))
    if not axes:
      return jnp.take(rows_VlxE, jnp.where(ids < 0, rows_VlxE.shape[0], ids), axis=0, mode="fill",
                      fill_value=jnp.nan)
    flat = ids.reshape(-1)
    num_rows = rows_VlxE.shape[0] * math.prod(placed.mesh.shape[a] for a in axes)
    # Sized per (table, ids per call) from the trace (parallel/lookups.py); an unknown call gets room for all its ids.
    call = lookups.LookupCall(table, flat.shape[0]).key  # a lookup call: its table and how many ids it reads
    with jax.named_scope(scopes.table(call)):  # HLO op names say which call a collective serves
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


def _context(mesh) -> runtime.ContextParallel:
  """Token slices over the context axis (a no-op for the model when the axis has size 1)."""

  def gather(x):
    with jax.named_scope(scopes.CONTEXT_PARALLEL):
      return jax.lax.all_gather(x, CP_AXIS, axis=0, tiled=True)

  return runtime.ContextParallel(mesh.shape[CP_AXIS], lambda: jax.lax.axis_index(CP_AXIS), gather)


def merge(graphdef, rest, params, specs, mesh):
  """The model on this device: every dense parameter gathered from its blocks (HSDP), every table left as
  this device's row block, all typed varying over every active axis (custom_vjp kernels need their inputs
  on one type). `specs` are the global parameter specs without their size-1 axes (active_spec; inside
  shard_map the arrays are local blocks, so specs cannot be recomputed from their shapes)."""
  # Every active axis: then all parameters enter the model with one vma type, the batch's (data_spec) and
  # the activations' alike, which custom_vjp kernels need (their cotangents must match their inputs' types).
  active = active_axes(mesh)

  def prepare(var, spec):
    if isinstance(var, embeddings_lib.Table):
      # Varying from the start, so that the gradients of all lookups of a table add up locally and its
      # cross-replica sum is one all-reduce at the end (not one per lookup, nor one in the fallback).
      return var.replace(value=_gather_param(var.get_value(), P(spec[0]) if len(spec) else P(), active,
                                             gather=False))
    return var.replace(value=_gather_param(var.get_value(), spec, active))

  full = jax.tree_util.tree_map(prepare, params, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, full, rest)


def device_key(dropout_rng, placed: Placement):
  """The step's dropout key folded with this device's data shard and tensor slice along every axis of size
  > 1, so no two devices draw the same mask (the context-parallel HSTU path folds in its slice itself). On
  one device the key is the step's own. The masks therefore depend on the mesh: with dropout on, two
  meshes train equally well but not on the same random numbers (with dropout off, the default, they
  compute the same function)."""
  for axis in (*DATA_AXES, TP_AXIS):
    if placed.mesh.shape[axis] > 1:
      dropout_rng = jax.random.fold_in(dropout_rng, jax.lax.axis_index(axis))
  return dropout_rng


@contextlib.contextmanager
def installed(placed: Placement, capacities: dict[str, int], stats: dict):
  """The runtime of a trace inside shard_map: the distributed lookup, the tensor-parallel sum, the
  context slices and the target the step is built for (the mesh's devices decide kernels and FP8 paths)."""
  tensor_sum = _tensor_sum if placed.mesh.shape[TP_AXIS] > 1 else (lambda x: x)
  with runtime.using(lookup=_lookup_fn(placed, capacities, stats), tensor_sum=tensor_sum, context=_context(placed.mesh),
                     target=target_lib.of(placed.mesh, placed.spec)):
    yield


def total(x, mesh):
  """The sum of x over data shards, once per shard. Devices along context / tensor that hold the same
  shard may carry copies (typed varying once a tensor-sharded parameter touched them); psum adds the
  copies too, so they are divided back out. Axes x does not vary over need no sum at all."""
  axes = tuple(a for a in MESH_AXES if a in vma.varying_axes(x))
  if not axes:
    return x
  copies = math.prod(mesh.shape[a] for a in axes if a not in DATA_AXES)
  return jax.lax.psum(x, axes) / copies


def stat_metrics(stats: dict, placed: Placement) -> dict:
  """Per lookup call ("table/N"): which fallback rounds ran anywhere, and per-device means of the counts."""
  out = {}
  for call, items in stats.items():
    unique = sum(s["unique"] for s in items).astype(jnp.float32)
    remote = sum(s["remote_unique"] for s in items).astype(jnp.float32)
    for key in ("overflow", "spill", "second", "last_resort"):
      ran = sum(s[key] for s in items)
      vary = tuple(a for a in MESH_AXES if a in vma.varying_axes(ran))
      out[f"emb/{call}/{key}"] = jax.lax.pmax(ran, vary) if vary else ran
    out[f"emb/{call}/unique"] = total(unique, placed.mesh) / placed.num_data_shards
    out[f"emb/{call}/remote_unique"] = total(remote, placed.mesh) / placed.num_data_shards
  return out
