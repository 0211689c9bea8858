"""The InterFormer exchange between the sequence arch (HSTU) and the non-sequence arch (Wukong).

Every GEM layer passes information both ways:
  sequence -> non-sequence  `SequenceSummary`: the C contextual-token outputs, an attention pooling of the
                            history (one learned query, softmax within each row), and the num_recent most
                            recent history tokens, projected to E: S = C + 1 + num_recent embeddings that
                            join the Wukong input.
  non-sequence -> sequence  `NonSequenceSummary`: the flattened Wukong state -> C contextual tokens of
                            width D, placed in front of the history of the next HSTU layer.

Everything is per row: the pooling is a segment softmax over the jagged tokens (never a B x T matrix),
empty rows pool to 0 and short rows give zero "recent" slots.

Letters: B batch, T token capacity, D model width, E embedding width, C contextual tokens, F Wukong
embeddings, S summary embeddings, K recent tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense, LayerNorm, sharded


def num_summary(cfg: ModelConfig) -> int:
  """S: embeddings the sequence summary adds to every Wukong layer's input."""
  return cfg.hstu.num_contextual + 1 + cfg.num_recent


def attention_pool(values_TxD, scores_T, x: Jagged):
  """sum_t softmax_row(scores)_t values_t per row -> B x D (f32); empty rows -> 0, padding ignored."""
  b = x.batch_size
  seg_T, valid_T = x.segment_ids(), x.valid_mask()
  # Padding scores are zeroed before exp: a large garbage score would give inf * 0 = NaN gradients.
  scores_T = jnp.where(valid_T, scores_T.astype(jnp.float32), 0.0)
  max_B = jax.ops.segment_max(jnp.where(valid_T, scores_T, -jnp.inf), seg_T, num_segments=b)
  max_B = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_B), max_B, 0.0))  # softmax is shift invariant
  row_T = jnp.minimum(seg_T, b - 1)
  exp_T = jnp.where(valid_T, jnp.exp(scores_T - max_B[row_T]), 0.0)
  denom_B = jax.ops.segment_sum(exp_T, seg_T, num_segments=b)
  weight_T = exp_T / jnp.where(denom_B > 0, denom_B, 1.0)[row_T]
  return jax.ops.segment_sum(weight_T[:, None] * values_TxD.astype(jnp.float32), seg_T, num_segments=b)


def recent_tokens(x: Jagged, k: int):
  """B x k x D: slot r holds the r-th most recent token of each row (r = 0: the last); zeros past the
  start of a shorter row."""
  b, d = x.batch_size, x.feature_shape
  if k == 0 or x.capacity == 0:
    return jnp.zeros((b, k) + d, x.values.dtype)
  r_K = jnp.arange(k, dtype=jnp.int32)
  idx_BxK = jnp.clip(x.offsets[1:, None] - 1 - r_K[None, :], 0, x.capacity - 1)
  present_BxK = r_K[None, :] < x.lengths()[:, None]
  return jnp.where(present_BxK[:, :, None], x.values[idx_BxK], jnp.zeros((), x.values.dtype))


class SequenceSummary(nnx.Module):
  """(contextual outputs B x C x D, history outputs Jagged(T x D)) -> B x S x E."""

  def __init__(self, cfg: ModelConfig, *, site: str, rngs: nnx.Rngs):
    d = cfg.model_dim
    self.num_recent = cfg.num_recent
    self.dtype = cfg.dtype
    self.query_D = nnx.Param(sharded(nnx.initializers.normal(stddev=d ** -0.5), ("embed",))(
        rngs.params(), (d,), cfg.params_dtype))
    self.norm = LayerNorm(d, cfg, rngs=rngs)
    self.proj = Dense(d, cfg.embed_dim, ("embed", "hidden"), cfg, site=f"{site}.proj", rngs=rngs)

  def __call__(self, ctx_BxCxD, history: Jagged):
    values_TxD = history.values
    d = values_TxD.shape[-1]
    scores_T = jnp.einsum("td,d->t", values_TxD, self.query_D[...].astype(values_TxD.dtype),
                          preferred_element_type=jnp.float32) * d ** -0.5
    pooled_BxD = attention_pool(values_TxD, scores_T, history).astype(self.dtype)
    recent_BxKxD = recent_tokens(history, self.num_recent).astype(self.dtype)
    parts_BxSxD = jnp.concatenate([ctx_BxCxD.astype(self.dtype), pooled_BxD[:, None, :], recent_BxKxD], axis=1)
    return self.proj(self.norm(parts_BxSxD))


class NonSequenceSummary(nnx.Module):
  """Wukong state B x F x E -> C contextual tokens B x C x D."""

  def __init__(self, num_features: int, cfg: ModelConfig, *, site: str, rngs: nnx.Rngs):
    self.num_features, self.embed_dim = num_features, cfg.embed_dim
    self.num_contextual, self.model_dim = cfg.hstu.num_contextual, cfg.model_dim
    self.proj = (Dense(num_features * cfg.embed_dim, self.num_contextual * cfg.model_dim, ("embed", "hidden"),
                       cfg, site=f"{site}.proj", rngs=rngs) if self.num_contextual else None)

  def __call__(self, state_BxFxE):
    b, f, e = state_BxFxE.shape
    if (f, e) != (self.num_features, self.embed_dim):
      raise ValueError(f"NonSequenceSummary expects {self.num_features} x {self.embed_dim}, got {f} x {e}")
    if self.proj is None:
      return jnp.zeros((b, 0, self.model_dim), state_BxFxE.dtype)
    return self.proj(state_BxFxE.reshape(b, f * e)).reshape(b, self.num_contextual, self.model_dim)
