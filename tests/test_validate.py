"""Host-side validation: every kind of bad input raises BatchValidationError naming the feature and row."""

import copy

import numpy as np
import pytest

from gem_jax.data.batch import Batch, Examples
from gem_jax.data.pipeline import PipelineConfig, pack
from gem_jax.data.spec import ads_feature_spec
from gem_jax.data.validate import BatchValidationError, validate_batch, validate_examples
from gem_jax.jagged import Jagged
from tests.data_helpers import make_examples

SPEC = ads_feature_spec(users=50, ads=40, advertisers=10, categories=12, embed_dim=4, max_history=6,
                        max_interests=3)
N = 6


@pytest.fixture
def ex():
  return make_examples(SPEC, np.random.default_rng(0), N, hist_lengths=[2, 0, 6, 1, 3, 3])


def _raises(fn, *needles):
  with pytest.raises(BatchValidationError) as info:
    fn()
  msg = str(info.value)
  for s in needles:
    assert s in msg, f"{s!r} not in {msg!r}"


def test_valid_examples_and_batch_pass(ex):
  validate_examples(ex, SPEC)
  validate_batch(pack(ex, SPEC, PipelineConfig(batch_size=8, bucket_multiple=8)), SPEC)


# ---- Examples ----------------------------------------------------------------------------------------


def _set_hist(ex, row, field, value):
  offsets = np.concatenate([[0], np.cumsum(ex.history[1])])
  ex.history[0][offsets[row] + ex.history[1][row] - 1, SPEC.sequence.field_index(field)] = value


def _set_interest(ex, value):
  values, lengths = ex.multi_hot["user_interests"]
  row = int(np.flatnonzero(lengths)[-1])
  values[-1] = value
  return row


def _with_long_history(ex):
  values, lengths = ex.history
  lengths[4] = SPEC.sequence.max_len + 1
  ex.history = (np.concatenate([values, values[:SPEC.sequence.max_len + 1 - 3]]), lengths)


def _with_long_interests(ex):
  values, lengths = ex.multi_hot["user_interests"]
  extra = 4 - lengths[1]
  lengths[1] = 4
  ex.multi_hot["user_interests"] = (np.concatenate([values, np.zeros(extra, values.dtype)]), lengths)


def setat(get, index, value):
  """A mutation that writes value at index of the array get(x) (in place: fixtures are per test)."""
  return lambda x: get(x).__setitem__(index, value)


def _orphan_conversion(e):
  e.labels_nxK[5, 0] = 0.0
  e.label_mask_nxK[5, 1] = 1.0


