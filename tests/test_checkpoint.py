"""Checkpointer: bit-exact round trips (bf16, int32, typed keys, sharded arrays), JSON extra, pruning, and
what a crash or a damaged file leaves: interrupted saves, truncated and bit-flipped files, fallback."""

import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.train import checkpoint as checkpoint_lib
from gem_jax.train.checkpoint import CheckpointCorruptError, Checkpointer, fingerprint
from tests.run_helpers import child_env


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
    with pytest.raises(ValueError, match=r"only in the target \[\"\['average'\]\"\]; .* train.ema_decay"):
      ckpt.restore(abstract_state=dict(abstract, average=jax.ShapeDtypeStruct((2,), jnp.float32)))
    ckpt.save(2, {"rng": jax.random.key_data(jax.random.key(0))}, force=True)
    with pytest.raises(ValueError, match=r"does not match abstract_state at \['rng'\]: saved uint32\[2\], target "
                       r"wants key<fry>\[\]"):
      ckpt.restore(abstract_state={"rng": jax.eval_shape(lambda: jax.random.key(0))})


def test_nnx_params_and_optimizer_state_round_trip(tmp_path):
  """The real train state: nnx Variables, optax named tuples and MaskedNode placeholders."""
  from flax import nnx
  from gem_jax.run import optim
  from gem_jax.config import TrainConfig

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


# ---- damage and crashes -------------------------------------------------------------------------------


def _big_state(seed: int):
  """Random (incompressible) weights, so the array data lands in one sizeable file per checkpoint."""
  return {"w": jax.random.normal(jax.random.key(seed), (256, 256)), "step": jnp.int32(seed)}


def _data_file(step_dir) -> str:
  """The largest file of a checkpoint's array item: the one holding the weights' bytes."""
  files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state")) for f in names]
  return max(files, key=os.path.getsize)


def _save_steps(ckpt, steps):
  for s in steps:
    ckpt.save(s, _big_state(s), {"step": s}, force=True)
  ckpt.wait()


@pytest.mark.parametrize("damage", ["truncate", "flip_bit", "edit_extra", "break_meta"])
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_restored(tmp_path, damage):
  abstract = jax.eval_shape(lambda: _big_state(0))
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    _save_steps(ckpt, (1, 2))
    step_dir = ckpt.step_dir(2)
    if damage == "truncate":
      path = _data_file(step_dir)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
      reason = "could not be read"
    elif damage == "flip_bit":  # orbax alone would restore this silently as a wrong weight
      path = _data_file(step_dir)
      with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
      reason = r"fails its integrity hashes in 1 leaves \(first: \['w'\]\)"
    elif damage == "edit_extra":  # still valid JSON, other content
      with open(os.path.join(step_dir, "extra", "metadata"), "w") as f:
        json.dump({"step": 3}, f)
      reason = "extra JSON fails its CRC32"
    else:
      with open(os.path.join(step_dir, "meta", "metadata"), "w") as f:
        f.write('{"format": ')
      reason = "is unreadable"
    with pytest.warns(RuntimeWarning, match="trying the previous checkpoint"):
      step, restored, extra = ckpt.restore(abstract_state=abstract)
    assert step == 1 and extra == {"step": 1}
    _assert_bit_equal(restored, _big_state(1))
    [fb] = ckpt.fallbacks
    assert fb.step == 2 and fb.moved_to == step_dir + ".corrupt"
    assert re.search(rf"checkpoint step 2 in {re.escape(str(tmp_path))}\b.*{reason}", fb.reason), fb.reason
    assert os.path.isdir(fb.moved_to) and ckpt.all_steps() == [1]
    # The resumed run saves step 2 again; the damaged copy stays aside for inspection.
    ckpt.save(2, _big_state(2), {"step": 2}, force=True)
    step, restored, _ = ckpt.restore(abstract_state=abstract)
    assert step == 2 and ckpt.all_steps() == [1, 2]
    _assert_bit_equal(restored, _big_state(2))


def test_every_checkpoint_damaged_raises_listing_each(tmp_path):
  abstract = jax.eval_shape(lambda: _big_state(0))
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    _save_steps(ckpt, (1, 2))
    for s in (1, 2):
      with open(_data_file(ckpt.step_dir(s)), "r+b") as f:
        f.truncate(10)
    with pytest.warns(RuntimeWarning):
      with pytest.raises(CheckpointCorruptError, match=r"no usable checkpoint in .*\n  checkpoint step 2 .*\n  "
                                                       r"checkpoint step 1 "):
        ckpt.restore(abstract_state=abstract)


