"""Host-side data sharding: balanced assignment, exact re-packing of jagged rows, placement on a mesh."""

import dataclasses

import jax
import numpy as np
import pytest

from gem_jax import configs
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.data.validate import BatchValidationError
from gem_jax.data import shards as pdata
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.rules import DATA_AXES


@pytest.fixture(scope="module")
def tiny_batch():
  cfg = configs.get("tiny")
  stream = SyntheticAdsStream(cfg.data.spec, cfg.data.synthetic)
  return cfg, pipeline.pack(stream.block(3, 32), cfg.data.spec, cfg.data.pipeline)


def test_assignment_is_a_partition_with_equal_counts():
  rng = np.random.default_rng(0)
  cost = rng.pareto(1.2, size=64)
  rows = pdata.assign_rows(cost, 8)
  assert rows.shape == (8, 8)
  assert sorted(rows.ravel().tolist()) == list(range(64))
  assert all(np.all(np.diff(r) > 0) for r in rows)


def test_balanced_beats_contiguous_on_heavy_tail():
  rng = np.random.default_rng(1)
  # Heavy-tailed (lognormal) history lengths, as in the synthetic stream, up to 256 tokens.
  lengths = np.minimum(rng.lognormal(3.0, 1.0, size=1024), 256).astype(int)
  cost = pdata.row_costs(lengths)
  assert cost.max() < cost.sum() / 8  # one row alone does not exceed a fair share
  balanced = pdata.imbalance(cost, pdata.assign_rows(cost, 8))
  contiguous = pdata.imbalance(cost, np.arange(1024).reshape(8, 128))
  random = np.median([pdata.imbalance(cost, rng.permutation(1024).reshape(8, 128)) for _ in range(9)])
  assert balanced < 1.01 and contiguous > 1.2 and random > 1.2, (balanced, contiguous, random)


def test_bad_split_names_the_sizes():
  with pytest.raises(ValueError, match="10 rows does not split into 4"):
    pdata.assign_rows(np.ones(10), 4)


def test_shards_hold_exactly_the_rows(tiny_batch):
  cfg, batch = tiny_batch
  spec = cfg.data.spec
  sharded = pdata.shard_batch(batch, spec, cfg.data.pipeline, 4)
  rows = pdata.assign_rows(pdata.row_costs(np.diff(batch.history.offsets)), 4)
  hist_rows = batch.history.rows()
  for s in range(4):
    local = jax.tree_util.tree_map(lambda x: np.asarray(x)[s], sharded)
    for name in batch.sparse:
      np.testing.assert_array_equal(local.sparse[name], batch.sparse[name][rows[s]])
    np.testing.assert_array_equal(local.labels_BxK, batch.labels_BxK[rows[s]])
    local.history.validate("history")
    for j, row in enumerate(rows[s]):
      np.testing.assert_array_equal(local.history.rows()[j], hist_rows[row])
    for name, jag in batch.multi_hot.items():
      for j, row in enumerate(rows[s]):
        np.testing.assert_array_equal(local.multi_hot[name].rows()[j], jag.rows()[row])


def test_overfull_shard_raises(tiny_batch):
  cfg, batch = tiny_batch
  tight = dataclasses.replace(cfg.data.pipeline, history_bucket_fractions=(1.0,))
  rows = np.arange(32).reshape(4, 8)
  # A fixed multi-hot capacity that the shard cannot meet: shrink the feature's capacity through spec max_ids.
  f = cfg.data.spec.multi_hot[0]
  values, offsets = np.asarray(batch.multi_hot[f.name].values), np.asarray(batch.multi_hot[f.name].offsets)
  with pytest.raises(BatchValidationError, match=f"{f.name}: a data shard holds"):
    pdata.pack_jagged(values, offsets, rows, 1, None, f.name)
  pdata.shard_batch(batch, cfg.data.spec, tight, 4, rows_Sxb=rows)  # the real capacities fit


def test_place_shards_the_leading_dim(tiny_batch):
  cfg, batch = tiny_batch
  spec = mesh_lib.load("meshes/cpu_8.yaml")
  mesh = mesh_lib.build_mesh(spec)
  sharded = pdata.shard_batch(batch, cfg.data.spec, cfg.data.pipeline, spec.data_shards)
  placed = pdata.place(sharded, mesh, DATA_AXES)
  np.testing.assert_array_equal(np.asarray(placed.history.values), sharded.history.values)
  assert placed.labels_BxK.sharding.spec == jax.sharding.PartitionSpec(DATA_AXES)


def test_rank_imbalance_with_readers_is_that_of_the_shards_each_reader_fills():
  """With data.readers, each reader balances its own rows over its own shards (shard_part), and the report's
  figure is that of those shards, not of one pass over the step's rows."""
  from gem_jax.observe import report
  cfg = configs.get("tiny")
  stream = SyntheticAdsStream(cfg.data.spec, cfg.data.synthetic)
  pipe = dataclasses.replace(cfg.data.pipeline, batch_size=16)   # each reader's piece: 16 real rows
  pieces = tuple(pipeline.pack(stream.block(i, 16), cfg.data.spec, pipe) for i in (0, 5))
  part = pdata.Part(readers=(0, 1), num_readers=2, batches=pieces)
  stacked, ids = pdata.shard_part(part, cfg.data.spec, pipe, 4)
  assert ids == [0, 1, 2, 3]
  loads = [pdata.row_costs(np.diff(np.asarray(offsets))).sum() for offsets in stacked.history.offsets]
  every_row = np.concatenate([np.diff(np.asarray(b.history.offsets)) for b in pieces])
  got = report.rank_imbalance(every_row, 4, seed=0, readers=2)
  assert got["balanced"] == pytest.approx(max(loads) / np.mean(loads), rel=1e-12)
  # One reader's rows all long, the other's all short: no shard of the second can take a long row.
  lopsided = report.rank_imbalance(np.array([100] * 8 + [1] * 8), 4, readers=2)
  assert lopsided["balanced"] == pytest.approx(2.0, rel=1e-3) and lopsided["random"] == pytest.approx(2.0, rel=1e-3)
  assert report.rank_imbalance(np.array([100] * 8 + [1] * 8), 4)["balanced"] == 1.0
  with pytest.raises(ValueError, match="3 readers must divide the 4 shards"):
    report.rank_imbalance(every_row[:30], 4, readers=3)
