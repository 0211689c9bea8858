"""NextItem: next-item prediction with gem-jax's HSTU tower (gem_jax/model/seqrec.py), trained with a sampled
or full softmax and evaluated by full ranking (HR@K, NDCG@K over every item, history excluded).

Protocol (the one the anchor tables use; ../shared/data/README.md): leave-one-out per user, the model
trained on next-item targets of everything before the validation item, full ranking of every item with the
user's history excluded, HR@K and NDCG@K averaged over all users (gem_jax/metrics.py). With
train.select_metric set, the evaluation with the best validation value picks the parameters the test split
is read with (the trainer's selection hook).

Losses (`loss`), over the model's scores divided by a temperature:
  sampled_softmax  the target against a set of negatives; a negative equal to a token's own target masked.
                   negatives="shared": one set shared by every token of the batch (the source draws them:
                   gem_jax/data/seqrec_source.py), logits corrected by the log of their expected count in
                   the set (logQ), the target logit too. negatives="per_token": num_negatives drawn
                   uniformly for each token in the step (SASRec+SS's setting; no correction needed)
  full_softmax     every item is a negative (exact cross-entropy; T x I x D per step), loss_chunk tokens at
                   a time with the gradients made in the same pass (chunked_full_softmax_loss_sums)
  bce              binary cross-entropy of the target against each of its negatives (SASRec's original
                   loss with negatives="per_token", num_negatives=1)

Letters: T token capacity, B rows, D model width, I items (+1: id 0 is padding), K negatives (per batch or
per token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import metrics
from gem_jax.model.seqrec import SeqRecModel
from gem_jax.run.tasks import Task, register


def _negative_logits(user_TxD, table_IxD, negatives, logq_neg, temperature):
  """Logits of the negatives, T x K: one set shared by every token (negatives_K) or a set per token
  (negatives_TxK), minus their logQ (K or T x K)."""
  if negatives.ndim == 1:
    logits_TxK = jnp.einsum("td,kd->tk", user_TxD, table_IxD[negatives], preferred_element_type=jnp.float32)
  else:
    logits_TxK = jnp.einsum("td,tkd->tk", user_TxD, table_IxD[negatives], preferred_element_type=jnp.float32)
  return logits_TxK / temperature - jnp.broadcast_to(logq_neg, logits_TxK.shape)


def _per_token_negatives(negatives, targets_T):
  return jnp.broadcast_to(negatives, targets_T.shape + negatives.shape[-1:])


def sampled_softmax_loss_sums(user_TxD, table_IxD, targets_T, negatives, logq_neg, logq_pos_T, temperature):
  """(sum over real tokens (target > 0) of -log softmax of the target among it and its negatives, the number
  of real tokens). negatives: K shared by all tokens, or T x K, one set per token; the logits are
  corrected by the log of each item's expected count in the set (logQ: logq_neg K or T x K, logq_pos_T),
  and a negative equal to the token's own target is masked."""
  valid_T = targets_T > 0
  pos_T = jnp.sum(user_TxD * table_IxD[targets_T], axis=-1) / temperature - logq_pos_T
  neg_TxK = _negative_logits(user_TxD, table_IxD, negatives, logq_neg, temperature)
  neg_TxK = jnp.where(_per_token_negatives(negatives, targets_T) == targets_T[:, None], -jnp.inf, neg_TxK)
  # log(exp(pos) + sum exp(neg)) without concatenating [pos, neg] (a copy of the T x K logits): the shift
  # includes the finite positive, so the sum is at least 1 even when every negative is masked.
  m_T = jax.lax.stop_gradient(jnp.maximum(pos_T, jnp.max(neg_TxK, axis=1)))
  lse_T = m_T + jnp.log(jnp.exp(pos_T - m_T) + jnp.sum(jnp.exp(neg_TxK - m_T[:, None]), axis=1))
  return jnp.sum(jnp.where(valid_T, lse_T - pos_T, 0.0)), jnp.sum(valid_T)


