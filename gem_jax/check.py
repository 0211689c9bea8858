"""Run validation: a config, a mesh file and the run's devices that cannot work together fail here, first.

  check_config(cfg, mesh_spec, num_devices)    # gem_jax/run/build.py::build, before anything is built

Where a check lives: a field that is wrong on its own fails in its dataclass's __post_init__ (so a bad
`--set` fails at once), and a mesh file that is wrong on its own fails in gem_jax/parallel/mesh.py::parse.
This module holds the checks across them: the config against itself, against the mesh file and against the
device count. A check is here only because the combination would otherwise fail late (after the tables are
allocated, inside tracing, at the first step) or run and compute something other than what the config says;
each error names the config key(s) or mesh axis and the numbers.

Tensor-parallel pairs: the SPMD step (gem_jax/run/step.py) cuts a parameter dim over `tensor` when its
rule maps it to exactly that axis and the size divides, and keeps it whole otherwise. The model then reads
its slice width off the parameter (gem_jax/model/layers.py), so every parameter of one column / row
parallel pair must be cut the same way, or tracing fails on mismatched shapes. `check_tensor_parallel`
reads the pairs off the built model's parameters (gem_jax/parallel/placement.py).

This module builds nothing, allocates nothing and never touches a device (the device count and, for
the tensor-parallel check, the model's parameters come in).
"""

from __future__ import annotations

import dataclasses
import math

from gem_jax import ops
from gem_jax.config import Config
from gem_jax.data.spec import FeatureSpec
from gem_jax.data.synthetic import SyntheticConfig
from gem_jax.model.config import ModelConfig
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.mesh import MeshFileError, MeshSpec
from gem_jax.parallel.placement import TP_AXIS, TP_NAMES, tensor_parallel_parts, tensor_slices


class ConfigError(ValueError):
  """A config that cannot run (on this mesh); the message names the config keys and the numbers."""


def check_config(cfg: Config, mesh_spec: MeshSpec | None, num_devices: int | None = None) -> None:
  """Raises ConfigError (or MeshFileError for the mesh and the devices) for the first combination of `cfg`,
  its mesh file `mesh_spec` (the loaded cfg.mesh; None: one device) and the run's `num_devices` (None: not
  checked) that cannot run. The GEM checks apply to GEM configs (a ModelConfig), the synthetic ones to a
  source with a SyntheticConfig; every config gets the mesh, device and batch checks."""
  if isinstance(cfg.model, ModelConfig):
    check_spec(cfg.data.spec)
    check_model(cfg.model)
  if isinstance(getattr(cfg.data, "synthetic", None), SyntheticConfig):
    check_synthetic(cfg.data.synthetic)
  if mesh_spec is None:
    return
  if num_devices is not None:
    mesh_lib.check_devices(mesh_spec, num_devices)
  mesh_lib.check_batch(mesh_spec, train_batch_size(cfg))
  check_rules(mesh_spec)


def check_selection(select_metric: str, selectable: dict[str, int]) -> None:
  """train.select_metric names a metric the task's evaluation reports (and knows the direction of)."""
  if select_metric and select_metric not in selectable:
    raise ConfigError(f"train.select_metric {select_metric!r} is not one of the task's selectable metrics: "
                      f"{sorted(selectable)}")


def train_batch_size(cfg) -> int:
  """Rows of a training batch, whatever the source's config calls it."""
  pipe = getattr(cfg.data, "pipeline", None)
  return pipe.batch_size if pipe is not None else cfg.data.batch_size


# ---- the config on its own ---------------------------------------------------------------------------------


def check_spec(spec: FeatureSpec) -> None:
  """Task weights: the loss is sum_k w_k BCE_k / sum_k w_k, so a zero sum or a NaN weight makes every loss
  NaN, and a negative weight makes the optimizer maximize that task's error."""
  weights = {t.name: t.weight for t in spec.tasks}
  bad = {name: w for name, w in weights.items() if not (math.isfinite(w) and w >= 0)}
  if bad:
    raise ConfigError(f"data.spec.tasks: weights must be finite and >= 0, got {bad}")
  if not sum(weights.values()) > 0:
    raise ConfigError(f"data.spec.tasks: the task weights {weights} sum to 0; the loss divides by their sum")


