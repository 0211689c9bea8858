"""One Wukong layer: the non-sequence interaction arch of a GEM layer (stacked factorization machines).

  X_BxFxE -> FMB: flatten(X (X^T Y)) -> LayerNorm -> MLP -> n_f embeddings
          -> LCB: W X over the feature axis  -> n_l embeddings
  concat (n_f + n_l embeddings) + residual(X) -> LayerNorm over E

The FM block uses the low-rank form X (X^T Y) (Y: F x k learned): O(F E k) instead of the O(F^2 E) of
the naive (X X^T) Y, and never builds the F x F interaction matrix. Both forms are exported so a test
can hold them equal. Every op is per example: nothing here mixes rows of the batch.

Letters: B batch, F input embeddings, E embedding width, k FM rank, O = n_f + n_l output embeddings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense, LayerNorm, sharded


def fm_interaction(x_BxFxE, y_FxK):
  """X (X^T Y): the factorization-machine interactions of F embeddings, projected to rank k (B x F x k)."""
  xty_BxExK = jnp.einsum("bfe,fk->bek", x_BxFxE, y_FxK, preferred_element_type=jnp.float32)
  return jnp.einsum("bfe,bek->bfk", x_BxFxE.astype(jnp.float32), xty_BxExK,
                    preferred_element_type=jnp.float32)


def fm_interaction_naive(x_BxFxE, y_FxK):
  """(X X^T) Y: the same value through the F x F dot-product matrix (for tests)."""
  x = x_BxFxE.astype(jnp.float32)
  xxt_BxFxF = jnp.einsum("bfe,bge->bfg", x, x, preferred_element_type=jnp.float32)
  return jnp.einsum("bfg,gk->bfk", xxt_BxFxF, y_FxK.astype(jnp.float32), preferred_element_type=jnp.float32)


class WukongLayer(nnx.Module):
  """F input embeddings -> O = fm_outputs + lcb_outputs output embeddings, all of width E."""

  def __init__(self, num_inputs: int, cfg: ModelConfig, *, site: str, rngs: nnx.Rngs):
    w, e = cfg.wukong, cfg.embed_dim
    self.num_inputs, self.embed_dim = num_inputs, e
    self.fm_outputs, self.lcb_outputs = w.fm_outputs, w.lcb_outputs
    self.num_outputs = w.fm_outputs + w.lcb_outputs
    pdt = cfg.params_dtype
    self.fm_y_FxK = nnx.Param(sharded(nnx.initializers.lecun_normal(), ("features", None))(
        rngs.params(), (num_inputs, w.fm_rank), pdt))
    self.fm_norm = LayerNorm(num_inputs * w.fm_rank, cfg, rngs=rngs)
    self.fm_mlp_in = Dense(num_inputs * w.fm_rank, w.mlp_hidden, ("embed", "mlp"), cfg, site=f"{site}.fm_mlp_in",
                           rngs=rngs)
    self.fm_mlp_out = Dense(w.mlp_hidden, w.fm_outputs * e, ("mlp", "embed"), cfg, site=f"{site}.fm_mlp_out",
                            rngs=rngs)
    # Feature-axis linear maps act on F, not on E: their kernels are (F_in, F_out), both small.
    self.lcb = Dense(num_inputs, w.lcb_outputs, ("features", "features"), cfg, site=f"{site}.lcb", rngs=rngs,
                     use_bias=False)
    # The residual needs a learned map only when the embedding count changes.
    self.residual = (Dense(num_inputs, self.num_outputs, ("features", "features"), cfg, site=f"{site}.residual",
                           rngs=rngs, use_bias=False) if num_inputs != self.num_outputs else None)
    self.norm_out = LayerNorm(e, cfg, rngs=rngs)

  def __call__(self, x_BxFxE):
    b, f, e = x_BxFxE.shape
    if (f, e) != (self.num_inputs, self.embed_dim):
      raise ValueError(f"WukongLayer expects {self.num_inputs} x {self.embed_dim} embeddings, got {f} x {e}")
    dtype = x_BxFxE.dtype
    fm_BxFxK = fm_interaction(x_BxFxE, self.fm_y_FxK[...].astype(dtype))
    hidden_BxM = jax.nn.silu(self.fm_mlp_in(self.fm_norm(fm_BxFxK.reshape(b, -1))))
    fmb_BxNfxE = self.fm_mlp_out(hidden_BxM).reshape(b, self.fm_outputs, e)
    x_BxExF = jnp.swapaxes(x_BxFxE, 1, 2)
    lcb_BxNlxE = jnp.swapaxes(self.lcb(x_BxExF), 1, 2)
    skip_BxOxE = x_BxFxE if self.residual is None else jnp.swapaxes(self.residual(x_BxExF), 1, 2)
    out_BxOxE = jnp.concatenate([fmb_BxNfxE, lcb_BxNlxE], axis=1) + skip_BxOxE
    return self.norm_out(out_BxOxE)
