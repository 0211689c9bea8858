"""Feature-spec files (gem_jax/data/spec_file.py), the Parquet source (gem_jax/data/parquet_source.py,
parquet_rows.py) and the export of the synthetic stream (gem_jax/data/export.py)."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gem_jax.data import export, parquet_source, sources, spec_file  # noqa: E402
from gem_jax.data.parquet_rows import DataFileError  # noqa: E402
from gem_jax.data.sources import SyntheticSource  # noqa: E402
from tests.run_helpers import ONE_LAYER, tiny  # noqa: E402

B = 32  # tiny's batch size


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """tiny's stream as Parquet: 20 blocks of 32 rows over 3 files of row groups of 100 rows."""
  out = str(tmp_path_factory.mktemp("tiny_parquet"))
  rows = export.export_synthetic(tiny(), out, 20 * B, rows_per_file=300, row_group_rows=100)
  assert rows == {"train": 640, "eval": 256}
  return out


def _source(path, **data):
  cfg = parquet_source.with_files(tiny(), str(path))
  return parquet_source.ParquetSource(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data)))


def _same_examples(a, b):
  flat = lambda ex: jax.tree_util.tree_leaves(dataclasses.asdict(ex))
  for x, y in zip(flat(a), flat(b), strict=True):
    assert x.shape == y.shape and np.array_equal(np.asarray(x, np.float64), np.asarray(y, np.float64), equal_nan=True)


# ---- spec files ------------------------------------------------------------------------------------------
def test_a_spec_file_round_trips_and_names_the_key_of_every_error(tmp_path):
  spec = tiny().data.spec
  doc = yaml.safe_load(spec_file.dump(spec))
  loaded = spec_file.parse(doc, "s.yaml")
  assert loaded.spec == spec and loaded.columns == spec_file.Columns.default(spec)

  def broken(edit, match):
    d = yaml.safe_load(spec_file.dump(spec))
    edit(d)
    with pytest.raises(spec_file.SpecFileError, match=match):
      spec_file.parse(d, "s.yaml")

  broken(lambda d: d["tables"]["user_id"].update(rowz=3), r"s.yaml: tables.user_id.rowz: unknown key")
  broken(lambda d: d["tables"]["user_id"].pop("rows"), r"tables.user_id.rows: is required")
  broken(lambda d: d["tables"]["user_id"].update(rows="many"), r"tables.user_id.rows: must be int")
  broken(lambda d: d["tables"]["user_id"].update(rows=0), r"tables.user_id.rows: must be a positive integer")
  broken(lambda d: d["tables"]["ad_id"].update(out_of_range="clamp"), r"tables.ad_id.out_of_range: must be one of")
  broken(lambda d: d["sparse"]["ad_id"].update(table="ads"), r"sparse.ad_id.table: unknown table 'ads'")
  broken(lambda d: d["sequence"].update(overflow="drop"), r"sequence.overflow: must be one of")
  broken(lambda d: d["tasks"]["conversion"].update(parent="purchase"), r"tasks.conversion.parent: must name an earlier")
  broken(lambda d: d["domains"].update(names=[]), r"domains.names: must be a non-empty list")
  broken(lambda d: d["dense"]["bid"].update(column="ad_id"), r"column 'ad_id' is named by more than one part")
  broken(lambda d: d.update(labels="strict"), r"s.yaml: labels: unknown key")
  path = tmp_path / "bad.yaml"
  path.write_text("tables: [unclosed")
  with pytest.raises(spec_file.SpecFileError, match="bad.yaml: not valid YAML"):
    spec_file.load(str(path))
  # A key given twice: PyYAML alone keeps the second and drops the first without a word.
  path.write_text("tables:\n  user_id: {rows: 10, dim: 4}\n  user_id: {rows: 20, dim: 4}\n")
  with pytest.raises(spec_file.SpecFileError, match=r"(?s)bad.yaml: not valid YAML: .*key 'user_id' a second time "
                     r"\(first given at line 2\)"):
    spec_file.load(str(path))


