"""Logical axis names -> mesh axes: the one place where sharding is decided.

Model code annotates parameters (and a few activations) with the logical names below and never names a
mesh axis. The mesh has five axes, outermost first: replica, fsdp, sparse, context, tensor.

Parameters
  table_rows   embedding-table rows: model parallel over `sparse` (the 2D sparse layout: the table is
               replicated over `replica`, and its optimizer state is sharded like it)
  table_dim    embedding width: never sharded
  embed        the input dim of dense layers: HSDP, sharded over `fsdp`, replicated over `replica`
  mlp          the hidden dim of a tensor-parallel pair (a column-parallel Dense into a row-parallel one,
               gem_jax/model/layers.py): `tensor`, and never gathered
  hidden       the output dim of a projection that is not part of such a pair: replicated
  heads        attention heads: `tensor`
  features     small per-feature dims (Wukong's feature axis, task/domain axes): replicated
Activations
  batch        examples: every data axis
  tokens       jagged sequence tokens: data axes (their sharding over `context` comes with the mesh issue)
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("replica", "fsdp", "sparse", "context", "tensor")
DATA_AXES = ("replica", "fsdp", "sparse")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("table_rows", "sparse"),
    ("table_dim", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("hidden", None),
    ("heads", "tensor"),
    ("features", None),
    ("batch", DATA_AXES),
    ("tokens", DATA_AXES),
)


def logical_to_spec(names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for an array whose dims carry `names`; a mesh axis is used at most once."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in names:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    axes = table[name]
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    free = tuple(a for a in axes if a not in used)
    used.update(free)
    out.append(None if not free else free[0] if len(free) == 1 else free)
  return PartitionSpec(*out)


def named_sharding(mesh: Mesh, names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, rules))


def single_device_mesh() -> Mesh:
  """All five axes of size 1 on the first device: the layout of a laptop run."""
  import numpy as np
  return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
