"""Sharded embedding lookup == jnp.take on the full table (values, NaN for bad ids, gradients), exact under
overflow, all-to-all only (no table gather) in the compiled program, and the host capacity helper."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gem_jax.parallel.rules import DATA_AXES, MESH_AXES
from gem_jax.parallel import sparse
from gem_jax.parallel.sparse import capacity_for, ideal_bytes, sharded_lookup

V, E, N = 64, 8, 40
STAT_KEYS = ("unique", "max_bucket", "overflow", "spill", "second", "last_resort", "remote_unique")


def make_mesh(shape):
  return Mesh(np.array(jax.devices()).reshape(shape), MESH_AXES)


def num_data_shards(mesh):
  return int(np.prod([mesh.shape[a] for a in DATA_AXES]))


def table_shards(mesh, table_axes):
  return int(np.prod([mesh.shape[a] for a in table_axes]))


@functools.lru_cache(maxsize=None)
def lookup_fn(mesh, table_axes, capacity, with_loss=False, flat=True, spill_fraction=0.125):
  """jit(shard_map): (table_VxE, ids_SxN[, w_SxNxE]) -> rows_SxNxE and per-shard stats (or the loss).
  flat=False passes the local ids as 1 x N (ids of any shape) instead of N."""

  def body(table_VlxE, ids_1xN, *w):
    rows, stats = sharded_lookup(table_VlxE, ids_1xN[0] if flat else ids_1xN, axes=table_axes, num_rows=V,
                                 capacity=capacity, uniform_axes=MESH_AXES, spill_fraction=spill_fraction)
    rows_1xNxE = rows[None] if flat else rows
    if with_loss:
      return jnp.sum(rows_1xNxE * w[0])[None]
    return rows_1xNxE, {k: v[None] for k, v in stats.items()}

  data = P(DATA_AXES)
  in_specs = (P(table_axes, None), P(DATA_AXES, None)) + ((P(DATA_AXES, None, None),) if with_loss else ())
  out_specs = data if with_loss else (P(DATA_AXES, None, None), {k: data for k in STAT_KEYS})
  f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
  if with_loss:
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a))))
  return jax.jit(f)


def place(mesh, table_axes, table, ids, *rest):
  out = [jax.device_put(table, NamedSharding(mesh, P(table_axes, None))),
         jax.device_put(ids, NamedSharding(mesh, P(DATA_AXES, None)))]
  return out + [jax.device_put(r, NamedSharding(mesh, P(DATA_AXES, None, None))) for r in rest]


def reference_rows(table, ids):
  """The spec: row for ids in [0, V), NaN otherwise (negative ids included)."""
  valid = (ids >= 0) & (ids < V)
  return np.where(valid[..., None], np.asarray(table)[np.where(valid, ids, 0)], np.nan)


def expected_stats(ids_SxN, mesh, table_axes):
  shards = table_shards(mesh, table_axes)
  rows_per = V // shards
  out = {k: [] for k in ("unique", "max_bucket", "remote_unique")}
  for d, ids in enumerate(ids_SxN):
    # Data shard d is row-major over (replica, fsdp, sparse); the table axes are its innermost ones.
    me = d % shards
    uniq = np.unique(ids[(ids >= 0) & (ids < V)])
    owners = uniq // rows_per
    out["unique"].append(len(uniq))
    out["max_bucket"].append(np.bincount(owners, minlength=shards).max())
    out["remote_unique"].append(int(np.sum(owners != me)))
  return {k: np.array(v) for k, v in out.items()}


def random_ids(rng, num_shards, pool=24):
  """Ids with many duplicates: each shard draws N ids from its own pool of `pool` distinct ids."""
  pools = [rng.choice(V, pool, replace=False) for _ in range(num_shards)]
  return np.stack([rng.choice(p, N) for p in pools]).astype(np.int32)


LAYOUTS = [
    pytest.param((2, 2, 2, 1, 1), ("sparse",), id="2x2x2-sparse"),
    pytest.param((2, 2, 2, 1, 1), ("fsdp", "sparse"), id="2x2x2-fsdp_sparse"),
    pytest.param((1, 2, 2, 2, 1), ("sparse",), id="context2-sparse"),
    pytest.param((1, 1, 8, 1, 1), ("sparse",), id="sparse8"),
]


@pytest.mark.parametrize("shape,table_axes", LAYOUTS)
def test_values_match_take_per_data_shard(shape, table_axes):
  mesh = make_mesh(shape)
  rng = np.random.default_rng(0)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = random_ids(rng, num_data_shards(mesh))
  cap = capacity_for(list(ids), V, table_shards(mesh, table_axes))
  rows, stats = lookup_fn(mesh, table_axes, cap)(*place(mesh, table_axes, table, ids))
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(table)[ids])
  want = expected_stats(ids, mesh, table_axes)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(stats[k]), v, err_msg=k)
  np.testing.assert_array_equal(np.asarray(stats["overflow"]), 0)
  assert np.all(want["remote_unique"] > 0)  # the test moves ids, not only local reads


def test_bad_ids_read_nan_and_good_ids_stay_exact():
  mesh, table_axes = make_mesh((2, 2, 2, 1, 1)), ("fsdp", "sparse")
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.standard_normal((V, E)), jnp.bfloat16)
  ids = random_ids(rng, 8)
  bad = np.array([-1, -V, V, V + 3, np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int32)
  for d in range(8):
    ids[d, rng.choice(N, len(bad), replace=False)] = bad
  rows, stats = lookup_fn(mesh, table_axes, 8, flat=False)(*place(mesh, table_axes, table, ids))
  assert rows.dtype == jnp.bfloat16
  want = reference_rows(np.asarray(table, np.float32), ids)
  np.testing.assert_array_equal(np.asarray(rows, np.float32), want)  # NaN == NaN in array_equal
  assert np.isnan(np.asarray(rows, np.float32)).any(axis=-1).sum() == 8 * len(bad)
  np.testing.assert_array_equal(np.asarray(stats["unique"]), expected_stats(ids, mesh, table_axes)["unique"])


def skewed_ids(rng, rows_per_owner):
  """Shard 0 asks owner 0 for many distinct ids (overflow); the other shards ask for a few ids each."""
  ids = rng.choice(np.array([0, 1, V // 2 + 1, V - 1], np.int32), (8, N))  # <= 2 per owner
  ids[0] = rng.choice(rows_per_owner, N)
  ids[0, :3] = [V - 1, V - 2, -5]  # also a remote id past the skew and a bad one
  return ids


@pytest.mark.parametrize("table_axes", [("sparse",), ("fsdp", "sparse")], ids=lambda a: "_".join(a))
def test_overflow_takes_the_fallback_and_stays_exact(table_axes):
  mesh = make_mesh((2, 2, 2, 1, 1))
  rng = np.random.default_rng(2)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = skewed_ids(rng, V // table_shards(mesh, table_axes))
  rows, stats = lookup_fn(mesh, table_axes, 2)(*place(mesh, table_axes, table, ids))
  np.testing.assert_array_equal(np.asarray(rows), reference_rows(table, ids))
  # Only shard 0 overflows, yet every device must have run the fallback with it: the spill round (one
  # slot at capacity 2) is not enough, so the last-resort round runs too.
  np.testing.assert_array_equal(np.asarray(stats["overflow"]), 1)
  np.testing.assert_array_equal(np.asarray(stats["spill"]), 1)
  np.testing.assert_array_equal(np.asarray(stats["second"]), 1)
  np.testing.assert_array_equal(np.asarray(stats["last_resort"]), 1)
  want = expected_stats(ids, mesh, table_axes)
  assert want["max_bucket"][0] > 2 and np.all(want["max_bucket"][1:] <= 2)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(stats[k]), v, err_msg=k)


@pytest.mark.parametrize("table_axes,overflow", [(("sparse",), False), (("fsdp", "sparse"), True)],
                         ids=["sparse", "fsdp_sparse-overflow"])
def test_gradient_matches_single_device(table_axes, overflow):
  mesh = make_mesh((2, 2, 2, 1, 1))
  rng = np.random.default_rng(3)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = skewed_ids(rng, V // table_shards(mesh, table_axes)) if overflow else random_ids(rng, 8)
  ids = np.where(ids < 0, 7, ids).astype(np.int32)  # a NaN row would poison the reference loss
  w = rng.standard_normal((8, N, E)).astype(np.float32)
  cap = 2 if overflow else capacity_for(list(ids), V, table_shards(mesh, table_axes))
  grad = lookup_fn(mesh, table_axes, cap, with_loss=True)(*place(mesh, table_axes, table, ids, w))
  want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * w))(jnp.asarray(table))
  assert grad.sharding.is_equivalent_to(NamedSharding(mesh, P(table_axes, None)), 2)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(want)).sum() > 0


def test_compiled_program_uses_all_to_all_and_never_gathers_the_table():
  mesh, table_axes = make_mesh((2, 2, 2, 1, 1)), ("fsdp", "sparse")
  rng = np.random.default_rng(4)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = random_ids(rng, 8)
  w = np.ones((8, N, E), np.float32)
  fwd = lookup_fn(mesh, table_axes, 4).lower(*place(mesh, table_axes, table, ids)).compile().as_text()
  bwd = lookup_fn(mesh, table_axes, 4, with_loss=True).lower(
      *place(mesh, table_axes, table, ids, w)).compile().as_text()
  for hlo in (fwd, bwd):
    assert "all-to-all" in hlo
    assert "all-gather" not in hlo
    assert "embedding_lookup" in hlo  # op_name metadata from the named scope
  assert "conditional" in fwd  # capacity 4 < N: the fallback round is compiled in


def test_errors_name_the_problem():
  mesh = make_mesh((2, 2, 2, 1, 1))

  def trace(num_rows, table_rows, uniform_axes=MESH_AXES):
    body = lambda t, i: sharded_lookup(t, i[0], axes="sparse", num_rows=num_rows, capacity=4,
                                       uniform_axes=uniform_axes)[0][None]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("sparse", None), P(DATA_AXES, None)),
                      out_specs=P(DATA_AXES, None, None), check_vma=True)
    jax.eval_shape(f, jax.ShapeDtypeStruct((table_rows, E), jnp.float32),
                   jax.ShapeDtypeStruct((8, N), jnp.int32))

  with pytest.raises(ValueError, match="not divisible"):
    trace(63, 64)
  with pytest.raises(ValueError, match="expected"):
    trace(32, 64)
  with pytest.raises(ValueError, match="missing"):
    trace(64, 64, uniform_axes=("replica",))


def test_capacity_for_hand_made_case():
  # 16 rows over 4 shards: owner = id // 4.
  shard_a = np.array([0, 1, 1, 2, 3, 3, 5, 17, -1])  # owner 0: {0,1,2,3} = 4; 17 and -1 are never sent
  shard_b = np.array([[4, 5], [6, 7]])  # owner 1: 4
  shard_c = np.array([8, 12])
  assert capacity_for([shard_a, shard_b, shard_c], 16, 4, slack=1.0, multiple=1) == 4
  assert capacity_for([shard_a, shard_b, shard_c], 16, 4, slack=1.1, multiple=1) == 5
  assert capacity_for([shard_a, shard_b, shard_c], 16, 4) == 8
  assert capacity_for([shard_c], 16, 4, slack=1.0, multiple=1) == 1
  assert capacity_for([np.array([-3, 99])], 16, 4, multiple=1) == 1
  assert capacity_for([np.arange(10)], 40, 1, slack=1.1, multiple=1) == 11
  assert capacity_for([np.arange(10)], 40, 1, slack=1.1, multiple=4) == 12
  with pytest.raises(ValueError, match="divisible"):
    capacity_for([shard_a], 15, 4)


def test_ideal_bytes_counts_ids_out_and_rows_back():
  assert ideal_bytes(10, 8) == 10 * (4 + 32)
  assert ideal_bytes(3, 16, id_bytes=4, row_bytes_per_elem=2) == 3 * (4 + 32)
  np.testing.assert_array_equal(ideal_bytes(jnp.array([0, 2], jnp.int32), 4), [0, 40])


def test_small_overflow_takes_only_the_spill_round():
  mesh = make_mesh((2, 2, 2, 1, 1))
  rng = np.random.default_rng(5)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = rng.choice(np.array([0, 1, V // 2 + 1, V - 1], np.int32), (8, N))  # <= 2 per owner
  ids[5] = 0
  ids[5, :9] = np.arange(9) + 2  # ids 0, 2..10: 10 distinct for owner 0 = capacity 8 + 2 spill slots
  rows, stats = lookup_fn(mesh, ("sparse",), 8, spill_fraction=0.25)(*place(mesh, ("sparse",), table, ids))
  np.testing.assert_array_equal(np.asarray(rows), reference_rows(table, ids))
  assert expected_stats(ids, mesh, ("sparse",))["max_bucket"].max() == 10
  np.testing.assert_array_equal(np.asarray(stats["spill"]), 1)
  np.testing.assert_array_equal(np.asarray(stats["second"]), 0)
  np.testing.assert_array_equal(np.asarray(stats["last_resort"]), 0)


def test_every_slot_in_use_reads_every_row_exactly():
  """Capacity 1 and one data shard asking for ids that all live on one owner: round 1, the spill and the
  second round take one id each and the last-resort round exactly the rest, every slot filled (a last-resort
  round one slot short would leave a row silently zero)."""
  mesh = make_mesh((2, 2, 2, 1, 1))
  rng = np.random.default_rng(7)
  table = rng.standard_normal((V, E)).astype(np.float32)
  n = 16
  ids = rng.integers(0, V, (num_data_shards(mesh), n)).astype(np.int32)
  ids[0] = rng.choice(V // 2, n, replace=False)  # distinct, all owned by shard 0 of `sparse`
  rows, stats = lookup_fn(mesh, ("sparse",), 1)(*place(mesh, ("sparse",), table, ids))
  np.testing.assert_array_equal(np.asarray(rows), reference_rows(table, ids))
  for key in ("spill", "second", "last_resort"):
    np.testing.assert_array_equal(np.asarray(stats[key]), 1, err_msg=key)


def test_by_source_keeps_each_source_s_rows_together_whatever_round_carried_them():
  """Round 1 carried 2 slots per source, the spill 1: an owner then adds a row's parts in source order."""
  first = jnp.array([10, 11, 20, 21])     # [source 0: 10, 11 | source 1: 20, 21]
  spill = jnp.array([12, 22])             # [source 0: 12 | source 1: 22]
  assert sparse.by_source([first, spill], 2).tolist() == [10, 11, 12, 20, 21, 22]
  rows = sparse.by_source([first[:, None] * jnp.ones((1, 3)), spill[:, None] * jnp.ones((1, 3))], 2)
  assert rows.shape == (6, 3) and rows[:, 0].tolist() == [10, 11, 12, 20, 21, 22]