EXAMPLE_CASES = {
    "single_hot_too_big": (setat(lambda e: e.sparse["device"], 3, 8), ["device", "row 3", "id 8", "vocab size 8"]),
    "single_hot_negative": (setat(lambda e: e.sparse["user_id"], 1, -1), ["user_id", "row 1", "id -1"]),
    "history_field": (lambda e: _set_hist(e, 2, "item_category", 12),
                      ["history.item_category", "row 2", "id 12", "vocab size 12"]),
    "history_negative": (lambda e: _set_hist(e, 5, "time_gap", -3), ["history.time_gap", "row 5", "id -3"]),
    "multi_hot": (lambda e: _set_interest(e, 99), ["user_interests", "id 99", "vocab size 12"]),
    "history_too_long": (_with_long_history, ["history", "row 4", "max_len = 6"]),
    "multi_hot_too_long": (_with_long_interests, ["user_interests", "row 1", "max_ids = 3"]),
    "history_negative_length": (setat(lambda e: e.history[1], 0, -1), ["history", "row 0", "negative"]),
    "history_lengths_mismatch": (setat(lambda e: e.history[1], 1, 1), ["history", "lengths sum to"]),
    "dense_nan": (setat(lambda e: e.dense_nxG, (4, 2), np.nan), ["'bid'", "row 4", "not finite"]),
    "dense_inf": (setat(lambda e: e.dense_nxG, (1, 1), np.inf), ["'user_activity'", "row 1", "inf"]),
    "dense_float64": (lambda e: setattr(e, "dense_nxG", e.dense_nxG.astype(np.float64)), ["dense", "float32"]),
    "dense_shape": (lambda e: setattr(e, "dense_nxG", e.dense_nxG[:, :2]), ["dense", "shape"]),
    "label_two": (setat(lambda e: e.labels_nxK, (2, 0), 2.0), ["labels.click", "row 2", "not 0 or 1"]),
    "label_half": (setat(lambda e: e.labels_nxK, (3, 0), 0.5), ["labels.click", "row 3"]),
    "label_mask_not_binary": (setat(lambda e: e.label_mask_nxK, (0, 0), 0.3), ["label_mask.click", "row 0"]),
    "child_without_parent": (_orphan_conversion, ["label_mask.conversion", "row 5", "'click'"]),
    "domain": (setat(lambda e: e.domain_n, 4, 3), ["domain", "row 4", "value 3"]),
    "domain_negative": (setat(lambda e: e.domain_n, 0, -1), ["domain", "row 0"]),
    "float_ids": (setat(lambda e: e.sparse, "hour", np.zeros(N, np.float32)), ["hour", "integer"]),
    "missing_feature": (lambda e: e.sparse.pop("hour"), ["sparse", "missing ['hour']"]),
    "unknown_feature": (setat(lambda e: e.sparse, "zip", np.zeros(N, np.int64)), ["unexpected ['zip']"]),
    "history_fields": (lambda e: setattr(e, "history", (e.history[0][:, :3], e.history[1])), ["history", "item_id"]),
    "planted_inf": (setat(lambda e: e.planted_logits_nxK, (1, 1), -np.inf), ["planted_logits.conversion", "row 1"]),
}


@pytest.mark.parametrize("case", sorted(EXAMPLE_CASES))
def test_bad_examples_raise(ex, case):
  mutate, needles = EXAMPLE_CASES[case]
  ex = copy.deepcopy(ex)
  mutate(ex)
  _raises(lambda: validate_examples(ex, SPEC), *needles)


def test_multi_hot_row_is_reported(ex):
  row = _set_interest(ex, 12)
  _raises(lambda: validate_examples(ex, SPEC), "user_interests", f"row {row}", "id 12")


def test_child_label_is_fine_where_parent_is_one(ex):
  ex.labels_nxK[5] = (1.0, 0.0)
  ex.label_mask_nxK[5] = (1.0, 1.0)
  validate_examples(ex, SPEC)


def test_planted_nan_means_unknown(ex):
  ex.planted_logits_nxK[:] = np.nan
  validate_examples(ex, SPEC)


# ---- Batch -------------------------------------------------------------------------------------------


@pytest.fixture
def batch(ex):
  return pack(ex, SPEC, PipelineConfig(batch_size=8, bucket_multiple=8))


def _replace(b, **kw):
  return Batch(**{**vars(b), **kw})


