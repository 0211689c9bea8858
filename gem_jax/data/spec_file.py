"""Feature-spec files: a FeatureSpec (gem_jax/data/spec.py) and the file columns of each of its parts, as YAML.

  tables:                       # name -> rows, dim [, out_of_range: error | hash]
    user_id: {rows: 1000, dim: 16}
  sparse:                       # name -> table [, group, max_ids, pooling, column]
    user_id: {table: user_id, group: user}
    user_interests: {table: category, group: user, max_ids: 4, pooling: mean}
  dense:                        # name -> [dim, column]
    bid: {dim: 1}
  sequence:                     # the user history, one list column per token field
    max_len: 32
    overflow: error             # or truncate: keep the most recent max_len tokens (counted)
    fields:
      item_id: {table: ad_id, column: history_item_id}
  domains: {names: [feed, stories], column: domain}
  tasks:                        # in order; a parent must come earlier
    click: {weight: 1.0}
    conversion: {weight: 1.0, parent: click}
  bad_labels: error             # or mask: a label outside {0, 1}, or a child's label where its parent is
                                # not 1, becomes undefined (counted)

`column` defaults to the part's name; a history field's to `history_<name>`; a task's label column to the
task's name, with optional `planted_logit_<task>` columns (the synthetic stream's ground truth). The column
types the Parquet source accepts are in gem_jax/data/parquet_source.py.

Every key is checked: an unknown key, a missing one or a value of the wrong type raises SpecFileError
naming the file and the key path (`spec.yaml: tables.user_id.rows: ...`). `dump` writes the same format,
and `load(dump(x)) == x`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from gem_jax import yamlfile
from gem_jax.data.spec import (DenseFeature, FeatureSpec, SequenceSpec, SparseFeature, TableSpec, TaskSpec,
                               TokenField)


class SpecFileError(ValueError):
  """A feature-spec file breaks the schema; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Columns:
  """The file column of every part of a spec (name -> column), and the domain column."""
  sparse: tuple[tuple[str, str], ...]
  dense: tuple[tuple[str, str], ...]
  history: tuple[tuple[str, str], ...]
  tasks: tuple[tuple[str, str], ...]
  domain: str = "domain"

  @staticmethod
  def default(spec: FeatureSpec) -> "Columns":
    return Columns(sparse=tuple((f.name, f.name) for f in spec.sparse),
                   dense=tuple((f.name, f.name) for f in spec.dense),
                   history=tuple((f.name, f"history_{f.name}") for f in spec.sequence.fields),
                   tasks=tuple((t.name, t.name) for t in spec.tasks))


@dataclasses.dataclass(frozen=True)
class SpecFile:
  spec: FeatureSpec
  columns: Columns


class _Reader:
  """Typed access to one YAML mapping, with the file and key path in every error."""

  def __init__(self, path: str, key: str, node: Any, known: tuple[str, ...]):
    self.path, self.key = path, key
    if not isinstance(node, dict):
      self.fail(f"must be a mapping, got {type(node).__name__}")
    unknown = [k for k in node if k not in known]
    if unknown:
      self.fail(f"unknown key {unknown[0]!r}; known: {list(known)}", sub=str(unknown[0]))
    self.node = node

  def fail(self, msg: str, sub: str | None = None):
    where = f"{self.key}.{sub}" if sub and self.key else (sub or self.key or "(top level)")
    raise SpecFileError(f"{self.path}: {where}: {msg}")

  def get(self, name: str, typ, default=dataclasses.MISSING):
    if name not in self.node:
      if default is dataclasses.MISSING:
        self.fail("is required", sub=name)
      return default
    value = self.node[name]
    ok = (isinstance(value, typ) and not isinstance(value, bool)) if typ in (int, float) else isinstance(value, typ)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
      value, ok = float(value), True
    if not ok:
      self.fail(f"must be {getattr(typ, '__name__', typ)}, got {value!r}", sub=name)
    return value

  def positive(self, name: str, default=dataclasses.MISSING) -> int:
    value = self.get(name, int, default)
    if value <= 0:
      self.fail(f"must be a positive integer, got {value}", sub=name)
    return value

  def choice(self, name: str, choices: tuple[str, ...], default: str) -> str:
    value = self.get(name, str, default)
    if value not in choices:
      self.fail(f"must be one of {list(choices)}, got {value!r}", sub=name)
    return value

  def named(self, name: str, required: bool = True) -> list[tuple[str, Any]]:
    """The (name, entry) pairs of a mapping-valued key, in file order."""
    node = self.node.get(name, {} if not required else None)
    if node is None:
      self.fail("is required", sub=name)
    if not isinstance(node, dict):
      self.fail(f"must be a mapping of name -> entry, got {type(node).__name__}", sub=name)
    return [(str(k), v if v is not None else {}) for k, v in node.items()]

  def sub(self, name: str, node: Any, known: tuple[str, ...]) -> "_Reader":
    return _Reader(self.path, f"{self.key}.{name}" if self.key else name, node, known)


