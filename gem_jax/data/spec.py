"""Feature specs: what an ads example holds, declared once and shared by data, model and validation.

Tables are declared apart from features: several features may look up one table (the candidate ad id and
the ad ids of the user's history share `ad_id`; the user's multi-hot interests and the candidate's
category share `category`). A spec never holds data; `Batch` (batch.py) is the data laid out by it.

Groups of sparse features:
  user       describe the viewer (user id, segment, multi-hot interests)
  context    describe the request (device, hour)
  candidate  describe the ad being scored; they also build the target token of the sequence arch
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Pooling = Literal["sum", "mean"]
Group = Literal["user", "context", "candidate"]
OutOfRange = Literal["error", "hash"]
Overflow = Literal["error", "truncate"]
BadLabels = Literal["error", "mask"]


def _check_choice(owner: str, field: str, value, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{owner}: {field} must be one of {list(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table: `vocab_size` rows of width `dim`. `out_of_range`: what a file-backed source does
  with an id outside [0, vocab_size): "error" (the default) or "hash" (a fixed hash into range, counted)."""
  name: str
  vocab_size: int
  dim: int
  out_of_range: OutOfRange = "error"

  def __post_init__(self):
    if self.vocab_size <= 0 or self.dim <= 0:
      raise ValueError(f"table {self.name!r}: vocab_size and dim must be positive, got {self.vocab_size}, {self.dim}")
    _check_choice(f"table {self.name!r}", "out_of_range", self.out_of_range, ("error", "hash"))


@dataclasses.dataclass(frozen=True)
class SparseFeature:
  """A categorical feature. max_ids == 1: single-hot (ids_B); > 1: multi-hot (a Jagged of ids), pooled."""
  name: str
  table: str
  group: Group = "user"
  max_ids: int = 1
  pooling: Pooling = "sum"

  @property
  def multi_hot(self) -> bool:
    return self.max_ids > 1


@dataclasses.dataclass(frozen=True)
class DenseFeature:
  name: str
  dim: int = 1


@dataclasses.dataclass(frozen=True)
class TokenField:
  """One per-token field of the history sequence (item id, action type, time-gap bucket, ...)."""
  name: str
  table: str


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
  """The user history: a jagged sequence whose tokens have `fields` (columns of Batch.history.values).
  `overflow`: what a file-backed source does with a longer history: "error" (the default) or "truncate"
  (keep the most recent max_len tokens, counted)."""
  fields: tuple[TokenField, ...]
  max_len: int
  overflow: Overflow = "error"

  def __post_init__(self):
    if self.max_len <= 0:
      raise ValueError(f"sequence: max_len must be positive, got {self.max_len}")
    _check_choice("sequence", "overflow", self.overflow, ("error", "truncate"))

  def field_index(self, name: str) -> int:
    for i, f in enumerate(self.fields):
      if f.name == name:
        return i
    raise KeyError(f"history has no field {name!r}; fields: {[f.name for f in self.fields]}")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """A binary prediction task. `parent`: the task must be positive for this one to be defined
  (conversion is only labelled on clicked examples)."""
  name: str
  weight: float = 1.0
  parent: str | None = None


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """`bad_labels`: what a file-backed source does with a label outside {0, 1}, or a child task's label set
  where its parent's is not 1: "error" (the default) or "mask" (the label becomes undefined, counted)."""
  tables: tuple[TableSpec, ...]
  sparse: tuple[SparseFeature, ...]
  dense: tuple[DenseFeature, ...]
  sequence: SequenceSpec
  domains: tuple[str, ...]
  tasks: tuple[TaskSpec, ...]
  bad_labels: BadLabels = "error"

  def __post_init__(self):
    _check_choice("spec", "bad_labels", self.bad_labels, ("error", "mask"))
    names = [t.name for t in self.tables]
    if len(set(names)) != len(names):
      raise ValueError(f"duplicate table names in {names}")
    for f in list(self.sparse) + list(self.sequence.fields):
      if f.table not in names:
        raise ValueError(f"feature {f.name!r} uses unknown table {f.table!r}; tables: {names}")
    fnames = [f.name for f in self.sparse] + [f.name for f in self.dense]
    if len(set(fnames)) != len(fnames):
      raise ValueError(f"duplicate feature names in {fnames}")
    tnames = [t.name for t in self.tasks]
    for t in self.tasks:
      if t.parent is not None and t.parent not in tnames[:tnames.index(t.name)]:
        raise ValueError(f"task {t.name!r}: parent {t.parent!r} must be an earlier task of {tnames}")
    if not self.domains:
      raise ValueError("at least one domain is needed")

  def table(self, name: str) -> TableSpec:
    for t in self.tables:
      if t.name == name:
        return t
    raise KeyError(f"no table {name!r}")

  def sparse_feature(self, name: str) -> SparseFeature:
    for f in self.sparse:
      if f.name == name:
        return f
    raise KeyError(f"no sparse feature {name!r}")

  @property
  def single_hot(self) -> tuple[SparseFeature, ...]:
    return tuple(f for f in self.sparse if not f.multi_hot)

  @property
  def multi_hot(self) -> tuple[SparseFeature, ...]:
    return tuple(f for f in self.sparse if f.multi_hot)

  @property
  def dense_dim(self) -> int:
    return sum(f.dim for f in self.dense)

  @property
  def task_names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.tasks)

  def group(self, group: Group) -> tuple[SparseFeature, ...]:
    return tuple(f for f in self.sparse if f.group == group)


def ads_feature_spec(*, users: int, ads: int, advertisers: int, categories: int, embed_dim: int,
                     max_history: int, max_interests: int = 8, num_domains: int = 3) -> FeatureSpec:
  """The ads feature spec used by the synthetic stream, sized by vocabularies (the configs pick them)."""
  tables = (
      TableSpec("user_id", users, embed_dim),
      TableSpec("user_segment", 256, embed_dim),
      TableSpec("ad_id", ads, embed_dim),
      TableSpec("advertiser_id", advertisers, embed_dim),
      TableSpec("category", categories, embed_dim),
      TableSpec("device", 8, embed_dim),
      TableSpec("hour", 24, embed_dim),
      TableSpec("action", 4, embed_dim),
      TableSpec("time_gap", 32, embed_dim),
  )
  sparse = (
      SparseFeature("user_id", "user_id", "user"),
      SparseFeature("user_segment", "user_segment", "user"),
      SparseFeature("user_interests", "category", "user", max_ids=max_interests, pooling="mean"),
      SparseFeature("device", "device", "context"),
      SparseFeature("hour", "hour", "context"),
      SparseFeature("ad_id", "ad_id", "candidate"),
      SparseFeature("advertiser_id", "advertiser_id", "candidate"),
      SparseFeature("ad_category", "category", "candidate"),
  )
  dense = (DenseFeature("ad_quality"), DenseFeature("user_activity"), DenseFeature("bid"))
  sequence = SequenceSpec(
      fields=(TokenField("item_id", "ad_id"), TokenField("item_category", "category"),
              TokenField("action", "action"), TokenField("time_gap", "time_gap")),
      max_len=max_history)
  domains = ("feed", "stories", "marketplace", "reels", "search")[:num_domains]
  tasks = (TaskSpec("click", 1.0), TaskSpec("conversion", 1.0, parent="click"))
  return FeatureSpec(tables, sparse, dense, sequence, domains, tasks)
