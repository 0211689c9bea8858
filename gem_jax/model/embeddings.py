"""Embedding tables and lookups: the sparse half of the model.

Every table of the FeatureSpec is one `Table` variable (V x E, logical axes ("table_rows", "table_dim")).
`Table` is its own nnx.Param subclass so the optimizer tells tables from dense weights by type and gives
them row-wise Adagrad, and so the sharding rules place their rows on the `sparse` mesh axis.

Lookups never clamp an id: an id outside its table reads a NaN row (the host validates every batch, so
this only fires when validation was skipped, and then the loss says so). Jagged padding slots (past
offsets[B]) are masked to id 0 before the lookup, so whatever the pipeline wrote there is never read.

Under SPMD (gem_jax/parallel/spmd.py) a device holds only its block of each table's rows; the step then
installs a distributed lookup in the runtime (gem_jax/runtime.py: (table, rows, ids) -> rows), and
`lookup` routes every read through it. The model code stays the same on one device and on a mesh. Every
lookup call is also told to the runtime's recorder, which is how lookup capacities are derived.

Letters: B batch, T jagged token capacity, V table rows, E embedding width, F history token fields.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import jagged, runtime
from gem_jax.data.spec import FeatureSpec
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig

TABLE_AXES = ("table_rows", "table_dim")

class Table(nnx.Param):
  """An embedding table (V x E). The optimizer gives variables of this type row-wise Adagrad."""


class EmbeddingCollection(nnx.Module):
  """One Table per spec table; lookups for single-hot, pooled multi-hot and history features."""

  def __init__(self, spec: FeatureSpec, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.spec = spec
    self.dtype = cfg.dtype
    tables = {}
    for t in spec.tables:
      # Unit-variance rows over E after the 1/sqrt(E) scale: the same scale as a LayerNorm-ed activation.
      init = jax.nn.initializers.normal(stddev=t.dim ** -0.5)
      tables[t.name] = Table(init(rngs.params(), (t.vocab_size, t.dim), cfg.params_dtype),
                             out_sharding=TABLE_AXES, eager_sharding=False)
    self.tables = nnx.Dict(tables)

  def lookup(self, table: str, ids):
    """Rows of `table` for ids of any shape -> ids.shape + (E,), in the compute dtype."""
    if table not in self.tables:
      raise KeyError(f"no embedding table {table!r}; tables: {sorted(self.tables)}")
    rows_VxE = self.tables[table][...]
    ids = jnp.asarray(ids, jnp.int32)
    runtime.record("lookup", table=table, ids=ids)
    rt = runtime.current()
    if rt.count_only:  # a trace that is only counted or read for its ids never reads a table
      return jnp.zeros(ids.shape + rows_VxE.shape[1:], self.dtype)
    override = rt.lookup
    if override is not None:
      out = override(table, rows_VxE, ids)
    else:
      # mode="fill" alone would wrap negative ids (-1 -> row V - 1): send them out of range too.
      out = jnp.take(rows_VxE, jnp.where(ids < 0, rows_VxE.shape[0], ids), axis=0, mode="fill",
                     fill_value=jnp.nan)
    return out.astype(self.dtype)

  def single_hot(self, feature: str, ids_B):
    """A single-hot feature -> B x E."""
    f = self.spec.sparse_feature(feature)
    if f.multi_hot:
      raise ValueError(f"feature {feature!r} is multi-hot (max_ids={f.max_ids}); use multi_hot()")
    return self.lookup(f.table, ids_B)

  def multi_hot(self, feature: str, ids: Jagged):
    """A multi-hot feature (Jagged of ids_T) pooled per the spec (sum or mean) -> B x E; empty rows -> 0."""
    f = self.spec.sparse_feature(feature)
    ids_T = jnp.where(ids.valid_mask(), ids.values, 0)
    # Pool in f32: a bf16 sum over many ids loses the small ones.
    rows_TxE = self.lookup(f.table, ids_T).astype(jnp.float32)
    pooled_BxE = jagged.segment_mean(rows_TxE, ids) if f.pooling == "mean" else jagged.segment_sum(rows_TxE, ids)
    return pooled_BxE.astype(self.dtype)

  def history(self, ids: Jagged) -> tuple:
    """History tokens (Jagged of ids_TxF) -> one T x E array per field (spec.sequence.fields order).
    Padding slots hold the embedding of id 0; callers read only real tokens."""
    fields = self.spec.sequence.fields
    if ids.feature_shape != (len(fields),):
      raise ValueError(f"history ids have per-token shape {ids.feature_shape}, the spec has "
                       f"{len(fields)} fields {[f.name for f in fields]}")
    ids_TxF = jnp.where(ids.valid_mask()[:, None], ids.values, 0)
    return tuple(self.lookup(f.table, ids_TxF[:, i]) for i, f in enumerate(fields))
