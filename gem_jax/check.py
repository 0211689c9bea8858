"""Run validation: a config, a mesh file and the run's devices that cannot work together fail here, first.

  check_config(cfg, mesh_spec, num_devices)    # gem_jax/train/loop.py::train, before anything is built

Where a check lives: a field that is wrong on its own fails in its dataclass's __post_init__ (so a bad
`--set` fails at once), and a mesh file that is wrong on its own fails in gem_jax/parallel/mesh.py::parse.
This module holds the checks across them: the config against itself, against the mesh file and against the
device count. A check is here only because the combination would otherwise fail late (after the tables are
allocated, inside tracing, at the first step) or run and compute something other than what the config says;
each error names the config key(s) or mesh axis and the numbers.

Tensor-parallel pairs: the SPMD step (gem_jax/parallel/spmd.py) cuts a parameter dim over `tensor` when its
rule maps it to exactly that axis and the size divides, and keeps it whole otherwise. The model then reads
its slice width off the parameter (gem_jax/model/layers.py), so every parameter of one column / row
parallel pair must be cut the same way, or tracing fails on mismatched shapes. `tensor_parallel_parts`
lists those parameters; tests/test_config_validation.py checks the list against the built model.

This module builds nothing, allocates nothing and never touches a device (the device count comes in).
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
from gem_jax.parallel.rules import logical_to_spec
from gem_jax.parallel.spmd import TP_AXIS, TP_NAMES


class ConfigError(ValueError):
  """A config that cannot run (on this mesh); the message names the config keys and the numbers."""


def check_config(cfg: Config, mesh_spec: MeshSpec | None, num_devices: int | None = None) -> None:
  """Raises ConfigError (or MeshFileError for the mesh and the devices) for the first combination of `cfg`,
  its mesh file `mesh_spec` (the loaded cfg.mesh; None: one device) and the run's `num_devices` (None: not
  checked) that cannot run."""
  check_spec(cfg.data.spec)
  check_synthetic(cfg.data.synthetic)
  check_model(cfg.model)
  if mesh_spec is None:
    return
  if num_devices is not None:
    mesh_lib.check_devices(mesh_spec, num_devices)
  mesh_lib.check_batch(mesh_spec, cfg.data.pipeline.batch_size)
  check_rules(mesh_spec)
  check_tensor_parallel(cfg.model, mesh_spec)


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
  and the model computes on it as one (spmd.plan raises the same once the model is built)."""
  if spec.shape[TP_AXIS] == 1:
    return
  for logical, target in spec.rules:
    if target == TP_AXIS and logical not in TP_NAMES:
      raise MeshFileError(f"{spec.name}: rules put logical axis {logical!r} on {TP_AXIS!r} (size "
                          f"{spec.shape[TP_AXIS]}), which holds tensor-parallel slices the model consumes as such; "
                          f"only {TP_NAMES} may map there")


@dataclasses.dataclass(frozen=True)
class Part:
  """One parameter dim of a tensor-parallel pair: `path` in the model, its logical `names`, the `dim` that
  the pair slices and its `size`."""
  path: str
  names: tuple[str | None, ...]
  dim: int
  size: int


def tensor_parallel_parts(model: ModelConfig) -> dict[str, tuple[Part, ...]]:
  """The parameter dims of each column / row parallel pair of the model (every layer has the same widths,
  so layer 0 stands for all). Keyed by the config keys that size them."""
  h, w = model.hstu, model.wukong
  cols, hdv = h.num_heads * (2 * h.value_dim + 2 * h.head_dim), h.num_heads * h.value_dim
  hstu = "layers.0.hstu"
  wukong = "layers.0.wukong"
  return {
      "model.hstu.num_heads": (
          Part(f"{hstu}.uvqk.kernel", ("embed", "mlp"), 1, cols), Part(f"{hstu}.uvqk.bias", ("mlp",), 0, cols),
          Part(f"{hstu}.norm_attn.scale", ("mlp",), 0, hdv), Part(f"{hstu}.norm_attn.bias", ("mlp",), 0, hdv),
          Part(f"{hstu}.out.kernel", ("mlp", "embed"), 0, hdv),
          Part(f"{hstu}.rel_bias_HxR", ("heads", None), 0, h.num_heads)),
      "model.wukong.mlp_hidden": (
          Part(f"{wukong}.fm_mlp_in.kernel", ("embed", "mlp"), 1, w.mlp_hidden),
          Part(f"{wukong}.fm_mlp_in.bias", ("mlp",), 0, w.mlp_hidden),
          Part(f"{wukong}.fm_mlp_out.kernel", ("mlp", "embed"), 0, w.mlp_hidden)),
      "model.tower_hidden": (
          Part("heads.trunk.kernel", ("embed", "mlp"), 1, model.tower_hidden),
          Part("heads.trunk.bias", ("mlp",), 0, model.tower_hidden),
          Part("heads.w1_RxGxG", ("features", "mlp", None), 1, model.tower_hidden)),
  }


def tensor_slices(part: Part, spec: MeshSpec) -> int:
  """How many slices the SPMD step leaves `part` cut into: the tensor size when its rule entry is exactly
  `tensor` and the size divides (spmd.Plan.spec_for), else 1 (whole, or gathered back before use)."""
  entry = logical_to_spec(part.names, spec.rules)[part.dim]
  t = spec.shape[TP_AXIS]
  return t if entry == TP_AXIS and t > 1 and part.size % t == 0 else 1


def check_tensor_parallel(model: ModelConfig, spec: MeshSpec) -> None:
  """Every parameter of a tensor-parallel pair is cut the same way; for HSTU that means whole heads."""
  t = spec.shape[TP_AXIS]
  if t == 1:
    return
  values = {"model.hstu.num_heads": f"model.hstu.num_heads={model.hstu.num_heads} (head_dim="
                                    f"{model.hstu.head_dim}, value_dim={model.hstu.value_dim})",
            "model.wukong.mlp_hidden": f"model.wukong.mlp_hidden={model.wukong.mlp_hidden}",
            "model.tower_hidden": f"model.tower_hidden={model.tower_hidden}"}
  for key, parts in tensor_parallel_parts(model).items():
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
      fix = f"use a {key} divisible by {TP_AXIS}={t}, or a mesh with {TP_AXIS}=1"
    raise ConfigError(f"{values[key]} does not split over mesh axis {TP_AXIS}={t} of mesh {spec.name!r}: the "
                      f"parameters of one tensor-parallel pair would be cut differently ({cuts}), and tracing "
                      f"the step would fail on their shapes; {fix}")
