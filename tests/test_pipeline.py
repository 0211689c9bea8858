"""The grain pipeline: pack round trips, padding, bucket choice, deterministic and resumable iteration."""

import json

import jax
import numpy as np
import pytest

from gem_jax.data.pipeline import (PipelineConfig, bucket_counts, eval_batches, make_iterator, pack,
                                   padding_stats, pick_bucket, train_dataset)
from gem_jax.data.spec import ads_feature_spec
from gem_jax.data.validate import BatchValidationError, validate_batch
from tests.data_helpers import make_examples

SPEC = ads_feature_spec(users=50, ads=40, advertisers=10, categories=12, embed_dim=4, max_history=6,
                        max_interests=3)
# B * max_len = 24 tokens; buckets 8, 16, 24.
CFG = PipelineConfig(batch_size=4, history_bucket_fractions=(0.25, 0.5, 1.0), bucket_multiple=8,
                     read_threads=2, prefetch_buffer_size=3)


class ToySource:
  """Deterministic in (seed, index, size), like SyntheticAdsStream; counts its reads."""

  def __init__(self, spec, seed=0):
    self.spec, self.seed, self.reads = spec, seed, []

  def block(self, index, size):
    self.reads.append((index, size))
    return make_examples(self.spec, np.random.default_rng((self.seed, index, size)), size)


def unpack(batch):
  """The real rows of a packed batch back as per-row python structures."""
  n = int(batch.example_mask_B.sum())
  return {
      "sparse": {k: v[:n] for k, v in batch.sparse.items()},
      "multi_hot": {k: j.rows()[:n] for k, j in batch.multi_hot.items()},
      "history": batch.history.rows()[:n],
      "dense": batch.dense_BxG[:n], "domain": batch.domain_B[:n], "labels": batch.labels_BxK[:n],
      "label_mask": batch.label_mask_BxK[:n], "planted": batch.planted_logits_BxK[:n],
  }


def split(values, lengths):
  ends = np.cumsum(lengths)
  return [values[e - l:e] for e, l in zip(ends, lengths)]


def assert_batches_equal(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)  # NaN == NaN here


# ---- config --------------------------------------------------------------------------------------------


def test_history_buckets():
  assert CFG.history_buckets(SPEC) == (8, 16, 24)
  big = PipelineConfig(batch_size=64)
  spec = ads_feature_spec(users=5, ads=5, advertisers=5, categories=5, embed_dim=4, max_history=100)
  buckets = big.history_buckets(spec)
  # Geometric by default: multiples of 128 from ~6400 / 32 up to 6400, each at most ~2^(1/4) x the last.
  assert buckets[0] == 256 and buckets[-1] == 6400 and len(buckets) > 10
  assert all(c % 128 == 0 for c in buckets) and list(buckets) == sorted(set(buckets))
  assert all(b <= a * 2**0.25 + 128 for a, b in zip(buckets, buckets[1:]))
  assert pick_bucket(2000, buckets) < 2000 * 1.19 + 128
  assert CFG.multi_hot_capacity(SPEC.sparse_feature("user_interests")) == 4 * 3
  with pytest.raises(ValueError):
    PipelineConfig(batch_size=4, history_bucket_fractions=(0.5, 0.9))


@pytest.mark.parametrize("tokens,bucket", [(0, 8), (1, 8), (8, 8), (9, 16), (16, 16), (17, 24), (24, 24)])
def test_pick_bucket_smallest_that_fits(tokens, bucket):
  assert pick_bucket(tokens, (8, 16, 24)) == bucket


def test_pick_bucket_overflow_raises():
  with pytest.raises(BatchValidationError, match="25 tokens"):
    pick_bucket(25, (8, 16, 24))


