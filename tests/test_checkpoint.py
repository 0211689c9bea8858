"""Checkpointer: bit-exact round trips (bf16, int32, typed keys, sharded arrays), JSON extra, pruning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.train.checkpoint import Checkpointer


def _state(seed: int):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "params": {"w": jax.random.normal(k1, (4, 3), jnp.float32),
                 "emb": jax.random.normal(k2, (6, 2)).astype(jnp.bfloat16)},
      "opt": ({"count": jnp.int32(seed)}, [jnp.arange(5, dtype=jnp.int32) * seed]),
      "step": jnp.int32(10 * seed),
      "rng": jax.random.fold_in(jax.random.key(seed), 7),
  }


def _assert_bit_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8))


def test_round_trip_is_bit_exact_with_extra(tmp_path):
  state = _state(1)
  extra = {"data": {"epoch": 2, "position": [3, 4]}, "config": "tiny", "loss": 0.25, "done": False, "x": None}
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    assert ckpt.save(10, state, extra)
    ckpt.wait()
    abstract = jax.eval_shape(lambda: _state(0))
    step, restored, got_extra = ckpt.restore(abstract_state=abstract)
  assert step == 10
  _assert_bit_equal(restored, state)
  assert got_extra == extra
  # The restored key is usable and gives the same stream.
  np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (3,)), jax.random.uniform(state["rng"], (3,)))


def test_non_default_prng_impl_round_trips(tmp_path):
  state = {"rng": jax.random.key(3, impl="rbg")}
  with Checkpointer(tmp_path, keep=1, save_every=1) as ckpt:
    ckpt.save(1, state)
    _, restored, extra = ckpt.restore(abstract_state=jax.eval_shape(lambda: state))
  assert extra == {}
  _assert_bit_equal(restored, state)


def test_restore_into_a_sharded_target(tmp_path):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  w = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
  with Checkpointer(tmp_path, keep=1, save_every=1) as ckpt:
    ckpt.save(1, {"w": w})
    sharding = NamedSharding(mesh, P("a", "b"))
    _, restored, _ = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)})
  assert restored["w"].sharding == sharding
  np.testing.assert_array_equal(restored["w"], w)


def test_keeps_the_last_k_and_restores_a_given_step(tmp_path):
  with Checkpointer(tmp_path, keep=2, save_every=2) as ckpt:
    saved = [s for s in range(1, 9) if ckpt.save(s, _state(s), {"step": s})]
    ckpt.wait()
    assert saved == [2, 4, 6, 8]
    assert ckpt.all_steps() == [6, 8] and ckpt.latest_step() == 8
    step, restored, extra = ckpt.restore(6, abstract_state=jax.eval_shape(lambda: _state(0)))
  assert step == 6 and extra == {"step": 6}
  _assert_bit_equal(restored, _state(6))
  # A new Checkpointer over the same directory (a restarted job) sees the same steps.
  with Checkpointer(tmp_path, keep=2, save_every=2) as again:
    assert again.all_steps() == [6, 8]
    assert again.save(9, _state(9), force=True)
    again.wait()
    assert again.all_steps() == [8, 9]


def test_errors(tmp_path):
  abstract = jax.eval_shape(lambda: _state(0))
  with Checkpointer(tmp_path / "empty", keep=1, save_every=1) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint to restore in .*empty"):
      ckpt.restore(abstract_state=abstract)
    with pytest.raises(ValueError, match="extra is not JSON-serializable"):
      ckpt.save(1, _state(1), {"array": np.zeros(2)})
    ckpt.save(1, _state(1))
    with pytest.raises(ValueError, match="step 1 already exists"):
      ckpt.save(1, _state(1))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 .*steps there: \[1\]"):
      ckpt.restore(5, abstract_state=abstract)
    with pytest.raises(ValueError, match="does not match abstract_state"):
      ckpt.restore(abstract_state=dict(abstract, missing=jax.ShapeDtypeStruct((2,), jnp.float32)))
    ckpt.save(2, {"rng": jax.random.key_data(jax.random.key(0))}, force=True)
    with pytest.raises(ValueError, match=r"\['rng'\] is a PRNG key in abstract_state but was saved as a plain"):
      ckpt.restore(abstract_state={"rng": jax.eval_shape(lambda: jax.random.key(0))})


def test_nnx_params_and_optimizer_state_round_trip(tmp_path):
  """The real train state: nnx Variables, optax named tuples and MaskedNode placeholders."""
  from flax import nnx
  from gem_jax.train import optim
  from gem_jax.train.config import TrainConfig

  class Table(nnx.Param):
    pass

  class Tiny(nnx.Module):
    def __init__(self, rngs):
      self.table = Table(jax.random.normal(rngs.params(), (5, 3)), eager_sharding=False)
      self.proj = nnx.Linear(3, 2, rngs=rngs)

  def make():
    params = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
    tx = optim.make_optimizer(TrainConfig(warmup_steps=0), params, Table)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial moments and accumulators
    return {"params": params, "opt": opt_state}

  state = make()
  with Checkpointer(tmp_path, keep=1, save_every=1) as ckpt:
    ckpt.save(3, state)
    _, restored, _ = ckpt.restore(abstract_state=jax.eval_shape(make))
  _assert_bit_equal(restored, state)
  assert type(restored["params"]["table"]) is Table
