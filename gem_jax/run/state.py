"""The train state and the non-finite guard, shared by the train step (gem_jax/run/step.py) and its table
updates (gem_jax/run/table_update.py).

The train state is a plain pytree (params, optimizer state, step, rng) so it can be donated, checkpointed
and sharded without knowing about Flax; the model's graph definition stays outside as a static value.

Non-finite guard: a step whose loss or gradient norm is NaN or infinite leaves the parameters and the
optimizer state exactly as they were (so Adam's moments and the learning-rate schedule do not move either)
and reports `nonfinite` = 1 in its metrics; `step` still advances, since the batch was consumed. `keep`
is that choice, element by element.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gem_jax import runtime


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  params: Any      # nnx.State of the model's nnx.Param variables (tables included)
  opt_state: Any
  step: Any        # int32 scalar: batches consumed
  rng: Any         # typed PRNG key; step N's dropout key is fold_in(rng, N); checkpointed with the rest


def init_state(params, optimizer: optax.GradientTransformation, rng) -> TrainState:
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), rng)


def ordered_sum(xs) -> jax.Array:
  """((0 + x_0) + x_1) + ... of float32 scalars, in this order on every target.

  Sums that every parameter's update reads (the gradient norm behind the non-finite guard and the clip) are a
  loop on CPU targets: XLA fuses a chain of scalar adds into each of its consumers, leaves x leaves
  instructions. On tiny's cpu_8 train step the chains took 33,000 of 81,000 instructions and a third of the
  compile (13.0 s -> 9.0 s here; one device 8.2 s -> 5.1 s); the same additions in the same order, so the
  same bits (the same losses to the last digit).
  Other targets keep the chain: a loop there would cost a kernel launch per term in every step, and XLA:GPU
  does not copy it (tiny's H200 train step: its ~500 adds sit in three scalar fusions)."""
  xs = list(xs)
  if runtime.platform() != "cpu" or len(xs) < 2:
    return sum(xs, jnp.zeros((), jnp.float32))
  xs_L = jnp.stack(xs)
  return jax.lax.fori_loop(0, len(xs), lambda i, acc: acc + xs_L[i], jnp.zeros((), jnp.float32))


def squared_norm(tree) -> jax.Array:
  """The sum of squares of every leaf, in float32, added in leaf order (ordered_sum)."""
  return ordered_sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(tree))


def global_norm(tree) -> jax.Array:
  return jnp.sqrt(squared_norm(tree))


def keep(finite, new, old):
  """`new` where `finite`, else `old`, leaf by leaf: element-wise selects that XLA fuses into the update's own
  loops, so the guard costs no extra pass over the parameters."""
  return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)

