"""GEM: embeddings -> L interleaved (HSTU sequence arch | Wukong non-sequence arch) layers -> heads.

  embed:   history ids (most recent keep_last[0]) -> field embeddings -> concat -> Linear -> tokens T x D
           candidate-group features -> concat -> Linear -> target token B x D
           every sparse feature (single-hot, pooled multi-hot) + the dense features (one Linear) -> B x F0 x E
  layer l: contextual tokens B x C x D <- NonSequenceSummary(state)
           row = [C contextual] ++ history (most recent keep_last[l]) ++ [target]   (jagged, per example)
           HSTU layer (max_seq_len = C + keep_last[l] + 1) -> split back into contextual / history / target
           summary B x S x E <- SequenceSummary(contextual outputs, history outputs)
           state <- Wukong([state ++ summary])
  heads:   [final state, final summary, target output] -> shared trunk -> domain tower -> logits B x K

Rows are independent end to end: no op mixes examples (no batch norm, no B x T or T x T matrix outside
the reference attention's per-row padding), so the logit of example b depends on example b's inputs only.
The model never names a mesh axis; parameters carry logical axis names (gem_jax/parallel/rules.py).

Letters: B batch, T token capacity, D model width, E embedding width, F Wukong embeddings, C contextual
tokens, S summary embeddings, K tasks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import jagged
from gem_jax.data.batch import Batch
from gem_jax.data.spec import FeatureSpec
from gem_jax.jagged import Jagged
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense
from gem_jax.model.embeddings import EmbeddingCollection
from gem_jax.model.heads import MultiDomainHeads
from gem_jax.model.hstu import HSTULayer
from gem_jax.model.interformer import NonSequenceSummary, SequenceSummary, num_summary
from gem_jax.model.wukong import WukongLayer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GEMInputs:
  """The dense inputs of the trunk, after every embedding lookup (what `GEM.embed` returns)."""
  nonseq_BxFxE: Any
  history: Jagged   # Jagged(T x D): token embeddings of the most recent keep_last[0] history tokens
  target_BxD: Any
  domain_B: Any


class GEMLayer(nnx.Module):
  """Layer `layer` of GEM: one HSTU layer next to one Wukong layer, exchanging summaries both ways."""

  def __init__(self, layer: int, num_state: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.keep_last = cfg.hstu.keep_last[layer]
    self.num_contextual = cfg.hstu.num_contextual
    site = f"layers.{layer}"
    self.context = NonSequenceSummary(num_state, cfg, site=f"{site}.context", rngs=rngs)
    self.hstu = HSTULayer(cfg, cfg.max_seq_len(layer), site=f"{site}.hstu", rngs=rngs)
    self.summary = SequenceSummary(cfg, site=f"{site}.summary", rngs=rngs)
    self.wukong = WukongLayer(num_state + num_summary(cfg), cfg, site=f"{site}.wukong", rngs=rngs)

  def __call__(self, state_BxFxE, history: Jagged, target_BxD, *, dropout_rng=None):
    """-> (state B x F' x E, history outputs Jagged(T' x D), target output B x D, summary B x S x E).
    dropout_rng: the key of the HSTU layer's dropout (cfg.hstu.dropout_rate); None: deterministic."""
    b, d = target_BxD.shape
    c = self.num_contextual
    hist = jagged.keep_last(history, self.keep_last)
    ctx_BxCxD = self.context(state_BxFxE).astype(hist.values.dtype)
    rows = jagged.concat_rows(jagged.concat_rows(jagged.dense_to_jagged(ctx_BxCxD), hist),
                              jagged.dense_to_jagged(target_BxD[:, None, :].astype(hist.values.dtype)))
    out = self.hstu(rows, num_targets_B=jnp.ones((b,), jnp.int32), dropout_rng=dropout_rng)
    ctx_out, rest = jagged.split_rows(out, jnp.full((b,), c, jnp.int32), b * c, hist.capacity + b)
    hist_out, target_out = jagged.split_rows(rest, rest.lengths() - 1, hist.capacity, b)
    # Every row has exactly C contextual tokens and one target, so both pack densely.
    summary_BxSxE = self.summary(ctx_out.values.reshape(b, c, d), hist_out)
    state_BxFxE = self.wukong(jnp.concatenate([state_BxFxE, summary_BxSxE.astype(state_BxFxE.dtype)], axis=1))
    return state_BxFxE, hist_out, target_out.values, summary_BxSxE


