"""Multi-domain multi-task heads and the multi-task loss.

  features_BxI -> LayerNorm -> shared trunk (Linear + SiLU) -> the example's domain tower (Linear + SiLU
  -> Linear) -> K task logits

The R domain towers are stacked (R x ...) and all evaluated, then each example keeps its own domain's
output: R is small, and this keeps one dense matmul instead of a per-example weight gather. Towers of
domains absent from a batch get exactly zero gradient. A domain id outside [0, R) gives NaN logits
(never a silently chosen tower).

The loss is f32 BCE with masks, each task summed over its counted labels and divided by the number of
real examples: a task is counted on an example only where label_mask and example_mask
are 1 and, for a task with a parent (conversion), only where the parent label is 1 (clicked).

Letters: B batch, I head input width, G tower width, R domains, K tasks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.data.batch import Batch
from gem_jax.data.spec import FeatureSpec
from gem_jax.model.config import ModelConfig
from gem_jax.model.layers import Dense, LayerNorm, sharded, tensor_sum


class MultiDomainHeads(nnx.Module):
  """(features_BxI, domain_B) -> logits_BxK (float32)."""

  def __init__(self, in_features: int, spec: FeatureSpec, cfg: ModelConfig, *, rngs: nnx.Rngs):
    g, r, k = cfg.tower_hidden, len(spec.domains), len(spec.tasks)
    self.norm = LayerNorm(in_features, cfg, rngs=rngs)
    self.trunk = Dense(in_features, g, ("embed", "mlp"), cfg, site="heads.trunk", rngs=rngs)
    tower_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    zeros, pdt = nnx.initializers.zeros_init(), cfg.params_dtype
    self.w1_RxGxG = nnx.Param(sharded(tower_init, ("features", "mlp", None))(rngs.params(), (r, g, g), pdt))
    self.b1_RxG = nnx.Param(sharded(zeros, ("features", None))(rngs.params(), (r, g), pdt))
    self.w2_RxGxK = nnx.Param(sharded(tower_init, ("features", None, None))(rngs.params(), (r, g, k), pdt))
    self.b2_RxK = nnx.Param(sharded(zeros, ("features", None))(rngs.params(), (r, k), pdt))

  def __call__(self, features_BxI, domain_B):
    shared_BxG = jax.nn.silu(self.trunk(self.norm(features_BxI))).astype(jnp.float32)
    # The towers run in f32: they are R small matmuls next to the logits, and XLA:CPU has no
    # bf16 x bf16 -> f32 batched dot.
    f32 = lambda p: p[...].astype(jnp.float32)
    # Tensor parallel: trunk is column parallel and the towers' first matmul row parallel (w1 then holds
    # this device's slice of G inputs): partial products are summed before the bias.
    pre_BxRxG = jnp.einsum("bg,rgh->brh", shared_BxG, f32(self.w1_RxGxG))
    if self.w1_RxGxG.shape[1] != self.trunk.out_features:
      pre_BxRxG = tensor_sum(pre_BxRxG)
    hidden_BxRxG = jax.nn.silu(pre_BxRxG + f32(self.b1_RxG)[None])
    logits_BxRxK = jnp.einsum("brg,rgk->brk", hidden_BxRxG, f32(self.w2_RxGxK)) + f32(self.b2_RxK)[None]
    domain_B = jnp.asarray(domain_B, jnp.int32)
    # An id outside [0, R) reads NaN. take_along_axis wraps a negative index before its fill applies (-1
    # would read the last tower), so those go out of range on the high side first.
    domain_Bx1x1 = jnp.where(domain_B < 0, logits_BxRxK.shape[1], domain_B)[:, None, None]
    return jnp.take_along_axis(logits_BxRxK, domain_Bx1x1, axis=1, mode="fill", fill_value=jnp.nan)[:, 0]


def task_masks(batch: Batch, spec: FeatureSpec):
  """B x K float32: 1 where task k's label counts for example b."""
  mask_BxK = batch.label_mask_BxK.astype(jnp.float32) * batch.example_mask_B.astype(jnp.float32)[:, None]
  names = spec.task_names
  parent_cols = []
  for t in spec.tasks:
    if t.parent is None:
      parent_cols.append(jnp.ones_like(mask_BxK[:, 0]))
    else:
      parent_cols.append((batch.labels_BxK[:, names.index(t.parent)] > 0.5).astype(jnp.float32))
  return mask_BxK * jnp.stack(parent_cols, axis=1)


def multitask_sums(logits_BxK, batch: Batch, spec: FeatureSpec):
  """The additive parts of multitask_loss: (BCE sum per task K, real examples, counted labels per task K).

  A data-parallel step adds these over its shards before dividing, so the loss of a sharded batch is the
  loss of the whole batch, not a mean of per-shard means.
  """
  k = len(spec.tasks)
  if logits_BxK.shape[-1] != k:
    raise ValueError(f"multitask_loss: logits have {logits_BxK.shape[-1]} tasks, the spec has {k}")
  logits_BxK = logits_BxK.astype(jnp.float32)
  labels_BxK = batch.labels_BxK.astype(jnp.float32)
  mask_BxK = task_masks(batch, spec)
  # Uncounted logits are replaced before the BCE, not multiplied by 0 after it: rows that only pad the
  # batch may hold anything, and a NaN there would turn into NaN gradients through a product.
  safe_BxK = jnp.where(mask_BxK > 0, logits_BxK, 0.0)
  sum_K = jnp.sum(optax.sigmoid_binary_cross_entropy(safe_BxK, labels_BxK) * mask_BxK, axis=0)
  examples = jnp.sum(batch.example_mask_B.astype(jnp.float32))
  return sum_K, examples, jnp.sum(mask_BxK, axis=0)


def loss_from_sums(sum_K, examples, counts_K, spec: FeatureSpec):
  """(loss, per-task metrics) from multitask_sums (possibly added over data shards)."""
  weights_K = jnp.asarray([t.weight for t in spec.tasks], jnp.float32)
  loss = jnp.sum(weights_K * sum_K) / jnp.maximum(examples, 1.0) / jnp.sum(weights_K)
  per_task_K = sum_K / jnp.maximum(counts_K, 1.0)
  return loss, {f"loss/{t.name}": per_task_K[i] for i, t in enumerate(spec.tasks)}


def multitask_loss(logits_BxK, batch: Batch, spec: FeatureSpec):
  """Task-weighted BCE (float32), every task normalized by the number of real examples in the batch.

  Normalizing a task by its own label count instead would give conversion (defined on the ~3% of
  clicked examples, a handful per batch) a per-example weight ~30x click's and a gradient that is mostly
  noise; over the batch, each task's gradient scales with how much evidence it has, as in production
  multi-task ads models. Returns (loss, {"loss/<task>": mean BCE over the task's counted labels}).
  """
  return loss_from_sums(*multitask_sums(logits_BxK, batch, spec), spec)