# ---- pack ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[2, 0, 6, 1], [6, 6, 6, 6], [0, 0, 0, 0], [3, 5, 0], [1]])
def test_pack_round_trip(lengths):
  ex = make_examples(SPEC, np.random.default_rng(1), len(lengths), hist_lengths=lengths)
  b = pack(ex, SPEC, CFG)
  validate_batch(b, SPEC)
  n, B = len(lengths), CFG.batch_size
  got = unpack(b)
  for f in SPEC.single_hot:
    assert b.sparse[f.name].dtype == np.int32 and b.sparse[f.name].shape == (B,)
    np.testing.assert_array_equal(got["sparse"][f.name], ex.sparse[f.name])
  for f in SPEC.multi_hot:
    jag = b.multi_hot[f.name]
    assert jag.values.dtype == np.int32 and jag.capacity == B * f.max_ids
    for r_got, r_want in zip(got["multi_hot"][f.name], split(*ex.multi_hot[f.name]), strict=True):
      np.testing.assert_array_equal(r_got, r_want)
  assert b.history.values.dtype == np.int32 and b.history.offsets.dtype == np.int32
  assert b.history.values.shape == (b.history.capacity, len(SPEC.sequence.fields))
  for r_got, r_want in zip(got["history"], split(*ex.history), strict=True):
    np.testing.assert_array_equal(r_got, r_want)
  np.testing.assert_array_equal(got["dense"], ex.dense_nxG)
  np.testing.assert_array_equal(got["domain"], ex.domain_n)
  np.testing.assert_array_equal(got["labels"], ex.labels_nxK)
  np.testing.assert_array_equal(got["label_mask"], ex.label_mask_nxK)
  np.testing.assert_array_equal(got["planted"], ex.planted_logits_nxK)
  np.testing.assert_array_equal(b.example_mask_B, [1.0] * n + [0.0] * (B - n))
  # Tail padding is zeros (a valid id for every table).
  assert not b.history.values[int(b.history.offsets[-1]):].any()


def test_short_block_is_padded_with_empty_masked_rows():
  ex = make_examples(SPEC, np.random.default_rng(2), 2, hist_lengths=[4, 3])
  b = pack(ex, SPEC, CFG)
  assert b.batch_size == 4
  np.testing.assert_array_equal(b.example_mask_B, [1, 1, 0, 0])
  np.testing.assert_array_equal(b.history.offsets, [0, 4, 7, 7, 7])
  assert b.history.capacity == 8
  for jag in b.multi_hot.values():
    assert jag.offsets[2] == jag.offsets[3] == jag.offsets[4]
  assert not b.labels_BxK[2:].any() and not b.label_mask_BxK[2:].any() and not b.dense_BxG[2:].any()
  assert np.isnan(b.planted_logits_BxK[2:]).all()
  assert all(not v[2:].any() for v in b.sparse.values())


def test_zero_length_histories():
  b = pack(make_examples(SPEC, np.random.default_rng(3), 4, hist_lengths=[0, 0, 0, 0]), SPEC, CFG)
  np.testing.assert_array_equal(b.history.offsets, np.zeros(5))
  assert b.history.capacity == 8 and all(r.shape == (0, 4) for r in b.history.rows())


def test_capacities_come_only_from_buckets():
  source = ToySource(SPEC, seed=4)
  seen = set()
  for i in range(40):
    b = pack(source.block(i, 4), SPEC, CFG)
    tokens = int(b.history.offsets[-1])
    assert b.history.capacity in CFG.history_buckets(SPEC)
    assert b.history.capacity == pick_bucket(tokens, (8, 16, 24))
    assert b.multi_hot["user_interests"].capacity == 12
    seen.add(b.history.capacity)
  assert seen == {8, 16, 24}


def test_pack_rejects_bad_input():
  ex = make_examples(SPEC, np.random.default_rng(5), 4)
  ex.sparse["hour"][2] = 24
  with pytest.raises(BatchValidationError, match="hour: row 2"):
    pack(ex, SPEC, CFG)
  with pytest.raises(BatchValidationError, match="batch_size 4"):
    pack(make_examples(SPEC, np.random.default_rng(5), 5), SPEC, CFG)


def test_padding_stats():
  b = pack(make_examples(SPEC, np.random.default_rng(6), 2, hist_lengths=[4, 2]), SPEC, CFG)
  stats = padding_stats(b)
  assert stats["history_tokens"] == 6 and stats["history_capacity"] == 8
  assert stats["history_padding"] == pytest.approx(0.25) and stats["row_padding"] == pytest.approx(0.5)
  b2 = pack(make_examples(SPEC, np.random.default_rng(6), 4, hist_lengths=[6, 6, 6, 2]), SPEC, CFG)
  counts = bucket_counts([b, b2, b])
  assert counts["bucket_counts"] == {8: 2, 24: 1}
  assert counts["history_padding"] == pytest.approx(1 - 32 / 40)


# ---- grain iteration ------------------------------------------------------------------------------------


