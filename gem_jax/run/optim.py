"""Optimizers: a row optimizer for embedding tables (gem_jax/run/table_optim.py: row-wise Adagrad by default,
SGD, row-wise Adam), clipped AdamW with warmup + cosine for the rest.

Letters: V table rows, E embedding width.

Embedding tables are told apart from dense parameters by their nnx variable type (`Table`, a subclass of
`nnx.Param` in gem_jax/model/embeddings.py), never by a parameter's name. The labels are computed once
from the typed parameter tree (`nnx.state(model, nnx.Param)`, whose leaves are `nnx.Variable`s) and
then looked up by key path, so the optimizer built by `make_optimizer` works on that typed tree and on
its pure-dict form (`nnx.to_pure_dict(state)`) alike.

Row-wise Adagrad (TorchRec / FBGEMM `EXACT_ROWWISE_ADAGRAD`) keeps one accumulator per table row, so its
state is (V,) per table and shards like the table's rows; dense Adam would cost 2 V E floats per table.
The sparse engine (gem_jax/run/table_update.py) updates tables itself, from `Optimizer.rule`, and runs only
`Optimizer.dense` on the dense gradients; both read and write the one optimizer state of `Optimizer.init`.

This module must never let a table reach AdamW: AdamW's moments make every row "touched" (a row with
no gradient this step still moves), weight decay would shrink rows that are rarely seen, and global-norm
clipping would let one hot table scale every dense gradient. A parameter that the labels do not know
raises instead of falling into a default group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.config import TrainConfig
from gem_jax.run import table_optim
from gem_jax.run.state import global_norm

TABLE = "table"
DENSE = "dense"


# ---- row-wise Adagrad -----------------------------------------------------------------------------
def rowwise_adagrad(learning_rate: float, initial_accumulator: float = 0.0,
                    eps: float = 1e-8) -> optax.GradientTransformation:
  """Row-wise Adagrad for V x E tables (gem_jax/run/table_optim.py): a_V += mean_E(g^2);
  update = -lr * g / (sqrt(a) + eps). A row whose gradient is exactly zero keeps its accumulator and gets an
  update of exactly zero, even with eps = 0 and a zero accumulator. The accumulator (state.slots[0]) is
  float32 whatever the table dtype; updates come back in the gradient's dtype."""
  return table_optim.RowwiseAdagrad(learning_rate, initial_accumulator, eps).transformation()


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


# ---- labels ---------------------------------------------------------------------------------------
def _path_key(path) -> tuple[str, ...]:
  """A key path as plain strings: the same for an nnx.State and its pure dict (and after a checkpoint
  restore that turned int keys into strings)."""
  out = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def _default_table_type() -> type:
  from gem_jax.model.embeddings import Table  # the model owns the type; imported late to keep arrows one way
  return Table


def param_labels(params, table_type: type | None = None):
  """A tree like `params` with TABLE or DENSE in place of every parameter (an nnx.Variable leaf).

  `table_type`: the nnx.Variable subclass of embedding tables; defaults to gem_jax.model.embeddings.Table.
  Raises when `params` holds a raw array, whose type cannot tell a table from a dense weight.
  """
  table_type = table_type or _default_table_type()

  def label(path, p):
    if not _is_variable(p):
      raise TypeError(f"param_labels: {jax.tree_util.keystr(path)} is a {type(p).__name__}, not an "
                      "nnx.Variable; pass the typed tree (nnx.state(model, nnx.Param)), not a pure dict")
    return TABLE if isinstance(p, table_type) else DENSE

  return jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_variable)


def _labels_by_path(params, table_type: type | None) -> dict[tuple[str, ...], tuple[str, int]]:
  labels = param_labels(params, table_type)
  flat_labels = jax.tree_util.tree_leaves_with_path(labels)
  flat_params = jax.tree_util.tree_leaves(params, is_leaf=_is_variable)
  return {_path_key(path): (label, p.get_value().ndim) for (path, label), p in zip(flat_labels, flat_params)}


def _lookup(known: dict, pick: Callable[[str, int], Any]) -> Callable[[Any], Any]:
  """A labels function for optax that works on the typed tree and on its pure dict."""

  def fn(tree):
    def one(path, leaf):
      if isinstance(leaf, optax.MaskedNode):
        return leaf
      key = _path_key(path)
      if key not in known:
        raise KeyError(f"optimizer: parameter {'/'.join(key)} was not in the tree the optimizer was built "
                       f"for (known: {sorted('/'.join(k) for k in known)[:8]}...)")
      return pick(*known[key])
    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: _is_variable(x) or isinstance(x, optax.MaskedNode))

  return fn


