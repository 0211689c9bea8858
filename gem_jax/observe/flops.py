"""Analytic model FLOPs and parameter counts of a GEM config.

Model FLOPs are counted from the config and the real (unpadded) history lengths only, so comparing them
with what XLA executed (padding included) measures padding waste. Conventions:
  - matmuls only: 2 * m * n * k per GEMM; norms, activations, gathers and pooling adds are not counted
    (XLA's cost analysis counts them too, which is why the two agree only to a few percent);
  - attention counts every (query, key) pair of a real sequence once (`n^2` per row and head): the work a
    dense kernel over the real tokens does. A causal kernel that skips masked pairs does about half;
    `hstu_pairs(..., exact_mask=True)` gives that count;
  - HSTU's SiLU attention also does pointwise work on every (pair, head) that softmax flash attention
    folds into its epilogue: scale by alpha, add the relative bias, SiLU (x * sigmoid(x): 4), mask,
    divide by N: ATTN_POINTWISE_FLOPS = 8 per pair and head, counted with the attention matmuls;
  - every domain tower is counted: the heads evaluate all R towers and keep one per example;
  - a train step costs 3x the forward (forward + two backward GEMMs per forward GEMM).
It mirrors gem_jax/model/*.py layer by layer; tests/test_flops.py holds it to XLA's count.

Letters: B rows, L history length, C contextual tokens, D model width, E embedding width, H heads,
Dh / Dv q-k / value head widths, F Wukong input embeddings, S summary embeddings.
"""

from __future__ import annotations

import numpy as np

from gem_jax.data.spec import FeatureSpec
from gem_jax.model.config import ModelConfig


ATTN_POINTWISE_FLOPS = 8


def _history_lengths_per_layer(cfg: ModelConfig, lengths_B: np.ndarray) -> list[np.ndarray]:
  """Kept history length of every row at every layer: the pyramid keeps the most recent keep_last[l]."""
  kept, out = np.asarray(lengths_B, np.int64), []
  for k in cfg.hstu.keep_last:
    kept = np.minimum(kept, k)
    out.append(kept)
  return out


def embedding_flops(cfg: ModelConfig, spec: FeatureSpec, lengths_B) -> float:
  """Projections of the looked-up embeddings (the lookups themselves are gathers: 0 FLOPs)."""
  e, d = cfg.embed_dim, cfg.model_dim
  b = len(lengths_B)
  tokens = float(np.minimum(np.asarray(lengths_B, np.int64), cfg.hstu.keep_last[0]).sum())
  token_in = sum(spec.table(f.table).dim for f in spec.sequence.fields)
  target_in = sum(spec.table(f.table).dim for f in spec.group("candidate"))
  per_row = 2 * target_in * d + 2 * spec.dense_dim * e
  per_row += sum(2 * spec.table(f.table).dim * e for f in spec.sparse if spec.table(f.table).dim != e)
  return 2.0 * tokens * token_in * d + b * per_row


def hstu_layer_flops(cfg: ModelConfig, seq_lengths_B: np.ndarray) -> float:
  """One HSTU layer over rows of `seq_lengths_B` tokens (contextual + history + target)."""
  h, d = cfg.hstu, cfg.model_dim
  n = np.asarray(seq_lengths_B, np.float64)
  proj = 2 * d * (2 * h.num_heads * h.value_dim + 2 * h.num_heads * h.head_dim) + 2 * h.num_heads * h.value_dim * d
  attn = h.num_heads * (2 * (h.head_dim + h.value_dim) + ATTN_POINTWISE_FLOPS)
  return float(n.sum() * proj + (n * n).sum() * attn)


def wukong_layer_flops(cfg: ModelConfig, num_inputs: int) -> float:
  """One Wukong layer for one example with `num_inputs` embeddings."""
  w, e, f = cfg.wukong, cfg.embed_dim, num_inputs
  out = w.fm_outputs + w.lcb_outputs
  fm = 2 * f * e * w.fm_rank * 2                        # X^T Y, then X (X^T Y)
  mlp = 2 * f * w.fm_rank * w.mlp_hidden + 2 * w.mlp_hidden * w.fm_outputs * e
  lcb = 2 * f * w.lcb_outputs * e
  residual = 2 * f * out * e if f != out else 0
  return float(fm + mlp + lcb + residual)


def num_nonseq_inputs(cfg: ModelConfig, spec: FeatureSpec) -> int:
  return len(spec.sparse) + (1 if spec.dense_dim else 0)


def num_summary(cfg: ModelConfig) -> int:
  return cfg.hstu.num_contextual + 1 + cfg.num_recent


def model_flops(cfg: ModelConfig, spec: FeatureSpec, lengths_B) -> float:
  """Forward model FLOPs of a batch whose rows have real history lengths `lengths_B`."""
  lengths_B = np.asarray(lengths_B, np.int64)
  b = len(lengths_B)
  c, d, e = cfg.hstu.num_contextual, cfg.model_dim, cfg.embed_dim
  s = num_summary(cfg)
  total = embedding_flops(cfg, spec, lengths_B)
  num_state = num_nonseq_inputs(cfg, spec)
  for kept in _history_lengths_per_layer(cfg, lengths_B):
    total += b * 2 * num_state * e * c * d                                  # non-seq summary -> C tokens
    total += hstu_layer_flops(cfg, c + kept + 1)
    total += 2 * 2 * float(kept.sum()) * d + b * 2 * s * d * e            # attention pooling + summary proj
    total += b * wukong_layer_flops(cfg, num_state + s)
    num_state = cfg.wukong.fm_outputs + cfg.wukong.lcb_outputs
  head_in = (num_state + s) * e + d
  g, r, k = cfg.tower_hidden, len(spec.domains), len(spec.tasks)
  total += b * (2 * head_in * g + r * (2 * g * g + 2 * g * k))
  return float(total)