# ---- export and read back --------------------------------------------------------------------------------
def test_the_files_give_back_the_streams_blocks_and_eval_set_exactly(exported):
  syn, src = SyntheticSource(tiny()), _source(exported)
  assert src.spec == syn.spec and src.steps_per_epoch() == 20
  assert len(os.listdir(os.path.join(exported, "train"))) == 3
  for i in (0, 2, 3, 9, 19):  # blocks inside one row group, across row groups and across files
    _same_examples(src.block(i, B), syn.block(i, B))
  _same_examples(src.block(20, B), src.block(0, B))  # the second epoch, unshuffled
  for a, b in zip(src.eval_batches(), syn.eval_batches(), strict=True):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
      assert np.array_equal(x, y, equal_nan=True)
  assert src.position(9) == {"epoch": 0, "file": os.path.join(exported, "train", "part-00000.parquet"),
                             "row_group": 2, "row": 288}
  assert src.position(10)["file"].endswith("part-00001.parquet") and src.position(10)["row"] == 20


def test_training_from_the_files_reads_the_streams_batches_exactly(exported):
  """What the trainer is fed: the files' train iterator gives the stream's batches, leaf for leaf (with the
  spec equal, the model and step are the same program, so the losses are too; the resume test below trains
  from the files through the trainer)."""
  its = [sources.make(cfg).train_iterator() for cfg in (tiny(), parquet_source.with_files(tiny(), exported))]
  for _ in range(6):
    want, got = (next(it) for it in its)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
      assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def test_the_iterator_resumes_at_the_exact_example_and_refuses_changed_files(exported, tmp_path):
  src = _source(exported, shuffle_window=96, seed=3)
  it = src.train_iterator()
  for _ in range(23):  # into the second epoch
    next(it)
  state = it.get_state()
  assert state["next_block"] == 23 and state["next_example"]["epoch"] == 1
  want = next(it)
  again = _source(exported, shuffle_window=96, seed=3).train_iterator()
  again.set_state(state)
  for x, y in zip(jax.tree_util.tree_leaves(next(again)), jax.tree_util.tree_leaves(want), strict=True):
    assert np.array_equal(x, y, equal_nan=True)
  other = _source(exported, shuffle_window=96, seed=4).train_iterator()
  with pytest.raises(DataFileError, match="the training files changed"):
    other.set_state(state)


def test_a_shuffled_epoch_reads_every_row_once_in_an_order_of_its_own(exported, tmp_path):
  # An empty file among the training files (a row group of 0 rows): every row is still read once per epoch.
  shutil.copytree(exported, tmp_path / "with_empty")
  train = sorted((tmp_path / "with_empty" / "train").glob("*.parquet"))
  pq.write_table(pq.read_schema(train[0]).empty_table(), train[0].with_name(train[0].stem + "-empty.parquet"))
  src = _source(tmp_path / "with_empty", shuffle_window=96, seed=0)
  ids = lambda epoch: np.concatenate([src.block(epoch * 20 + j, B).sparse["user_id"] for j in range(20)])
  plain = np.concatenate([_source(exported).block(j, B).sparse["user_id"] for j in range(20)])
  first, second = ids(0), ids(1)
  assert sorted(first) == sorted(plain) == sorted(second)
  assert not np.array_equal(first, plain) and not np.array_equal(first, second)
  again = _source(tmp_path / "with_empty", shuffle_window=96, seed=0)
  assert np.array_equal(first, np.concatenate([again.block(j, B).sparse["user_id"] for j in range(20)]))


