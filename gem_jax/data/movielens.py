"""MovieLens-100K as an engagement problem: every rating is an impression of the rated movie, labelled
`like` (rating >= 4) and `love` (rating 5, defined only where like is 1), written as Parquet files for the
Parquet source with the spec gem_jax/data/specs/movielens_100k.yaml.

  prepare(data_dir, out)   reads data_dir/ml-100k/{u.data, u.user, u.item}, writes out/spec.yaml, out/train/,
                           out/eval/ and out/prepare.json (counts, the time cut)

No example sees its future. Events are ordered by timestamp; every feature of an event is computed from
events strictly earlier in time (a same-second rating is neither history nor count): the history (the
user's most recent 50 earlier ratings: movie, its first genre, the rating as the action, the time gap
bucketed by log2), and the dense counts and means of the user and of the movie. The split is by time:
events at or after the timestamp of the event at 80% of the time order are the evaluation set, so all of
evaluation is later than all of training.

The files are read from the user's copy (its terms forbid redistribution) and written to `out`; nothing
of the data enters the repository. A malformed line raises an error naming the file and the line.
"""

from __future__ import annotations

import json
import os

import numpy as np

from gem_jax.data import export, spec_file
from gem_jax.data.batch import Examples

SPEC = os.path.join(os.path.dirname(__file__), "specs", "movielens_100k.yaml")
HISTORY = 50
EVAL_FRACTION = 0.2
_AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups


class MovieLensError(ValueError):
  """A MovieLens file is malformed; the message names the file and the line."""


