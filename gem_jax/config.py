"""The run configuration: frozen dataclasses composed from each part's own config.

  Config(name, model: ModelConfig, data: DataConfig(spec, synthetic, pipeline), train: TrainConfig, mesh)

Named configs are built by functions in gem_jax/configs.py. `apply_overrides(cfg, ["train.steps=200"])` sets
nested fields from strings (the `--set` flag of experiments/train.py); an unknown key, a value that does
not parse (tuple elements included) or one its dataclass rejects raises a ValueError naming the key, before
anything is compiled. Checks across fields, against the mesh file and the devices are in gem_jax/check.py.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from gem_jax.data.pipeline import PipelineConfig
from gem_jax.data.spec import FeatureSpec
from gem_jax.data.synthetic import SyntheticConfig
from gem_jax.model.config import ModelConfig
from gem_jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
  spec: FeatureSpec
  synthetic: SyntheticConfig
  pipeline: PipelineConfig


@dataclasses.dataclass(frozen=True)
class Config:
  name: str
  model: ModelConfig
  data: DataConfig
  train: TrainConfig
  mesh: str | None = None  # path of a meshes/*.yaml file; None: one device


def _parse(value: str, typ, key: str):
  """`value` (a --set string) as a field of type `typ`; `key` is the whole dotted key, for the errors."""
  if typing.get_origin(typ) is tuple or typ is tuple:
    return _parse_tuple(value, typ, key)
  try:
    if typ is bool:
      if value.lower() in ("1", "true", "yes"):
        return True
      if value.lower() in ("0", "false", "no"):
        return False
      raise ValueError(value)
    if typ in (int, float, str):
      return typ(value)
    if typ == (str | None) or typ == typing.Optional[str]:
      return None if value.lower() == "none" else value
  except ValueError as e:
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ}") from e
  raise ValueError(f"--set {key}: fields of type {typ} cannot be set from the command line")


def _parse_tuple(value: str, typ, key: str) -> tuple:
  """A JSON list ("[8, 4]") or comma-separated values ("8,4"); every element must be of the element type
  (a float keep_last or a string fraction would otherwise fail only where the model or pipeline uses it)."""
  args = typing.get_args(typ)
  item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
  if item not in (int, float, str):
    raise ValueError(f"--set {key}: fields of type {typ} cannot be set from the command line")
  try:
    parsed = json.loads(value if value.startswith("[") else f"[{value}]")
  except json.JSONDecodeError as e:
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ} (a JSON list, or values separated by "
                     "commas)") from e
  if not isinstance(parsed, list):
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ}")
  out = []
  for x in parsed:
    if item is float and not isinstance(x, bool) and isinstance(x, (int, float)):
      x = float(x)
    if type(x) is not item:
      raise ValueError(f"--set {key}={value!r}: element {x!r} is not of type {item.__name__} ({typ})")
    out.append(x)
  return tuple(out)


def apply_overrides(cfg: Config, assignments: list[str]) -> Config:
  """cfg with every "dotted.key=value" of `assignments` set. They are applied together, one
  dataclasses.replace per config section, so a change that needs two fields at once (model.num_layers
  with model.hstu.keep_last) is checked only once both are set; a later assignment of the same key wins.
  Errors name the key (or, for a check across fields, the assignments of that section)."""
  tree: dict = {}
  for a in assignments:
    if "=" not in a:
      raise ValueError(f"--set expects key=value, got {a!r}")
    key, value = (x.strip() for x in a.split("=", 1))
    node, parts = tree, key.split(".")
    for i, part in enumerate(parts[:-1]):
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ValueError(f"--set {key}: {'.'.join(parts[:i + 1])} is set as a value and as a section")
    if isinstance(node.get(parts[-1]), dict):
      raise ValueError(f"--set {key}: {key} is set as a value and as a section")
    node[parts[-1]] = (value, a)
  return _apply(cfg, tree, "")


def _leaves(tree: dict) -> list[str]:
  """The assignments (as written) under a tree of overrides."""
  return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v[1]])]


def _first_key(sub, full: str) -> str:
  while isinstance(sub, dict):
    head, sub = next(iter(sub.items()))
    full = f"{full}.{head}"
  return full


def _apply(cfg, tree: dict, prefix: str):
  """cfg (a config section) with the overrides of `tree` ({field: (value, assignment) or subtree})."""
  if not dataclasses.is_dataclass(cfg):
    raise ValueError(f"--set {_first_key(tree, prefix[:-1])}: {prefix[:-1]} is not a config section (it holds a "
                     f"{type(cfg).__name__})")
  fields = {f.name for f in dataclasses.fields(cfg)}
  hints = typing.get_type_hints(type(cfg))
  changes = {}
  for head, sub in tree.items():
    full = prefix + head
    if head not in fields:
      raise ValueError(f"--set {_first_key(sub, full)}: unknown key {head!r} in {type(cfg).__name__}; known: "
                       f"{sorted(fields)}")
    changes[head] = (_apply(getattr(cfg, head), sub, full + ".") if isinstance(sub, dict)
                     else _parse(sub[0], hints[head], full))
  try:
    return dataclasses.replace(cfg, **changes)
  except ValueError as e:  # a section's own check (__post_init__) names the field, not the flag
    if str(e).startswith("--set"):
      raise
    raise ValueError(f"--set {', '.join(_leaves(tree))}: {e}") from e
