"""The jitted train and eval steps, and the non-finite guard both the one-device and the mesh step use.

The train state is a plain pytree (params, optimizer state, step, rng) so it can be donated, checkpointed
and sharded without knowing about Flax; the model's graph definition stays outside as a static value.
A step never reads anything back to the host: the loop fetches step N's metrics after dispatching N+1.

Non-finite guard: a step whose loss or gradient norm is NaN or infinite leaves the parameters and the
optimizer state exactly as they were (so Adam's moments and the learning-rate schedule do not move either)
and reports `nonfinite` = 1 in its metrics; `step` and `rng` still advance, since the batch was consumed.
The loop counts these and decides what to do after several in a row (gem_jax/train/loop.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.data.batch import Batch
from gem_jax.data.spec import FeatureSpec
from gem_jax.model.heads import multitask_loss

RNG_STREAM = 0x64726F70  # folded into the seed for the training key, apart from nnx's parameter streams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  params: Any      # nnx.State of the model's nnx.Param variables (tables included)
  opt_state: Any
  step: Any        # int32 scalar: batches consumed
  rng: Any         # typed PRNG key; split once per step (dropout masks), checkpointed with the rest


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, seed: int = 0):
  """Splits the model into (graphdef, other state) and a TrainState holding its parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = jax.random.fold_in(jax.random.key(seed), RNG_STREAM)
  return graphdef, rest, TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), rng)


def global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(tree)))


def guarded_update(optimizer: optax.GradientTransformation, state: TrainState, loss, grads,
                   rng) -> tuple[TrainState, dict]:
  """The optimizer update of `state`, or `state` itself (params and optimizer state) when the loss or the
  gradient norm is not finite; -> (new state, {"loss", "grad_norm", "nonfinite"})."""
  grad_norm = global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # Element-wise selects that XLA fuses into the update's own loops: no extra pass over the parameters.
  keep = lambda new, old: jnp.where(finite, new, old)
  params = jax.tree_util.tree_map(keep, params, state.params)
  opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
  metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
  return TrainState(params, opt_state, state.step + 1, rng), metrics


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, spec: FeatureSpec) -> Callable:
  """Returns train_step(state, batch) -> (state, metrics); the state argument is donated."""

  def loss_fn(params, batch: Batch, dropout_rng):
    model = nnx.merge(graphdef, params, rest)
    logits_BxK = model(batch, dropout_rng=dropout_rng)
    loss, per_task = multitask_loss(logits_BxK, batch, spec)
    return loss, per_task

  def train_step(state: TrainState, batch: Batch):
    rng, dropout_rng = jax.random.split(state.rng)
    (loss, per_task), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, dropout_rng)
    new_state, metrics = guarded_update(optimizer, state, loss, grads, rng)
    return new_state, {**metrics, **per_task}

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(graphdef, rest) -> Callable:
  """Returns eval_step(params, batch) -> probs_BxK (float32)."""

  def eval_step(params, batch: Batch):
    model = nnx.merge(graphdef, params, rest)
    return jax.nn.sigmoid(model(batch).astype(jnp.float32))

  return jax.jit(eval_step)