def bce_loss_sums(user_TxD, table_IxD, targets_T, negatives, logq_neg, logq_pos_T, temperature):
  """(sum over real tokens of -log sigmoid(target logit) - sum over its negatives of log(1 - sigmoid(logit)),
  the number of real tokens): SASRec's original loss with one negative per token. No logQ; a negative equal
  to the target is masked."""
  del logq_neg, logq_pos_T
  valid_T = targets_T > 0
  pos_T = jnp.sum(user_TxD * table_IxD[targets_T], axis=-1) / temperature
  neg_TxK = _negative_logits(user_TxD, table_IxD, negatives, 0.0, temperature)
  hit_TxK = _per_token_negatives(negatives, targets_T) == targets_T[:, None]
  loss_T = jax.nn.softplus(-pos_T) + jnp.sum(jnp.where(hit_TxK, 0.0, jax.nn.softplus(neg_TxK)), axis=1)
  return jnp.sum(jnp.where(valid_T, loss_T, 0.0)), jnp.sum(valid_T)


def full_softmax_loss_sums(user_TxD, table_IxD, targets_T, negatives_K, logq_neg_K, logq_pos_T, temperature):
  """(sum over real tokens of the cross-entropy over every item (row 0, padding, excluded), the number of
  real tokens); the sampling arguments are ignored."""
  del negatives_K, logq_neg_K, logq_pos_T
  valid_T = targets_T > 0
  logits_TxI = jnp.einsum("td,id->ti", user_TxD, table_IxD, preferred_element_type=jnp.float32) / temperature
  logits_TxI = logits_TxI.at[:, 0].set(-jnp.inf)
  pos_T = jnp.take_along_axis(logits_TxI, targets_T[:, None], axis=1)[:, 0]
  lse_T = jax.nn.logsumexp(logits_TxI, axis=1)
  return jnp.sum(jnp.where(valid_T, lse_T - pos_T, 0.0)), jnp.sum(valid_T)


def _token_chunks(x, chunk: int):
  """T x ... -> (T / chunk) x chunk x ..., the token axis padded with zeros to a multiple of chunk; fewer
  than chunk tokens make one chunk of their own length (no padded logits: a one-row trace of the FLOP model,
  gem_jax/observe/flops.py, counts the row's own tokens)."""
  chunk = max(1, min(chunk, x.shape[0]))
  pad = -x.shape[0] % chunk
  x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  return x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:])


def _chunk_logits(user_CxD, items_JxD, temperature):
  """A chunk's logits over the items (the table without its padding row 0), C x J: (log-sum-exp C, logits).
  Slicing row 0 off once, instead of adding -inf to its column in every chunk, saves a pass over C x I."""
  logits_CxJ = jnp.einsum("cd,jd->cj", user_CxD, items_JxD, preferred_element_type=jnp.float32) / temperature
  return jax.nn.logsumexp(logits_CxJ, axis=1), logits_CxJ


