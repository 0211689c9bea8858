"""Fuzz tests over the batch validator and the dataset parsers (issue 8, item 5): every generated case is
either accepted by a documented policy or rejected with an error naming the feature (or file:line).

A case is a valid input (Examples, a packed Batch, or a dataset file) with exactly one mutation from a
catalog applied. An oracle written here in plain python, which never calls the code under test, says whether
the mutated input is still valid:
  valid    -> accepted, and what comes out equals what went in (the packed Batch holds the same values, the
              parsed sequences are the oracle's parse): nothing clamped, cast or dropped;
  invalid  -> BatchValidationError / SeqRecDataError whose message names the mutated part or file:line.
Any other exception (IndexError, OverflowError, numpy's TypeError, ...) is a crash and fails the test.

Each hypothesis property runs inside a plain test that counts the cases per mutation kind and outcome, and
checks that the planned number ran and that both outcomes occurred. GEM_JAX_FUZZ_SCALE=10 runs ten times as
many cases (a deeper local search); database=None and a temporary hypothesis home leave nothing in the repo.
"""

import collections
import dataclasses
import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, configuration, given, settings
from hypothesis import strategies as st

from gem_jax.data import seqrec
from gem_jax.data.pipeline import PipelineConfig, pack
from gem_jax.data.spec import ads_feature_spec
from gem_jax.data.validate import BatchValidationError, validate_batch, validate_examples
from gem_jax.jagged import Jagged
from tests.data_helpers import make_examples

SPEC = ads_feature_spec(users=50, ads=40, advertisers=10, categories=12, embed_dim=4, max_history=6,
                        max_interests=3)
CFG = PipelineConfig(batch_size=8, bucket_multiple=8)
B = CFG.batch_size
TASKS = list(SPEC.task_names)
PARENT = [TASKS.index(t.parent) if t.parent else None for t in SPEC.tasks]
DENSE_COLUMNS = [f.name for f in SPEC.dense]  # every dense feature of SPEC has dim 1
MULTI = SPEC.multi_hot[0]
SCALE = float(os.environ.get("GEM_JAX_FUZZ_SCALE", "1"))
PLANNED = {"examples": 400, "batch": 400, "rating_files": 400, "sequence_files": 300}  # >= 1000 in all


def vocab(table: str) -> int:
  return SPEC.table(table).vocab_size


@pytest.fixture(autouse=True)
def _hypothesis_home_outside_repo(tmp_path):
  """database=None keeps examples out of .hypothesis/, but hypothesis also caches the constants it reads from
  our modules under its home; point that at tmp_path while these tests run."""
  configuration.set_hypothesis_home_dir(tmp_path / "hypothesis")
  yield
  configuration.set_hypothesis_home_dir(None)


