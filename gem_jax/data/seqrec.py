"""Public sequential-recommendation datasets: parsers, the leave-one-out split, jagged training batches.

Three on-disk formats are read:

  ratings     MovieLens-1M as GroupLens ships it: `UserID::MovieID::Rating::Timestamp` per line
  u.data      MovieLens-100K: `user \\t item \\t rating \\t timestamp` per line
  sequences   one user per line, `user item item ...`, already in chronological order (the format of
              ../shared/data/ml-1m/ml-1m_sequences_orig_ids.txt and of the S3-Rec Amazon files)

Rating files are grouped by user and sorted by timestamp; interactions with equal timestamps keep their
file order (a stable sort), so the result does not depend on the sort algorithm. Ratings are kept as
interactions whatever their value (the HSTU and S3-Rec protocols keep all of them).

Item ids are remapped to 1..I in increasing order of the original id (0 is the padding id); the
candidate set of full-ranking evaluation is every item that appears in the file. User ids keep their
original values in `SeqDataset.user_ids`.

Leave-one-out (the standard protocol): per user, the last item is the test target, the second-to-last
the validation target, everything before is training. A user needs at least 3 interactions.

Reading policy (the same for the three formats):
  bytes     files are read as latin-1, so every byte decodes; only ASCII digits can make a number
  lines     a line ends at "\n"; spaces, tabs and carriage returns around a line are ignored (CRLF files and
            trailing blanks read fine, a missing final newline too); a blank line is skipped but still counts
            in the line numbers of errors; a lone "\r" inside a line is not a line break
  fields    ratings split on "::", u.data on tabs, sequences on runs of spaces and tabs; every field is a
            plain decimal integer (an optional "-" and ASCII digits, leading zeros allowed) that fits int64:
            no "+", "_", inner spaces, unicode digits or other whitespace; user, item ids and ratings are
            positive, timestamps any int64

This module never repairs input: a malformed line, a duplicate user line, a non-positive or out-of-range id
or a user too short to split raises `SeqRecDataError` naming the file, the line and the reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Iterator

import numpy as np

from gem_jax.jagged import Jagged

MIN_INTERACTIONS = 3  # one training item, the validation target, the test target
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
_LINE_BLANKS = " \t\r\n"  # stripped around a line; other whitespace (\x0b, \xa0, ...) is an error
_SEQUENCE_SEPARATOR = re.compile(r"[ \t]+")


class SeqRecDataError(ValueError):
  """A dataset file is malformed or cannot be split; the message names the file, line and reason."""


@dataclasses.dataclass(frozen=True)
class SeqDataset:
  """Chronological item sequences of every user, item ids remapped to 1..num_items (0 = padding).

  sequences[u]: int32 array of user u's items in order; user_ids[u]: the user's id in the file;
  item_ids[i - 1]: the file's id of remapped item i. file, sha256: which file was read (`load` sets them), so
  that a result says which of a dataset's files it came from (ML-1M's two order ties differently).
  """
  name: str
  sequences: list[np.ndarray]
  user_ids: np.ndarray
  item_ids: np.ndarray
  file: str = ""
  sha256: str = ""

  @property
  def num_items(self) -> int:
    return int(self.item_ids.shape[0])

  @property
  def num_users(self) -> int:
    return len(self.sequences)

  @property
  def num_interactions(self) -> int:
    return int(sum(s.shape[0] for s in self.sequences))


# ---- parsers ----------------------------------------------------------------------------------------
def _parse_int(field: str, what: str, path: str, lineno: int) -> int:
  """A field by the module's policy: int64, positive unless it is a timestamp."""
  # Not int(field) alone: it accepts " 5", "+5", "1_000" and unicode digits, and has no int64 bound.
  if not (field.isascii() and (field.isdigit() or (field[:1] == "-" and field[1:].isdigit()))):
    raise SeqRecDataError(f"{path}:{lineno}: {what} {field[:40]!r} is not an integer")
  # Up to 18 characters always fit; the digit count keeps int() off very long strings (slow, or refused past
  # 4300 digits).
  if len(field) > 18 and (len(field.lstrip("-").lstrip("0")) > 19 or not _INT64_MIN <= int(field) <= _INT64_MAX):
    raise SeqRecDataError(f"{path}:{lineno}: {what} {field[:40]} does not fit in int64")
  value = int(field)
  if value < 1 and what != "timestamp":
    raise SeqRecDataError(f"{path}:{lineno}: {what} {value} must be a positive integer")
  return value


