"""Fuzz test of the Parquet reader (gem_jax/data/parquet_rows.py through parquet_source.RowGroups): every
generated file is valid Examples written by the export with at most one mutation, under a random policy
(tables: error or hash; history: error or truncate; labels: error or mask). An oracle here, in plain python,
says what the reader must do:
  valid, or tolerated by the policy  -> accepted, and what comes back equals the oracle's Examples exactly
                                        (a hashed id only has to land in its table; the counters say how many);
  invalid                            -> DataFileError naming the file, the column and (for a value) the row.
Any other exception is a crash and fails the test. 500 cases (GEM_JAX_FUZZ_SCALE multiplies them).
"""

import collections
import dataclasses
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, configuration, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gem_jax.data import export, spec_file  # noqa: E402
from gem_jax.data.parquet_rows import Converter, DataFileError  # noqa: E402
from gem_jax.data.parquet_source import RowGroups  # noqa: E402
from gem_jax.data.spec import ads_feature_spec  # noqa: E402
from tests.data_helpers import make_examples  # noqa: E402

BASE = ads_feature_spec(users=50, ads=40, advertisers=10, categories=12, embed_dim=4, max_history=6, max_interests=3)
COLUMNS = spec_file.Columns.default(BASE)
N = 7
CASES = int(500 * float(os.environ.get("GEM_JAX_FUZZ_SCALE", "1")))
KINDS = ("none", "single_id", "multi_id", "history_id", "null_id", "wrong_type", "dense", "history_long",
         "history_mismatch", "root_label", "child_label", "missing_column", "domain", "multi_long")
ODD = [-2**63, -2**31, -1, 0, 1, 2**31 - 1, 2**40, 2**63 - 1]


@pytest.fixture(autouse=True)
def _hypothesis_home_outside_repo(tmp_path):
  configuration.set_hypothesis_home_dir(tmp_path / "hypothesis")
  yield
  configuration.set_hypothesis_home_dir(None)


def _policy_spec(hash_ids: bool, truncate: bool, mask: bool):
  tables = tuple(dataclasses.replace(t, out_of_range="hash" if hash_ids else "error") for t in BASE.tables)
  return dataclasses.replace(BASE, tables=tables, sequence=dataclasses.replace(BASE.sequence,
                             overflow="truncate" if truncate else "error"), bad_labels="mask" if mask else "error")


@st.composite
def cases(draw, kind):
  return {"kind": kind, "seed": draw(st.integers(0, 2**31)), "row": draw(st.integers(0, N - 1)),
          "value": draw(st.sampled_from(["-1", "0", "V-1", "V", "V+1", "mid", "odd"])),
          "odd": draw(st.sampled_from(ODD)), "float": draw(st.sampled_from(
              [float("nan"), float("inf"), -float("inf"), 1e39, -2.5, 0.0, 3.0])),
          "label": draw(st.sampled_from([0.0, 1.0, 2.0, -1.0, 0.5, None])), "pick": draw(st.integers(0, 100)),
          "extra": draw(st.integers(1, 4)), "group": draw(st.integers(1, N)),
          "policy": (draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))}


def _lists(col):
  return col.to_pylist()