def _chunked_loss_and_grads(user_TxD, table_IxD, targets_T, temperature, chunk):
  """The full-softmax sums and their gradients with respect to user_TxD and table_IxD, one chunk of tokens
  at a time: a chunk's C x I logits are made once and give its log-sum-exp and its softmax, whose products
  with the table and the chunk's users are the gradients (the target's -1 is added after the loop)."""
  valid_T = targets_T > 0
  w_T = jnp.where(valid_T, 1.0 / temperature, 0.0)   # d(logit)/d(score), zero on padding tokens
  items_JxD = table_IxD[1:]

  def one_chunk(ditems_DxJ, xs):
    user_CxD, w_C = xs
    lse_C, logits_CxJ = _chunk_logits(user_CxD, items_JxD, temperature)
    p_CxJ = jnp.exp(logits_CxJ - lse_C[:, None]) * w_C[:, None]
    # The item gradient is summed transposed, D x J: with the long item axis last, XLA:CPU's product over the
    # chunk's tokens took 0.62-0.76x the time of the J x D one (C = 512, D = 128, J = 3,705 to 18,357), and
    # the whole loss with its gradients 0.89-0.92x, the same numbers (one core, 2026-12-07).
    ditems_DxJ = ditems_DxJ + jnp.einsum("cd,cj->dj", user_CxD, p_CxJ, preferred_element_type=jnp.float32)
    return ditems_DxJ, (lse_C, p_CxJ @ items_JxD)

  ditems_DxJ, (lse, duser) = jax.lax.scan(one_chunk, jnp.zeros(items_JxD.shape[::-1], jnp.float32),
                                          (_token_chunks(user_TxD, chunk), _token_chunks(w_T, chunk)))
  dtable_IxD = jnp.concatenate([jnp.zeros((1, table_IxD.shape[1]), jnp.float32), ditems_DxJ.T])
  T = user_TxD.shape[0]
  lse_T, duser_TxD = lse.reshape(-1)[:T], duser.reshape(-1, user_TxD.shape[1])[:T]
  target_TxD = table_IxD[targets_T]
  pos_T = jnp.sum(user_TxD * target_TxD, axis=-1) / temperature
  duser_TxD = duser_TxD - w_T[:, None] * target_TxD
  dtable_IxD = dtable_IxD.at[targets_T].add(-w_T[:, None] * user_TxD)
  total = jnp.sum(jnp.where(valid_T, lse_T - pos_T, 0.0))
  return (total, jnp.sum(valid_T)), (duser_TxD.astype(user_TxD.dtype), dtable_IxD.astype(table_IxD.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_full_softmax(user_TxD, table_IxD, targets_T, temperature, chunk):
  lse = jax.lax.map(lambda u: _chunk_logits(u, table_IxD[1:], temperature)[0], _token_chunks(user_TxD, chunk))
  lse_T = lse.reshape(-1)[:user_TxD.shape[0]]
  valid_T = targets_T > 0
  pos_T = jnp.sum(user_TxD * table_IxD[targets_T], axis=-1) / temperature
  return jnp.sum(jnp.where(valid_T, lse_T - pos_T, 0.0)), jnp.sum(valid_T)


def _chunked_fwd(user_TxD, table_IxD, targets_T, temperature, chunk):
  return _chunked_loss_and_grads(user_TxD, table_IxD, targets_T, temperature, chunk)


def _chunked_bwd(temperature, chunk, grads, cotangents):
  del temperature, chunk
  duser_TxD, dtable_IxD = grads
  g = cotangents[0]   # the loss sum is linear in nothing else: its gradients scale with its cotangent
  return g * duser_TxD, g * dtable_IxD, None


_chunked_full_softmax.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_full_softmax_loss_sums(user_TxD, table_IxD, targets_T, negatives_K, logq_neg_K, logq_pos_T,
                                   temperature, *, chunk: int = 512):
  """full_softmax_loss_sums, `chunk` tokens at a time, never holding the T x I logits: the forward keeps a
  chunk's logits only for its log-sum-exp, and under differentiation the gradients are computed with the
  loss in the same pass over each chunk (as fused linear-cross-entropy kernels do) and scaled by the loss's
  cotangent in the backward. Same value and gradients as full_softmax_loss_sums up to float rounding
  (tests/test_seqrec.py); the token count is not differentiable."""
  del negatives_K, logq_neg_K, logq_pos_T
  return _chunked_full_softmax(user_TxD, table_IxD, targets_T, temperature, chunk)


LOSSES = {"sampled_softmax": sampled_softmax_loss_sums, "full_softmax": full_softmax_loss_sums, "bce": bce_loss_sums}
NEGATIVES = ("shared", "per_token")


def mean_loss(loss_of, *args):
  """The mean per-token loss of one batch (the per-shard sums divided, as the step does for the mesh)."""
  total, count = loss_of(*args)
  return total / jnp.maximum(count, 1)


NEGATIVES_STREAM = 0x6E6567  # fold_in constant: per-token negatives' key, apart from the dropout keys


@dataclasses.dataclass(frozen=True)
class NextItemConfig:
  loss: str = "sampled_softmax"     # "sampled_softmax", "full_softmax" or "bce"
  temperature: float = 0.05
  ks: tuple[int, ...] = (10, 50, 200)
  negatives: str = "shared"         # "shared": the source's set per batch; "per_token": num_negatives per token
  num_negatives: int = 256          # per_token: drawn uniformly from the catalog in the step (no logQ needed)
  loss_chunk: int = 512             # full_softmax: tokens per chunk (chunked_full_softmax_loss_sums); 0: the
                                    # whole T x I logits at once through autodiff

  def __post_init__(self):
    if self.loss not in LOSSES:
      raise ValueError(f"task.loss: unknown loss {self.loss!r}; known: {sorted(LOSSES)}")
    if self.negatives not in NEGATIVES:
      raise ValueError(f"task.negatives: must be one of {NEGATIVES}, got {self.negatives!r}")
    if self.num_negatives < 1:
      raise ValueError(f"task.num_negatives must be >= 1, got {self.num_negatives}")
    if self.loss_chunk < 0:
      raise ValueError(f"task.loss_chunk must be >= 0 (0: unchunked), got {self.loss_chunk}")
    if not self.temperature > 0:
      raise ValueError(f"task.temperature must be > 0, got {self.temperature}")
    if not self.ks or min(self.ks) < 1:
      raise ValueError(f"task.ks must be positive cutoffs, got {self.ks}")

  def metric_names(self) -> set[str]:
    return {f"{m}@{k}" for m in ("HR", "NDCG") for k in self.ks}


@register(NextItemConfig)
class NextItem(Task):
  name = "next_item"

  def train_key(self, seed: int):
    # The recipe's dropout stream since its first public-benchmark runs: fold_in(key(seed + 1), step).
    return jax.random.key(seed + 1)

  def build_model(self, cfg, source, rngs):
    if cfg.model.max_len != source.config.max_len:
      raise ValueError(f"model.max_len={cfg.model.max_len} differs from data.max_len={source.config.max_len}: the "
                       "rows the source cuts must fit the model's positions")
    return SeqRecModel(cfg.model, source.num_items, rngs=rngs)

  def sums(self, model, batch, dropout_rng):
    user_TxD = model.encode(batch.items, dropout_rng=dropout_rng)
    c = self.config
    negatives, logq_neg, logq_pos_T = batch.negatives_K, batch.logq_neg_K, batch.logq_pos_T
    if c.negatives == "per_token":  # uniform: every item's logQ is the same and cancels
      key = jax.random.fold_in(dropout_rng, NEGATIVES_STREAM)
      negatives = jax.random.randint(key, batch.targets_T.shape + (c.num_negatives,), 1, model.num_items + 1,
                                     dtype=jnp.int32)
      logq_neg, logq_pos_T = 0.0, jnp.zeros_like(logq_pos_T)
    loss_sums = LOSSES[c.loss]
    if c.loss == "full_softmax" and c.loss_chunk:
      loss_sums = functools.partial(chunked_full_softmax_loss_sums, chunk=c.loss_chunk)
    # A loss over one shared set of sampled negatives reads the table by row: normalizing the rows it
    # gathers, not every item, is the same embedding at a fraction of the work on a large catalog.
    table = model.item_table(dropout_rng, rows_only=c.loss != "full_softmax" and c.negatives == "shared")
    total, count = loss_sums(user_TxD, table, batch.targets_T, negatives, logq_neg, logq_pos_T, c.temperature)
    return {"loss_sum": total, "tokens": count.astype(jnp.float32)}

  def loss(self, totals):
    return totals["loss_sum"] / jnp.maximum(totals["tokens"], 1.0), {"tokens": totals["tokens"]}

  def predict(self, model, batch):
    """The rank of each row's target among every item (1 = first; ties count against the target), from
    the user embedding after the row's last token; an empty (padding) row reads slot 0."""
    user_TxD = model.encode(batch.items)
    last_B = jnp.maximum(batch.items.offsets[1:] - 1, 0)
    scores_BxI = jnp.einsum("bd,id->bi", user_TxD[last_B], model.item_table(), preferred_element_type=jnp.float32)
    return metrics.full_ranking_ranks(scores_BxI, batch.targets_B, batch.exclude_BxI)

  def eval_example(self, train_batch):
    """The validation split's first batch: evaluation reads rows with a held-out target and an exclusion
    mask (NextItemEvalBatch), not the training batch. Never the test split, which is read once, at the end."""
    return self.source.eval_batches("valid")[0]

  def evaluate(self, predictions, batches) -> dict:
    ranks = [np.asarray(r).reshape(-1)[np.asarray(b.row_mask_B).reshape(-1) > 0] for r, b in zip(predictions, batches)]
    return metrics.hit_rate_ndcg(np.concatenate(ranks), self.config.ks)

  def selectable(self) -> dict[str, int]:
    return {name: 1 for name in self.config.metric_names()}

  def summarize(self, evaluation: dict, counters: dict) -> dict:
    """Per split: the metrics and the most-popular baseline through the same metric code."""
    baselines = {split: self.source.popularity_baseline(split, self.config.ks) for split in evaluation}
    return {**evaluation, "baseline_most_popular": baselines, "stats": self.source.describe()}