def _lines(path: str) -> Iterator[tuple[int, str]]:
  """(1-based line number, line without the blanks around it), blank lines skipped."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"dataset file {path} does not exist")
  with open(path, encoding="latin-1", newline="\n") as f:  # newline="\n": a lone "\r" does not end a line
    for lineno, line in enumerate(f, 1):
      line = line.strip(_LINE_BLANKS)
      if line:
        yield lineno, line


def _from_events(name: str, path: str, events: list[tuple[int, int, int, int]]) -> SeqDataset:
  """events: (user, item, timestamp, line number) -> per-user sequences sorted by (timestamp, line)."""
  if not events:
    raise SeqRecDataError(f"{path}: no interactions")
  ev = np.asarray(events, dtype=np.int64)
  order = np.lexsort((ev[:, 3], ev[:, 2], ev[:, 0]))  # user, then timestamp, then file order
  ev = ev[order]
  users, starts = np.unique(ev[:, 0], return_index=True)
  bounds = np.append(starts, ev.shape[0])
  raw = [ev[bounds[u]:bounds[u + 1], 1] for u in range(users.shape[0])]
  first_lines = [int(ev[bounds[u]:bounds[u + 1], 3].min()) for u in range(users.shape[0])]
  return _remap(name, path, users, raw, first_lines)


def _remap(name: str, path: str, users: np.ndarray, raw: list[np.ndarray], lines: list[int]) -> SeqDataset:
  for user, seq, lineno in zip(users, raw, lines):
    if seq.shape[0] < MIN_INTERACTIONS:
      raise SeqRecDataError(
          f"{path}:{lineno}: user {int(user)} has {seq.shape[0]} interactions; the leave-one-out split needs "
          f"at least {MIN_INTERACTIONS} (training, validation, test)")
  item_ids = np.unique(np.concatenate(raw))
  sequences = [(np.searchsorted(item_ids, s) + 1).astype(np.int32) for s in raw]
  return SeqDataset(name, sequences, np.asarray(users, np.int64), item_ids.astype(np.int64))


def _load_rating_rows(path: str, name: str, sep: str, layout: str) -> SeqDataset:
  """Rows of user, item, rating, timestamp separated by `sep` (`layout` names the format in errors)."""
  events = []
  for lineno, line in _lines(path):
    fields = line.split(sep)
    if len(fields) != 4:
      raise SeqRecDataError(f"{path}:{lineno}: expected 4 fields {layout}, got {len(fields)}: {line[:80]!r}")
    user = _parse_int(fields[0], "user id", path, lineno)
    item = _parse_int(fields[1], "item id", path, lineno)
    _parse_int(fields[2], "rating", path, lineno)
    events.append((user, item, _parse_int(fields[3], "timestamp", path, lineno), lineno))
  return _from_events(name, path, events)


def load_ratings(path: str, name: str = "ml-1m") -> SeqDataset:
  """MovieLens-1M `ratings.dat`: UserID::MovieID::Rating::Timestamp."""
  return _load_rating_rows(path, name, "::", "UserID::MovieID::Rating::Timestamp")


def load_u_data(path: str, name: str = "ml-100k") -> SeqDataset:
  """MovieLens-100K `u.data`: user, item, rating, timestamp separated by tabs."""
  return _load_rating_rows(path, name, "\t", "user<TAB>item<TAB>rating<TAB>timestamp")


def load_sequences(path: str, name: str = "sequences") -> SeqDataset:
  """One line per user, `user item item ...` in chronological order, separated by spaces or tabs."""
  users, raw, lines, seen = [], [], [], {}
  for lineno, line in _lines(path):
    fields = _SEQUENCE_SEPARATOR.split(line)
    user = _parse_int(fields[0], "user id", path, lineno)
    if user in seen:
      raise SeqRecDataError(f"{path}:{lineno}: user {user} already has a line (line {seen[user]})")
    seen[user] = lineno
    if len(fields) == 1:
      raise SeqRecDataError(f"{path}:{lineno}: user {user} has no items")
    items = [_parse_int(f, "item id", path, lineno) for f in fields[1:]]
    users.append(user)
    raw.append(np.asarray(items, np.int64))
    lines.append(lineno)
  if not users:
    raise SeqRecDataError(f"{path}: no user lines")
  return _remap(name, path, np.asarray(users), raw, lines)


# ---- the datasets the experiments know --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DatasetSource:
  """Where a named dataset lives under a data root: the first path in `paths` that exists is read."""
  paths: tuple[tuple[str, Callable[[str, str], SeqDataset]], ...]


DATASETS: dict[str, DatasetSource] = {
    # A GroupLens ratings.dat, when the user has one, comes first: it carries the timestamps.
    "ml-1m": DatasetSource((("ml-1m/ratings.dat", load_ratings),
                            ("ml-1m/ml-1m_sequences_orig_ids.txt", load_sequences))),
    "ml-100k": DatasetSource((("ml-100k/u.data", load_u_data),)),
    "beauty": DatasetSource((("amazon-s3rec/Beauty.txt", load_sequences),)),
    "sports": DatasetSource((("amazon-s3rec/Sports_and_Outdoors.txt", load_sequences),)),
    "toys": DatasetSource((("amazon-s3rec/Toys_and_Games.txt", load_sequences),)),
}


def dataset_path(name: str, data_dir: str) -> tuple[str, Callable[[str, str], SeqDataset]] | None:
  """(file, loader) of dataset `name` under `data_dir`, or None when none of its files is there."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
  for rel, loader in DATASETS[name].paths:
    path = os.path.join(data_dir, rel)
    if os.path.isfile(path):
      return path, loader
  return None


