"""The run configuration: frozen dataclasses composed from each part's own config.

  Config(name, model: ModelConfig, data: DataConfig(spec, synthetic, pipeline), train: TrainConfig, mesh)

Named configs are built by functions in gem_jax/configs.py. `override(cfg, "train.steps", "200")` sets one
nested field from a string (the `--set` flag of experiments/train.py); an unknown key, a value that does
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


def override(cfg, key: str, value: str, *, _prefix: str = ""):
  """Returns cfg with the dotted field `key` (e.g. "model.hstu.num_heads") set from the string `value`.
  Errors name the whole key (`_prefix` is the part above `cfg` in the recursion)."""
  head, _, tail = key.partition(".")
  full = _prefix + key
  if not dataclasses.is_dataclass(cfg):
    raise ValueError(f"--set {full}: {_prefix[:-1]} is not a config section (it holds a {type(cfg).__name__})")
  fields = {f.name: f for f in dataclasses.fields(cfg)}
  if head not in fields:
    raise ValueError(f"--set {full}: unknown key {head!r} in {type(cfg).__name__}; known: {sorted(fields)}")
  current = getattr(cfg, head)
  if tail:
    return dataclasses.replace(cfg, **{head: override(current, tail, value, _prefix=f"{_prefix}{head}.")})
  hints = typing.get_type_hints(type(cfg))
  return dataclasses.replace(cfg, **{head: _parse(value, hints[head], full)})


def apply_overrides(cfg: Config, assignments: list[str]) -> Config:
  for a in assignments:
    if "=" not in a:
      raise ValueError(f"--set expects key=value, got {a!r}")
    key, value = a.split("=", 1)
    try:
      cfg = override(cfg, key.strip(), value.strip())
    except ValueError as e:  # a config's own check (__post_init__) names the field, not the flag
      if str(e).startswith("--set"):
        raise
      raise ValueError(f"--set {a}: {e}") from e
  return cfg