def test_records_are_packed_blocks_from_start_index():
  source = ToySource(SPEC, seed=7)
  it = iter(train_dataset(source, SPEC, CFG, start_index=5))
  got = [next(it) for _ in range(3)]
  for i, b in enumerate(got):
    assert_batches_equal(b, pack(ToySource(SPEC, seed=7).block(5 + i, 4), SPEC, CFG))
  assert (5, 4) in source.reads and all(i >= 5 for i, _ in source.reads)
  assert not np.array_equal(got[0].dense_BxG, got[1].dense_BxG)


@pytest.mark.parametrize("threads", [0, 2])
def test_iterator_resumes_from_json_state(threads):
  cfg = PipelineConfig(batch_size=4, history_bucket_fractions=(0.25, 0.5, 1.0), bucket_multiple=8,
                       read_threads=threads, prefetch_buffer_size=3)
  source = ToySource(SPEC, seed=8)
  it = make_iterator(source, SPEC, cfg, start_index=2)
  for _ in range(3):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  after = [next(it) for _ in range(4)]
  resumed = make_iterator(ToySource(SPEC, seed=8), SPEC, cfg, start_index=2, state=state)
  for a, b in zip(after, [next(resumed) for _ in range(4)], strict=True):
    assert_batches_equal(a, b)
  # The same state also resumes an existing iterator, and the stream is deterministic from scratch.
  fresh = make_iterator(ToySource(SPEC, seed=8), SPEC, cfg, start_index=2)
  first = [next(fresh) for _ in range(7)]
  for a, b in zip(after, first[3:], strict=True):
    assert_batches_equal(a, b)
  fresh.set_state(state)
  assert_batches_equal(next(fresh), after[0])


def test_bad_block_surfaces_through_the_iterator():
  class Broken(ToySource):
    def block(self, index, size):
      ex = super().block(index, size)
      ex.dense_nxG[1, 0] = np.nan
      return ex
  it = make_iterator(Broken(SPEC), SPEC, CFG)
  with pytest.raises(BatchValidationError, match="'ad_quality': row 1"):
    next(it)


def test_source_spec_must_match():
  other = ads_feature_spec(users=51, ads=40, advertisers=10, categories=12, embed_dim=4, max_history=6)
  with pytest.raises(ValueError, match="spec"):
    train_dataset(ToySource(other), SPEC, CFG)


def test_eval_batches_cover_the_range_once():
  source = ToySource(SPEC, seed=9)
  batches = eval_batches(source, SPEC, CFG, num_examples=11, start_index=100)
  assert len(batches) == 3 and all(b.batch_size == 4 for b in batches)
  assert [int(b.example_mask_B.sum()) for b in batches] == [4, 4, 3]
  assert sorted(source.reads) == [(100, 4), (101, 4), (102, 3)]
  ref = ToySource(SPEC, seed=9)
  for b, (i, n) in zip(batches, [(100, 4), (101, 4), (102, 3)]):
    assert_batches_equal(b, pack(ref.block(i, n), SPEC, CFG))
  assert len(eval_batches(source, SPEC, CFG, num_examples=8, start_index=0)) == 2


def test_pipeline_over_the_synthetic_stream():
  synthetic = pytest.importorskip("gem_jax.data.synthetic")
  spec = ads_feature_spec(users=1000, ads=500, advertisers=40, categories=20, embed_dim=4, max_history=32,
                          max_interests=4)
  stream = synthetic.SyntheticAdsStream(spec, synthetic.SyntheticConfig(seed=3, calibration_examples=1024))
  cfg = PipelineConfig(batch_size=16, bucket_multiple=16, read_threads=2, prefetch_buffer_size=2)
  it = make_iterator(stream, spec, cfg)
  first = [next(it) for _ in range(2)]
  state = json.loads(json.dumps(it.get_state()))
  after = [next(it) for _ in range(2)]
  resumed = make_iterator(stream, spec, cfg, state=state)
  for a, b in zip(after, [next(resumed) for _ in range(2)], strict=True):
    assert_batches_equal(a, b)
  for i, b in enumerate(first + after):
    validate_batch(b, spec)
    assert b.history.capacity in cfg.history_buckets(spec)
    assert_batches_equal(b, pack(stream.block(i, 16), spec, cfg))
  [last] = eval_batches(stream, spec, cfg, num_examples=5, start_index=1000)
  np.testing.assert_array_equal(last.example_mask_B, [1.0] * 5 + [0.0] * 11)