BATCH_CASES = {
    "offsets_decrease": (setat(lambda b: b.history.offsets, 2, 0), ["history", "decrease at row 1"]),
    "offsets_start": (setat(lambda b: b.history.offsets, 0, 1), ["history", "offsets[0]"]),
    "offsets_past_capacity": (setat(lambda b: b.history.offsets, slice(6, None), 40),
                              ["history", "exceeds the capacity 16"]),
    "offsets_int64": (lambda b: _replace(b, history=Jagged(b.history.values, b.history.offsets.astype(np.int64))),
                      ["history offsets", "int32"]),
    # Row 2 grows to 7 tokens (row 3 shrinks to 0), past max_len = 6.
    "history_too_long": (setat(lambda b: b.history.offsets, 3, 9), ["history", "row 2", "max_len = 6"]),
    "multi_hot_offsets": (setat(lambda b: b.multi_hot["user_interests"].offsets, 3, -1),
                          ["user_interests", "decrease at row 2"]),
    "padding_slot_id": (setat(lambda b: b.history.values, (-1, 1), 12),
                        ["history.item_category", "padding slot 15", "id 12"]),
    "history_id": (setat(lambda b: b.history.values, (2, 0), 40), ["history.item_id", "row 2", "id 40"]),
    "ids_int64": (lambda b: _replace(b, sparse={**b.sparse, "ad_id": b.sparse["ad_id"].astype(np.int64)}),
                  ["ad_id", "int32"]),
    "single_hot": (setat(lambda b: b.sparse["hour"], 6, 24), ["hour", "row 6", "id 24"]),
    "dense_nan": (setat(lambda b: b.dense_BxG, (0, 0), np.nan), ["'ad_quality'", "row 0"]),
    "padding_row_label": (setat(lambda b: b.label_mask_BxK, (6, 0), 1.0), ["label_mask_BxK", "row 6", "padding row"]),
    "example_mask": (setat(lambda b: b.example_mask_B, 0, 0.5), ["example_mask_B", "row 0"]),
    "padding_row_history": (setat(lambda b: b.history.offsets, 8, 16),
                            ["history (tokens per row)", "row 7", "padding row"]),
    "padding_row_multi_hot": (setat(lambda b: b.multi_hot["user_interests"].offsets, 8, 12),
                              ["user_interests (tokens per row)", "row 7", "padding row"]),
    "batch_size_mismatch": (lambda b: _replace(b, domain_B=b.domain_B[:7]), ["domain_B", "shape (8,)"]),
}


@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_bad_batches_raise(batch, case):
  mutate, needles = BATCH_CASES[case]
  bad = mutate(batch) or batch
  _raises(lambda: validate_batch(bad, SPEC), *needles)


# ---- regressions found by tests/test_fuzz.py -----------------------------------------------------------------


@pytest.mark.parametrize("part", ["history", "user_interests"])
def test_scalar_jagged_values_raise(ex, part):
  """A 0-d values array used to raise IndexError (np.shape(values)[0])."""
  if part == "history":
    ex.history = (np.asarray(0), ex.history[1])
  else:
    ex.multi_hot[part] = (np.asarray(0), ex.multi_hot[part][1])
  _raises(lambda: validate_examples(ex, SPEC), part, "scalar")


def test_scalar_batch_values_raise(batch):
  bad = _replace(batch, history=Jagged(np.asarray(0, np.int32), batch.history.offsets))
  _raises(lambda: validate_batch(bad, SPEC), "history", "scalar")


@pytest.mark.parametrize("how", ["values_only", "none", "triple"])
def test_jagged_part_that_is_not_a_pair_raises(ex, how):
  """Unpacking used to raise ValueError ('too many values to unpack') or TypeError (None)."""
  values, lengths = ex.history
  ex.history = {"values_only": values, "none": None, "triple": (values, lengths, lengths)}[how]
  _raises(lambda: validate_examples(ex, SPEC), "history", "(values, lengths) pair")


def test_non_string_feature_key_is_reported(ex):
  """Sorting the keys for the message used to raise TypeError (int < str)."""
  ex.sparse[7] = ex.sparse["hour"]
  _raises(lambda: validate_examples(ex, SPEC), "sparse", "unexpected [7]")


def test_row_count_error_names_the_part_rows_are_counted_by(ex, batch):
  """A short domain_n used to be reported as 'user_id: expected shape (5,), got (6,)' alone."""
  ex.domain_n = ex.domain_n[:-1]
  _raises(lambda: validate_examples(ex, SPEC), "user_id", "rows counted by domain_n")
  bad = _replace(batch, example_mask_B=batch.example_mask_B[:-1])
  _raises(lambda: validate_batch(bad, SPEC), "domain_B", "rows counted by example_mask_B")


@pytest.mark.parametrize("part", ["labels_nxK", "label_mask_nxK", "planted_logits_nxK"])
def test_float64_label_parts_raise(ex, part):
  """float64 used to pass and pack rounded it to float32: a planted logit of 1e300 became inf in the Batch."""
  a = getattr(ex, part).astype(np.float64)
  if part == "planted_logits_nxK":
    a[0, 0] = 1e300
  setattr(ex, part, a)
  _raises(lambda: validate_examples(ex, SPEC), part.removesuffix("_nxK"), "float32", "float64")