def check_synthetic(syn: SyntheticConfig) -> None:
  """The synthetic stream's numbers: a NaN strength gives NaN planted logits and all-zero labels (a run that
  learns nothing and says nothing), a NaN length parameter fails in numpy far from the config."""
  for field in dataclasses.fields(syn):
    value = getattr(syn, field.name)
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"data.synthetic.{field.name} must be finite, got {value}")
  if syn.session_mean_len < 1:  # the session length is geometric with p = 1 / session_mean_len
    raise ConfigError(f"data.synthetic.session_mean_len must be >= 1, got {syn.session_mean_len}")


def check_model(model: ModelConfig) -> None:
  """The attention kernel must be one gem_jax.ops knows (else tracing the first step fails)."""
  impl = model.hstu.attn_impl
  known = list(ops.hstu_impls())
  if impl != "auto" and impl not in known:
    raise ConfigError(f"model.hstu.attn_impl={impl!r} is not an HSTU attention impl; known: {known} or 'auto'")


# ---- the config on a mesh ----------------------------------------------------------------------------------


def check_rules(spec: MeshSpec) -> None:
  """Only the tensor-parallel logical axes may map to `tensor` alone: the step keeps such a dim as a slice
  and the model computes on it as one (placement.of raises the same once the model is built)."""
  if spec.shape[TP_AXIS] == 1:
    return
  for logical, target in spec.rules:
    if target == TP_AXIS and logical not in TP_NAMES:
      raise MeshFileError(f"{spec.name}: rules put logical axis {logical!r} on {TP_AXIS!r} (size "
                          f"{spec.shape[TP_AXIS]}), which holds tensor-parallel slices the model consumes as such; "
                          f"only {TP_NAMES} may map there")


def check_precision_rules(cfg: Config, model) -> None:
  """Every model.precision.rules pattern names at least one Dense site of `model` (a typo would otherwise
  leave the sites it meant in the policy's default without a word)."""
  import fnmatch

  from gem_jax.model.layers import dense_sites
  precision = getattr(cfg.model, "precision", None)
  if precision is None or not precision.rules:
    return
  sites = [site for site, _ in dense_sites(model)]
  for pattern, _ in precision.parsed_rules():
    if not any(fnmatch.fnmatchcase(site, pattern) for site in sites):
      raise ValueError(f"model.precision.rules: {pattern!r} matches no Dense site of the model; its sites are "
                       f"{sites[:8]}{' ...' if len(sites) > 8 else ''} ({len(sites)} in all)")


def check_tensor_parallel(params, spec: MeshSpec) -> None:
  """Every parameter of a tensor-parallel pair is cut the same way (for HSTU: whole heads). `params`: the
  built or abstract model's parameters, whose tensor-parallel dims are read off their logical axes
  (placement.tensor_parallel_parts), so a layer added to the model is checked without being listed here.
  build() calls this before anything is compiled."""
  t = spec.shape[TP_AXIS]
  if t == 1:
    return
  groups: dict[str, list] = {}
  for part in tensor_parallel_parts(params):
    groups.setdefault(part.group, []).append(part)
  for group, parts in groups.items():
    slices = [tensor_slices(p, spec) for p in parts]
    if len(set(slices)) == 1:
      continue
    cuts = "; ".join(f"{p.path} dim {p.dim} ({p.size}) {'into ' + str(n) if n > 1 else 'whole'}"
                     for p, n in zip(parts, slices))
    if all(p.size % t == 0 for p in parts):
      rules = dict(spec.rules)
      fix = (f"the mesh file's rules (mlp: {rules['mlp']}, heads: {rules['heads']}, embed: {rules['embed']}, "
             f"features: {rules['features']}) place them differently; map mlp and heads to {TP_AXIS!r} alone "
             "(the default) or neither")
    else:
      fix = (f"use widths divisible by {TP_AXIS}={t} (the number of heads of an HSTU layer, the MLP width of a "
             f"Wukong layer, the tower width of the heads), or a mesh with {TP_AXIS}=1")
    raise ConfigError(f"{group}: the parameters of its tensor-parallel pair would be cut differently over mesh "
                      f"axis {TP_AXIS}={t} of mesh {spec.name!r} ({cuts}), and tracing the step would fail on "
                      f"their shapes; {fix}")
