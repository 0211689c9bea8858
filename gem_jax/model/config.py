"""Model configuration (frozen dataclasses). The named configs live in gem_jax/configs.py.

Letters used across gem_jax/model: B batch, T jagged token capacity, D sequence model width,
E embedding width, H heads, Dh head dim (q/k), Dv value dim per head, F number of feature embeddings
entering a Wukong layer, S number of sequence-summary vectors, C contextual tokens, K tasks, R domains.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HSTUConfig:
  """One HSTU layer per GEM layer. `keep_last[l]`: history tokens layer l keeps (the pyramid: deeper
  layers see only the most recent ones); len(keep_last) == number of GEM layers."""
  num_heads: int = 2
  head_dim: int = 32          # q/k width per head
  value_dim: int = 32         # v/u width per head
  keep_last: tuple[int, ...] = (128, 64)
  num_contextual: int = 2     # C contextual tokens built from the non-sequence summary every layer
  rel_pos_buckets: int = 32   # log-spaced relative-position buckets of the attention bias
  attn_impl: str = "auto"     # gem_jax.ops.hstu_attention impl


@dataclasses.dataclass(frozen=True)
class WukongConfig:
  fm_outputs: int = 8         # n_f embeddings out of the factorization-machine block
  lcb_outputs: int = 8        # n_l embeddings out of the linear compression block
  fm_rank: int = 8            # k of the low-rank Y in X (X^T Y)
  mlp_hidden: int = 256


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

  def __post_init__(self):
    if len(self.hstu.keep_last) != self.num_layers:
      raise ValueError(f"hstu.keep_last has {len(self.hstu.keep_last)} entries for {self.num_layers} layers")