def _value(case, V: int) -> int:
  """An id at or around the edges of [0, V), or a far one."""
  return {"-1": -1, "0": 0, "V-1": V - 1, "V": V, "V+1": V + 1, "mid": V // 2, "odd": case["odd"]}[case["value"]]


def _mutate(table, ex, spec, case):
  """(mutated table, expected Examples or None, the column and row an error must name, tolerated counters)."""
  kind, r = case["kind"], case["row"]
  names = table.column_names

  def put(name, values, typ=None):
    return table.set_column(names.index(name), name, pa.array(values, typ or table.schema.field(name).type))

  single = [f for f in spec.sparse if not f.multi_hot]
  if kind == "none":
    return table, ex, None, {}
  if kind == "single_id":
    f = single[case["pick"] % len(single)]
    V = spec.table(f.table).vocab_size
    v = _value(case, V)
    vals = _lists(table.column(f.name))
    vals[r] = v
    if 0 <= v < V:
      want = dataclasses.replace(ex, sparse={**ex.sparse, f.name: np.array(vals)})
      return put(f.name, vals), want, None, {}
    return put(f.name, vals), "hashed" if spec.table(f.table).out_of_range == "hash" else None, (f.name, r), \
        {f"hashed_ids/{f.table}": 1}
  if kind in ("multi_id", "history_id"):
    col = "user_interests" if kind == "multi_id" else f"history_{spec.sequence.fields[case['pick'] % 4].name}"
    table_name = (spec.sparse_feature("user_interests").table if kind == "multi_id"
                  else spec.sequence.fields[case["pick"] % 4].table)
    vals = _lists(table.column(col))
    rows = [i for i, x in enumerate(vals) if x]
    if not rows:
      return table, ex, None, {}
    r = rows[r % len(rows)]
    V = spec.table(table_name).vocab_size
    v = _value(case, V)
    vals[r] = list(vals[r])
    vals[r][0] = v
    if 0 <= v < V:
      return put(col, vals), "same_but_values", None, {}
    return put(col, vals), "hashed" if spec.table(table_name).out_of_range == "hash" else None, (col, r), \
        {f"hashed_ids/{table_name}": 1}
  if kind == "null_id":
    f = single[case["pick"] % len(single)]
    vals = _lists(table.column(f.name))
    vals[r] = None
    return put(f.name, vals), None, (f.name, r), {}
  if kind == "wrong_type":
    f = single[case["pick"] % len(single)]
    return put(f.name, [str(x) for x in _lists(table.column(f.name))], pa.string()), None, (f.name, None), {}
  if kind == "dense":
    f = spec.dense[case["pick"] % len(spec.dense)]
    vals = _lists(table.column(f.name))
    vals[r] = case["float"]
    finite = math.isfinite(case["float"]) and abs(case["float"]) < 3e38
    dense = ex.dense_nxG.copy()
    dense[r, [d.name for d in spec.dense].index(f.name)] = case["float"] if finite else 0
    return put(f.name, vals, pa.float64()), (dataclasses.replace(ex, dense_nxG=dense) if finite else None), \
        (f.name, r), {}
  if kind == "history_long":
    k, extra = spec.sequence.max_len, case["extra"]
    cols = {fd.name: _lists(table.column(f"history_{fd.name}")) for fd in spec.sequence.fields}
    grown = {n: c[r] + [0] * (k + extra - len(c[r])) for n, c in cols.items()}
    for n, c in cols.items():
      c[r] = grown[n]
      table = table.set_column(names.index(f"history_{n}"), f"history_{n}",
                               pa.array(c, table.schema.field(f"history_{n}").type))
    if spec.sequence.overflow == "error":
      return table, None, (f"history_{spec.sequence.fields[0].name}", r), {}
    values, lengths = ex.history
    ends = np.cumsum(lengths)
    kept = np.array([grown[fd.name][-k:] for fd in spec.sequence.fields]).T
    new_values = np.concatenate([values[:ends[r] - lengths[r]], kept, values[ends[r]:]])
    new_lengths = lengths.copy()
    new_lengths[r] = k
    return table, dataclasses.replace(ex, history=(new_values, new_lengths)), None, \
        {"truncated_histories": 1, "truncated_tokens": extra}
  if kind == "history_mismatch":
    name = f"history_{spec.sequence.fields[1 + case['pick'] % 3].name}"
    vals = _lists(table.column(name))
    vals[r] = vals[r] + [0]
    return put(name, vals), None, (name, r), {}
  if kind in ("root_label", "child_label"):
    k = 0 if kind == "root_label" else 1
    task = spec.tasks[k]
    vals = _lists(table.column(task.name))
    vals[r] = case["label"]
    labels, mask = ex.labels_nxK.copy(), ex.label_mask_nxK.copy()
    value = case["label"]
    parent_ok = k == 0 or (mask[r, 0] == 1 and labels[r, 0] == 1)
    bad = value is not None and (value not in (0.0, 1.0) or not parent_ok)
    if bad and spec.bad_labels == "error":
      return put(task.name, vals), None, (task.name, r), {}
    if value is None or bad:
      labels[r, k], mask[r, k] = 0, 0
    else:
      labels[r, k], mask[r, k] = value, 1
    counters = {f"masked_labels/{task.name}": 1} if bad else {}
    if k == 0:  # the child's label hangs off this one
      child = _lists(table.column(spec.tasks[1].name))[r]
      if child is not None and not (mask[r, 0] == 1 and labels[r, 0] == 1):
        if spec.bad_labels == "error":
          return put(task.name, vals), None, (spec.tasks[1].name, r), {}
        labels[r, 1], mask[r, 1] = 0, 0
        counters[f"masked_labels/{spec.tasks[1].name}"] = 1
    return put(task.name, vals), dataclasses.replace(ex, labels_nxK=labels, label_mask_nxK=mask), None, counters
  if kind == "missing_column":
    name = names[case["pick"] % len(names)]
    if name.startswith("planted_logit_"):  # optional: the ground truth becomes unknown
      planted = ex.planted_logits_nxK.copy()
      planted[:, [f"planted_logit_{t.name}" for t in spec.tasks].index(name)] = np.nan
      return table.drop_columns([name]), dataclasses.replace(ex, planted_logits_nxK=planted), None, {}
    return table.drop_columns([name]), None, (name, None), {}
  if kind == "domain":
    vals = _lists(table.column("domain"))
    v = _value(case, len(spec.domains))
    vals[r] = v
    if 0 <= v < len(spec.domains):
      return put("domain", vals, pa.int64()), dataclasses.replace(ex, domain_n=np.array(vals)), None, {}
    return put("domain", vals, pa.int64()), None, ("domain", r), {}
  if kind == "multi_long":
    vals = _lists(table.column("user_interests"))
    vals[r] = [1] * (spec.sparse_feature("user_interests").max_ids + case["extra"])
    return put("user_interests", vals), None, ("user_interests", r), {}
  raise AssertionError(kind)


def _equal(a, b, skip_values_of=None):
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    items = x.items() if isinstance(x, dict) else [(None, x)]
    for key, xv in items:
      yv = y[key] if key is not None else y
      xs, ys = (xv if isinstance(xv, tuple) else (xv,)), (yv if isinstance(yv, tuple) else (yv,))
      for i, (p, q) in enumerate(zip(xs, ys, strict=True)):
        if skip_values_of == (f.name, key) and i == 0:
          assert np.shape(p) == np.shape(q), (f.name, key)
          continue
        assert np.shape(p) == np.shape(q) and np.array_equal(np.asarray(p, np.float64), np.asarray(q, np.float64),
                                                             equal_nan=True), (f.name, key)


def check(case, folder):
  spec = _policy_spec(*case["policy"])
  ex = make_examples(spec, np.random.default_rng(case["seed"]), N)
  table, want, names, counters = _mutate(export.to_table(ex, spec, COLUMNS), ex, spec, case)
  path = os.path.join(folder, "part.parquet")
  pq.write_table(table, path, row_group_size=case["group"])
  converter = Converter(spec, COLUMNS)
  try:
    groups = RowGroups([path], converter)
    got = groups.read(np.arange(len(groups.groups)), np.arange(groups.num_rows))
  except DataFileError as e:
    msg = str(e)
    assert want is None, f"{case['kind']}: valid input rejected: {msg}"
    col, row = names
    assert msg.startswith(path) and repr(col) in msg, (case["kind"], msg)
    if row is not None:
      assert f"row {row}:" in msg, (case["kind"], msg)
    return "rejected"
  assert want is not None, f"{case['kind']}: invalid input accepted ({names})"
  if isinstance(want, str):  # an id changed in place: hashed into range, or a valid new value
    f = names[0] if names else None
    if case["kind"] == "single_id":
      assert 0 <= got.sparse[f][names[1]] < spec.table(spec.sparse_feature(f).table).vocab_size
      got.sparse[f][names[1]] = ex.sparse[f][names[1]]
      _equal(got, ex)
    else:
      _equal(got, ex, skip_values_of=("multi_hot", "user_interests") if case["kind"] == "multi_id" else ("history", None))
  else:
    _equal(got, want)
  assert dict(converter.counters) == counters, (case["kind"], dict(converter.counters), counters)
  return "tolerated" if counters else "accepted"


def test_fuzz_parquet_files(tmp_path):
  per_kind = max(1, math.ceil(CASES / len(KINDS)))
  by_kind = {}
  for kind in KINDS:
    counts = by_kind[kind] = collections.Counter()

    @settings(max_examples=per_kind, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases(kind))
    def prop(case):
      counts[check(case, str(tmp_path))] += 1

    prop()
  total = sum(by_kind.values(), collections.Counter())
  print(f"\nparquet files: {sum(total.values())} cases {dict(total)}")
  for kind, counts in by_kind.items():
    print(f"  {kind:18s} {dict(sorted(counts.items()))}")
  assert sum(total.values()) >= CASES and total["accepted"] and total["rejected"] and total["tolerated"], total
