"""Model configuration (frozen dataclasses); gem_jax/model/layers.py applies it (dtypes, sharding names).

The named configs live in gem_jax/configs.py. This module must never name a mesh axis: layers carry the
logical axis names of gem_jax/parallel/rules.py and the rules table maps them to the mesh.

Letters used across gem_jax/model: B batch, T jagged token capacity, D sequence model width,
E embedding width, H heads, Dh head dim (q/k), Dv value dim per head, F number of feature embeddings
entering a Wukong layer, S number of sequence-summary vectors, C contextual tokens, K tasks, R domains.

Sharding metadata: every parameter is an nnx.Param (or a subclass) whose `out_sharding` metadata is a
tuple of logical names, one per dim (None: never sharded), created with eager_sharding=False so that a
model can be built without a mesh; `rules.logical_to_spec(var.get_metadata()["out_sharding"])` gives the
PartitionSpec.
"""

from __future__ import annotations

import dataclasses
import numbers
import re

import jax.numpy as jnp

from gem_jax.precision.policy import PrecisionConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _check_ints(prefix: str, obj, minimum: dict[str, int]) -> None:
  """Each named field is an int (a float or bool size fails only deep inside a shape) >= its minimum."""
  for name, low in minimum.items():
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
      raise ValueError(f"{prefix}{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class HSTUConfig:
  """One HSTU layer per GEM layer. `keep_last[l]`: history tokens layer l keeps (the pyramid: deeper
  layers see only the most recent ones); len(keep_last) == number of GEM layers."""
  num_heads: int = 2
  head_dim: int = 32          # q/k width per head
  value_dim: int = 32         # v/u width per head
  keep_last: tuple[int, ...] = (128, 64)
  num_contextual: int = 2     # C contextual tokens built from the non-sequence summary every layer
  rel_pos_buckets: int = 32   # log-spaced relative-position buckets of the attention bias; 0: no bias
  attn_impl: str = "auto"     # gem_jax.ops.hstu_attention impl
  dropout_rate: float = 0.0   # on the gated attention output before the output projection (training only)
  layer_form: str = "research"  # or "stu" (gem_jax/model/hstu.py)
  qk_scale: float = 0.0       # multiplies q.k before the bias and SiLU; 0: 1 / sqrt(head_dim) (HSTU's research
                              # code uses 1)
  # The xla impl's tiles: "default" (pallas_kernels/hstu_attention/tiled.py DEFAULT_TILES), "auto" (timed per
  # shape bucket on this backend, gem_jax.ops.hstu_attention), or "<block>x<group>", e.g. "32x16".
  attn_tiles: str = "default"

  def __post_init__(self):
    _check_ints("model.hstu.", self, {"num_heads": 1, "head_dim": 1, "value_dim": 1, "num_contextual": 0,
                                      "rel_pos_buckets": 0})
    if not isinstance(self.keep_last, tuple) or any(
        isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1 for k in self.keep_last):
      raise ValueError(f"model.hstu.keep_last must be a tuple of integers >= 1, got {self.keep_last!r}")
    if not isinstance(self.dropout_rate, numbers.Real) or not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"model.hstu.dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
    if self.layer_form not in ("research", "stu"):
      raise ValueError(f"model.hstu.layer_form must be 'research' or 'stu', got {self.layer_form!r}")
    if not isinstance(self.qk_scale, numbers.Real) or self.qk_scale < 0:
      raise ValueError(f"model.hstu.qk_scale must be >= 0 (0: 1 / sqrt(head_dim)), got {self.qk_scale!r}")
    if self.attn_tiles not in ("default", "auto") and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", str(self.attn_tiles)):
      raise ValueError(f"model.hstu.attn_tiles must be 'default', 'auto' or '<block>x<group>' (e.g. '32x16'), "
                       f"got {self.attn_tiles!r}")

  def tiles(self):
    """attn_tiles as None ("default"), "auto", or (block, group)."""
    if self.attn_tiles in ("default", "auto"):
      return None if self.attn_tiles == "default" else "auto"
    return tuple(int(x) for x in self.attn_tiles.split("x"))


@dataclasses.dataclass(frozen=True)
class WukongConfig:
  fm_outputs: int = 8         # n_f embeddings out of the factorization-machine block
  lcb_outputs: int = 8        # n_l embeddings out of the linear compression block
  fm_rank: int = 8            # k of the low-rank Y in X (X^T Y)
  mlp_hidden: int = 256

  def __post_init__(self):
    # Each block needs an output: a zero-width Dense has no fan to initialize from (ZeroDivisionError).
    _check_ints("model.wukong.", self, {"fm_outputs": 1, "lcb_outputs": 1, "fm_rank": 1, "mlp_hidden": 1})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  embed_dim: int = 32         # E
  model_dim: int = 64         # D, width of the sequence tokens
  num_layers: int = 2         # GEM layers (each: one HSTU layer next to one Wukong layer)
  hstu: HSTUConfig = HSTUConfig()
  wukong: WukongConfig = WukongConfig()
  num_recent: int = 2         # most recent history tokens passed into the non-sequence arch
  tower_hidden: int = 128     # per-domain tower width
  compute_dtype: str = "float32"
  param_dtype: str = "float32"
  precision: PrecisionConfig = PrecisionConfig()   # per-layer FP8 policy (gem_jax/precision/policy.py)

  def __post_init__(self):
    """Single-field checks (hstu and wukong check their own fields); checks across configs or against a mesh
    are in gem_jax/check.py."""
    _check_ints("model.", self, {"embed_dim": 1, "model_dim": 1, "num_layers": 1, "num_recent": 0,
                                 "tower_hidden": 1})
    if len(self.hstu.keep_last) != self.num_layers:
      raise ValueError(f"model.hstu.keep_last has {len(self.hstu.keep_last)} entries for {self.num_layers} "
                       "layers (model.num_layers): one per layer")
    for name in ("compute_dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

  @property
  def dtype(self):
    """The compute dtype as a jnp dtype."""
    return _DTYPES[self.compute_dtype]

  @property
  def params_dtype(self):
    """The parameter dtype as a jnp dtype."""
    return _DTYPES[self.param_dtype]

  def max_seq_len(self, layer: int) -> int:
    """Static length bound of layer `layer`'s HSTU rows: C contextual + kept history + 1 target."""
    return self.hstu.num_contextual + self.hstu.keep_last[layer] + 1