def load(name: str, data_dir: str) -> SeqDataset:
  found = dataset_path(name, data_dir)
  if found is None:
    wanted = " or ".join(os.path.join(data_dir, rel) for rel, _ in DATASETS[name].paths)
    raise FileNotFoundError(f"dataset {name!r} not found: looked for {wanted}")
  path, loader = found
  return dataclasses.replace(loader(path, name), file=os.path.relpath(path, data_dir), sha256=file_sha256(path))


def file_sha256(path: str) -> str:
  import hashlib
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


# ---- leave-one-out split ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EvalSplit:
  """Prefixes (model input, oldest first) and the held-out target of every user."""
  prefixes: list[np.ndarray]
  targets: np.ndarray


@dataclasses.dataclass(frozen=True)
class LeaveOneOut:
  train: list[np.ndarray]     # every item but the last two (through_valid: but the last one): the model is
                              # trained on next-item targets
  valid: EvalSplit            # prefix = all but the last two items, target = second-to-last
  test: EvalSplit             # prefix = all but the last item, target = last


def leave_one_out(ds: SeqDataset, through_valid: bool = False) -> LeaveOneOut:
  """The split. through_valid: HSTU's protocol, training on the validation item as well (the validation
  split is then inside the training data and cannot select anything)."""
  seqs = ds.sequences
  return LeaveOneOut(
      train=[s[:-1] if through_valid else s[:-2] for s in seqs],
      valid=EvalSplit([s[:-2] for s in seqs], np.asarray([s[-2] for s in seqs], np.int32)),
      test=EvalSplit([s[:-1] for s in seqs], np.asarray([s[-1] for s in seqs], np.int32)))