# ---- bad input, loudly ----------------------------------------------------------------------------------
def _write(tmp_path, exported, edit_table=None, edit_spec=None):
  """A one-file copy of the first 64 training rows of `exported`, with a column edited and/or the spec."""
  table = pq.read_table(os.path.join(exported, "train", "part-00000.parquet")).slice(0, 64)
  if edit_table:
    table = edit_table(table)
  os.makedirs(tmp_path / "train", exist_ok=True)
  path = str(tmp_path / "train" / "part-00000.parquet")
  pq.write_table(table, path, row_group_size=40)
  doc = yaml.safe_load(open(os.path.join(exported, "spec.yaml")))
  if edit_spec:
    edit_spec(doc)
  (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
  return tmp_path, path


def _set(table, name, values, typ=None):
  i = table.column_names.index(name)
  return table.set_column(i, name, pa.array(values, typ))


def _col(table, name):
  return table.column(name).to_pylist()


def _read_all(src):
  return [src.block(0, B), src.block(1, B)]


CASES = {
    "missing column": (lambda t: t.drop_columns(["bid"]), None, r"missing column 'bid'"),
    "wrong type": (lambda t: _set(t, "user_id", [str(x) for x in _col(t, "user_id")]), None,
                   r"column 'user_id' must hold integers, has string"),
    "null id": (lambda t: _set(t, "ad_id", [None if i == 45 else x for i, x in enumerate(_col(t, "ad_id"))], pa.int64()),
                None, r"row 45: column 'ad_id': null value"),
    "id outside its table": (lambda t: _set(t, "ad_id", [5000 if i == 7 else x for i, x in enumerate(_col(t, "ad_id"))]),
                             None, r"row 7: column 'ad_id': id 5000 is outside table 'ad_id' of 2000 rows"),
    "uint64 id above 2^63": (lambda t: _set(t, "ad_id", [2**63 + 5 if i == 7 else x for i, x in
                                                        enumerate(_col(t, "ad_id"))], pa.uint64()),
                             None, r"row 7: column 'ad_id': id 9223372036854775813 is outside table 'ad_id'"),
    "planted logit as text": (lambda t: _set(t, "planted_logit_click",
                                             [str(x) for x in _col(t, "planted_logit_click")]),
                              None,
                              r"column 'planted_logit_click' \(the planted logit of task 'click'\) must hold numbers"),
    "infinite planted logit": (lambda t: _set(t, "planted_logit_click", [float("inf") if i == 4 else x for i, x in
                                                                         enumerate(_col(t, "planted_logit_click"))]),
                               None, r"row 4: column 'planted_logit_click': planted logit inf is not finite"),
    "history id outside": (lambda t: _set(t, "history_item_category", [[99] * len(x) if i == 50 else x for i, x in
                                                                       enumerate(_col(t, "history_item_category"))]),
                           None, r"row 50: column 'history_item_category': id 99 is outside table 'category'"),
    "NaN dense": (lambda t: _set(t, "bid", [float("nan") if i == 3 else x for i, x in enumerate(_col(t, "bid"))],
                                 pa.float32()), None, r"row 3: column 'bid': non-finite dense value"),
    "history fields of different lengths": (lambda t: _set(t, "history_action", [[1] * 40 if i == 41 else x for i, x in
                                                              enumerate(_col(t, "history_action"))]),
                         None, r"row 41: column 'history_action': history length 40 differs"),
    "label outside {0, 1}": (lambda t: _set(t, "click", [2.0 if i == 9 else x for i, x in enumerate(_col(t, "click"))],
                                            pa.float32()), None, r"row 9: column 'click': label outside \{0, 1\}"),
    "child label without parent": (
        lambda t: _set(t, "conversion", [0.0 if c == 0 else v for c, v in zip(_col(t, "click"), _col(t, "conversion"))],
                       pa.float32()), None, r"column 'conversion': label set where its parent 'click' is not 1"),
    "multi-hot over max_ids": (lambda t: _set(t, "user_interests", [[1] * 5 if i == 2 else x for i, x in
                                                                    enumerate(_col(t, "user_interests"))]),
                               None, r"row 2: column 'user_interests': 5 ids, more than max_ids 4"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_names_the_file_the_row_and_the_column(tmp_path, exported, case):
  edit_table, edit_spec, match = CASES[case]
  folder, path = _write(tmp_path, exported, edit_table, edit_spec)
  with pytest.raises(DataFileError, match=match) as e:
    _read_all(_source(folder, eval=str(folder / "train")))
  assert path in str(e.value)


def test_a_history_longer_than_max_len_fails_or_keeps_its_most_recent_tokens_counted(tmp_path, exported):
  fields = ("item_id", "item_category", "action", "time_gap")
  long = {f: list(range(1, 19)) * 2 for f in fields}  # 36 tokens > max_len 32, ids valid in every table
  long["item_category"] = [i % 20 for i in long["item_category"]]
  long["action"] = [i % 4 for i in long["action"]]

  def edit(t):
    for f in fields:
      t = _set(t, f"history_{f}", [long[f] if i == 33 else x for i, x in enumerate(_col(t, f"history_{f}"))])
    return t

  folder, _ = _write(tmp_path / "a", exported, edit)
  with pytest.raises(DataFileError, match=r"row 33: column 'history_item_id': history of 36 tokens, more than max_len 32"):
    _read_all(_source(folder))
  folder, _ = _write(tmp_path / "b", exported, edit, lambda d: d["sequence"].update(overflow="truncate"))
  src = _source(folder)
  values, lengths = src.block(1, B).history
  assert lengths[1] == 32
  row = values[int(lengths[:1].sum()):int(lengths[:2].sum())]
  assert row[:, 0].tolist() == long["item_id"][4:]  # the most recent 32
  assert src.counters() == {"truncated_histories": 1, "truncated_tokens": 4}


def test_tolerating_policies_count_what_they_did(tmp_path, exported):
  first = pq.read_table(os.path.join(exported, "train", "part-00000.parquet")).slice(0, 64)
  clicked = [i for i, (c, v) in enumerate(zip(_col(first, "click"), _col(first, "conversion"))) if c == 1 and v is not None]
  row = clicked[0]

  def edit(t):
    t = _set(t, "ad_id", [2000 + i if i < 3 else x for i, x in enumerate(_col(t, "ad_id"))])
    return _set(t, "click", [7.0 if i == row else x for i, x in enumerate(_col(t, "click"))], pa.float32())

  def policy(d):
    d["tables"]["ad_id"]["out_of_range"] = "hash"
    d["bad_labels"] = "mask"

  folder, _ = _write(tmp_path, exported, edit, policy)
  src = _source(folder)
  ex = src.block(0, B)
  assert ((ex.sparse["ad_id"] >= 0) & (ex.sparse["ad_id"] < 2000)).all()
  assert len(set(ex.sparse["ad_id"][:3].tolist())) == 3  # distinct ids hash apart
  assert ex.label_mask_nxK[row].tolist() == [0, 0]  # the conversion label hangs off the masked click
  assert ex.label_mask_nxK.sum() == _source(exported).block(0, B).label_mask_nxK.sum() - 2
  assert src.counters() == {"hashed_ids/ad_id": 3, "masked_labels/click": 1, "masked_labels/conversion": 1}
  # Each row counts once, however often its row group is read again: the next epoch, after the cache let it go.
  src.train_groups.cache = 1
  for j in (5, 20, 21, 40):
    src.block(j, B)
  assert src.counters() == {"hashed_ids/ad_id": 3, "masked_labels/click": 1, "masked_labels/conversion": 1}


@pytest.mark.slow
def test_resume_from_a_checkpoint_in_the_middle_of_a_file_repeats_the_losses(exported, tmp_path):
  """Checkpoint at step 4 (row 128 of the first 300-row file, shuffled in windows of 96): the resumed run's
  losses are the uninterrupted run's, bit for bit, and the checkpoint says where in the files it was."""
  import json

  from gem_jax.train.jobs import train_config
  cfg = tiny(*ONE_LAYER, **{"train.steps": 8, "train.warmup_steps": 1, "train.log_every": 1,
                            "train.checkpoint_every": 4, "train.eval_every": 100, "train.eval_examples": 64})
  cfg = parquet_source.with_files(cfg, exported)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shuffle_window=96, seed=1))
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  train_config(cfg, full, progress=False, report=False)
  train_config(cfg, part, progress=False, report=False, stop_after=4)
  train_config(cfg, part, resume=True, progress=False, report=False)
  losses = lambda d: {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "loss" in r}
  assert losses(part) == losses(full) and sorted(losses(full)) == list(range(1, 9))


def test_a_folder_with_parquet_files_in_subfolders_is_refused_and_a_recursive_glob_reads_them(exported, tmp_path):
  """A partitioned folder (files one level down, next to one at its top) would lose the subfolders' rows if
  read as a folder: refused, naming the first such file; `DIR/**/*.parquet` names every file, each once."""
  train = sorted(os.listdir(os.path.join(exported, "train")))
  part = tmp_path / "train"
  (part / "day=1").mkdir(parents=True)
  shutil.copy(os.path.join(exported, "train", train[0]), part / train[0])
  for name in train[1:]:
    shutil.copy(os.path.join(exported, "train", name), part / "day=1" / name)
  with pytest.raises(ValueError, match=rf"holds {len(train) - 1} Parquet file\(s\) in subfolders \(first: "
                                       rf"'day=1/{train[1]}'\).*\*\*"):
    parquet_source.list_files(str(part))
  every = parquet_source.list_files(str(part / "**" / "*.parquet"))
  assert sorted(map(os.path.basename, every)) == train and len(set(every)) == len(train)
  with pytest.raises(FileNotFoundError, match="no Parquet files at"):
    parquet_source.list_files(str(tmp_path / "nothing" / "*.parquet"))


def test_the_readmes_spec_file_example_parses():
  text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
  start = text.index("```yaml\ntables:") + len("```yaml\n")
  loaded = spec_file.parse(yaml.safe_load(text[start:text.index("```", start)]), "README.md")
  assert loaded.spec.task_names == ("click", "conversion") and dict(loaded.columns.sparse)["ad_id"] == "candidate_ad"


# ---- readers: each process reads its own rows ------------------------------------------------------------
def _keys(ex) -> list[bytes]:
  """One key per example: its dense features and planted logits (float32, distinct for every row here)."""
  return [a.tobytes() + b.tobytes() for a, b in zip(ex.dense_nxG, ex.planted_logits_nxK)]


@pytest.mark.parametrize("window", [0, 96])
def test_two_readers_read_every_example_of_an_epoch_exactly_once(exported, window):
  """data.readers=2: the two readers' pieces of one epoch hold every row once between them, none twice;
  unshuffled, they open row groups that meet only at the edge of their ranges (640 rows, groups of 100)."""
  everything = _keys(_source(exported).block(0, 640))
  assert len(set(everything)) == 640
  seen, opened = {}, {}
  for r in (0, 1):
    src = _source(exported, readers=2, shuffle_window=window, seed=1)  # one process's own reader (and cache)
    assert src.steps_per_epoch() == 20
    calls, group = [], src.train_groups.group
    src.train_groups.group = lambda k, group=group: (calls.append(k), group(k))[1]
    seen[r] = [k for j in range(20) for k in _keys(src.reader_block(r, j))]
    opened[r] = set(calls)
    assert len(src.reader_block(r, 20)) == B // 2  # the next epoch starts again
  assert len(seen[0]) == len(seen[1]) == 320
  assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == sorted(everything)
  if window == 0:
    assert opened[0] & opened[1] == {3} and opened[0] | opened[1] == set(range(7)), opened


def test_readers_whose_count_does_not_divide_the_rows_still_read_every_row_once(exported, tmp_path):
  """637 rows (the last file three rows short) over 4 readers: the ranges are 159 or 160 rows, and together
  the readers' pieces of one epoch hold every row exactly once, the last row included."""
  import shutil
  import pyarrow.parquet as pq
  short = tmp_path / "short"
  shutil.copytree(exported, short)
  last = sorted((short / "train").glob("*.parquet"))[-1]
  table = pq.read_table(last)
  pq.write_table(table.slice(0, table.num_rows - 3), last, row_group_size=100)
  everything = _keys(_source(short).block(0, 637))
  assert len(everything) == len(set(everything)) == 637
  src = _source(short, readers=4)
  seen = [k for r in range(4) for j in range(src.steps_per_epoch()) for k in _keys(src.reader_block(r, j))]
  assert sorted(seen) == sorted(everything)


def test_a_reader_iterator_yields_parts_that_resume_where_they_stopped(exported):
  src = _source(exported, readers=2)
  it = src.train_iterator(readers=(1,))
  for _ in range(5):
    part = next(it)
  assert part.readers == (1,) and part.num_readers == 2 and [b.batch_size for b in part.batches] == [B // 2]
  state = it.get_state()
  where = state["next_example"]["readers"]  # block 5: rows 80 and 320 + 80 of the files' order
  assert state["next_block"] == 5 and [(os.path.basename(w["file"]), w["row"]) for w in where] == [
      ("part-00000.parquet", 80), ("part-00001.parquet", 100)]
  again = _source(exported, readers=2).train_iterator(readers=(1,))
  again.set_state(state)
  for x, y in zip(jax.tree_util.tree_leaves(next(again).batches), jax.tree_util.tree_leaves(next(it).batches),
                  strict=True):
    assert np.array_equal(x, y, equal_nan=True)
  # The checkpoint written after the resume names the position the unbroken iterator is at.
  assert again.get_state() == it.get_state() and again.get_state()["next_block"] == 6
  with pytest.raises(ValueError, match="does not divide data.pipeline.batch_size"):
    _source(exported, readers=3)
