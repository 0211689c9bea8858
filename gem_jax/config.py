"""The run configuration: frozen dataclasses composed from each part's own config.

  Config(name, model: ModelConfig, data: DataConfig(spec, synthetic, pipeline), train: TrainConfig, mesh)

Named configs are built by functions in gem_jax/configs.py. `override(cfg, "train.steps", "200")` sets one
nested field from a string (the `--set` flag of experiments/train.py); an unknown key or a value that does
not parse raises a ValueError naming the key, before anything is compiled.
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
  origin = typing.get_origin(typ)
  try:
    if typ is bool:
      if value.lower() in ("1", "true", "yes"):
        return True
      if value.lower() in ("0", "false", "no"):
        return False
      raise ValueError(value)
    if typ in (int, float, str):
      return typ(value)
    if origin is tuple or typ is tuple:
      parsed = json.loads(value if value.startswith("[") else f"[{value}]")
      return tuple(parsed)
    if typ == (str | None) or typ == typing.Optional[str]:
      return None if value.lower() == "none" else value
  except (ValueError, json.JSONDecodeError) as e:
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ}") from e
  raise ValueError(f"--set {key}: fields of type {typ} cannot be set from the command line")


def override(cfg, key: str, value: str):
  """Returns cfg with the dotted field `key` (e.g. "model.hstu.num_heads") set from the string `value`."""
  head, _, tail = key.partition(".")
  if not dataclasses.is_dataclass(cfg):
    raise ValueError(f"--set {key}: {type(cfg).__name__} has no fields")
  fields = {f.name: f for f in dataclasses.fields(cfg)}
  if head not in fields:
    raise ValueError(f"--set {key}: unknown key {head!r} in {type(cfg).__name__}; known: {sorted(fields)}")
  current = getattr(cfg, head)
  if tail:
    return dataclasses.replace(cfg, **{head: override(current, tail, value)})
  hints = typing.get_type_hints(type(cfg))
  return dataclasses.replace(cfg, **{head: _parse(value, hints[head], key)})


def apply_overrides(cfg: Config, assignments: list[str]) -> Config:
  for a in assignments:
    if "=" not in a:
      raise ValueError(f"--set expects key=value, got {a!r}")
    key, value = a.split("=", 1)
    cfg = override(cfg, key.strip(), value.strip())
  return cfg