class GEM(nnx.Module):
  """`GEM(spec, cfg, rngs=...)(batch) -> logits_BxK` (float32, K = len(spec.tasks))."""

  def __init__(self, spec: FeatureSpec, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.num_layers < 1:
      raise ValueError(f"GEM needs at least one layer, got num_layers={cfg.num_layers}")
    candidates = spec.group("candidate")
    if not candidates:
      raise ValueError("GEM builds its target token from the 'candidate' sparse features; the spec has none")
    self.spec, self.cfg = spec, cfg
    e, d = cfg.embed_dim, cfg.model_dim
    dim = lambda table: spec.table(table).dim
    self.embeddings = EmbeddingCollection(spec, cfg, rngs=rngs)
    self.token_proj = Dense(sum(dim(f.table) for f in spec.sequence.fields), d, ("embed", "hidden"), cfg,
                            site="token_proj", rngs=rngs)
    self.target_proj = Dense(sum(dim(f.table) for f in candidates), d, ("embed", "hidden"), cfg,
                             site="target_proj", rngs=rngs)
    # Sparse features whose table is not E wide get their own projection to E.
    self.feature_proj = nnx.Dict({f.name: Dense(dim(f.table), e, ("embed", "hidden"), cfg,
                                                site=f"feature_proj.{f.name}", rngs=rngs)
                                  for f in spec.sparse if dim(f.table) != e})
    self.dense_proj = (Dense(spec.dense_dim, e, ("embed", "hidden"), cfg, site="dense_proj", rngs=rngs)
                       if spec.dense_dim else None)
    num_state = len(spec.sparse) + (1 if spec.dense_dim else 0)
    layers = []
    for layer in range(cfg.num_layers):
      layers.append(GEMLayer(layer, num_state, cfg, rngs=rngs))
      num_state = cfg.wukong.fm_outputs + cfg.wukong.lcb_outputs
    self.layers = nnx.List(layers)
    self.heads = MultiDomainHeads((num_state + num_summary(cfg)) * e + d, spec, cfg, rngs=rngs)

  def embed(self, batch: Batch) -> GEMInputs:
    """Every embedding lookup of the batch (the sparse part of the model)."""
    feats = {}
    for f in self.spec.sparse:
      if f.multi_hot:
        if f.name not in batch.multi_hot:
          raise KeyError(f"batch has no multi-hot feature {f.name!r}; it has {sorted(batch.multi_hot)}")
        feats[f.name] = self.embeddings.multi_hot(f.name, batch.multi_hot[f.name])
      else:
        if f.name not in batch.sparse:
          raise KeyError(f"batch has no single-hot feature {f.name!r}; it has {sorted(batch.sparse)}")
        feats[f.name] = self.embeddings.single_hot(f.name, batch.sparse[f.name])
    target_BxD = self.target_proj(jnp.concatenate([feats[f.name] for f in self.spec.group("candidate")], -1))
    nonseq = [self.feature_proj[f.name](feats[f.name]) if f.name in self.feature_proj else feats[f.name]
              for f in self.spec.sparse]
    if self.dense_proj is not None:
      nonseq.append(self.dense_proj(jnp.asarray(batch.dense_BxG, jnp.float32)))
    ids = jagged.keep_last(batch.history, self.cfg.hstu.keep_last[0])
    tokens_TxD = self.token_proj(jnp.concatenate(self.embeddings.history(ids), axis=-1))
    return GEMInputs(jnp.stack(nonseq, axis=1), ids.replace_values(tokens_TxD), target_BxD, batch.domain_B)

  def forward(self, inputs: GEMInputs, *, dropout_rng=None):
    """The dense trunk and heads: GEMInputs -> logits_BxK (float32). dropout_rng: training's key for the
    HSTU layers' dropout (layer i folds in i); None: deterministic (evaluation)."""
    state_BxFxE, history, target_BxD = inputs.nonseq_BxFxE, inputs.history, inputs.target_BxD
    summary_BxSxE = None
    for i, layer in enumerate(self.layers):
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
      state_BxFxE, history, target_BxD, summary_BxSxE = layer(state_BxFxE, history, target_BxD, dropout_rng=rng)
    b, dt = target_BxD.shape[0], state_BxFxE.dtype
    head_in_BxI = jnp.concatenate(
        [state_BxFxE.reshape(b, -1), summary_BxSxE.reshape(b, -1).astype(dt), target_BxD.astype(dt)], axis=-1)
    return self.heads(head_in_BxI, inputs.domain_B).astype(jnp.float32)

  def __call__(self, batch: Batch, *, dropout_rng=None):
    return self.forward(self.embed(batch), dropout_rng=dropout_rng)