def run_counted(plan: str, kinds: list, strategy_for, check) -> None:
  """Runs check(case) -> 'accepted' | 'rejected' on cases of strategy_for(kind), an equal share of the plan for
  each mutation kind (hypothesis alone would draw some kinds rarely), then prints and checks the counts."""
  per_kind = max(1, math.ceil(PLANNED[plan] * SCALE / len(kinds)))
  by_kind: dict = {}
  for kind in kinds:
    counts = by_kind[kind] = collections.Counter()

    @settings(max_examples=per_kind, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(strategy_for(kind))
    def prop(case):
      counts[check(case)] += 1

    prop()
  outcomes = sum(by_kind.values(), collections.Counter())
  print(f"\n{plan}: {sum(outcomes.values())} cases {dict(outcomes)}")
  for kind, counts in by_kind.items():
    print(f"  {kind:26s} {dict(sorted(counts.items()))}")
  assert sum(outcomes.values()) >= PLANNED[plan] * SCALE, outcomes
  assert outcomes["accepted"] and outcomes["rejected"], outcomes


@dataclasses.dataclass
class Mut:
  """What a mutation did. legal_layout False: dtype, shape, keys or structure break the policy, so the input is
  invalid whatever its values and the error must name one of `names`; True: the content oracle decides (and
  names the parts). anywhere: the name may sit anywhere in the message (the part all row counts come from)."""
  names: tuple = ()
  legal_layout: bool = True
  anywhere: bool = False


def expect_outcome(fn, error, bad: list, anywhere: bool = False):
  """'accepted' (with fn's result) if bad is empty, else 'rejected' by `error` naming one of bad."""
  try:
    result = fn()
  except error as e:
    msg = str(e)
    assert bad, f"valid input rejected: {msg}"
    where = msg if anywhere else msg.split(": ")[0]  # messages start with the part they are about
    assert any(name in where for name in bad), f"{msg!r} does not name any of {bad}"
    return "rejected", None
  assert not bad, f"invalid input accepted; the oracle found {bad}"
  return "accepted", result


# ---- value draws ---------------------------------------------------------------------------------------------

HUGE = [-2**63, -2**31 - 1, -2**31, 2**31 - 1, 2**31, 2**40, 2**63 - 1]
INT32_EDGES = [-2**31, -1, 2**31 - 1]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
OTHER_DTYPES = ["float16", "float32", "float64", "bool", "object", "complex64"]
FLOAT_LABELS = st.one_of(st.sampled_from([0.0, 1.0, -0.0]), st.floats(width=32))


def ids(n: int, edges=tuple(HUGE)):
  """Ids around a vocab of n (both edges) and far outside it."""
  return st.one_of(st.integers(-2, n + 1), st.sampled_from(edges))


def cast(draw, a: np.ndarray, allowed) -> tuple[np.ndarray, bool]:
  """a in a drawn dtype (integer casts may wrap, as a careless producer's would) and whether it is allowed."""
  dt = draw(st.sampled_from(INT_DTYPES + OTHER_DTYPES))
  with np.errstate(invalid="ignore"):  # NaN planted logits cast to an integer dtype
    return a.astype(dt), dt in allowed


def resize(draw, a: np.ndarray) -> np.ndarray:
  """a with its leading dim one shorter or one longer."""
  return a[:-1] if draw(st.booleans()) else np.concatenate([a, a[-1:]])


def new_tokens(draw, count: int, tables: list[str]) -> np.ndarray:
  return np.asarray([[draw(st.integers(0, vocab(t) - 1)) for t in tables] for _ in range(count)],
                    np.int64).reshape(count, len(tables))


# ---- the content oracles (plain python; they assume dtypes and shapes are legal) ----------------------------


def _out_of(xs, n: int) -> bool:
  return any(not 0 <= x < n for x in xs)


def _label_violations(labels, mask, planted, rows) -> list[str]:
  bad = []
  for r in rows:
    for k, task in enumerate(TASKS):
      if labels[r][k] not in (0.0, 1.0):
        bad.append(f"labels.{task}")
      if mask[r][k] not in (0.0, 1.0):
        bad.append(f"label_mask.{task}")
      if math.isinf(planted[r][k]):
        bad.append(f"planted_logits.{task}")
      p = PARENT[k]
      if p is not None and mask[r][k] == 1.0 and not (mask[r][p] == 1.0 and labels[r][p] == 1.0):
        bad.append(f"label_mask.{task}")
  return bad


def _dense_violations(dense) -> list[str]:
  return [DENSE_COLUMNS[c] for row in dense for c, x in enumerate(row) if not math.isfinite(x)]


def example_violations(ex) -> list[str]:
  """The parts of ex that break the spec's value rules."""
  bad = [f.name for f in SPEC.single_hot if _out_of(ex.sparse[f.name].tolist(), vocab(f.table))]
  parts = [(MULTI.name, *ex.multi_hot[MULTI.name], MULTI.max_ids), ("history", *ex.history, SPEC.sequence.max_len)]
  for name, values, lengths, limit in parts:
    lengths = lengths.tolist()
    if any(not 0 <= n <= limit for n in lengths) or sum(lengths) != len(values):
      bad.append(name)
  if _out_of(ex.multi_hot[MULTI.name][0].tolist(), vocab(MULTI.table)):
    bad.append(MULTI.name)
  bad += _token_dense_domain_violations(ex.history[0].tolist(), ex.dense_nxG.tolist(), ex.domain_n.tolist())
  return bad + _label_violations(ex.labels_nxK.tolist(), ex.label_mask_nxK.tolist(),
                                 ex.planted_logits_nxK.tolist(), range(len(ex.domain_n)))


def _token_dense_domain_violations(tokens: list, dense: list, domain: list) -> list[str]:
  """History token ids (every slot), dense values and domains: the rules both layouts share."""
  bad = [f"history.{field.name}" for j, field in enumerate(SPEC.sequence.fields)
         if _out_of([t[j] for t in tokens], vocab(field.table))]
  bad += _dense_violations(dense)
  return bad + (["domain"] if _out_of(domain, len(SPEC.domains)) else [])


def _offsets_bad(offsets: list, capacity: int, limit: int) -> bool:
  steps = [b - a for a, b in zip(offsets, offsets[1:])]
  return offsets[0] != 0 or any(not 0 <= s <= limit for s in steps) or offsets[-1] > capacity


def batch_violations(b) -> list[str]:
  """The parts of batch b that break the spec's value rules; every token slot, padding included, is looked up."""
  bad = [f.name for f in SPEC.single_hot if _out_of(b.sparse[f.name].tolist(), vocab(f.table))]
  jag = b.multi_hot[MULTI.name]
  if _offsets_bad(jag.offsets.tolist(), jag.values.shape[0], MULTI.max_ids) or _out_of(jag.values.tolist(),
                                                                                       vocab(MULTI.table)):
    bad.append(MULTI.name)
  if _offsets_bad(b.history.offsets.tolist(), b.history.values.shape[0], SPEC.sequence.max_len):
    bad.append("history")
  bad += _token_dense_domain_violations(b.history.values.tolist(), b.dense_BxG.tolist(), b.domain_B.tolist())
  example_mask, label_mask = b.example_mask_B.tolist(), b.label_mask_BxK.tolist()
  bad += _label_violations(b.labels_BxK.tolist(), label_mask, b.planted_logits_BxK.tolist(), range(B))
  if any(m not in (0.0, 1.0) for m in example_mask):
    bad.append("example_mask_B")
  if any(x > m for m, row in zip(example_mask, label_mask) for x in row):
    bad.append("label_mask")  # a defined label on a padding row
  for name, offsets in ((MULTI.name, jag.offsets.tolist()), ("history", b.history.offsets.tolist())):
    if name not in bad and any(m == 0.0 and hi > lo for m, lo, hi in zip(example_mask, offsets, offsets[1:])):
      bad.append(name)  # tokens on a padding row
  return bad


# ---- Examples -------------------------------------------------------------------------------------------------


def _row(draw, n: int) -> int:
  return draw(st.integers(0, n - 1))


def _jagged_pair(ex, which: str):
  return ex.history if which == "history" else ex.multi_hot[which]


def _set_jagged_pair(ex, which: str, pair) -> None:
  if which == "history":
    ex.history = pair
  else:
    ex.multi_hot[which] = pair


def _ensure_token(values, lengths):
  """A (values, lengths) pair with at least one token (row 0 gets one id-0 token if all rows were empty)."""
  if values.shape[0]:
    return values.copy(), lengths
  lengths = lengths.copy()
  lengths[0] = 1
  return np.zeros((1,) + values.shape[1:], values.dtype), lengths


def ex_none(ex, draw):
  return ex, Mut()


def ex_empty_block(ex, draw):
  return make_examples(SPEC, np.random.default_rng(0), 0), Mut()


def ex_single_hot_id(ex, draw):
  f = draw(st.sampled_from(SPEC.single_hot))
  dtype = draw(st.sampled_from([np.int64, np.uint64, np.int32]))
  info = np.iinfo(dtype)
  v = min(max(draw(ids(vocab(f.table))), int(info.min)), int(info.max))
  a = ex.sparse[f.name].astype(dtype)
  a[_row(draw, len(ex))] = v
  ex.sparse[f.name] = a
  return ex, Mut((f.name,))


def ex_single_hot_dtype(ex, draw):
  f = draw(st.sampled_from(SPEC.single_hot))
  ex.sparse[f.name], ok = cast(draw, ex.sparse[f.name], INT_DTYPES)
  return ex, Mut((f.name,), ok)


def ex_multi_hot_id(ex, draw):
  values, lengths = _ensure_token(*ex.multi_hot[MULTI.name])
  values[draw(st.integers(0, values.shape[0] - 1))] = draw(ids(vocab(MULTI.table)))
  ex.multi_hot[MULTI.name] = (values, lengths)
  return ex, Mut((MULTI.name,))


def ex_history_id(ex, draw):
  values, lengths = _ensure_token(*ex.history)
  j = draw(st.integers(0, values.shape[1] - 1))
  values[draw(st.integers(0, values.shape[0] - 1)), j] = draw(ids(vocab(SPEC.sequence.fields[j].table)))
  ex.history = (values, lengths)
  return ex, Mut()


def ex_length(ex, draw):
  """Row r gets length L; `aligned` inserts or removes valid tokens of that row so the values still match."""
  which = draw(st.sampled_from(["history", MULTI.name]))
  values, lengths = _jagged_pair(ex, which)
  limit = SPEC.sequence.max_len if which == "history" else MULTI.max_ids
  tables = [f.table for f in SPEC.sequence.fields] if which == "history" else [MULTI.table]
  r = _row(draw, len(ex))
  L = draw(st.one_of(st.integers(-2, limit + 2), st.sampled_from([2**31, 2**62, -2**63])))
  if draw(st.booleans()) and 0 <= L <= limit + 2:
    lo = int(lengths[:r].sum())
    row = new_tokens(draw, L, tables).reshape((L,) + values.shape[1:])
    values = np.concatenate([values[:lo], row, values[lo + int(lengths[r]):]])
  lengths = lengths.copy()
  lengths[r] = L
  _set_jagged_pair(ex, which, (values, lengths))
  return ex, Mut()


def ex_empty_histories(ex, draw):
  ex.history = (ex.history[0][:0], np.zeros(len(ex), np.int64))
  return ex, Mut()


def ex_history_layout(ex, draw):
  values, lengths = ex.history
  how = draw(st.sampled_from(["cast", "drop_field", "extra_field", "flat", "scalar", "3d"]))
  ok = False
  if how == "cast":
    values, ok = cast(draw, values, INT_DTYPES)
  else:
    values = {"drop_field": lambda: values[:, :-1], "extra_field": lambda: np.concatenate([values, values[:, :1]], 1),
              "flat": lambda: values[:, 0], "scalar": lambda: np.asarray(0), "3d": lambda: values[:, :, None]}[how]()
  ex.history = (values, lengths)
  return ex, Mut(("history",), ok)


def ex_multi_hot_layout(ex, draw):
  values, lengths = ex.multi_hot[MULTI.name]
  how = draw(st.sampled_from(["cast", "2d", "scalar"]))
  ok = False
  if how == "cast":
    values, ok = cast(draw, values, INT_DTYPES)
  else:
    values = values[:, None] if how == "2d" else np.asarray(0)
  ex.multi_hot[MULTI.name] = (values, lengths)
  return ex, Mut((MULTI.name,), ok)


def ex_lengths_layout(ex, draw):
  which = draw(st.sampled_from(["history", MULTI.name]))
  values, lengths = _jagged_pair(ex, which)
  how = draw(st.sampled_from(["cast", "resize", "2d", "scalar"]))
  ok = False
  if how == "cast":
    lengths, ok = cast(draw, lengths, INT_DTYPES)
  else:
    lengths = {"resize": lambda: resize(draw, lengths), "2d": lambda: lengths[:, None],
               "scalar": lambda: np.asarray(lengths.sum())}[how]()
  _set_jagged_pair(ex, which, (values, lengths))
  return ex, Mut((which,), ok)


def ex_structure(ex, draw):
  """A jagged part that is not a (values, lengths) pair."""
  which = draw(st.sampled_from(["history", MULTI.name]))
  values, lengths = _jagged_pair(ex, which)
  how = draw(st.sampled_from(["values_only", "triple", "none", "dict"]))
  _set_jagged_pair(ex, which, {"values_only": values, "triple": (values, lengths, lengths), "none": None,
                               "dict": {"values": values, "lengths": lengths}}[how])
  return ex, Mut((which,), False)


def ex_dense_value(ex, draw):
  ex.dense_nxG[_row(draw, len(ex)), draw(st.integers(0, SPEC.dense_dim - 1))] = draw(st.floats(width=32))
  return ex, Mut()


def ex_dense_layout(ex, draw):
  if draw(st.booleans()):
    ex.dense_nxG, ok = cast(draw, ex.dense_nxG, ["float32"])
  else:
    how = draw(st.sampled_from(["rows", "narrow", "wide", "flat"]))
    d = ex.dense_nxG
    ex.dense_nxG = {"rows": lambda: resize(draw, d), "narrow": lambda: d[:, :-1],
                    "wide": lambda: np.concatenate([d, d[:, :1]], 1), "flat": lambda: d[:, 0]}[how]()
    ok = False
  return ex, Mut(("dense",), ok)


def ex_domain(ex, draw):
  if draw(st.booleans()):
    ex.domain_n[_row(draw, len(ex))] = draw(ids(len(SPEC.domains)))
    return ex, Mut()
  ex.domain_n, ok = cast(draw, ex.domain_n, INT_DTYPES)
  return ex, Mut(("domain",), ok)


LABEL_PARTS = {"labels_nxK": "labels", "label_mask_nxK": "label_mask", "planted_logits_nxK": "planted_logits"}


def ex_label_value(ex, draw):
  part = draw(st.sampled_from(sorted(LABEL_PARTS)))
  getattr(ex, part)[_row(draw, len(ex)), draw(st.integers(0, len(TASKS) - 1))] = draw(FLOAT_LABELS)
  return ex, Mut()


def ex_label_layout(ex, draw):
  part = draw(st.sampled_from(sorted(LABEL_PARTS)))
  a = getattr(ex, part)
  how = draw(st.sampled_from(["cast", "rows", "drop_task", "extra_task", "flat"]))
  ok = False
  if how == "cast":
    a, ok = cast(draw, a, ["float32"])
  else:
    a = {"rows": lambda: resize(draw, a), "drop_task": lambda: a[:, :-1],
         "extra_task": lambda: np.concatenate([a, a[:, :1]], 1), "flat": lambda: a[:, 0]}[how]()
  setattr(ex, part, a)
  return ex, Mut((LABEL_PARTS[part],), ok)


def ex_keys(ex, draw):
  where = draw(st.sampled_from(["sparse", "multi_hot"]))
  d = getattr(ex, where)
  key = draw(st.sampled_from(sorted(d)))
  how = draw(st.sampled_from(["drop", "extra", "extra_int_key", "rename"]))
  if how == "drop":
    del d[key]
  elif how == "extra":
    d["zip_code"] = d[key]
  elif how == "extra_int_key":
    d[7] = d[key]
  else:
    d[key.upper()] = d.pop(key)
  return ex, Mut((where,), False)


def ex_row_count(ex, draw):
  """One per-example part with a row too few or too many; domain_n is the part the others are counted against."""
  part = draw(st.sampled_from(["domain_n", "sparse", "history lengths", "multi_hot lengths", "dense_nxG",
                               *sorted(LABEL_PARTS)]))
  if part == "domain_n":
    ex.domain_n = resize(draw, ex.domain_n)
    return ex, Mut(("domain",), False, anywhere=True)
  if part == "sparse":
    f = draw(st.sampled_from(SPEC.single_hot))
    ex.sparse[f.name] = resize(draw, ex.sparse[f.name])
    return ex, Mut((f.name,), False)
  if part.endswith("lengths"):
    which = "history" if part == "history lengths" else MULTI.name
    values, lengths = _jagged_pair(ex, which)
    _set_jagged_pair(ex, which, (values, resize(draw, lengths)))
    return ex, Mut((which,), False)
  setattr(ex, part, resize(draw, getattr(ex, part)))
  return ex, Mut((LABEL_PARTS.get(part, "dense"),), False)


EXAMPLE_MUTATIONS = {f.__name__[3:]: f for f in [
    ex_none, ex_empty_block, ex_single_hot_id, ex_single_hot_dtype, ex_multi_hot_id, ex_history_id, ex_length,
    ex_empty_histories, ex_history_layout, ex_multi_hot_layout, ex_lengths_layout, ex_structure, ex_dense_value,
    ex_dense_layout, ex_domain, ex_label_value, ex_label_layout, ex_keys, ex_row_count]}


@st.composite
def mutated_examples(draw, kind: str):
  ex = make_examples(SPEC, np.random.default_rng(draw(st.integers(0, 2**32 - 1))), draw(st.integers(1, B)))
  return EXAMPLE_MUTATIONS[kind](ex, draw)


def assert_packed_unchanged(ex, b) -> None:
  """The packed batch holds exactly the examples' values (no clamp, no narrowing, nothing dropped)."""
  n = len(ex)
  for f in SPEC.single_hot:
    assert b.sparse[f.name][:n].tolist() == ex.sparse[f.name].tolist(), f.name
  for name, (values, lengths), jag in [(MULTI.name, ex.multi_hot[MULTI.name], b.multi_hot[MULTI.name]),
                                       ("history", ex.history, b.history)]:
    steps = np.diff(jag.offsets)
    assert steps[:n].tolist() == lengths.tolist() and not steps[n:].any(), name
    assert jag.values[:values.shape[0]].tolist() == values.tolist(), name
  assert b.dense_BxG[:n].tolist() == ex.dense_nxG.tolist()
  assert b.domain_B[:n].tolist() == ex.domain_n.tolist()
  assert b.labels_BxK[:n].tolist() == ex.labels_nxK.tolist()
  assert b.label_mask_BxK[:n].tolist() == ex.label_mask_nxK.tolist()
  assert np.array_equal(b.planted_logits_BxK[:n], ex.planted_logits_nxK, equal_nan=True)
  assert b.example_mask_B.tolist() == [1.0] * n + [0.0] * (B - n)


def check_examples(case) -> str:
  ex, mut = case
  bad = example_violations(ex) if mut.legal_layout else list(mut.names)
  outcome, _ = expect_outcome(lambda: validate_examples(ex, SPEC), BatchValidationError, bad, mut.anywhere)
  if outcome == "accepted":
    b = pack(ex, SPEC, CFG)
    validate_batch(b, SPEC)
    assert_packed_unchanged(ex, b)
  return outcome


def test_fuzz_examples():
  run_counted("examples", list(EXAMPLE_MUTATIONS), mutated_examples, check_examples)


# ---- Batch ----------------------------------------------------------------------------------------------------


def _jag(b, which: str) -> Jagged:
  return b.history if which == "history" else b.multi_hot[which]


def _with_jag(b, which: str, jag: Jagged):
  if which == "history":
    return dataclasses.replace(b, history=jag)
  return dataclasses.replace(b, multi_hot={**b.multi_hot, which: jag})


JAGGED = st.sampled_from(["history", MULTI.name])


def b_none(b, draw):
  return b, Mut()


def b_offsets_value(b, draw):
  jag = _jag(b, draw(JAGGED))
  jag.offsets[draw(st.integers(0, B))] = draw(ids(jag.capacity, INT32_EDGES))
  return b, Mut()


def b_offsets_layout(b, draw):
  which = draw(JAGGED)
  jag = _jag(b, which)
  how = draw(st.sampled_from(["cast", "resize", "2d", "scalar"]))
  ok = False
  if how == "cast":
    offsets, ok = cast(draw, jag.offsets, ["int32"])
  else:
    offsets = {"resize": lambda: resize(draw, jag.offsets), "2d": lambda: jag.offsets[:, None],
               "scalar": lambda: np.asarray(0, np.int32)}[how]()
  return _with_jag(b, which, Jagged(jag.values, offsets)), Mut((which,), ok)


def b_values_layout(b, draw):
  which = draw(JAGGED)
  jag = _jag(b, which)
  how = draw(st.sampled_from(["cast", "scalar", "short", "rank"]))
  ok = how == "short"  # a capacity below offsets[B] is a value error the oracle sees
  if how == "cast":
    values, ok = cast(draw, jag.values, ["int32"])
  elif how == "short":
    values = jag.values[:max(int(jag.offsets[-1]) - draw(st.integers(0, 1)), 0)]
  elif how == "scalar":
    values = np.asarray(0, np.int32)
  else:
    values = jag.values[:, :-1] if which == "history" else jag.values[:, None]
  return _with_jag(b, which, Jagged(values, jag.offsets)), Mut((which,), ok)


def b_slot_id(b, draw):
  """Any token slot, the tail padding included (a lookup reads every slot of the capacity)."""
  which = draw(JAGGED)
  jag = _jag(b, which)
  t = draw(st.integers(0, jag.capacity - 1))
  if which == "history":
    j = draw(st.integers(0, len(SPEC.sequence.fields) - 1))
    jag.values[t, j] = draw(ids(vocab(SPEC.sequence.fields[j].table), INT32_EDGES))
  else:
    jag.values[t] = draw(ids(vocab(MULTI.table), INT32_EDGES))
  return b, Mut()


def b_single_hot(b, draw):
  f = draw(st.sampled_from(SPEC.single_hot))
  if draw(st.booleans()):
    b.sparse[f.name][_row(draw, B)] = draw(ids(vocab(f.table), INT32_EDGES))
    return b, Mut()
  if draw(st.booleans()):
    a, ok = cast(draw, b.sparse[f.name], ["int32"])
  else:
    a, ok = resize(draw, b.sparse[f.name]), False
  return dataclasses.replace(b, sparse={**b.sparse, f.name: a}), Mut((f.name,), ok)


def b_dense(b, draw):
  if draw(st.booleans()):
    b.dense_BxG[_row(draw, B), draw(st.integers(0, SPEC.dense_dim - 1))] = draw(st.floats(width=32))
    return b, Mut()
  if draw(st.booleans()):
    d, ok = cast(draw, b.dense_BxG, ["float32"])
  else:
    d, ok = (resize(draw, b.dense_BxG) if draw(st.booleans()) else b.dense_BxG[:, :-1]), False
  return dataclasses.replace(b, dense_BxG=d), Mut(("dense",), ok)


def b_domain(b, draw):
  if draw(st.booleans()):
    b.domain_B[_row(draw, B)] = draw(ids(len(SPEC.domains), INT32_EDGES))
    return b, Mut()
  if draw(st.booleans()):
    d, ok = cast(draw, b.domain_B, ["int32"])
  else:
    d, ok = resize(draw, b.domain_B), False
  return dataclasses.replace(b, domain_B=d), Mut(("domain",), ok)


FLOAT_PARTS = {"labels_BxK": "labels", "label_mask_BxK": "label_mask", "planted_logits_BxK": "planted_logits",
               "example_mask_B": "example_mask_B"}


def b_float_value(b, draw):
  """A label, label mask, planted logit or example mask entry: padding rows become real and back."""
  part = draw(st.sampled_from(sorted(FLOAT_PARTS)))
  a = getattr(b, part)
  index = _row(draw, B) if a.ndim == 1 else (_row(draw, B), draw(st.integers(0, len(TASKS) - 1)))
  a[index] = draw(FLOAT_LABELS)
  return b, Mut()


def b_float_layout(b, draw):
  part = draw(st.sampled_from(sorted(FLOAT_PARTS)))
  a = getattr(b, part)
  if draw(st.booleans()):
    a, ok = cast(draw, a, ["float32"])
  else:
    a, ok = (resize(draw, a) if draw(st.booleans()) or a.ndim == 1 else a[:, :-1]), False
  # example_mask_B sets B: the other parts' row counts are reported against it.
  return dataclasses.replace(b, **{part: a}), Mut((FLOAT_PARTS[part],), ok, anywhere=part == "example_mask_B")


def b_keys(b, draw):
  where = draw(st.sampled_from(["sparse", "multi_hot"]))
  d = dict(getattr(b, where))
  key = draw(st.sampled_from(sorted(d)))
  how = draw(st.sampled_from(["drop", "extra", "extra_int_key"]))
  if how == "drop":
    del d[key]
  else:
    d["zip_code" if how == "extra" else 7] = d[key]
  return dataclasses.replace(b, **{where: d}), Mut((where,), False)


BATCH_MUTATIONS = {f.__name__[2:]: f for f in [
    b_none, b_offsets_value, b_offsets_layout, b_values_layout, b_slot_id, b_single_hot, b_dense, b_domain,
    b_float_value, b_float_layout, b_keys]}


@st.composite
def mutated_batches(draw, kind: str):
  ex = make_examples(SPEC, np.random.default_rng(draw(st.integers(0, 2**32 - 1))), draw(st.integers(1, B)))
  return BATCH_MUTATIONS[kind](pack(ex, SPEC, CFG), draw)


def check_batch(case) -> str:
  b, mut = case
  bad = batch_violations(b) if mut.legal_layout else list(mut.names)
  return expect_outcome(lambda: validate_batch(b, SPEC), BatchValidationError, bad, mut.anywhere)[0]


def test_fuzz_batches():
  run_counted("batch", list(BATCH_MUTATIONS), mutated_batches, check_batch)


# ---- dataset files -------------------------------------------------------------------------------------------

# fmt -> (loader, field separator of a valid line)
FORMATS = {"ratings": (seqrec.load_ratings, "::"), "u.data": (seqrec.load_u_data, "\t"),
           "sequences": (seqrec.load_sequences, " ")}
HEADERS = {"ratings": "UserID::MovieID::Rating::Timestamp", "u.data": "user\titem\trating\ttimestamp",
           "sequences": "user_id item_id_list"}
SEPARATOR_SWAPS = {"ratings": [":", ";", " :: ", "\t", ":::"], "u.data": [" ", ",", "\t\t", "  ", ":"],
                   "sequences": ["\t", "  ", " \t ", ",", "\xa0", "\x0b"]}
USER_IDS = st.one_of(st.integers(1, 60), st.sampled_from([2**31, 10**12, 2**63 - 1]))
ITEM_IDS = st.one_of(st.integers(1, 30), st.sampled_from([2**32, 2**63 - 1]))
TIMESTAMPS = st.one_of(st.integers(-5, 30), st.sampled_from([-2**63, 0, 978300760, 2**63 - 1]))
JUNK = ["x", "", " ", "1.5", "1e3", "+3", "1_0", "0x1f", "nan", "--1", "1-", "\ufeff7", "\u0663", "\uff13",
        "\u22125", "\xb2", "\xa07", "7\x00", "\xe9", "1 2"]
INT_TOKENS = ["0", "-0", "-1", "007", "0" * 25 + "1", str(2**63 - 1), str(2**63), str(-2**63), str(-2**63 - 1),
              str(10**30), "-" + "9" * 30, "9" * 5000]
_INT = re.compile(r"-?[0-9]+")


def as_bytes_text(s: str) -> str:
  """s as a real file holds it (utf-8), seen byte per character: the parsers read files as latin-1."""
  return s.encode("utf-8").decode("latin-1")


@dataclasses.dataclass
class FileCase:
  lines: list
  eol: str = "\n"
  final_newline: bool = True

  def text(self) -> str:
    return self.eol.join(self.lines) + (self.eol if self.final_newline and self.lines else "")


def _tokens(line: str, fmt: str) -> list[str]:
  return line.split(FORMATS[fmt][1])


def _join(tokens: list[str], fmt: str) -> str:
  return FORMATS[fmt][1].join(tokens)


def _line(draw, c: FileCase) -> int:
  return draw(st.integers(0, len(c.lines) - 1))


def f_none(c, draw, fmt):
  pass


def f_blank_line(c, draw, fmt):
  c.lines.insert(draw(st.integers(0, len(c.lines))), draw(st.sampled_from(["", " ", "\t", " \t ", "\r"])))


def f_edge_whitespace(c, draw, fmt):
  i, ws = _line(draw, c), draw(st.sampled_from([" ", "\t", "\r", "  \t", " \r"]))
  c.lines[i] = ws + c.lines[i] if draw(st.booleans()) else c.lines[i] + ws


def f_crlf(c, draw, fmt):
  c.eol = "\r\n"


def f_no_final_newline(c, draw, fmt):
  c.final_newline = False


def f_lone_cr(c, draw, fmt):
  if len(c.lines) >= 2:
    i = draw(st.integers(0, len(c.lines) - 2))
    c.lines[i:i + 2] = [c.lines[i] + "\r" + c.lines[i + 1]]


def f_field_count(c, draw, fmt):
  i = _line(draw, c)
  tokens = _tokens(c.lines[i], fmt)
  if draw(st.booleans()):
    del tokens[draw(st.integers(0, len(tokens) - 1))]
  else:
    tokens.insert(draw(st.integers(0, len(tokens))), str(draw(ITEM_IDS)))
  c.lines[i] = _join(tokens, fmt)


def _replace_token(c, draw, fmt, token: str):
  i = _line(draw, c)
  tokens = _tokens(c.lines[i], fmt)
  tokens[draw(st.integers(0, len(tokens) - 1))] = token
  c.lines[i] = _join(tokens, fmt)


def f_junk_token(c, draw, fmt):
  _replace_token(c, draw, fmt, as_bytes_text(draw(st.sampled_from(JUNK))))


def f_int_token(c, draw, fmt):
  _replace_token(c, draw, fmt, draw(st.one_of(st.sampled_from(INT_TOKENS), st.integers(-3, 40).map(str))))


def f_duplicate_line(c, draw, fmt):
  c.lines.insert(draw(st.integers(0, len(c.lines))), c.lines[_line(draw, c)])


def f_drop_lines(c, draw, fmt):
  for _ in range(draw(st.integers(1, len(c.lines)))):
    del c.lines[_line(draw, c)]


def f_short_user(c, draw, fmt):
  """One user keeps 1 or 2 interactions."""
  keep = draw(st.integers(1, 2))
  if fmt == "sequences":
    i = _line(draw, c)
    c.lines[i] = _join(_tokens(c.lines[i], fmt)[:1 + keep], fmt)
  else:
    user = _tokens(c.lines[_line(draw, c)], fmt)[0]
    mine = [i for i, line in enumerate(c.lines) if _tokens(line, fmt)[0] == user]
    for i in reversed(mine[keep:]):
      del c.lines[i]


def f_empty_file(c, draw, fmt):
  c.lines = draw(st.sampled_from([[], [""], [" ", "\t"]]))


def f_separator(c, draw, fmt):
  i = _line(draw, c)
  c.lines[i] = c.lines[i].replace(FORMATS[fmt][1], draw(st.sampled_from(SEPARATOR_SWAPS[fmt])))


def f_insert_text(c, draw, fmt):
  """Arbitrary unicode (utf-8 encoded) or raw bytes inserted anywhere in a line, newlines included."""
  i = _line(draw, c)
  junk = draw(st.one_of(st.text(min_size=1, max_size=4).map(as_bytes_text),
                        st.binary(min_size=1, max_size=3).map(lambda b: b.decode("latin-1"))))
  pos = draw(st.integers(0, len(c.lines[i])))
  c.lines[i] = c.lines[i][:pos] + junk + c.lines[i][pos:]


def f_header(c, draw, fmt):
  c.lines.insert(0, HEADERS[fmt])


def f_byte_order_mark(c, draw, fmt):
  c.lines[0] = as_bytes_text("\ufeff") + c.lines[0]


FILE_MUTATIONS = {f.__name__[2:]: f for f in [
    f_none, f_blank_line, f_edge_whitespace, f_crlf, f_no_final_newline, f_lone_cr, f_field_count, f_junk_token,
    f_int_token, f_duplicate_line, f_drop_lines, f_short_user, f_empty_file, f_separator, f_insert_text, f_header,
    f_byte_order_mark]}


@st.composite
def mutated_files(draw, fmt_kind: str):
  fmt, kind = fmt_kind.split("/")
  users = draw(st.lists(USER_IDS, min_size=1, max_size=4, unique=True))
  if fmt == "sequences":
    lines = [" ".join(map(str, [u] + draw(st.lists(ITEM_IDS, min_size=3, max_size=6)))) for u in users]
  else:
    rows = [(u, draw(ITEM_IDS), draw(st.integers(1, 5)), draw(TIMESTAMPS))
            for u in users for _ in range(draw(st.integers(3, 5)))]
    lines = [FORMATS[fmt][1].join(map(str, r)) for r in draw(st.permutations(rows))]
  case = FileCase(lines)
  FILE_MUTATIONS[kind](case, draw, fmt)
  return fmt, case.text()


# The documented file policy, written again independently: lines end at "\n"; spaces, tabs and CRs around a
# line are ignored; blank lines are skipped but counted; a field is an optional "-" and ASCII digits, in int64;
# ids and ratings are positive. Returns ("ok", users, sequences) or ("error", line or None, reason).


def _oracle_int(token: str, what: str):
  if not _INT.fullmatch(token):
    return None, "is not an integer"
  if len(token.lstrip("-").lstrip("0")) > 19 or not -2**63 <= int(token) < 2**63:
    return None, "does not fit in int64"
  if what != "timestamp" and int(token) < 1:
    return None, "must be a positive integer"
  return int(token), None


def _oracle_lines(text: str):
  for i, raw in enumerate(text.split("\n"), 1):
    line = raw.strip(" \t\r")
    if line:
      yield i, line


def oracle_rating_rows(text: str, sep: str):
  by_user = {}
  for i, line in _oracle_lines(text):
    fields = line.split(sep)
    if len(fields) != 4:
      return "error", i, "expected 4 fields"
    values = []
    for token, what in zip(fields, ("user id", "item id", "rating", "timestamp")):
      v, why = _oracle_int(token, what)
      if why:
        return "error", i, why
      values.append(v)
    by_user.setdefault(values[0], []).append((values[3], i, values[1]))
  if not by_user:
    return "error", None, "no interactions"
  for user in sorted(by_user):
    if len(by_user[user]) < 3:
      return "error", min(i for _, i, _ in by_user[user]), "interactions"
  return "ok", sorted(by_user), [[item for _, _, item in sorted(by_user[u])] for u in sorted(by_user)]


def oracle_sequences(text: str):
  users, seqs, line_of = [], [], {}
  for i, line in _oracle_lines(text):
    tokens = re.split(r"[ \t]+", line)
    user, why = _oracle_int(tokens[0], "user id")
    if why:
      return "error", i, why
    if user in line_of:
      return "error", i, "already has a line"
    line_of[user] = i
    if len(tokens) == 1:
      return "error", i, "has no items"
    items = []
    for token in tokens[1:]:
      v, why = _oracle_int(token, "item id")
      if why:
        return "error", i, why
      items.append(v)
    users.append(user)
    seqs.append(items)
  if not users:
    return "error", None, "no user lines"
  for user, items in zip(users, seqs):
    if len(items) < 3:
      return "error", line_of[user], "interactions"
  return "ok", users, seqs


def check_file(path: str, case) -> str:
  fmt, text = case
  with open(path, "wb") as f:
    f.write(text.encode("latin-1"))
  expect = oracle_sequences(text) if fmt == "sequences" else oracle_rating_rows(text, FORMATS[fmt][1])
  try:
    ds = FORMATS[fmt][0](path)
  except seqrec.SeqRecDataError as e:
    msg = str(e)
    assert expect[0] == "error", f"valid file rejected: {msg}\n{text[:300]!r}"
    where = f"{path}:{expect[1]}: " if expect[1] else f"{path}: "
    assert msg.startswith(where) and expect[2] in msg, f"{msg[:300]!r} should start {where!r}, say {expect[2]!r}"
    return "rejected"
  assert expect[0] == "ok", f"invalid file accepted: the oracle says {expect}\n{text[:300]!r}"
  _, users, seqs = expect
  assert ds.user_ids.tolist() == users
  assert [ds.item_ids[s - 1].tolist() for s in ds.sequences] == seqs
  assert ds.item_ids.tolist() == sorted({i for s in seqs for i in s})
  assert all(s.dtype == np.int32 and s.min() >= 1 for s in ds.sequences)
  return "accepted"


def test_fuzz_rating_files(tmp_path):
  kinds = [f"{fmt}/{kind}" for fmt in ("ratings", "u.data") for kind in FILE_MUTATIONS]
  run_counted("rating_files", kinds, mutated_files, lambda case: check_file(str(tmp_path / "ratings.dat"), case))


def test_fuzz_sequence_files(tmp_path):
  kinds = [f"sequences/{kind}" for kind in FILE_MUTATIONS]
  run_counted("sequence_files", kinds, mutated_files, lambda case: check_file(str(tmp_path / "seq.txt"), case))
