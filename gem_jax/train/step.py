"""The jitted train and eval steps.

The train state is a plain pytree (params, optimizer state, step) so it can be donated, checkpointed and
sharded without knowing about Flax; the model's graph definition stays outside as a static value.
A step never reads anything back to the host: the loop fetches step N's metrics after dispatching N+1.
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  params: Any      # nnx.State of the model's nnx.Param variables (tables included)
  opt_state: Any
  step: Any        # int32 scalar


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation):
  """Splits the model into (graphdef, other state) and a TrainState holding its parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, rest, TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, spec: FeatureSpec) -> Callable:
  """Returns train_step(state, batch) -> (state, metrics); the state argument is donated."""

  def loss_fn(params, batch: Batch):
    model = nnx.merge(graphdef, params, rest)
    logits_BxK = model(batch)
    loss, per_task = multitask_loss(logits_BxK, batch, spec)
    return loss, per_task

  def train_step(state: TrainState, batch: Batch):
    (loss, per_task), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(grads)))
    metrics = {"loss": loss, "grad_norm": grad_norm, **per_task}
    return TrainState(params, opt_state, state.step + 1), metrics

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(graphdef, rest) -> Callable:
  """Returns eval_step(params, batch) -> probs_BxK (float32)."""

  def eval_step(params, batch: Batch):
    model = nnx.merge(graphdef, params, rest)
    return jax.nn.sigmoid(model(batch).astype(jnp.float32))

  return jax.jit(eval_step)