# ---- batches -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SeqBatch:
  """B user rows of one step, jagged: `items` the input tokens, `targets` the next item of each token
  (0 where there is none: the last token of an evaluation row, padding). Rows are the most recent
  max_len input items of each user."""
  items: Jagged        # values (T,) int32
  targets_T: np.ndarray
  row_user_B: np.ndarray  # index of the user of each row; -1 for a padding row


def bucket_capacity(tokens: int, multiple: int) -> int:
  """Static capacity of a batch with `tokens` real tokens: rounded up to a multiple (one compile each)."""
  return max(multiple, -(-tokens // multiple) * multiple)


def pack(rows: list[np.ndarray], row_targets: list[np.ndarray], row_user: list[int], batch_size: int,
         multiple: int) -> SeqBatch:
  """Packs up to `batch_size` rows back to back; missing rows are empty (offsets repeat)."""
  if len(rows) > batch_size:
    raise ValueError(f"pack: {len(rows)} rows for a batch of {batch_size}")
  lengths = np.zeros(batch_size, np.int32)
  lengths[:len(rows)] = [r.shape[0] for r in rows]
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  cap = bucket_capacity(int(offsets[-1]), multiple)
  items = np.zeros(cap, np.int32)
  targets = np.zeros(cap, np.int32)
  if rows:
    items[:offsets[-1]] = np.concatenate(rows)
    targets[:offsets[-1]] = np.concatenate(row_targets)
  users = np.full(batch_size, -1, np.int32)
  users[:len(row_user)] = row_user
  return SeqBatch(Jagged(items, offsets), targets, users)


def epoch_users(train: list[np.ndarray], rng: np.random.Generator) -> list[int]:
  """One epoch's order: every user with at least two training items (one (input, next item) pair), in a
  random order. Users with a single training item have no pair and are skipped."""
  return [u for u in rng.permutation(len(train)) if train[u].shape[0] >= 2]


def train_batch(train: list[np.ndarray], users: list[int], *, batch_size: int, max_len: int,
                multiple: int, window_rng: np.random.Generator | None = None) -> SeqBatch:
  """The batch of `users`: each row max_len + 1 consecutive training items of its user as (input, next item)
  pairs, the last ones; with window_rng, a window whose end is drawn uniformly over every position a whole
  window can end at (one draw per row, so a user with fewer items keeps them all)."""
  window = max_len + 1
  seqs = [train[u] for u in users]
  if window_rng is None:
    ends = [s.shape[0] for s in seqs]
  else:
    lengths = np.asarray([s.shape[0] for s in seqs], np.int64)
    ends = window_rng.integers(np.minimum(lengths, window), lengths + 1)
  seqs = [s[max(0, int(e) - window):int(e)] for s, e in zip(seqs, ends)]
  return pack([s[:-1] for s in seqs], [s[1:] for s in seqs], list(users), batch_size, multiple)


def train_batches(train: list[np.ndarray], *, batch_size: int, max_len: int, multiple: int,
                  rng: np.random.Generator, random_windows: bool = False) -> Iterator[SeqBatch]:
  """One epoch of training batches (epoch_users, then train_batch per chunk of batch_size users; with
  random_windows, each batch's windows are drawn from rng)."""
  users = epoch_users(train, rng)
  for start in range(0, len(users), batch_size):
    yield train_batch(train, users[start:start + batch_size], batch_size=batch_size, max_len=max_len,
                      multiple=multiple, window_rng=rng if random_windows else None)


def eval_batches(split: EvalSplit, *, batch_size: int, max_len: int, multiple: int) -> Iterator[SeqBatch]:
  """Every user once, in order; a row is the user's last max_len prefix items (its target is read from
  `split.targets` by the caller, the per-token targets are zero)."""
  n = len(split.prefixes)
  for start in range(0, n, batch_size):
    chunk = list(range(start, min(n, start + batch_size)))
    rows = [split.prefixes[u][-max_len:] for u in chunk]
    yield pack(rows, [np.zeros_like(r) for r in rows], chunk, batch_size, multiple)