# ---- the optimizer ---------------------------------------------------------------------------------
class ScheduleState(NamedTuple):
  """The dense learning-rate schedule's step count and its numbers. The numbers ride in the state, not in
  the compiled step, so runs that differ only in steps, warmup or the dense learning rate share one
  compiled program (the persistent compilation cache serves them all); a restore writes the config's numbers back
  (`Optimizer.with_schedule`), so a resumed run follows its own config's schedule."""
  count: Any
  peak: Any
  warmup: Any
  decay_steps: Any
  end: Any


def schedule_numbers(cfg: TrainConfig, total_steps: int | None = None) -> dict[str, float]:
  return {"peak": cfg.learning_rate, "warmup": float(cfg.warmup_steps), "decay_steps": float(total_steps or cfg.steps),
          "end": cfg.learning_rate * cfg.end_lr_fraction}


def warmup_cosine(count, peak, warmup, decay_steps, end):
  """0 -> peak linearly over `warmup` steps, then cosine to `end` at `decay_steps` (optax's
  warmup_cosine_decay_schedule, written for traced numbers)."""
  f32 = jnp.float32
  count, peak, warmup, decay_steps, end = (jnp.asarray(x, f32) for x in (count, peak, warmup, decay_steps, end))
  rising = peak * jnp.clip(count, 0.0, warmup) / jnp.maximum(warmup, 1.0)
  span = jnp.maximum(decay_steps - warmup, 1.0)
  cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(count - warmup, span) / span))
  alpha = jnp.where(peak == 0, 0.0, end / jnp.where(peak == 0, 1.0, peak))
  falling = peak * ((1.0 - alpha) * cosine + alpha)
  return jnp.where(count < warmup, rising, falling)


def dense_schedule(cfg: TrainConfig, total_steps: int | None = None) -> optax.Schedule:
  """0 -> learning_rate linearly over warmup_steps, then cosine to learning_rate * end_lr_fraction at
  total_steps (default train.steps; a run over epochs passes its own)."""
  numbers = schedule_numbers(cfg, total_steps)
  return lambda count: warmup_cosine(count, **numbers)