def model_flops_per_example(cfg: ModelConfig, spec: FeatureSpec, history_len: int) -> float:
  """Forward model FLOPs of one example with a history of `history_len` tokens."""
  return model_flops(cfg, spec, np.array([history_len]))


def hstu_pairs(seq_lengths_B, *, num_contextual: int = 0, num_targets: int = 0, exact_mask: bool = False,
               causal: bool = True) -> int:
  """(query, key) pairs of jagged attention rows: n^2 per row, or (exact_mask) only the pairs the HSTU
  mask keeps (causal history, contextual tokens see all non-targets, targets see history + themselves)."""
  n = np.asarray(seq_lengths_B, np.int64)
  if not exact_mask or not causal:
    return int((n * n).sum())
  c, t = num_contextual, num_targets
  total = 0
  for ni in n:
    hist = max(int(ni) - c - t, 0)
    ctx = min(c, int(ni))
    # contextual rows: every non-target token; history rows: contextual + causal history;
    # target rows: contextual + history + themselves.
    total += ctx * (ctx + hist) + hist * ctx + hist * (hist + 1) // 2 + min(t, int(ni) - ctx) * (ctx + hist + 1)
  return total


def param_counts(cfg: ModelConfig, spec: FeatureSpec) -> dict:
  """{'sparse': embedding-table parameters, 'dense': every other parameter}, counted without allocating."""
  from flax import nnx
  from gem_jax.model.embeddings import Table
  from gem_jax.model.gem import GEM
  abstract = nnx.eval_shape(lambda: GEM(spec, cfg, rngs=nnx.Rngs(0)))
  sparse = sum(int(np.prod(v.shape)) for v in _leaves(nnx.state(abstract, Table)))
  total = sum(int(np.prod(v.shape)) for v in _leaves(nnx.state(abstract, nnx.Param)))
  return {"sparse": sparse, "dense": total - sparse}


def _leaves(state):
  import jax
  return jax.tree_util.tree_leaves(state)


TILED_BLOCK = 16  # pallas_kernels/hstu_attention/tiled.py's default tile edge, which the model uses


def tiled_attention_tiles(seq_lengths_B, *, max_seq_len: int, num_contextual: int, block: int = TILED_BLOCK) -> int:
  """Tiles the tiled HSTU kernel ("xla" impl, causal) walks for rows of these lengths, counted on the host.

  Per row of n tokens (clipped to max_seq_len), nb = ceil(n / block) query blocks: a query block that
  starts inside the contextual tokens sees every key block (nb tiles), any other block qb sees key
  blocks 0..qb (qb + 1 tiles); the same enumeration as tiled._key_block_range without max_attn_len.
  """
  n_B = np.minimum(np.asarray(seq_lengths_B, np.int64), max_seq_len)
  if block < 1 or np.any(n_B < 0):
    raise ValueError(f"tiled_attention_tiles: block ({block}) must be >= 1 and lengths >= 0")
  nb_B = -(-n_B // block)
  ctx_blocks = -(-num_contextual // block) if num_contextual > 0 else 0
  ctx_B = np.minimum(ctx_blocks, nb_B)   # query blocks starting inside the contextual tokens
  causal = nb_B * (nb_B + 1) // 2
  # Contextual blocks qb < ctx see nb tiles instead of qb + 1: extra sum over qb < ctx of (nb - qb - 1).
  extra = ctx_B * nb_B - ctx_B * (ctx_B + 1) // 2
  return int((causal + extra).sum())


def tiled_attention_train_flops(cfg: ModelConfig, lengths_B, *, block: int = TILED_BLOCK) -> float:
  """FLOPs a train step spends inside the tiled HSTU attention loops for histories `lengths_B` (every
  row of the batch, padding rows included: the kernel walks their contextual and target tokens too).

  XLA's cost analysis counts a while loop's body once, so the trainer's executed FLOPs add this count.
  Per (pair, head) of a walked tile: forward q.k (2 Dh) and w.v (2 Dv); backward recomputes q.k and does
  dw, dq, dk, dv (2 (3 Dh + 2 Dv)); pointwise work three times ATTN_POINTWISE_FLOPS (forward, backward).
  """
  h = cfg.hstu
  per_pair_head = 2 * (4 * h.head_dim + 3 * h.value_dim) + 3 * ATTN_POINTWISE_FLOPS
  total = 0
  for layer, kept in enumerate(_history_lengths_per_layer(cfg, lengths_B)):
    total += tiled_attention_tiles(h.num_contextual + kept + 1, max_seq_len=cfg.max_seq_len(layer),
                                   num_contextual=h.num_contextual, block=block)
  return float(total) * block * block * h.num_heads * per_pair_head
