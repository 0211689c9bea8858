"""Row-wise Adagrad vs a hand computation, routing of tables vs dense params, the dense lr schedule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gem_jax.run import optim, table_optim
from gem_jax.config import TrainConfig


class Table(nnx.Param):
  """Stands in for gem_jax.model.embeddings.Table."""


class TinyModel(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.table = Table(jax.random.normal(rngs.params(), (6, 4)), eager_sharding=False,
                       out_sharding=("table_rows", "table_dim"))
    self.proj = nnx.Linear(4, 3, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(3, 3, rngs=rngs)])


def _params():
  return nnx.state(TinyModel(nnx.Rngs(0)), nnx.Param)


CFG = TrainConfig(steps=100, learning_rate=0.01, warmup_steps=0, weight_decay=0.1,
                  embedding_learning_rate=0.5, adagrad_eps=1e-6)


# ---- row-wise Adagrad --------------------------------------------------------------------------------
def test_rowwise_adagrad_matches_hand_computation_over_steps():
  lr, acc0, eps = 0.3, 0.1, 1e-3
  rng = np.random.default_rng(0)
  table = rng.normal(size=(5, 3)).astype(np.float32)
  grads = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)]
  grads[0][1] = 0.0  # row 1 untouched at step 0, row 3 at steps 1 and 2
  grads[1][3] = grads[2][3] = 0.0

  tx = optim.rowwise_adagrad(lr, acc0, eps)
  params = {"t": jnp.asarray(table)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  want_p, want_a = table.astype(np.float64), np.full(5, acc0)
  for g in grads:
    updates, state = update({"t": jnp.asarray(g)}, state, params)
    params = optax.apply_updates(params, updates)
    for v in range(5):
      if np.any(g[v] != 0):
        want_a[v] += np.mean(g[v].astype(np.float64) ** 2)
        want_p[v] -= lr * g[v] / (np.sqrt(want_a[v]) + eps)
  np.testing.assert_allclose(state.slots[0]["t"], want_a, rtol=1e-6)
  np.testing.assert_allclose(params["t"], want_p, rtol=1e-5, atol=1e-6)


def test_untouched_rows_stay_bit_exact_even_with_zero_eps_and_accumulator():
  tx = optim.rowwise_adagrad(1.0, initial_accumulator=0.0, eps=0.0)
  table = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
  state = tx.init({"t": table})
  g = jnp.zeros((4, 3), jnp.float32).at[2].set(jnp.array([1.0, -2.0, 0.0]))
  updates, state = tx.update({"t": g}, state)
  new = np.asarray(optax.apply_updates({"t": table}, updates)["t"])
  acc = np.asarray(state.slots[0]["t"])
  assert np.all(np.isfinite(new))
  np.testing.assert_array_equal(new[[0, 1, 3]], np.asarray(table)[[0, 1, 3]])
  np.testing.assert_array_equal(acc[[0, 1, 3]], 0.0)
  assert acc[2] == pytest.approx(5.0 / 3.0)
  np.testing.assert_allclose(new[2], np.array([6.0, 7.0, 8.0]) - np.array([1.0, -2.0, 0.0]) / np.sqrt(5.0 / 3.0),
                             rtol=1e-6)


def test_rowwise_state_is_one_float32_per_row():
  tx = optim.rowwise_adagrad(0.1)
  state = tx.init({"a": jnp.zeros((7, 4), jnp.bfloat16), "b": jnp.zeros((3, 2), jnp.float32)})
  assert state.slots[0]["a"].shape == (7,) and state.slots[0]["a"].dtype == jnp.float32
  assert state.slots[0]["b"].shape == (3,)
  updates, _ = tx.update({"a": jnp.ones((7, 4), jnp.bfloat16), "b": jnp.ones((3, 2))}, state)
  assert updates["a"].dtype == jnp.bfloat16


def test_rowwise_rejects_non_tables():
  with pytest.raises(ValueError, match=r"\['w'\] has shape \(3,\)"):
    optim.rowwise_adagrad(0.1).init({"w": jnp.zeros(3)})


def test_accumulator_shards_like_the_table_rows():
  state = optim.rowwise_adagrad(0.1).init({"table": _params()["table"]})
  acc = state.slots[0]["table"]
  assert isinstance(acc, Table) and acc.get_value().shape == (6,)
  assert acc.get_metadata()["out_sharding"] == ("table_rows",)


# ---- routing -------------------------------------------------------------------------------------------
def test_param_labels_by_type():
  labels = optim.param_labels(_params(), Table)
  assert labels["table"] == optim.TABLE
  assert labels["proj"]["kernel"] == labels["proj"]["bias"] == labels["blocks"][0]["kernel"] == optim.DENSE
  with pytest.raises(TypeError, match="not an nnx.Variable"):
    optim.param_labels(nnx.to_pure_dict(_params()), Table)


def _find(state, cls):
  found = []
  jax.tree.map(lambda x: found.append(x) if isinstance(x, cls) else None, state,
               is_leaf=lambda x: isinstance(x, cls))
  assert len(found) == 1
  return found[0]


def test_tables_get_no_adam_moments_and_dense_gets_no_row_accumulator():
  params = _params()
  state = optim.make_optimizer(CFG, params, Table).init(params)
  adam = _find(state, optax.ScaleByAdamState)
  assert isinstance(adam.mu["table"], optax.MaskedNode) and isinstance(adam.nu["table"], optax.MaskedNode)
  assert adam.mu["proj"]["kernel"].get_value().shape == (4, 3)
  acc = _find(state, table_optim.TableState).slots[0]
  assert isinstance(acc["proj"]["kernel"], optax.MaskedNode)
  assert acc["table"].get_value().shape == (6,)


@pytest.mark.parametrize("pure", [False, True], ids=["nnx_state", "pure_dict"])
def test_updates_route_tables_to_adagrad_and_decay_only_dense_kernels(pure):
  params = _params()
  tx = optim.make_optimizer(CFG, params, Table)
  if pure:
    params = nnx.to_pure_dict(params)
  get = (lambda x: x) if pure else (lambda x: x.get_value())
  grads = jax.tree.map(jnp.zeros_like, params)
  g_table = jnp.zeros((6, 4)).at[1].set(2.0)
  if pure:
    grads["table"] = g_table
  else:
    grads["table"] = grads["table"].replace(value=g_table)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)

  lr = CFG.learning_rate  # no warmup: the peak at step 0
  # Zero dense gradients: the only dense update is decoupled weight decay, on kernels only.
  np.testing.assert_allclose(get(updates["proj"]["kernel"]), -lr * CFG.weight_decay * get(params["proj"]["kernel"]),
                             rtol=1e-6)
  np.testing.assert_allclose(get(updates["blocks"][0]["kernel"]),
                             -lr * CFG.weight_decay * get(params["blocks"][0]["kernel"]), rtol=1e-6)
  np.testing.assert_array_equal(get(updates["proj"]["bias"]), 0.0)
  # The table: row-wise Adagrad on row 1 (mean g^2 = 4 -> step lr / (2 + eps)), no decay elsewhere.
  want = np.zeros((6, 4), np.float32)
  want[1] = -CFG.embedding_learning_rate * 2.0 / (2.0 + CFG.adagrad_eps)
  np.testing.assert_allclose(get(updates["table"]), want, rtol=1e-6)


def test_unknown_parameter_is_an_error():
  params = _params()
  tx = optim.make_optimizer(CFG, params, Table)
  pure = nnx.to_pure_dict(params)
  pure["extra"] = jnp.zeros((2, 2))
  with pytest.raises(KeyError, match="extra was not in the tree"):
    tx.init(pure)


# ---- schedule and config ---------------------------------------------------------------------------------
def test_dense_schedule_warmup_and_cosine():
  cfg = TrainConfig(steps=100, warmup_steps=10, learning_rate=2e-3, end_lr_fraction=0.1)
  lr = optim.dense_schedule(cfg)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(1e-3)
  assert float(lr(10)) == pytest.approx(2e-3)
  assert float(lr(55)) == pytest.approx(2e-4 + (2e-3 - 2e-4) * 0.5, rel=1e-5)  # cosine midpoint
  assert float(lr(100)) == pytest.approx(2e-4)


def test_adam_step_uses_the_schedule():
  cfg = dataclasses.replace(CFG, warmup_steps=10, weight_decay=0.0)
  params = _params()
  tx = optim.make_optimizer(cfg, params, Table)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["proj"]["kernel"].get_value(), 0.0)  # lr(0) = 0


@pytest.mark.parametrize("field, value", [("warmup_steps", 500), ("end_lr_fraction", 1.5), ("b2", 1.0),
                                          ("learning_rate", 0.0), ("weight_decay", -1.0)])
def test_train_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(TrainConfig(), **{field: value})


def test_dense_gradients_are_clipped_by_their_own_norm_and_no_table_gradient_reaches_them():
  """Global-norm clipping rescales the dense gradients (Adam's first moment holds (1 - b1) x the clipped
  gradient) by the dense norm alone: a huge table gradient leaves every dense update and moment bit-identical."""
  cfg = dataclasses.replace(CFG, grad_clip_norm=0.5, b1=0.9)
  params = nnx.to_pure_dict(_params())
  tx = optim.make_optimizer(cfg, _params(), Table)
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)) * 10, params)
  dense_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g))) for k, g in
                                 jax.tree_util.tree_leaves_with_path(grads) if "table" not in jax.tree_util.keystr(k))))
  assert dense_norm > 5 * cfg.grad_clip_norm
  update = jax.jit(tx.update)
  out = {}
  for scale in (1.0, 1e6):
    g = dict(grads, table=grads["table"] * scale)
    out[scale] = update(g, tx.init(params), params)
  mu = _find(out[1.0][1], optax.ScaleByAdamState).mu
  np.testing.assert_allclose(np.asarray(mu["proj"]["kernel"]),
                             (1 - cfg.b1) * np.asarray(grads["proj"]["kernel"]) * cfg.grad_clip_norm / dense_norm,
                             rtol=1e-5)
  for scale in (1.0, 1e6):
    (u, s) = out[scale]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((u, _find(s, optax.ScaleByAdamState))),
                                 jax.tree_util.tree_leaves((out[1.0][0], _find(out[1.0][1], optax.ScaleByAdamState)))):
      if "table" not in jax.tree_util.keystr(path):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)


@pytest.mark.parametrize("steps, warmup, end", [(100, 10, 0.1), (20, 0, 0.5), (7, 1, 1.0)])
def test_the_schedule_held_in_the_state_is_optaxs_warmup_cosine(steps, warmup, end):
  cfg = TrainConfig(steps=steps, warmup_steps=warmup, learning_rate=2e-3, end_lr_fraction=end)
  ref = optax.warmup_cosine_decay_schedule(0.0, 2e-3, warmup, steps, 2e-3 * end)
  ours = optim.dense_schedule(cfg)
  for count in range(steps + 3):
    assert float(ours(count)) == pytest.approx(float(ref(count)), rel=1e-6, abs=1e-12), count


def test_runs_that_differ_in_steps_share_a_program_and_a_restore_takes_the_configs_schedule():
  """The schedule's numbers are state, not constants: two step counts trace to the same jaxpr, and
  with_schedule puts the optimizer's own numbers into a state carrying another run's (the count stays)."""
  params = _params()
  short = optim.make_optimizer(dataclasses.replace(CFG, steps=10, warmup_steps=2), params, Table)
  long = optim.make_optimizer(dataclasses.replace(CFG, steps=1000, warmup_steps=50), params, Table)
  pure = nnx.to_pure_dict(params)
  grads = jax.tree.map(jnp.ones_like, pure)
  jaxpr = lambda tx: str(jax.make_jaxpr(lambda g, s: tx.update(g, s, pure))(grads, tx.init(pure)))
  assert jaxpr(short) == jaxpr(long)
  state = short.init(pure)
  _, state = jax.jit(short.update)(grads, state, pure)
  moved = long.with_schedule(state)
  sched = lambda s: [x for x in jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, optim.ScheduleState))
                     if isinstance(x, optim.ScheduleState)]
  (before,), (after,) = sched(state), sched(moved)
  assert float(before.decay_steps) == 10 and float(after.decay_steps) == 1000 and float(after.warmup) == 50
  assert int(after.count) == int(before.count) == 1


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_clip_and_the_guard_norm_are_optax_s_to_the_bit(platform):
  """squared_norm adds the leaves' sums in leaf order on every target (a loop on CPU, a chain elsewhere), so
  the clip is optax.clip_by_global_norm exactly, above and below its threshold."""
  from gem_jax import runtime
  from gem_jax.parallel import target
  from gem_jax.run import state
  rng = np.random.default_rng(0)
  tree = {f"w{i}": jnp.asarray(rng.normal(size=(3 + i, 5)) * 10.0 ** rng.uniform(-3, 1), jnp.float32)
          for i in range(9)}
  want_sq = optax.tree.norm(tree, squared=True)
  dev = target.CPU if platform == "cpu" else target.get("h200")
  with runtime.using(target=dev):
    got_sq = jax.jit(lambda t: state.squared_norm(t))(tree)  # a fresh trace under this target
    assert np.asarray(got_sq).tobytes() == np.asarray(want_sq).tobytes()
    for max_norm in (0.5 * float(np.sqrt(want_sq)), 2.0 * float(np.sqrt(want_sq)), float("inf")):
      ours, _ = jax.jit(lambda t: optim.clip_by_global_norm(max_norm).update(t, optax.EmptyState()))(tree)
      theirs, _ = jax.jit(lambda t: optax.clip_by_global_norm(max_norm).update(t, optax.EmptyState()))(tree)
      for k in tree:
        assert np.asarray(ours[k]).tobytes() == np.asarray(theirs[k]).tobytes(), (max_norm, k)
  # No clipping (an infinite norm, the next-item presets): the updates pass through, no pass over them.
  jaxpr = jax.make_jaxpr(lambda t: optim.clip_by_global_norm(float("inf")).update(t, optax.EmptyState()))(tree)
  assert not jaxpr.eqns, jaxpr


# ---- parameter averaging (train.ema_decay) -------------------------------------------------------------
@pytest.mark.parametrize("warmup", [10.0, 3.0])
def test_the_average_follows_the_recurrence_over_the_dense_parameters_and_leaves_tables_alone(warmup):
  """Five updates through the whole optimizer: every dense parameter's average is the hand recurrence with the
  warmed-up decay, over the parameters the updates led to; tables keep their own values (no average)."""
  decay = 0.9
  params = _params()
  tx = optim.make_optimizer(dataclasses.replace(CFG, ema_decay=decay, ema_warmup=warmup), params, Table)
  pure = nnx.to_pure_dict(params)
  state = tx.init(pure)
  assert optim.Optimizer.averaged(pure, tx.init(pure))["table"] is pure["table"]
  update = jax.jit(tx.update)
  want = jax.tree.map(lambda p: np.asarray(p, np.float64), pure)
  for t in range(5):
    grads = jax.tree.map(lambda p: jnp.cos(p * (t + 1.0)) - 0.3 * t, pure)
    updates, state = update(grads, state, pure)
    pure = optax.apply_updates(pure, updates)
    rate = min(decay, (1 + t) / (warmup + t))
    want = jax.tree.map(lambda w, p: rate * w + (1 - rate) * np.asarray(p, np.float64), want, pure)
  got = optim.Optimizer.averaged(pure, state)
  for path in (("proj", "kernel"), ("proj", "bias"), ("blocks", 0, "kernel")):
    g, w, p = got, want, pure
    for k in path:
      g, w, p = g[k], w[k], p[k]
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not np.allclose(g, p)   # the average lags the parameters it follows
  np.testing.assert_array_equal(got["table"], pure["table"])
  no_average = optim.make_optimizer(CFG, params, Table)
  assert optim.Optimizer.averaged(pure, no_average.init(pure)) is pure
  assert optim.Optimizer.average_state(state) is not None
  assert optim.Optimizer.average_state(no_average.init(pure)) is None
  alone = optim.Optimizer.averaged(pure, optim.Optimizer.average_state(state))   # the average's part suffices
  assert jax.tree.all(jax.tree.map(np.array_equal, alone, got))


def test_the_average_is_float32_and_given_back_in_the_parameters_dtype():
  decay = 0.5
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.to_pure_dict(_params()))
  tx = optim.track_average(decay)
  state = tx.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.average))
  updates = jax.tree.map(lambda p: jnp.full_like(p, 2.0 ** -6), params)
  _, state = tx.update(updates, state, params)
  got = optim.Optimizer.averaged(params, (state,))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(updates, state)
