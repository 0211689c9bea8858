"""Tests of the synthetic ads stream: determinism, spec conformance, consistency of observed features with
the hidden attributes, rates and planted signal, and tables of 10^9 rows."""

import dataclasses
import tracemalloc

import numpy as np
import pytest

from gem_jax.data.spec import ads_feature_spec
from gem_jax.data.synthetic import CLICK_COMPONENTS, SyntheticAdsStream, SyntheticConfig
from gem_jax.data.validate import validate_examples
from gem_jax.metrics import normalized_entropy_from_logits

SMALL = ads_feature_spec(users=5_000, ads=3_000, advertisers=300, categories=40, embed_dim=8,
                         max_history=64, max_interests=6, num_domains=4)
FAST = SyntheticConfig(calibration_examples=4096)


@pytest.fixture(scope="module")
def small():
  return SyntheticAdsStream(SMALL, FAST)


@pytest.fixture(scope="module")
def ads():
  """The spec the lead trains on; default config."""
  spec = ads_feature_spec(users=100_000, ads=50_000, advertisers=5_000, categories=200, embed_dim=32,
                          max_history=128)
  return SyntheticAdsStream(spec, SyntheticConfig())


def _arrays(ex):
  """Every array of an Examples, flattened to a name -> array dict."""
  out = {f"sparse.{k}": v for k, v in ex.sparse.items()}
  for k, (values, lengths) in ex.multi_hot.items():
    out[f"multi_hot.{k}.values"], out[f"multi_hot.{k}.lengths"] = values, lengths
  out["history.values"], out["history.lengths"] = ex.history
  for k in ("dense_nxG", "domain_n", "labels_nxK", "label_mask_nxK", "planted_logits_nxK"):
    out[k] = getattr(ex, k)
  return out


def _rows(lengths):
  return np.repeat(np.arange(lengths.shape[0]), lengths)


def test_same_seed_and_index_give_identical_blocks(small):
  a, b = _arrays(small.block(7, 500)), _arrays(SyntheticAdsStream(SMALL, FAST).block(7, 500))
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_other_index_or_seed_gives_other_examples(small):
  base = _arrays(small.block(7, 500))
  other_index = _arrays(small.block(8, 500))
  other_seed = _arrays(SyntheticAdsStream(SMALL, dataclasses.replace(FAST, seed=1)).block(7, 500))
  for other in (other_index, other_seed):
    for k in ("sparse.user_id", "sparse.ad_id", "dense_nxG", "history.lengths", "planted_logits_nxK"):
      assert not np.array_equal(base[k], other[k]), k
  # A far (eval-range) index is a different stream too.
  assert not np.array_equal(small.block(2**30 + 7, 500).sparse["user_id"], base["sparse.user_id"])


def test_block_conforms_to_spec(small):
  ex = small.block(3, 2000)
  validate_examples(ex, SMALL)  # ids in range, lengths <= max_len / max_ids, finite dense, label rules
  assert len(ex) == 2000
  for k, v in _arrays(ex).items():
    floats = ("dense_nxG", "labels_nxK", "label_mask_nxK", "planted_logits_nxK")
    want = np.float32 if k in floats else np.int32
    assert v.dtype == want, k
  values, lengths = ex.history
  assert values.shape == (lengths.sum(), len(SMALL.sequence.fields))
  assert lengths.max() <= SMALL.sequence.max_len and (lengths == 0).any() and (lengths > 1).any()
  assert lengths.max() == SMALL.sequence.max_len  # the log-normal tail reaches the cap
  assert set(np.unique(ex.domain_n)) == set(range(len(SMALL.domains)))
  assert set(np.unique(values[:, SMALL.sequence.field_index("action")])) == {0, 1, 2, 3}
  assert np.all(np.abs(ex.dense_nxG.mean(0)) < 0.3) and np.all(np.abs(ex.dense_nxG.std(0) - 1) < 0.3)


def test_time_gap_non_increasing_and_most_recent_smallest(small):
  values, lengths = small.block(4, 3000).history
  gap = values[:, SMALL.sequence.field_index("time_gap")].astype(np.int64)
  rows = _rows(lengths)
  same_row = rows[1:] == rows[:-1]
  assert np.all(np.diff(gap)[same_row] <= 0)
  assert np.any(np.diff(gap)[same_row] < 0)
  assert gap.min() >= 0 and gap.max() < SMALL.table("time_gap").vocab_size