def parse(data: Any, path: str = "<spec>") -> SpecFile:
  """The SpecFile of a loaded YAML document (`path` only names it in errors)."""
  top = _Reader(path, "", data, ("tables", "sparse", "dense", "sequence", "domains", "tasks", "bad_labels"))
  tables = []
  for name, node in top.named("tables"):
    r = top.sub(f"tables.{name}", node, ("rows", "dim", "out_of_range"))
    tables.append(TableSpec(name, r.positive("rows"), r.positive("dim"),
                            r.choice("out_of_range", ("error", "hash"), "error")))
  table_names = [t.name for t in tables]

  def table_of(r: _Reader) -> str:
    table = r.get("table", str)
    if table not in table_names:
      r.fail(f"unknown table {table!r}; tables: {table_names}", sub="table")
    return table

  sparse, sparse_cols = [], []
  for name, node in top.named("sparse"):
    r = top.sub(f"sparse.{name}", node, ("table", "group", "max_ids", "pooling", "column"))
    sparse.append(SparseFeature(name, table_of(r), r.choice("group", ("user", "context", "candidate"), "user"),
                                r.positive("max_ids", 1), r.choice("pooling", ("sum", "mean"), "sum")))
    sparse_cols.append((name, r.get("column", str, name)))
  dense, dense_cols = [], []
  for name, node in top.named("dense", required=False):
    r = top.sub(f"dense.{name}", node, ("dim", "column"))
    dense.append(DenseFeature(name, r.positive("dim", 1)))
    dense_cols.append((name, r.get("column", str, name)))
  seq = top.sub("sequence", top.get("sequence", dict), ("max_len", "overflow", "fields"))
  fields, history_cols = [], []
  for name, node in seq.named("fields"):
    r = seq.sub(f"fields.{name}", node, ("table", "column"))
    fields.append(TokenField(name, table_of(r)))
    history_cols.append((name, r.get("column", str, f"history_{name}")))
  if not fields:
    seq.fail("needs at least one field", sub="fields")
  sequence = SequenceSpec(tuple(fields), seq.positive("max_len"), seq.choice("overflow", ("error", "truncate"), "error"))
  dom = top.sub("domains", top.get("domains", dict), ("names", "column"))
  names = dom.get("names", list)
  if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
    dom.fail(f"must be a non-empty list of distinct strings, got {names!r}", sub="names")
  tasks, task_cols = [], []
  for name, node in top.named("tasks"):
    r = top.sub(f"tasks.{name}", node, ("weight", "parent", "column"))
    weight = r.get("weight", float, 1.0)
    if not weight >= 0:
      r.fail(f"must be >= 0, got {weight}", sub="weight")
    parent = r.get("parent", str, None)
    if parent is not None and parent not in [t.name for t in tasks]:
      r.fail(f"must name an earlier task, got {parent!r}", sub="parent")
    tasks.append(TaskSpec(name, weight, parent))
    task_cols.append((name, r.get("column", str, name)))
  if not tasks:
    top.fail("needs at least one task", sub="tasks")
  try:
    spec = FeatureSpec(tuple(tables), tuple(sparse), tuple(dense), sequence, tuple(names), tuple(tasks),
                       top.choice("bad_labels", ("error", "mask"), "error"))
  except ValueError as e:
    raise SpecFileError(f"{path}: {e}") from e
  columns = Columns(tuple(sparse_cols), tuple(dense_cols), tuple(history_cols), tuple(task_cols),
                    dom.get("column", str, "domain"))
  all_cols = [c for _, c in columns.sparse + columns.dense + columns.history + columns.tasks] + [columns.domain]
  dup = sorted({c for c in all_cols if all_cols.count(c) > 1})
  if dup:
    raise SpecFileError(f"{path}: column {dup[0]!r} is named by more than one part of the spec")
  return SpecFile(spec, columns)


def load(path: str) -> SpecFile:
  try:
    with open(path) as f:
      data = yamlfile.load(f)
  except yaml.YAMLError as e:
    raise SpecFileError(f"{path}: not valid YAML: {e}") from e
  return parse(data, path)


def to_dict(spec: FeatureSpec, columns: Columns | None = None) -> dict:
  """The YAML document of (spec, columns); defaults are written out, so the file says everything."""
  columns = columns or Columns.default(spec)
  sc, dc, hc, tc = (dict(x) for x in (columns.sparse, columns.dense, columns.history, columns.tasks))
  return {
      "tables": {t.name: {"rows": t.vocab_size, "dim": t.dim, "out_of_range": t.out_of_range} for t in spec.tables},
      "sparse": {f.name: {"table": f.table, "group": f.group, "max_ids": f.max_ids, "pooling": f.pooling,
                          "column": sc[f.name]} for f in spec.sparse},
      "dense": {f.name: {"dim": f.dim, "column": dc[f.name]} for f in spec.dense},
      "sequence": {"max_len": spec.sequence.max_len, "overflow": spec.sequence.overflow,
                   "fields": {f.name: {"table": f.table, "column": hc[f.name]} for f in spec.sequence.fields}},
      "domains": {"names": list(spec.domains), "column": columns.domain},
      "tasks": {t.name: {"weight": t.weight, **({"parent": t.parent} if t.parent else {}), "column": tc[t.name]}
                for t in spec.tasks},
      "bad_labels": spec.bad_labels,
  }


def dump(spec: FeatureSpec, columns: Columns | None = None) -> str:
  return yaml.safe_dump(to_dict(spec, columns), sort_keys=False, default_flow_style=None)
