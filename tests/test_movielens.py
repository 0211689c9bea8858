"""MovieLens-100K as impression rows (gem_jax/data/movielens.py) and through the GEM trainer. Reads the shared
data (../shared/data or $GEM_JAX_DATA_DIR); skips, naming the path, where it is absent."""

import json
import os

import numpy as np
import pytest

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import movielens, parquet_source
from gem_jax.train.jobs import train_config
from tests.data_helpers import shared_data_root


@pytest.fixture(scope="module")
def events():
  if not os.path.exists(os.path.join(shared_data_root(), "ml-100k", "u.data")):
    pytest.skip(f"MovieLens-100K absent under {shared_data_root()} (set GEM_JAX_DATA_DIR)")
  d = movielens.load(shared_data_root())
  ex, ts = movielens.examples(d)
  return d, ex, ts


def test_every_feature_comes_from_strictly_earlier_events(events):
  """Brute force on 300 events: the history is the user's ratings before this one's timestamp (the most
  recent 50, oldest first), the dense counts and means are of strictly earlier ratings."""
  d, ex, ts = events
  r = d["ratings"]
  order = np.lexsort((r[:, 1], r[:, 0], r[:, 3]))
  r = r[order]
  ends = np.cumsum(ex.history[1])
  for k in np.random.default_rng(0).choice(len(r), 300, replace=False):
    u, i, rating, t = r[k]
    mine = r[(r[:, 0] == u) & (r[:, 3] < t)]
    mine = mine[np.lexsort((mine[:, 1], mine[:, 3]))][-movielens.HISTORY:]
    tokens = ex.history[0][ends[k] - ex.history[1][k]:ends[k]]
    assert tokens[:, 0].tolist() == mine[:, 1].tolist() and tokens[:, 2].tolist() == mine[:, 2].tolist()
    assert (tokens[:, 3] == np.floor(np.log2(1.0 + t - mine[:, 3]))).all() and (tokens[:, 3] >= 1).all()
    before = r[(r[:, 0] == u) & (r[:, 3] < t)]
    item_before = r[(r[:, 1] == i) & (r[:, 3] < t)]
    want = [np.log1p(len(before)), before[:, 2].mean() - 3 if len(before) else 0.0,
            np.log1p(len(item_before)), item_before[:, 2].mean() - 3 if len(item_before) else 0.0]
    np.testing.assert_allclose(ex.dense_nxG[k], want, rtol=1e-6, atol=1e-6)
    assert ex.sparse["item_id"][k] == i and ex.labels_nxK[k, 0] == (rating >= 4)
    assert ex.label_mask_nxK[k, 1] == (rating >= 4) and (rating >= 4) <= (ex.labels_nxK[k, 1] == (rating == 5))


def test_prepare_splits_by_time_and_the_files_match_the_spec(movielens_prepared):
  info = json.load(open(os.path.join(movielens_prepared, "prepare.json")))
  assert info["rows"] == {"train": 79999, "eval": 20001}
  cfg = parquet_source.with_files(configs.get("movielens"), movielens_prepared)
  src = parquet_source.ParquetSource(cfg)
  assert src.steps_per_epoch() == 313 and sum(len(b.example_mask_B) for b in src.eval_batches()) >= 20001
  d = movielens.load(shared_data_root())
  ts = np.sort(d["ratings"][:, 3])
  assert ts[79998] < info["eval_from_timestamp"] == ts[79999]  # all of evaluation is later than training
  assert src.counters() == {}


@pytest.mark.slow
def test_gem_trains_on_movielens_and_beats_the_base_rate(movielens_prepared, tmp_path):
  pq = pytest.importorskip("pyarrow.parquet")
  # Batches of 64 and the first 4,096 evaluation rows (the suite's XLA flags make every step slow), one bucket.
  os.makedirs(tmp_path / "eval")
  first = pq.read_table(os.path.join(movielens_prepared, "eval", "part-00000.parquet")).slice(0, 4096)
  pq.write_table(first, str(tmp_path / "eval" / "part-00000.parquet"))
  cfg = configs.with_steps(parquet_source.with_files(configs.get("movielens"), movielens_prepared), 60)
  cfg = apply_overrides(cfg, ["data.pipeline.history_bucket_fractions=1.0", "data.pipeline.batch_size=64",
                             f"data.eval={tmp_path / 'eval'}"])
  summary = train_config(cfg, str(tmp_path / "run"), progress=False, report=False)
  like = summary["tasks"]["like"]
  assert like["eval_count"] == 4096 and like["eval_auc"] > 0.65 and like["eval_ne"] < like["baseline_ne"], like
  assert summary["input_counters"] == {}


def _fake_ml100k(root, users=("1|24|M|technician|85711", "2|53|F|other|94043"), data=None):
  folder = root / "ml-100k"
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "u.occupation").write_text("technician\nother\n")
  (folder / "u.user").write_text("\n".join(users) + "\n")
  flags = "|".join(["0"] * 18 + ["1"])
  (folder / "u.item").write_text(f"1|A (1995)|01-Jan-1995||http://a|{flags}\n"
                                 f"2|B (1996)|01-Jan-1996||http://b|{flags}\n")
  (folder / "u.data").write_text(data or "1\t1\t5\t874965758\n1\t2\t3\t874965759\n2\t1\t4\t874965760\n")
  return root


def test_malformed_files_name_the_line_and_a_repeated_id_is_refused(tmp_path):
  d = movielens.load(str(_fake_ml100k(tmp_path / "ok")))
  assert d["ratings"].shape == (3, 4) and d["gender"].tolist() == [0, 0, 1]
  # A user id on two lines would overwrite the first and leave user 2 with made-up attributes.
  with pytest.raises(movielens.MovieLensError, match=r"u.user:3: user id 1 again \(first at line 1\)"):
    movielens.load(str(_fake_ml100k(tmp_path / "twice", users=("1|24|M|technician|85711", "",
                                                                  "1|30|F|other|10001"))))
  # Line numbers count blank lines; a sixth field is an error, not a crash on unpacking.
  with pytest.raises(movielens.MovieLensError, match=r"u.user:3: expected 5 fields, got 6"):
    movielens.load(str(_fake_ml100k(tmp_path / "six", users=("1|24|M|technician|85711", "",
                                                                "2|53|F|other|94043|x"))))


def test_prior_counts_do_not_depend_on_the_timestamps_scale():
  """Millisecond (or larger) timestamps order the same events the same way as seconds."""
  rng = np.random.default_rng(0)
  keys, ts, values = rng.integers(0, 5, 200), rng.integers(0, 8, 200), rng.integers(1, 6, 200)
  small = movielens._prior(keys, ts, values)
  large = movielens._prior(keys, ts * (1 << 41) + (1 << 50), values)
  for a, b in zip(small, large, strict=True):
    assert np.array_equal(a, b)
