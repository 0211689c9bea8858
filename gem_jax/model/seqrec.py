"""Next-item model over jagged item histories: a sequence tower with a shared item table.

  tokens  = sqrt(D) * item_emb[item] + pos_emb[position]     (position inside the row, 0 = oldest kept item,
                                                             or 0 = newest with positions="from_end";
                                                             embed_scale=False drops the sqrt(D))
  -> dropout -> L x layer (jagged, causal)
  -> L2 normalize (normalize=True)                           = the user embedding after each token

The layer (`arch`): "hstu", gem-jax's HSTULayer (relative-position bias, linear dropout), with hstu_ffn
each followed by eSASRec's gated feed-forward (FuXi-alpha, Ye et al. 2025, also follows its HSTU-style
attention with a feed-forward network); "sasrec" and "esasrec", the softmax-attention blocks of
gem_jax/model/sasrec.py, which set the model/loss comparison apart from the code around it (same
embeddings, losses, task and metrics).

An item's output embedding is its input row of the same table (L2 normalized when the user embedding is);
a score is the dot product of the two (divided by a temperature in the loss). The defaults are the setup of
HSTU's public experiments (Zhai et al., ICML 2024, Sec. 4.1.1): item_embedding_dim 50, 2 blocks, 1 head,
dqk = dv = 50, dropout 0.2, l2-normalized user and item embeddings, on MovieLens-1M with max length 200.

Letters: T token capacity, B rows, D model width, I items (+1: column/row 0 is padding), K negatives.
The model never builds a B x N padded layout itself; attention goes through gem_jax.ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.jagged import Jagged
from gem_jax.model.config import HSTUConfig, ModelConfig
from gem_jax.model.hstu import HSTULayer
from gem_jax.model import sasrec
from gem_jax.model.layers import LayerNorm, dropout

L2_EPS = 1e-6
TABLE_STREAM = 0x746162  # fold_in constant: the output table's dropout key, apart from the encoder's


@dataclasses.dataclass(frozen=True)
class SeqRecModelConfig:
  dim: int = 50               # D: item embedding and model width
  num_layers: int = 2
  num_heads: int = 1
  head_dim: int = 50          # q/k width per head
  value_dim: int = 50         # u/v width per head
  max_len: int = 200          # most recent items kept per row
  dropout_rate: float = 0.2   # input embeddings and each layer's linear dropout
  attn_impl: str = "auto"     # gem_jax.ops attention impl
  attn_tiles: str = "default"  # hstu, impl xla: the tiled loop's "<block>x<group>", "auto" or "default"
  attn_block: int = 0         # sasrec / esasrec, impl xla: the softmax loop's tile edge; 0: its default (16)
  attn_group: int = 0         # sasrec / esasrec, impl xla: the softmax loop's tiles per step; 0: its default (8)
  arch: str = "hstu"          # "hstu", "sasrec" or "esasrec" (module docstring)
  ffn_multiplier: int = 1     # sasrec / esasrec / hstu_ffn: feed-forward width = ffn_multiplier * dim
  normalize: bool = True      # L2-normalize user and item embeddings (False: raw dot products, as SASRec)
  embed_scale: bool = True    # multiply item embeddings by sqrt(dim) at the input
  rel_bias: bool = True       # hstu: the relative-position attention bias
  layer_form: str = "research"  # hstu: "research" or "stu" (gem_jax/model/hstu.py)
  positions: str = "from_start"  # learned position of a token: counted from its row's oldest item, or
                                 # "from_end" (the newest is 0, as RecTools' SASRec's inverse positions)
  table_dropout: bool = False  # training: dropout (dropout_rate) on the output item table too, as RecTools does
  qk_scale: float = 0.0       # hstu: the scale of q.k before the SiLU; 0: 1 / sqrt(head_dim)
  hstu_ffn: bool = False      # hstu: eSASRec's gated feed-forward (width ffn_multiplier * dim) after each layer

  def __post_init__(self):
    if self.arch not in ("hstu",) + sasrec.ARCHS:
      raise ValueError(f"SeqRecModelConfig: arch must be one of {('hstu',) + sasrec.ARCHS}, got {self.arch!r}")
    if self.positions not in ("from_start", "from_end"):
      raise ValueError(f"SeqRecModelConfig: positions must be 'from_start' or 'from_end', got {self.positions!r}")
    if self.hstu_ffn and self.arch != "hstu":
      raise ValueError(f"SeqRecModelConfig: hstu_ffn adds a feed-forward to HSTU layers; arch {self.arch!r} "
                       "has its own")
    if self.ffn_multiplier < 1:
      raise ValueError(f"SeqRecModelConfig: ffn_multiplier must be >= 1, got {self.ffn_multiplier}")
    if self.attn_block < 0 or self.attn_group < 0:
      raise ValueError(f"SeqRecModelConfig: attn_block and attn_group must be >= 0 (0: the kernel's default), got "
                       f"{self.attn_block} and {self.attn_group}")
    if min(self.dim, self.num_layers, self.num_heads, self.head_dim, self.value_dim, self.max_len) < 1:
      raise ValueError(f"SeqRecModelConfig: sizes must be positive: {self}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"SeqRecModelConfig: dropout_rate must be in [0, 1), got {self.dropout_rate}")

  def hstu_model_config(self) -> ModelConfig:
    """The ModelConfig an HSTULayer reads (its GEM-only fields stay at their defaults). One relative-position
    bucket per distance: 2 * max_len buckets make the first max_len of them exact distances."""
    hstu = HSTUConfig(num_heads=self.num_heads, head_dim=self.head_dim, value_dim=self.value_dim,
                      keep_last=(self.max_len,) * self.num_layers, num_contextual=0,
                      rel_pos_buckets=2 * self.max_len if self.rel_bias else 0, attn_impl=self.attn_impl,
                      attn_tiles=self.attn_tiles, dropout_rate=self.dropout_rate, qk_scale=self.qk_scale,
                      layer_form=self.layer_form)
    return ModelConfig(model_dim=self.dim, num_layers=self.num_layers, hstu=hstu)


def l2_normalize(x_NxD):
  x_NxD = x_NxD.astype(jnp.float32)
  return x_NxD * jax.lax.rsqrt(jnp.maximum(jnp.sum(x_NxD * x_NxD, axis=-1, keepdims=True), L2_EPS * L2_EPS))


class NormalizedRows:
  """An item table read by row only: table[ids] is l2_normalize(raw[ids]), the rows of l2_normalize(raw)
  without normalizing the items no one reads (a batch's targets and shared negatives are a few thousand rows
  of a catalog that may hold millions)."""

  def __init__(self, raw_IxD):
    self.raw_IxD = raw_IxD

  def __getitem__(self, ids):
    return l2_normalize(self.raw_IxD[ids])


class SeqRecModel(nnx.Module):

  def __init__(self, cfg: SeqRecModelConfig, num_items: int, *, rngs: nnx.Rngs):
    if num_items < 1:
      raise ValueError(f"SeqRecModel: num_items must be >= 1, got {num_items}")
    self.cfg = cfg
    self.num_items = num_items
    # HSTU's initialization: items at std 0.02 (times sqrt(D) at the input), positions at std sqrt(1 / D).
    item_init = nnx.initializers.truncated_normal(stddev=0.02)
    pos_init = nnx.initializers.truncated_normal(stddev=cfg.dim ** -0.5)
    self.item_emb_IxD = nnx.Param(item_init(rngs.params(), (num_items + 1, cfg.dim), jnp.float32))
    self.pos_emb_NxD = nnx.Param(pos_init(rngs.params(), (cfg.max_len, cfg.dim), jnp.float32))
    mcfg = cfg.hstu_model_config()
    if cfg.arch == "hstu":
      self.layers = nnx.List([HSTULayer(mcfg, cfg.max_len, site=f"layers.{i}", rngs=rngs)
                              for i in range(cfg.num_layers)])
    else:
      self.layers = nnx.List([sasrec.SoftmaxBlock(cfg.arch, mcfg, cfg.max_len, ffn_multiplier=cfg.ffn_multiplier,
                                                  dropout_rate=cfg.dropout_rate, attn_impl=cfg.attn_impl,
                                                  attn_block=cfg.attn_block, attn_group=cfg.attn_group,
                                                  site=f"layers.{i}", rngs=rngs)
                              for i in range(cfg.num_layers)])
    self.final_norm = LayerNorm(cfg.dim, mcfg, rngs=rngs) if cfg.arch == "sasrec" else None
    self.ffns = nnx.List([sasrec.GatedFFN(mcfg, ffn_multiplier=cfg.ffn_multiplier, dropout_rate=cfg.dropout_rate,
                                          site=f"ffns.{i}", rngs=rngs)
                          for i in range(cfg.num_layers)]) if cfg.hstu_ffn else None

  def encode(self, items: Jagged, dropout_rng=None):
    """items: Jagged (T,) int32 item ids, rows of at most max_len (the batch builder checks it on the host:
    a longer row would read a clamped position) -> user embeddings T x D (f32; unit rows when normalize).
    Dropout is on only when `dropout_rng` is given."""
    rngs = [None] * (len(self.layers) + 1)
    if dropout_rng is not None:
      rngs = list(jax.random.split(dropout_rng, len(self.layers) + 1))
    ids_T = items.values
    pos_T = items.positions()  # padding slots read position 0; their outputs are never used
    if self.cfg.positions == "from_end":
      lengths_Bp1 = jnp.concatenate([jnp.asarray(items.lengths()), jnp.zeros(1, jnp.int32)])  # padding: segment B
      pos_T = jnp.where(items.valid_mask(), lengths_Bp1[items.segment_ids()] - 1 - pos_T, 0)
    scale = self.cfg.dim ** 0.5 if self.cfg.embed_scale else 1.0
    x_TxD = scale * self.item_emb_IxD[...][ids_T] + self.pos_emb_NxD[...][pos_T]
    x = Jagged(dropout(x_TxD, self.cfg.dropout_rate, rngs[0]), items.offsets)
    for i, (layer, rng) in enumerate(zip(self.layers, rngs[1:])):
      if self.ffns is None:
        x = layer(x, dropout_rng=rng)
        continue
      layer_rng, ffn_rng = (None, None) if rng is None else jax.random.split(rng)
      x = self.ffns[i](layer(x, dropout_rng=layer_rng), dropout_rng=ffn_rng)
    user_TxD = x.values if self.final_norm is None else self.final_norm(x.values)
    return l2_normalize(user_TxD) if self.cfg.normalize else user_TxD.astype(jnp.float32)

  def item_table(self, dropout_rng=None, rows_only: bool = False):
    """Output embeddings of every item, (I + 1) x D (unit rows when normalize); row 0 (padding) is not a
    candidate. With table_dropout and a key (training), dropout on the table first. rows_only: for a reader
    that only indexes rows (table[ids]), a table whose rows are normalized as they are gathered."""
    table_IxD = self.item_emb_IxD[...]
    if self.cfg.table_dropout and dropout_rng is not None:
      table_IxD = dropout(table_IxD, self.cfg.dropout_rate, jax.random.fold_in(dropout_rng, TABLE_STREAM))
    if not self.cfg.normalize:
      return table_IxD.astype(jnp.float32)
    return NormalizedRows(table_IxD) if rows_only else l2_normalize(table_IxD)