def _read(path: str, sep: str, fields: int, encoding: str = "latin-1") -> list[tuple[int, list[str]]]:
  """(line number, its `fields` fields) of every non-empty line."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"MovieLens-100K: no {path} (pass --data-dir, the folder that holds ml-100k/)")
  rows = []
  with open(path, encoding=encoding) as f:
    for n, line in enumerate(f, 1):
      line = line.rstrip("\n")
      if not line:
        continue
      parts = line.split(sep)
      if len(parts) != fields:
        raise MovieLensError(f"{path}:{n}: expected {fields} fields, got {len(parts)}: {line[:80]!r}")
      rows.append((n, parts))
  return rows


def _int(path: str, n: int, value: str, what: str, low: int, high: int) -> int:
  try:
    x = int(value)
  except ValueError:
    raise MovieLensError(f"{path}:{n}: {what} {value[:20]!r} is not an integer") from None
  if not low <= x <= high:
    raise MovieLensError(f"{path}:{n}: {what} {x} outside [{low}, {high}]")
  return x


def _once(path: str, n: int, what: str, key: int, seen: dict) -> None:
  """Ids 1..count, each on one line: a second line of an id would overwrite the first and leave another id
  with no line (and made-up attributes)."""
  first = seen.setdefault(key, n)
  if first != n:
    raise MovieLensError(f"{path}:{n}: {what} id {key} again (first at line {first})")


def load(data_dir: str) -> dict[str, np.ndarray]:
  """The ratings (user, item, rating, ts) and the user and item attributes, as id-indexed arrays."""
  root = os.path.join(data_dir, "ml-100k")
  users_path, items_path, data_path = (os.path.join(root, f) for f in ("u.user", "u.item", "u.data"))
  occupations = [r[0] for _, r in _read(os.path.join(root, "u.occupation"), "|", 1)]
  users = _read(users_path, "|", 5)
  U = len(users)
  age, gender, occupation, zip_region = (np.zeros(U + 1, np.int64) for _ in range(4))
  seen = {}
  for n, (uid, a, g, occ, z) in users:
    u = _int(users_path, n, uid, "user id", 1, U)
    _once(users_path, n, "user", u, seen)
    age[u] = int(np.searchsorted(_AGE_EDGES, _int(users_path, n, a, "age", 1, 120), side="right"))
    if g not in ("M", "F"):
      raise MovieLensError(f"{users_path}:{n}: gender {g!r} is not M or F")
    gender[u] = g == "F"
    if occ not in occupations:
      raise MovieLensError(f"{users_path}:{n}: occupation {occ!r} is not in u.occupation")
    occupation[u] = occupations.index(occ)
    zip_region[u] = int(z[0]) if z[:1].isdigit() else 10
  items = _read(items_path, "|", 24)
  I = len(items)
  genres, first_genre, decade = np.zeros((I + 1, 19), bool), np.zeros(I + 1, np.int64), np.zeros(I + 1, np.int64)
  seen = {}
  for n, row in items:
    i = _int(items_path, n, row[0], "movie id", 1, I)
    _once(items_path, n, "movie", i, seen)
    flags = [_int(items_path, n, x, "genre flag", 0, 1) for x in row[5:24]]
    genres[i] = flags
    first_genre[i] = flags.index(1) if 1 in flags else 0
    if row[2]:
      decade[i] = _int(items_path, n, row[2][-4:], "release year", 1910, 1999) // 10 - 190
  ratings = _read(data_path, "\t", 4)
  data = np.array([[_int(data_path, n, r[0], "user id", 1, U), _int(data_path, n, r[1], "movie id", 1, I),
                    _int(data_path, n, r[2], "rating", 1, 5), _int(data_path, n, r[3], "timestamp", 0, 2**62)]
                   for n, r in ratings], np.int64)
  return {"ratings": data, "age": age, "gender": gender, "occupation": occupation, "zip_region": zip_region,
          "genres": genres, "first_genre": first_genre, "decade": decade}


def _prior(keys: np.ndarray, ts: np.ndarray, values: np.ndarray):
  """For every event: (the count, the sum of `values`) of the events of the same key strictly earlier."""
  order = np.lexsort((ts, keys))
  k, t, v = keys[order], ts[order], values[order]
  starts = np.searchsorted(k, k, side="left")           # the key's first event
  first = np.ones(len(k), bool)                        # sorted by (key, ts): where each (key, ts) run starts
  first[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
  earlier = np.maximum.accumulate(np.where(first, np.arange(len(k)), 0))   # first event of (key, ts)
  csum = np.concatenate([[0], np.cumsum(v)])
  count, total = np.empty_like(keys), np.empty(keys.shape, np.float64)
  count[order] = earlier - starts
  total[order] = csum[earlier] - csum[starts]
  return count, total, order, starts, earlier


def examples(d: dict[str, np.ndarray]) -> tuple[Examples, np.ndarray]:
  """All events as Examples in time order, and their timestamps."""
  r = d["ratings"][np.lexsort((d["ratings"][:, 1], d["ratings"][:, 0], d["ratings"][:, 3]))]
  user, item, rating, ts = r.T
  n = len(r)
  u_count, u_sum, order, starts, earlier = _prior(user, ts, rating)
  i_count, i_sum, _, _, _ = _prior(item, ts, rating)
  # History: the user's events before `earlier` (strictly earlier in time), the most recent HISTORY.
  hist_end = np.empty(n, np.int64)
  hist_end[order] = earlier
  hist_len = np.minimum(u_count, HISTORY)
  pos = np.repeat(hist_end - hist_len, hist_len) + (np.arange(int(hist_len.sum())) -
                                                     np.repeat(np.cumsum(hist_len) - hist_len, hist_len))
  src = order[pos]  # the history tokens as event indices, oldest first
  gap = np.repeat(ts, hist_len) - ts[src]
  gap_bucket = np.floor(np.log2(1.0 + gap)).astype(np.int64)
  if gap_bucket.max(initial=0) >= 32:
    raise MovieLensError(f"a time gap of {int(gap.max())} s needs more than the spec's 32 time_gap buckets")
  history = np.stack([item[src], d["first_genre"][item[src]], rating[src], gap_bucket], axis=1)
  g = d["genres"][item]
  hours, weekdays = (ts // 3600) % 24, (ts // 86400 + 3) % 7  # 1970-01-01 was a Thursday (weekday 3)
  like = (rating >= 4).astype(np.float32)
  ex = Examples(
      sparse={"user_id": user, "age": d["age"][user], "gender": d["gender"][user],
              "occupation": d["occupation"][user], "zip_region": d["zip_region"][user], "hour": hours,
              "weekday": weekdays, "item_id": item, "item_decade": d["decade"][item]},
      multi_hot={"item_genres": (np.nonzero(g)[1].astype(np.int64), g.sum(axis=1).astype(np.int64))},
      dense_nxG=np.stack([np.log1p(u_count), np.where(u_count > 0, u_sum / np.maximum(u_count, 1) - 3, 0),
                          np.log1p(i_count), np.where(i_count > 0, i_sum / np.maximum(i_count, 1) - 3, 0)],
                         axis=1).astype(np.float32),
      history=(history, hist_len), domain_n=np.zeros(n, np.int64),
      labels_nxK=np.stack([like, (rating == 5).astype(np.float32)], axis=1),
      label_mask_nxK=np.stack([np.ones(n, np.float32), like], axis=1),
      planted_logits_nxK=np.full((n, 2), np.nan, np.float32))
  return ex, ts


def prepare(data_dir: str, out: str, rows_per_file: int = 1 << 20, row_group_rows: int = 16384) -> dict:
  """out/spec.yaml, out/train/, out/eval/ (module docstring); returns and writes out/prepare.json."""
  spec = spec_file.load(SPEC)
  ex, ts = examples(load(data_dir))
  cut_time = int(ts[int((1 - EVAL_FRACTION) * len(ts))])
  n_train = int(np.searchsorted(ts, cut_time, side="left"))
  rows = export.write_dataset(out, spec.spec, [ex.slice(0, n_train)], [ex.slice(n_train, len(ex))], spec.columns,
                              rows_per_file=rows_per_file, row_group_rows=row_group_rows)
  info = {"rows": rows, "eval_from_timestamp": cut_time, "eval_fraction": rows["eval"] / len(ex),
          "like_rate": {s: float(ex.labels_nxK[sl, 0].mean()) for s, sl in
                        (("train", slice(0, n_train)), ("eval", slice(n_train, None)))},
          "love_rate_given_like": {s: float(ex.labels_nxK[sl, 1].sum() / ex.label_mask_nxK[sl, 1].sum()) for s, sl in
                                   (("train", slice(0, n_train)), ("eval", slice(n_train, None)))},
          "mean_history": float(ex.history[1].mean())}
  with open(os.path.join(out, "prepare.json"), "w") as f:
    json.dump(info, f, indent=2)
  return info
