"""Row optimizers for embedding tables: row-wise Adagrad, plain SGD and row-wise Adam, each written once as
math on a set of rows and used two ways.

  rule = make_rule(train_cfg)                 # train.embedding_optimizer picks it
  rule.update_rows(g_UxE, slots_U, count)     # -> (update_UxE, new slots): the rows' math, U rows at a time
  rule.transformation()                       # the same math as an optax transformation on V x E gradients

The sparse engine (gem_jax/run/table_update.py) gathers the touched rows and their slots, calls
`update_rows` and scatters the results back into the donated table, so nothing of size V is read or written
beyond the touched rows. The transformation applies `update_rows` to every row of a V x E gradient and
keeps a row whose gradient is exactly zero as it was: it is the dense path (train.embedding_update=dense)
and the exact reference the sparse path is tested against. Both paths share this one function, so they
differ only in the order in which the gradient of a row was summed.

Slots are per-row optimizer state: a (V,) vector ("row" slot, sharded like the table's rows) or a V x E
array ("table" slot, sharded like the table). A rule's state is TableState(slots, count): one tree per
slot (shaped like the tables) and the number of updates applied, which row-wise Adam's bias correction
reads. Updates are lazy: a row with no gradient keeps its slots, as in FBGEMM's sparse optimizers.

Rules (Letters: V rows, U touched rows, E width):
  rowwise_adagrad  a_U += mean_E(g^2); u = -lr g / (sqrt(a) + eps)       (FBGEMM EXACT_ROWWISE_ADAGRAD)
  sgd              u = -lr g
  rowwise_adam     m = b1 m + (1 - b1) g; v_U = b2 v + (1 - b2) mean_E(g^2);
                   u = -lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), t = count + 1
                   (a first moment per element, a second moment per row: FBGEMM's PARTIAL_ROWWISE_ADAM)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

ROW, FULL = "row", "table"


class TableState(NamedTuple):
  slots: tuple      # one tree per slot, shaped like the tables ((V,) or V x E leaves)
  count: Any        # int32 scalar: updates applied so far


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _slot_like(table, value, kind: str):
  """`value` wrapped like `table`: a Variable keeps its type and sharding metadata (a row slot shards
  over the table's row axis only), so the placement lays it out like the table."""
  if not _is_variable(table):
    return value
  if kind == FULL:
    return table.replace(value=value)
  names = table.get_metadata().get("out_sharding")
  metadata = {"out_sharding": (names[0],)} if isinstance(names, (tuple, list)) and len(names) == 2 else {}
  return table.replace(value=value, **metadata)


class RowRule:
  """One row optimizer (module docstring): its slots and the update of a set of rows."""
  name = "rule"
  slot_kinds: tuple[str, ...] = ()

  def init_slot(self, kind: str, value):
    return jnp.zeros(value.shape[:1] if kind == ROW else value.shape, jnp.float32)

  def update_rows(self, g_UxE, slots: tuple, count) -> tuple[Any, tuple]:
    raise NotImplementedError

  def transformation(self) -> optax.GradientTransformation:
    """The rule on whole V x E gradients; rows whose gradient is all zero keep their slots exactly."""

    def init_fn(params):
      def check(path, value):
        if value.ndim != 2:
          raise ValueError(f"{self.name}: parameter {jax.tree_util.keystr(path)} has shape {value.shape}; "
                           "only V x E embedding tables are supported")

      def slot(kind):
        def one(path, p):
          value = p.get_value() if _is_variable(p) else p
          check(path, value)
          return _slot_like(p, self.init_slot(kind, value), kind)
        return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)

      jax.tree_util.tree_map_with_path(lambda path, p: check(path, p.get_value() if _is_variable(p) else p),
                                       params, is_leaf=_is_variable)
      return TableState(tuple(slot(k) for k in self.slot_kinds), jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
      del params
      treedef = jax.tree.structure(updates, is_leaf=_is_variable)
      grads = treedef.flatten_up_to(updates)
      slots = [treedef.flatten_up_to(s) for s in state.slots]
      new_updates, new_slots = [], [[] for _ in slots]
      for i, g in enumerate(grads):
        value = g.get_value() if _is_variable(g) else g
        own = tuple(s[i].get_value() if _is_variable(s[i]) else s[i] for s in slots)
        u, out = self.dense_update(value, own, state.count)
        new_updates.append(g.replace(value=u) if _is_variable(g) else u)
        for k, s in enumerate(slots):
          new_slots[k].append(s[i].replace(value=out[k]) if _is_variable(s[i]) else out[k])
      return (treedef.unflatten(new_updates),
              TableState(tuple(treedef.unflatten(s) for s in new_slots), state.count + 1))

    return optax.GradientTransformation(init_fn, update_fn)

  def dense_update(self, g_VxE, slots: tuple, count):
    """update_rows on every row; a row with an all-zero gradient gets a zero update and keeps its slots."""
    touched_V = jnp.any(g_VxE != 0, axis=1)
    u_VxE, new = self.update_rows(g_VxE, slots, count)
    u_VxE = jnp.where(touched_V[:, None], u_VxE, jnp.zeros((), u_VxE.dtype))  # never 0 * inf
    keep = lambda n, o: jnp.where(touched_V.reshape((-1,) + (1,) * (o.ndim - 1)), n, o)
    return u_VxE, tuple(keep(n, o) for n, o in zip(new, slots))


class RowwiseAdagrad(RowRule):
  name = "rowwise_adagrad"
  slot_kinds = (ROW,)

  def __init__(self, learning_rate: float, initial_accumulator: float = 0.0, eps: float = 1e-8):
    self.lr, self.acc0, self.eps = learning_rate, initial_accumulator, eps

  def init_slot(self, kind, value):
    return jnp.full(value.shape[:1], self.acc0, jnp.float32)

  def update_rows(self, g_UxE, slots, count):
    g32 = g_UxE.astype(jnp.float32)
    acc_U = slots[0] + jnp.mean(jnp.square(g32), axis=1)
    step_U = self.lr / (jnp.sqrt(acc_U) + self.eps)
    return (-step_U[:, None] * g32).astype(g_UxE.dtype), (acc_U,)


class SGD(RowRule):
  name = "sgd"

  def __init__(self, learning_rate: float):
    self.lr = learning_rate

  def update_rows(self, g_UxE, slots, count):
    return (-self.lr * g_UxE.astype(jnp.float32)).astype(g_UxE.dtype), ()


class RowwiseAdam(RowRule):
  name = "rowwise_adam"
  slot_kinds = (FULL, ROW)

  def __init__(self, learning_rate: float, b1: float, b2: float, eps: float):
    self.lr, self.b1, self.b2, self.eps = learning_rate, b1, b2, eps

  def update_rows(self, g_UxE, slots, count):
    g32 = g_UxE.astype(jnp.float32)
    m_UxE = self.b1 * slots[0] + (1 - self.b1) * g32
    v_U = self.b2 * slots[1] + (1 - self.b2) * jnp.mean(jnp.square(g32), axis=1)
    t = (count + 1).astype(jnp.float32)
    m_hat = m_UxE / (1 - self.b1 ** t)
    v_hat = v_U / (1 - self.b2 ** t)
    return (-self.lr * m_hat / (jnp.sqrt(v_hat)[:, None] + self.eps)).astype(g_UxE.dtype), (m_UxE, v_U)


RULES = ("rowwise_adagrad", "sgd", "rowwise_adam")


def make_rule(cfg) -> RowRule:
  """The row optimizer train.embedding_optimizer names (cfg: gem_jax.config.TrainConfig)."""
  name = cfg.embedding_optimizer
  if name == "rowwise_adagrad":
    return RowwiseAdagrad(cfg.embedding_learning_rate, cfg.adagrad_initial_accumulator, cfg.adagrad_eps)
  if name == "sgd":
    return SGD(cfg.embedding_learning_rate)
  if name == "rowwise_adam":
    return RowwiseAdam(cfg.embedding_learning_rate, cfg.b1, cfg.b2, cfg.adagrad_eps)
  raise ValueError(f"train.embedding_optimizer must be one of {RULES}, got {name!r}")