def test_an_explicit_damaged_step_raises_and_max_step_bounds_the_search(tmp_path):
  abstract = jax.eval_shape(lambda: _big_state(0))
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    _save_steps(ckpt, (1, 2, 3))
    with open(_data_file(ckpt.step_dir(2)), "r+b") as f:
      f.truncate(10)
    with pytest.raises(CheckpointCorruptError, match="checkpoint step 2 .* could not be read"):
      ckpt.restore(2, abstract_state=abstract)
    assert ckpt.all_steps() == [1, 2, 3] and not ckpt.fallbacks  # an explicit step is never moved
    with pytest.warns(RuntimeWarning):
      step, _, _ = ckpt.restore(abstract_state=abstract, max_step=2)
    assert step == 1 and ckpt.all_steps() == [1, 3]
    with pytest.raises(FileNotFoundError, match="no checkpoint at or before step 0"):
      ckpt.restore(abstract_state=abstract, max_step=0)


def test_fingerprint_does_not_depend_on_the_layout():
  x = jax.random.normal(jax.random.key(0), (8, 6)).astype(jnp.bfloat16)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  tree = {"x": x, "k": jax.random.key(1), "n": jnp.arange(5), "flag": jnp.array([True, False])}
  np.testing.assert_array_equal(fingerprint(tree), fingerprint(dict(tree, x=sharded)))
  moved = x.at[3, 1].set(x[3, 1] + 1)
  assert not np.array_equal(fingerprint({"x": x}), fingerprint({"x": moved}))
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])  # same words, other places
  if x[0, 0] != x[0, 1]:
    assert not np.array_equal(fingerprint({"x": x}), fingerprint({"x": swapped}))


def test_host_hashes_equal_the_jitted_ones_for_every_dtype_and_across_chunks(monkeypatch):
  """On CPU the hashes come leaf by leaf (checkpoint._fingerprint: numpy, or a jitted pass per large leaf);
  they must be the one jitted pass's bits, for every itemsize, either way, and for numpy leaves (host
  tables)."""
  monkeypatch.setattr(checkpoint_lib, "_HOST_ELEMENTS", 9)  # x (45 elements) and its casts: the per-leaf jit
  key = jax.random.key(3)
  x = jax.random.normal(key, (5, 9))
  leaves = [x, x.astype(jnp.bfloat16), x.astype(jnp.float8_e4m3fn), (x * 100).astype(jnp.int8),
            (x * 1e4).astype(jnp.int32), jax.random.key_data(key), x > 0, jnp.zeros((0, 3)), jnp.float32(2.5),
            np.asarray(x * 3), jnp.arange(4, dtype=jnp.uint32), np.asarray(x).T,
            np.arange(-3, 4, dtype=np.int64), np.float64(-2.5)]  # 64-bit: hashed as jit makes them 32-bit
  assert all(checkpoint_lib._on_host(leaf) for leaf in leaves)
  host = np.asarray(checkpoint_lib._fingerprint(leaves))
  np.testing.assert_array_equal(host, np.asarray(checkpoint_lib._fingerprint_jit(leaves)))
  assert len({tuple(h) for h in host.tolist()}) == len(leaves)  # the empty leaf: (0, 0)
  monkeypatch.setattr(checkpoint_lib, "_HOST_ELEMENTS", 1 << 16)  # every leaf in numpy
  np.testing.assert_array_equal(host, np.asarray(checkpoint_lib._fingerprint(leaves)))
  moved = np.asarray(x).copy()
  moved[4, 8] += 1                               # the last word
  assert not np.array_equal(checkpoint_lib._leaf_hash_host(moved), host[0])