def test_observed_features_agree_with_hidden_attributes(small):
  ex = small.block(5, 2000)
  ad, user = ex.sparse["ad_id"], ex.sparse["user_id"]
  np.testing.assert_array_equal(ex.sparse["ad_category"], small.ad_category(ad))
  np.testing.assert_array_equal(ex.sparse["advertiser_id"], small.ad_advertiser(ad))
  np.testing.assert_array_equal(ex.sparse["user_segment"], small.user_segment(user))
  values, lengths = ex.history
  f = SMALL.sequence.field_index
  np.testing.assert_array_equal(values[:, f("item_category")], small.ad_category(values[:, f("item_id")]))
  interests_nxM, counts = small.user_interests(user)
  got_values, got_lengths = ex.multi_hot["user_interests"]
  np.testing.assert_array_equal(got_lengths, counts)
  np.testing.assert_array_equal(got_values, interests_nxM[interests_nxM >= 0])
  assert counts.min() >= 1 and counts.max() <= 6
  # Interests are distinct within a row; history items mostly come from the user's interests.
  rows = _rows(got_lengths)
  assert not np.any((rows[1:] == rows[:-1]) & (got_values[1:] == got_values[:-1]))
  hrows = _rows(lengths)
  in_interests = (values[:, f("item_category")][:, None] == interests_nxM[hrows]).any(axis=1)
  assert 0.5 < in_interests.mean() < 0.95


def test_ids_are_zipf_and_exponent_matters():
  def top_user_share(exponent):
    stream = SyntheticAdsStream(SMALL, dataclasses.replace(FAST, zipf_exponent=exponent))
    users = stream.block(0, 20_000).sparse["user_id"]
    return np.bincount(users).max() / users.size, np.unique(users).size
  steep, flat = top_user_share(1.3), top_user_share(0.6)
  assert steep[0] > 3 * flat[0] and steep[0] > 0.05  # a head user gets a large share...
  assert flat[1] > 2_000  # ...but a flat law reaches much of the tail


def test_rates_and_conversion_only_on_clicks(ads):
  ex = ads.block(0, 40_000)
  click, conv = ex.labels_nxK[:, 0], ex.labels_nxK[:, 1]
  assert 0.02 <= click.mean() <= 0.05
  assert 0.05 <= conv[click == 1].mean() <= 0.2
  np.testing.assert_array_equal(ex.label_mask_nxK[:, 0], 1.0)
  np.testing.assert_array_equal(ex.label_mask_nxK[:, 1], click)
  assert np.all(conv[click == 0] == 0)
  # Labels are drawn from the planted logits: predicted and observed clicks agree.
  predicted = 1.0 / (1.0 + np.exp(-ex.planted_logits_nxK[:, 0].astype(np.float64)))
  assert abs(predicted.sum() / click.sum() - 1.0) < 0.1
  assert 30.0 <= ex.history[1].mean() <= 40.0


def test_planted_signal_is_realistic_and_spread(ads):
  report = ads.signal_report(num_examples=60_000)
  click = report["click"]
  assert 0.6 <= click["planted_ne"] <= 0.9, report
  assert abs(click["planted_ne_sampled_labels"] - click["planted_ne"]) < 0.05
  assert set(click["ablation"]) == set(CLICK_COMPONENTS)
  for name, frac in click["ablation"].items():
    assert 0.0 < frac < 0.5, (name, frac)
  # Per-id terms (unlearnable for tail ids) are a minority of the signal.
  assert click["ablation"]["id_affinity"] + click["ablation"]["popularity"] < 0.25
  assert 0.05 <= report["conversion"]["base_rate"] <= 0.2 and report["conversion"]["planted_ne"] < 1.0
  assert ads.signal_report(num_examples=20_000) == ads.signal_report(num_examples=20_000)


def test_planted_ne_matches_ne_of_sampled_labels(ads):
  ex = ads.block(1, 30_000)
  ne = normalized_entropy_from_logits(ex.labels_nxK[:, 0], ex.planted_logits_nxK[:, 0])
  assert 0.6 <= ne <= 0.9
  mask = ex.label_mask_nxK[:, 1]
  assert normalized_entropy_from_logits(ex.labels_nxK[:, 1], ex.planted_logits_nxK[:, 1], weights=mask) < 1.0


def test_billion_row_tables_need_no_big_allocation():
  spec = ads_feature_spec(users=10**9, ads=10**9, advertisers=10**8, categories=10**6, embed_dim=8,
                          max_history=32)
  tracemalloc.start()
  try:
    stream = SyntheticAdsStream(spec, FAST)
    ex = stream.block(0, 512)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB"
  validate_examples(ex, spec)
  np.testing.assert_array_equal(ex.sparse["ad_category"], stream.ad_category(ex.sparse["ad_id"]))
  np.testing.assert_array_equal(ex.sparse["advertiser_id"], stream.ad_advertiser(ex.sparse["ad_id"]))
  assert ex.sparse["user_id"].max() > 2**31 // 4  # ids spread over the whole table


def test_bad_input_raises_with_a_clear_message(small):
  with pytest.raises(ValueError, match="index"):
    small.block(-1, 10)
  with pytest.raises(ValueError, match="size"):
    small.block(0, 0)
  with pytest.raises(ValueError, match="click_rate"):
    SyntheticConfig(click_rate=1.5)
  bad = dataclasses.replace(SMALL, dense=SMALL.dense[:2])
  with pytest.raises(ValueError, match="dense"):
    SyntheticAdsStream(bad, FAST)
