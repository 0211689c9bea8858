"""The sparse embedding engine (gem_jax/run/table_update.py) against the dense path, its row rules
(gem_jax/run/table_optim.py), and the owner exchange of row gradients (parallel/sparse.send_to_owners)."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gem_jax.config import TrainConfig, apply_overrides
from gem_jax.parallel import mesh as mesh_lib, sparse
from gem_jax.run import table_optim, table_update
from gem_jax.run.build import build
from tests.run_helpers import ONE_LAYER, tiny


def _grown(cfg, table: str, rows: int):
  """`cfg` with `table` given `rows` rows (the stream still draws ids from the original vocabulary, so the
  rows past it are never looked up)."""
  spec = cfg.data.spec
  spec = dataclasses.replace(spec, tables=tuple(dataclasses.replace(t, vocab_size=rows) if t.name == table else t
                                                for t in spec.tables))
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=spec))


def _train(cfg, steps, keep_first=False):
  run = build(cfg)
  it = run.source.train_iterator()
  state, losses, first = run.state, [], None
  for _ in range(steps):
    state, m = run.train_step(state, run.device_batch(next(it)))
    losses.append(float(m["loss"]))
    if keep_first and first is None:
      first = jax.device_get(state.params)  # the next step donates the state
  return (run, state, losses, m, first) if keep_first else (run, state, losses, m)


def _leaves(state):
  return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state))]


@pytest.mark.slow
def test_sparse_engine_matches_the_dense_path_on_one_device():
  """Same batches, same seed: every loss within 1e-6 relative over 20 steps, and the final parameters within
  1e-6 relative as one vector. After one step the parameters agree to a float32 rounding of a row (the two
  paths add a row's gradients in different orders); after 20 steps, with AdamW's normalisation amplifying
  such roundings, each leaf to 1e-5 of its largest entry."""
  runs = {mode: _train(tiny(**{"train.embedding_update": mode}), 20, keep_first=True) for mode in ("dense", "sparse")}
  (_, dense, dense_losses, dm, dense_1), (_, sparse_state, sparse_losses, sm, sparse_1) = runs["dense"], runs["sparse"]
  rel = [abs(a - b) / abs(a) for a, b in zip(dense_losses, sparse_losses)]
  assert max(rel) <= 1e-6, rel
  assert float(sm["grad_norm"]) == pytest.approx(float(dm["grad_norm"]), rel=1e-5)
  pairs = list(zip(_leaves(dense.params), _leaves(sparse_state.params)))
  for (path, a), (_, b) in pairs:
    assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(a)))), path
  # The whole parameter vector (tables included) within 1e-6 relative: 4.1e-7 at the suite's XLA flags,
  # 3.1e-7 at XLA's defaults, where the dense path against itself compiled with the suite's flags differs
  # by 8.1e-7 (a few small bias leaves move by 1-5e-6 of their norm in both comparisons).
  diff = sum(float(np.sum(np.square(a.astype(np.float64) - b))) for (_, a), (_, b) in pairs)
  norm = sum(float(np.sum(np.square(a.astype(np.float64)))) for (_, a), _ in pairs)
  assert np.sqrt(diff / norm) <= 1e-6, np.sqrt(diff / norm)
  for (path, a), (_, b) in zip(_leaves(dense.opt_state), _leaves(sparse_state.opt_state)):
    assert a.shape == b.shape and a.dtype == b.dtype, path
    assert np.max(np.abs(a.astype(np.float64) - b), initial=0.0) <= 1e-5 * max(1.0, float(np.max(np.abs(a), initial=0))), path
  # One step: a float32 rounding of a row at most.
  for (path, a), (_, b) in zip(_leaves(dense_1), _leaves(sparse_1)):
    assert np.max(np.abs(a - b)) <= 4 * np.finfo(np.float32).eps * max(1.0, float(np.max(np.abs(a)))), path


def test_rows_no_batch_reads_stay_bit_identical_with_their_accumulators():
  """A user_id table of 20,000 rows and 10 batches of 32 examples (one GEM layer): every row no batch read, and
  its accumulator, ends exactly as initialised; the rows that were read moved and gained accumulator."""
  run = build(_grown(tiny(*ONE_LAYER, **{"train.embedding_update": "sparse"}), "user_id", 20_000))
  before = np.asarray(run.state.params["embeddings"]["tables"]["user_id"].get_value()).copy()
  it = run.source.train_iterator()
  state, seen = run.state, set()
  for _ in range(10):
    batch = next(it)
    seen.update(np.asarray(batch.sparse["user_id"]).reshape(-1).tolist())
    state, m = run.train_step(state, run.device_batch(batch))
  assert int(m["nonfinite"]) == 0
  after = np.asarray(state.params["embeddings"]["tables"]["user_id"].get_value())
  acc = np.asarray(run.optimizer.table_state(state.opt_state).slots[0]["embeddings"]["tables"]["user_id"].get_value())
  unread = np.setdiff1d(np.arange(20_000), np.fromiter(seen, np.int64))
  assert unread.size > 15_000
  assert after[unread].tobytes() == before[unread].tobytes()
  assert acc[unread].tobytes() == np.zeros_like(acc[unread]).tobytes()
  read = np.fromiter(seen, np.int64)
  moved = np.any(after[read] != before[read], axis=1)
  assert moved.mean() > 0.9 and np.all(acc[read][moved] > 0)


def _compiled(cfg):
  run = build(cfg)
  batch = run.device_batch(next(run.source.train_iterator()))
  return run.train_step.lower(run.state, batch).compile()


def test_the_sparse_step_holds_nothing_table_sized_but_the_tables_and_their_state():
  """XLA's temporary memory of the sparse step does not grow with V (200x tiny's 1,000 user rows: within
  1.1x), while the dense step's does; and no op of the sparse step but the in-place row writes produces a
  V x E array. (One-layer tiny's own step: other tests compile the same program, which the session cache
  serves.)"""
  temps, texts = {}, {}
  for mode, rows in (("sparse", 1_000), ("sparse", 200_003), ("dense", 200_003)):
    c = _compiled(_grown(tiny(*ONE_LAYER, **{"train.embedding_update": mode}), "user_id", rows))
    temps[mode, rows] = c.memory_analysis().temp_size_in_bytes
    texts[mode, rows] = c.as_text()
  assert temps["sparse", 200_003] <= 1.1 * temps["sparse", 1_000], temps
  assert temps["dense", 200_003] > 200_003 * 16 * 4, temps     # the dense path holds a V x E gradient
  big = re.compile(r"=\s*f32\[200003,16\]\{[^}]*\}\s+([a-z\-]+)\(")
  allowed = {"parameter", "get-tuple-element", "tuple", "while", "dynamic-update-slice", "fusion", "copy", "bitcast"}
  ops = [m.group(1) for m in map(big.search, texts["sparse", 200_003].splitlines()) if m]
  assert ops and set(ops) <= allowed, sorted(set(ops) - allowed)
  # Every table-sized fusion of the sparse step writes rows in place (a dynamic-update-slice inside).
  fusions = [l for l in texts["sparse", 200_003].splitlines() if big.search(l) and big.search(l).group(1) == "fusion"]
  assert all("dynamic-update-slice" in l for l in fusions), fusions[:3]
  dense_ops = {m.group(1) for m in map(big.search, texts["dense", 200_003].splitlines()) if m}
  assert dense_ops - allowed, dense_ops  # the check sees the dense gradient's ops


def test_on_one_device_a_table_with_no_more_rows_than_ids_skips_the_sort():
  """The size rule (table_update.dense_rows): on one device a table of V <= N rows (N: the ids its lookups
  read in a step) is updated from its scatter-added V x E gradient, so its update scope holds no sort; a
  larger table deduplicates its ids with one. tiny has tables on both sides of the rule."""
  run = build(tiny(**{"train.embedding_update": "sparse"}))
  batch = run.device_batch(next(run.source.train_iterator()))
  local = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
  ids: dict[str, int] = {}
  for call in run.lookups.calls(local):
    ids[call.table] = ids.get(call.table, 0) + call.ids
  rows = {t.name: t.vocab_size for t in run.cfg.data.spec.tables}
  dense = {t for t in ids if table_update.dense_rows(rows[t], ids[t])}
  assert dense and set(ids) - dense, (rows, ids)
  text = run.train_step.lower(run.state, batch).compile().as_text()
  sorts = {t for t in ids if re.search(rf"sort\(.*op_name=\"[^\"]*table={t}/", text)}
  assert sorts == set(ids) - dense, (sorts, dense)


@pytest.mark.parametrize("name", table_optim.RULES)
def test_a_row_rule_on_touched_rows_equals_its_dense_form(name):
  """apply_rows on the touched rows gives bit for bit what the rule's optax form gives on the V x E
  gradient, for several steps; rows with a zero gradient keep their values and slots exactly."""
  cfg = TrainConfig(embedding_optimizer=name, embedding_learning_rate=0.1, adagrad_eps=1e-6)
  rule = table_optim.make_rule(cfg)
  tx = rule.transformation()
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.normal(size=(12, 4)).astype(np.float32))
  dense_params, state = {"t": table}, tx.init({"t": table})
  block, slots, count = table, tuple(s["t"] for s in state.slots), jnp.int32(0)
  for step in range(4):
    g = rng.normal(size=(12, 4)).astype(np.float32)
    g[rng.choice(12, 5, replace=False)] = 0.0
    updates, state = tx.update({"t": jnp.asarray(g)}, state)
    dense_params = {"t": dense_params["t"] + updates["t"]}
    touched = np.flatnonzero(np.any(g != 0, axis=1)).astype(np.int32)
    uniq = jnp.asarray(np.concatenate([touched, np.full(12 - touched.size, 12, np.int32)]))
    g_rows = jnp.asarray(np.concatenate([g[touched], np.zeros((12 - touched.size, 4), np.float32)]))
    write = uniq < 12
    block, slots = table_update.apply_rows(rule, block, slots, uniq, g_rows, write, count)
    count = count + 1
    assert np.asarray(block).tobytes() == np.asarray(dense_params["t"]).tobytes(), (name, step)
    for s, d in zip(slots, state.slots):
      assert np.asarray(s).tobytes() == np.asarray(d["t"]).tobytes(), (name, step)
  if name == "sgd":
    assert state.slots == ()


def test_rowwise_adam_matches_a_hand_computation():
  lr, b1, b2, eps = 0.1, 0.9, 0.99, 1e-6
  rule = table_optim.RowwiseAdam(lr, b1, b2, eps)
  g = np.array([[0.5, -1.0], [2.0, 0.0]], np.float32)
  m, v = np.zeros((2, 2)), np.zeros(2)
  slots = (jnp.zeros((2, 2)), jnp.zeros(2))
  for t in range(3):
    u, slots = rule.update_rows(jnp.asarray(g), slots, jnp.int32(t))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * np.mean(g.astype(np.float64) ** 2, axis=1)
    want = -lr * (m / (1 - b1 ** (t + 1))) / (np.sqrt(v / (1 - b2 ** (t + 1)))[:, None] + eps)
    np.testing.assert_allclose(np.asarray(u), want, rtol=1e-5)


def test_sgd_moves_a_row_by_the_learning_rate_times_its_gradient():
  lr = 0.25
  g = jnp.asarray([[0.5, -1.0], [2.0, 0.0]], jnp.float32)
  u, slots = table_optim.SGD(lr).update_rows(g, (), jnp.int32(0))
  assert slots == ()
  np.testing.assert_array_equal(np.asarray(u), -lr * np.asarray(g))


@pytest.mark.parametrize("parts", [None, (2, 3)])
def test_merging_distinct_ids_keeps_every_row_and_duplicates_sum(parts):
  """Five ids, all distinct (a table much larger than the batch): five rows come out, each with its own
  gradient; a repeated id adds its rows; invalid ids (-1, >= V) contribute nothing."""
  g = jnp.asarray(np.arange(10, dtype=np.float32).reshape(5, 2) + 1.0)
  uniq, summed = table_update.merge_rows(jnp.asarray([40, 3, 17, 8, 25]), g, 100, parts)
  order = np.argsort([40, 3, 17, 8, 25])
  np.testing.assert_array_equal(np.asarray(uniq)[:5], np.sort([40, 3, 17, 8, 25]))
  np.testing.assert_array_equal(np.asarray(summed)[:5], np.asarray(g)[order])
  uniq, summed = table_update.merge_rows(jnp.asarray([7, -1, 7, 100, 2]), g, 100, parts)
  assert np.asarray(uniq)[:2].tolist() == [2, 7] and (np.asarray(uniq)[2:] == 100).all()
  np.testing.assert_array_equal(np.asarray(summed)[:2], [np.asarray(g)[4], np.asarray(g)[0] + np.asarray(g)[2]])
  assert not np.asarray(summed)[2:].any()


def test_row_gradients_reach_their_owner_through_every_round():
  """send_to_owners with capacity 1 and every id on one owner: the spill, second and last-resort rounds all
  run, and the owner receives every (id, row) exactly once, summed with nothing lost."""
  devices = np.array(jax.devices()[:4]).reshape(4)
  mesh = jax.sharding.Mesh(devices, ("sparse",))
  num_rows, n, e = 64, 12, 3
  rng = np.random.default_rng(0)
  # Every device sends 12 distinct ids, all owned by shard 1 (rows 16..31).
  ids = np.stack([np.sort(rng.choice(np.arange(16, 32), n, replace=False)) for _ in range(4)]).astype(np.int32)
  vals = rng.normal(size=(4, n, e)).astype(np.float32)

  def body(ids, vals):
    got_ids, got_rows, st = sparse.send_to_owners(ids[0], vals[0], axes="sparse", num_rows=num_rows, capacity=1,
                                                  uniform_axes=("sparse",))
    return got_ids[None], got_rows[None], st["overflow"][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("sparse"), P("sparse")),
                            out_specs=(P("sparse"), P("sparse"), P("sparse"))))
  got_ids, got_rows, overflow = map(np.asarray, f(ids, vals))
  assert overflow.max() == 1
  want = np.zeros((16, e))
  for d in range(4):
    np.add.at(want, ids[d] - 16, vals[d])
  have = np.zeros((16, e))
  keep = got_ids[1] >= 0
  np.add.at(have, got_ids[1][keep], got_rows[1][keep])
  np.testing.assert_allclose(have, want, rtol=1e-6)
  assert keep.sum() == 4 * n
  for d in (0, 2, 3):
    assert np.all(got_ids[d] == -1)


def test_the_embedding_benchmark_counts_distinct_rows_and_its_ids_are_skewed():
  from gem_jax.bench import embeddings
  rng = np.random.default_rng(0)
  flat, skewed = (np.unique(embeddings.zipf_ids(rng, 4096, 10_000, a)).size for a in (0.8, 1.2))
  assert 0 < skewed < flat <= 4096
  r = embeddings.update_rows_per_s(rows=10_000, dim=8, ids=1024, a=1.0, reps=2)
  assert r["unique_rows"] == np.unique(embeddings.zipf_ids(np.random.default_rng(0), 1024, 10_000, 1.0)).size
  assert r["median_ms"] > 0 and r["unique_rows_per_s"] == pytest.approx(r["unique_rows"] / (r["median_ms"] / 1e3))


@pytest.mark.slow
def test_a_run_traces_the_model_count_only_once_per_batch_shape(tiny_cpu8_run):
  """The session's run on cpu_8 through the trainer (conftest.py tiny_cpu8_run: 8 steps, evaluations at 4 and
  8, checkpoints, the efficiency report): the capacities at build, the sparse engine's lookup calls in every
  step trace, the meter's FLOP model and its second lowering of the step, the evaluations. Every count-only
  trace of the task (nothing runs: lookups, attention and truncations recorded) is of a batch shape not
  traced before (without LookupTrace's memo, a shape is traced twice and this fails)."""
  cfg, run_dir, _ = tiny_cpu8_run
  seen = [json.dumps(s) for s in json.loads((run_dir / "count_only_traces.json").read_text())]
  assert seen and len(seen) == len(set(seen)), [s[:80] for s in seen]
  with open(run_dir / "metrics.jsonl") as f:
    steps = [r for r in map(json.loads, f) if "loss" in r and "step" in r]
  assert len(steps) == cfg.train.steps