def scale_by_schedule_in_state(numbers: dict[str, float]) -> optax.GradientTransformation:
  """updates * -lr(count), lr = warmup_cosine over the numbers held in the state (ScheduleState): the
  last link of AdamW (optax.adamw ends in scale_by_learning_rate the same way)."""

  def init(params):
    del params
    return ScheduleState(jnp.zeros([], jnp.int32), *(jnp.asarray(numbers[k], jnp.float32)
                                                      for k in ("peak", "warmup", "decay_steps", "end")))

  def update(updates, state, params=None):
    del params
    lr = warmup_cosine(state.count, state.peak, state.warmup, state.decay_steps, state.end)
    updates = jax.tree_util.tree_map(lambda g: jnp.asarray(-lr, g.dtype) * g, updates)
    return updates, state._replace(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformation(init, update)


class AverageState(NamedTuple):
  """track_average's state: updates seen, and the float32 moving average of the parameters they led to."""
  count: Any
  average: Any


def track_average(decay: float, warmup: float = 10.0) -> optax.GradientTransformation:
  """Passes the updates through and keeps an exponential moving average of the parameters they lead to
  (params + updates, as optax.apply_updates forms them), in float32 whatever the parameters' dtype. The decay
  at update t is min(decay, (1 + t) / (warmup + t)): the average follows the parameters closely at first instead
  of remembering the initial values for 1 / (1 - decay) steps, spanning about the last t / (warmup - 1) updates
  until the decay binds. It must be the chain's last link, where the updates are final."""

  def init(params):
    return AverageState(jnp.zeros([], jnp.int32), jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("track_average needs the parameters: call update(updates, state, params)")
    count = state.count.astype(jnp.float32)
    rate = jnp.minimum(jnp.float32(decay), (1.0 + count) / (jnp.float32(warmup) + count))

    def step(average, p, u):
      new = (jnp.asarray(p) + u).astype(jnp.asarray(p).dtype).astype(jnp.float32)
      return rate * average + (1.0 - rate) * new

    average = jax.tree_util.tree_map(step, state.average, params, updates)
    return updates, AverageState(optax.safe_int32_increment(state.count), average)

  return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """The run's optimizer: an optax transformation over the whole parameter tree (`init`, `update`: tables
  get their row rule on V x E gradients, the dense path) and its two parts for the sparse engine, which
  updates tables itself: `dense` (optax.masked over the dense parameters, the same transformation and state
  as inside the whole) and `rule` (the tables' row optimizer). State layout: that of optax.multi_transform
  with groups TABLE and DENSE (`dense_state`, `table_state` read the parts)."""
  whole: optax.GradientTransformation
  dense: optax.GradientTransformation
  rule: table_optim.RowRule
  numbers: dict = dataclasses.field(default_factory=dict)  # the dense schedule's (schedule_numbers)

  def init(self, params):
    return self.whole.init(params)

  def update(self, grads, state, params=None):
    return self.whole.update(grads, state, params)

  @staticmethod
  def dense_state(state):
    return state.inner_states[DENSE]

  @staticmethod
  def table_state(state) -> table_optim.TableState:
    return state.inner_states[TABLE].inner_state

  @staticmethod
  def _averages(state) -> list:
    found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, AverageState))
             if isinstance(x, AverageState)]
    if len(found) > 1:
      raise ValueError(f"optimizer state holds {len(found)} parameter averages; expected one")
    return found

  @staticmethod
  def average_state(state):
    """The part of the optimizer state that holds the moving average of the dense parameters (an
    AverageState, which `averaged` reads as well as the whole state), or None without train.ema_decay: what a
    copy of the averaged parameters needs to copy."""
    found = Optimizer._averages(state)
    return found[0] if found else None

  @staticmethod
  def averaged(params, state):
    """`params` with the moving average of each dense parameter in its place, in the parameter's dtype
    (track_average, train.ema_decay); `params` itself when the optimizer keeps no average. Tables are
    never averaged."""
    found = Optimizer._averages(state)
    if not found:
      return params

    def pick(average, p):
      return p if isinstance(average, optax.MaskedNode) else average.astype(jnp.asarray(p).dtype)

    return jax.tree_util.tree_map(pick, found[0].average, params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  def with_schedule(self, state):
    """`state` with this optimizer's schedule numbers (a restored state carries the checkpoint's)."""
    def put(x):
      if not isinstance(x, ScheduleState):
        return x
      return x._replace(**{k: jax.device_put(jnp.asarray(self.numbers[k], jnp.float32), getattr(x, k).sharding)
                           for k in ("peak", "warmup", "decay_steps", "end")})
    return jax.tree_util.tree_map(put, state, is_leaf=lambda x: isinstance(x, ScheduleState))

  @staticmethod
  def with_parts(state, dense_state, table_state):
    inner = dict(state.inner_states)
    inner[DENSE] = dense_state
    inner[TABLE] = inner[TABLE]._replace(inner_state=table_state)
    return state._replace(inner_states=inner)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm on state.global_norm (ordered_sum's form, which XLA:CPU does not copy into
  every leaf's update): the same arithmetic, leaf by leaf, and the same (empty) state. An infinite max_norm
  (no clipping, as the next-item presets) passes the updates through: optax's select would still divide
  every gradient by the norm, a pass over each parameter (an item table's included) that it then discards."""

  def update(updates, state, params=None):
    del params
    if math.isinf(max_norm):
      return updates, state
    norm = global_norm(updates)
    below = norm < max_norm
    return jax.tree_util.tree_map(lambda t: jax.lax.select(below, t, (t / norm.astype(t.dtype)) * max_norm),
                                  updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: TrainConfig, params, table_type: type | None = None,
                   total_steps: int | None = None) -> Optimizer:
  """Tables -> their row rule (train.embedding_optimizer, default row-wise Adagrad); everything else ->
  global-norm clip + AdamW (decay on >= 2-D kernels). Clipping sees the dense gradients only. With
  train.ema_decay > 0 the dense chain ends in track_average (Optimizer.averaged reads it).

  `params`: the typed parameter tree (nnx.State of nnx.Variables) the optimizer is built for. The result
  accepts that tree or its pure dict; a parameter it was not built for raises a KeyError.
  """
  known = _labels_by_path(params, table_type)
  # AdamW as optax.adamw composes it (Adam's scaling, decoupled weight decay, -lr), with the schedule's
  # numbers in the state (ScheduleState).
  dense = optax.chain(
      clip_by_global_norm(cfg.grad_clip_norm),
      optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=1e-8),
      optax.add_decayed_weights(cfg.weight_decay, mask=_lookup(known, lambda label, ndim: label == DENSE and ndim >= 2)),
      scale_by_schedule_in_state(schedule_numbers(cfg, total_steps)),
      *([track_average(cfg.ema_decay, cfg.ema_warmup)] if cfg.ema_decay > 0 else []),
  )
  rule = table_optim.make_rule(cfg)
  whole = optax.multi_transform({TABLE: rule.transformation(), DENSE: dense}, _lookup(known, lambda label, ndim: label))
  dense_only = optax.masked(dense, _lookup(known, lambda label, ndim: label == DENSE))
  return Optimizer(whole, dense_only, rule, schedule_numbers(cfg, total_steps))