def test_the_per_process_parts_of_a_sharded_leaf_add_up_to_its_hash():
  """A multi-process CPU run hashes each process's shards of replica 0 at their places in the whole array
  (checkpoint._local_sums) and adds the processes' parts up. Here one process holds all 8 devices, so its
  part is every shard's: it must be the whole leaf's hash, for sharded, partly replicated, replicated
  and scalar leaves of every itemsize."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  key = jax.random.key(5)
  x = jax.random.normal(key, (8, 6, 3))
  cases = [(x, P("a", "b")), (x.astype(jnp.bfloat16), P(None, "b", None)), ((x * 50).astype(jnp.int8), P("b")),
           (x > 0, P("a", None, None)), (jnp.arange(16, dtype=jnp.uint32), P(("a", "b"))),
           (x[:, :, 0], P()), (jnp.float32(3.5), P()), (jax.random.key_data(key), P())]
  for value, spec in cases:
    placed = jax.device_put(value, NamedSharding(mesh, spec))
    want = checkpoint_lib._leaf_hash_host(np.asarray(value))
    np.testing.assert_array_equal(np.array(checkpoint_lib._local_sums(placed), np.uint32), want, err_msg=str(spec))
  np.testing.assert_array_equal(np.array(checkpoint_lib._local_sums(np.asarray(x)), np.uint32),
                                checkpoint_lib._leaf_hash_host(np.asarray(x)))
  # A shard at the wrong place (positions off by one row) changes the weighted sum.
  index = (slice(1, 3), slice(0, 6), slice(0, 3))
  assert checkpoint_lib._positions((8, 6, 3), index)[0, 0, 0] == 18
  assert checkpoint_lib._positions((8, 6, 3), index).reshape(-1).tolist() == list(range(18, 54))


_KILL_MID_SAVE = r"""
import os, signal, sys
import jax, jax.numpy as jnp
from gem_jax.train.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep=3, save_every=1)
ckpt.save(1, {"w": jax.random.normal(jax.random.key(1), (256, 256))}, {"step": 1}, force=True)
ckpt.wait()
big = {"w": jax.random.normal(jax.random.key(2), (4096, 4096))}   # 64 MiB: the write takes a while
ckpt.save(2, big, {"step": 2}, force=True)                          # returns with the write in flight
if os.path.exists(os.path.join(sys.argv[1], "2")):
  print("committed before the kill", flush=True)
  sys.exit(3)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _KILL_MID_SAVE, str(tmp_path)], env=child_env(1), capture_output=True,
                        text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr[-2000:])
  leftovers = [n for n in os.listdir(tmp_path) if n.startswith("2.")]
  assert leftovers, os.listdir(tmp_path)   # the interrupted write is a temporary directory, not step 2
  with Checkpointer(tmp_path, keep=3, save_every=1) as ckpt:
    assert ckpt.all_steps() == [1]
    step, restored, extra = ckpt.restore(abstract_state={"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)})
    assert step == 1 and extra == {"step": 1} and not ckpt.fallbacks
    np.testing.assert_array_equal(restored["w"], jax.random.normal(jax.random.key(1), (256, 256)))
    ckpt.save(2, {"w": restored["w"]}, force=True)   # the next save clears the leftover and commits
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
  assert not [n for n in os.listdir(tmp_path) if n.startswith("2.")]


def test_restore_refuses_a_dtype_only_mismatch_and_a_wrong_weighted_hash(tmp_path, monkeypatch):
  """A target leaf that differs from the saved one only in dtype is refused by name; and the weighted
  (second) hash column counts on its own: a restore whose recomputed weighted sums differ while the plain
  sums agree (two words swapped) is refused as corrupt."""
  state = _state(3)
  abstract = jax.eval_shape(lambda: state)
  with Checkpointer(tmp_path / "c", keep=1, save_every=1) as ckpt:
    ckpt.save(1, state)
  w = abstract["params"]["w"]
  wrong = dict(abstract, params=dict(abstract["params"], w=jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)))
  with Checkpointer(tmp_path / "c", keep=1, save_every=1) as ckpt:
    with pytest.raises(ValueError, match=r"does not match abstract_state at \['params'\]\['w'\].*float32.*bfloat16"):
      ckpt.restore(abstract_state=wrong)
  # Swapping two words keeps every plain sum and changes the weighted one.
  x = jnp.arange(8, dtype=jnp.uint32)
  a, b = fingerprint({"x": x}), fingerprint({"x": x[jnp.array([1, 0, 2, 3, 4, 5, 6, 7])]})
  assert np.asarray(a)[0, 0] == np.asarray(b)[0, 0] and np.asarray(a)[0, 1] != np.asarray(b)[0, 1]
  real = checkpoint_lib._fingerprint

  def weighted_off(leaves):
    h = real(leaves)
    return h.at[0, 1].add(jnp.uint32(1))

  monkeypatch.setattr(checkpoint_lib, "_fingerprint", weighted_off)
  with Checkpointer(tmp_path / "c", keep=1, save_every=1) as ckpt:
    with pytest.raises(CheckpointCorruptError, match="fails its integrity hashes"):
      ckpt.restore(abstract_state=abstract, fallback=False)
