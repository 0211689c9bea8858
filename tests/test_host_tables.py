"""Host tables (gem_jax/run/host_tables.py): the slot policy of one cache, the batch's ids rewritten to slots,
and training with tables in host memory bit for bit equal to training with them on the device, through
evictions, on one device and on a mesh where the tables' rows are sharded, through a checkpoint taken with
one cache size and restored with another, in evaluation, and through the multi-process fault drill."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from gem_jax.data.spec import ads_feature_spec
from gem_jax.run import host_tables
from gem_jax.run.build import build
from gem_jax.run.host_tables import CacheTooSmall, RowCache
from gem_jax.train import jobs
from gem_jax.train.checkpoint import Checkpointer, fingerprint
from tests import run_helpers

HOST = 'train.host_tables=["ad_id","user_id"]'
ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("GEM_JAX_HOST_TABLE_STEPS", "8"))  # 50: the acceptance run


# ---- one cache's slots ------------------------------------------------------------------------------------

def test_empty_slots_fill_first_then_lru_gives_up_the_slot_read_longest_ago():
  c = RowCache(num_rows=100, slots=4, policy="lru")
  slots, fill_slots, fill_rows, evicted = c.plan(np.array([10, 20, 30]))
  assert sorted(fill_rows) == [10, 20, 30] and list(evicted) == [-1, -1, -1]
  c.unpin(slots)
  s2, _, _, _ = c.plan(np.array([20, 30]))   # 20 and 30 read again: 10 is the oldest
  c.unpin(s2)
  s3, f3, r3, e3 = c.plan(np.array([20, 40, 50]))
  assert list(r3) == [40, 50]
  assert set(e3) == {-1, 10}                  # the empty slot first, then the least recently read row
  assert c.slot_of[30] >= 0 and c.slot_of[10] == -1 and c.row_at[c.slot_of[40]] == 40
  assert (c.row_at[s3] == [20, 40, 50]).all()
  assert c.hits == 3 and c.misses == 5 and c.evictions == 1


def test_lfu_gives_up_the_row_read_in_the_fewest_batches():
  c = RowCache(num_rows=100, slots=3, policy="lfu")
  for rows in ([1, 2, 3], [1, 2], [1], [2, 3]):
    c.unpin(c.plan(np.array(rows))[0])
  # reads: 1 three times, 2 three times, 3 twice; 3 was read last, which LRU would keep, LFU does not
  _, _, rows, evicted = c.plan(np.array([7]))
  assert list(rows) == [7] and list(evicted) == [3]


def test_a_slot_a_staged_batch_reads_is_never_given_up_and_a_batch_too_big_names_the_numbers():
  c = RowCache(num_rows=100, slots=4, policy="lru")
  staged, _, _, _ = c.plan(np.array([1, 2, 3]))
  _, _, _, evicted = c.plan(np.array([4]))    # 1..3 pinned by the staged batch: only the empty slot
  assert list(evicted) == [-1]
  with pytest.raises(CacheTooSmall, match="2 rows missed and only 0 of 4 slots are free"):
    c.plan(np.array([5, 6]))
  c.unpin(staged)
  _, _, rows, evicted = c.plan(np.array([5, 6]))
  assert set(evicted) <= {1, 2, 3} and len(evicted) == 2


def _cache_state(c: RowCache):
  arrays = [c.slot_of, c.row_at, c.last_read, c.pins] + ([c.reads] if c.reads is not None else [])
  return [a.copy() for a in arrays], (c.clock, c.hits, c.misses, c.evictions)


def _same_cache_state(a, b) -> bool:
  return all((x == y).all() for x, y in zip(a[0], b[0])) and a[1] == b[1]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_plan_taken_back_leaves_the_cache_as_it_was_and_a_failed_one_changes_nothing(policy):
  c, twin = RowCache(num_rows=100, slots=4, policy=policy), RowCache(num_rows=100, slots=4, policy=policy)
  for rows in ([1, 2, 3], [2, 4], [5, 1]):
    for cache in (c, twin):
      cache.unpin(cache.plan(np.array(rows))[0])
  before = _cache_state(c)
  _, _, filled, evicted = c.plan(np.array([1, 7, 8]))   # two misses, each evicting a row
  assert list(filled) == [7, 8] and (evicted >= 0).all()
  c.rollback()
  assert _same_cache_state(_cache_state(c), before)
  got, want = c.plan(np.array([9, 2])), twin.plan(np.array([9, 2]))
  assert [list(x) for x in got] == [list(x) for x in want]
  c.unpin(got[0])
  staged = c.plan(np.array([10, 11, 12, 13]))[0]
  before = _cache_state(c)
  with pytest.raises(CacheTooSmall):
    c.plan(np.array([14]))
  assert _same_cache_state(_cache_state(c), before)
  c.unpin(staged)


def test_a_table_whose_second_owner_shard_does_not_fit_takes_back_the_first_ones_plan():
  """Owner 0 fits (filling and evicting), owner 1 does not: owner 0's cache is as before, and the pending
  row-0 fill still goes out with the next plan that fits."""
  from gem_jax.run.host_tables import HostTable
  table = HostTable("t", [np.zeros((200, 2), np.float32)], owners=2, slots_per_owner=3, policy="lru")
  table.unpin(table.plan(np.array([1, 2, 101]))[2])
  before = [_cache_state(c) for c in table.caches]
  with pytest.raises(CacheTooSmall, match="host table 't', owner shard 1"):
    table.plan(np.array([3, 4, 102, 103, 104, 105]))
  assert all(_same_cache_state(_cache_state(c), b) for c, b in zip(table.caches, before))
  _, fill, _ = table.plan(np.array([3, 102]))
  assert 0 not in fill.rows                       # row 0 went out with the first plan
  fresh = HostTable("t", [np.zeros((200, 2), np.float32)], owners=2, slots_per_owner=3, policy="lru")
  with pytest.raises(CacheTooSmall):
    fresh.plan(np.array([1, 101, 102, 103, 104]))
  assert 0 in fresh.plan(np.array([1]))[1].rows   # a failed first plan leaves row 0's fill pending


# ---- a run's batches ----------------------------------------------------------------------------------------

def _config(*sets, ads: int = 100_000, one_layer: bool = True):
  """tiny with tables of 100,000 users and `ads` ads, so that 1% of either holds a batch's distinct rows. One GEM
  layer by default: caches, evictions and write-backs are the same at any depth, and each distinct config here
  is a compile of its own. The comparisons with device tables at these sizes keep two: bit for bit needs both
  programs compiled alike, and at the suite's optimization level one-layer tiny with these 100,000-row tables
  behind a 1% cache rounds some dense gradients differently (README, host tables; on cpu_8 since the attention
  became a custom call, while XLA's default flags give the same bits with one layer)."""
  cfg = run_helpers.tiny(*(run_helpers.ONE_LAYER if one_layer else ()), *sets)
  spec = ads_feature_spec(users=100_000, ads=ads, advertisers=100, categories=20, embed_dim=16, max_history=32,
                          max_interests=4, num_domains=2)
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=spec))


def test_a_batch_reads_the_cache_slots_of_the_rows_it_read_before():
  run = build(_config(HOST, "train.host_cache_fraction=0.01"))
  host_batch = run.source.first_batch()
  sharded = run.shard(host_batch)
  remapped = run.tables.remap(sharded)
  ad = run.tables.tables["ad_id"]
  valid = np.arange(sharded.history.values.shape[1])[None, :] < np.asarray(sharded.history.offsets)[:, -1:]
  item = np.asarray(sharded.history.values)[..., 0]
  slot = np.asarray(remapped.history.values)[..., 0]
  assert (ad.caches[0].row_at[slot[valid]] == item[valid]).all()
  assert (slot[~valid] == 0).all()               # padding: slot 0 (the model masks it to id 0)
  assert (np.asarray(remapped.history.values)[..., 1:] == np.asarray(sharded.history.values)[..., 1:]).all()
  cand = run.tables.tables["ad_id"].caches[0].row_at[np.asarray(remapped.sparse["ad_id"])]
  assert (cand == np.asarray(sharded.sparse["ad_id"])).all()
  fill = run.tables.staged[0].fills["ad_id"]
  # and row 0, held in slot 0 for the padding (HostTable._hold_row_zero)
  assert sorted(fill.rows) == sorted(set(item[valid]) | set(np.asarray(sharded.sparse["ad_id"]).ravel()) | {0})
  assert fill.slots[0] == 0 and fill.rows[0] == 0
  assert (fill.evicted == -1).all()


def _train(cfg, steps: int = STEPS):
  """(run, the final state with host tables whole, losses) of `steps` train steps fed one by one."""
  run = build(cfg)
  it, state, losses = run.train_iterator(), run.state, []
  for _ in range(steps):
    batch, _ = run.feed(next(it))
    state, metrics = run.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  return run, run.whole(state), losses


def _leaves(state) -> list[np.ndarray]:
  plain = jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, state)
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(plain))]


def _assert_same(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for i, (x, y) in enumerate(zip(la, lb)):
    assert x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y), f"leaf {i} differs"


@pytest.fixture(scope="module")
def on_device():
  return _train(_config(one_layer=False))


# A cache that turns over (0.01) and one that holds the whole table (1.0); GEM_JAX_HOST_TABLE_FULL=1 adds a
# partial cache that never evicts.
ONE_DEVICE_FRACTIONS = ["0.01", "0.1", "1.0"] if os.environ.get("GEM_JAX_HOST_TABLE_FULL") else ["0.01", "1.0"]


@pytest.mark.parametrize("fraction", ONE_DEVICE_FRACTIONS)
def test_host_tables_train_what_device_tables_train_on_one_device(on_device, fraction):
  _, want, want_losses = on_device
  run, got, losses = _train(_config(HOST, f"train.host_cache_fraction={fraction}", one_layer=False))
  assert losses == want_losses
  _assert_same(want, got)
  ad = run.tables.stats()["tables"]["ad_id"]
  assert ad["cache_rows"] == int(float(fraction) * 100_000)
  if fraction == "0.01":
    assert ad["evictions"] > 0   # the cache turned over: write-backs were exercised


MESH_FRACTIONS = ["0.01", "0.1", "1.0"] if os.environ.get("GEM_JAX_HOST_TABLE_FULL") else ["0.01"]


@pytest.fixture(scope="module")
def on_device_cpu_8():
  return _train(_config("mesh=meshes/cpu_8.yaml", one_layer=False))


@pytest.mark.parametrize("fraction", MESH_FRACTIONS)
def test_host_tables_train_what_device_tables_train_on_a_row_sharded_mesh(on_device_cpu_8, fraction):
  _, want, want_losses = on_device_cpu_8
  run, got, losses = _train(_config("mesh=meshes/cpu_8.yaml", HOST, f"train.host_cache_fraction={fraction}",
                                    one_layer=False))
  ad = run.tables.tables["ad_id"]
  assert ad.owners > 1 and run.plan.table_axes["ad_id"]
  if fraction == "0.01":
    assert ad.stats()["evictions"] > 0
  assert losses == want_losses
  _assert_same(want, got)


def test_a_cache_no_larger_than_a_step_s_ids_rounds_like_the_whole_table():
  """tiny's own tables behind 20% caches (400 ad rows, fewer than a step reads on one device): the cache
  takes the whole table's path and merges in arrays of the whole table's sizes (table_update.Layout.whole_rows),
  since XLA:CPU rounds a row's reduction differently in arrays of different lengths. On cpu_8: the next test."""
  _, want, want_losses = _train(run_helpers.tiny(*run_helpers.ONE_LAYER))
  run, got, losses = _train(run_helpers.tiny(*run_helpers.ONE_LAYER, HOST, "train.host_cache_fraction=0.2"))
  assert run.tables.tables["ad_id"].stats()["evictions"] > 0
  assert losses == want_losses
  _assert_same(want, got)


@pytest.mark.slow
def test_on_cpu_8_a_cache_no_larger_than_a_step_s_ids_rounds_like_the_whole_table(tiny_cpu8_run):
  """As above on cpu_8, where an owner's cache block is 200 rows and the whole table's 1000; the device-table
  run is the session's tiny_cpu8_run (the trainer's: its logged losses and its checkpoint of the last step)."""
  cfg, ref_dir, _ = tiny_cpu8_run
  steps = cfg.train.steps
  run, got, losses = _train(run_helpers.tiny_cpu8_config(HOST, "train.host_cache_fraction=0.2"), steps)
  assert run.tables.tables["ad_id"].stats()["evictions"] > 0
  logged = {r["step"]: r["loss"] for r in map(json.loads, open(ref_dir / "metrics.jsonl")) if "loss" in r}
  assert losses == [logged[s] for s in range(1, steps + 1)]
  target = build(cfg, abstract=True).restore_target()
  with Checkpointer(os.path.join(ref_dir, "checkpoints"), keep=3, save_every=cfg.train.checkpoint_every) as ckpt:
    step, want, _ = ckpt.restore(steps, abstract_state=target)
  assert step == steps
  _assert_same(want, got)


def test_an_evaluation_compiles_one_eval_program_however_its_batches_rows_spread(monkeypatch):
  """Each eval batch reads its own number of distinct rows; the packed tables of every batch of one
  evaluation have one size per table (the largest batch's bucket), so the eval step is traced once."""
  from gem_jax.run import tasks
  from gem_jax.train import trainer
  run = build(_config(HOST, "train.host_cache_fraction=0.01", "train.eval_examples=512"))
  whole, batches = run.whole_params(run.state.params), run.eval_batches("eval")
  shapes = lambda views: {tuple(x.shape for x in jax.tree_util.tree_leaves(p)) for p, _ in views}
  alone = set().union(*(shapes(run.tables.eval_views(whole, [b])) for b in batches))
  assert len(alone) > 1   # packed one batch at a time, the batches' tables would differ in size
  assert len(shapes(run.tables.eval_views(whole, batches))) == 1
  traces, original = [], tasks.AdsMultiTask.predict
  monkeypatch.setattr(tasks.AdsMultiTask, "predict", lambda self, *a: (traces.append(1), original(self, *a))[1])
  trainer.evaluate(run, whole, "eval")
  assert len(traces) == 1


@pytest.mark.slow
def test_a_checkpoint_from_one_cache_size_resumes_with_another_and_evaluations_match(tmp_path):
  sets = ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=4", "train.eval_examples=256",
          "train.log_every=1", "train.warmup_steps=1"]
  want = jobs.train_config(_config(*sets, one_layer=False), str(tmp_path / "device"), progress=False, report=False)
  jobs.train_config(_config(*sets, HOST, "train.host_cache_fraction=0.1", one_layer=False), str(tmp_path / "host"),
                    progress=False, report=False, stop_after=4)
  got = jobs.train_config(_config(*sets, HOST, "train.host_cache_fraction=0.01", one_layer=False),
                          str(tmp_path / "host"), progress=False, report=False, resume=True)
  assert got["evaluations"] == want["evaluations"] and got["tasks"] == want["tasks"]
  # A host-table checkpoint holds the tables whole, as a device-table run's does: one restore target for both.
  target = build(_config(*sets, one_layer=False), abstract=True).abstract_state()
  prints = []
  for name in ("device", "host"):
    with Checkpointer(os.path.join(tmp_path, name, "checkpoints"), keep=3, save_every=4) as ckpt:
      _, state, _ = ckpt.restore(8, abstract_state=target)
    prints.append(fingerprint(state))
  assert np.array_equal(prints[0], prints[1])


def test_with_parameter_averaging_best_keeps_the_dense_average_and_the_whole_host_tables(tmp_path):
  """train.ema_decay with host tables: a selecting evaluation keeps (best/) the average of every dense
  parameter and each host table whole, as written back from its cache; the last checkpoint's state is the
  same train state, so the kept tree is its `averaged` parameters, leaf for leaf."""
  from gem_jax.run.optim import Optimizer
  sets = ["train.steps=4", "train.checkpoint_every=4", "train.eval_every=4", "train.eval_examples=128",
          "train.warmup_steps=1", "train.ema_decay=0.5", "train.select_metric=click/ne"]
  summary = jobs.train_config(_config(*sets, HOST, "train.host_cache_fraction=0.01"), str(tmp_path),
                              progress=False, report=False)
  assert summary["selected"]["step"] == 4
  target = build(_config(*sets), abstract=True).restore_target()   # tables whole, as both folders hold them
  with Checkpointer(str(tmp_path / "checkpoints"), keep=1, save_every=4) as ckpt:
    _, state, _ = ckpt.restore(4, abstract_state=target)
  with Checkpointer(str(tmp_path / "best"), keep=1, save_every=1) as ckpt:
    _, kept, _ = ckpt.restore(4, abstract_state=target.params)
  want = Optimizer.averaged(state.params, state.opt_state)
  flat = lambda tree: jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))
  averaged = 0
  for (path, k), (_, w), (_, p) in zip(flat(kept), flat(want), flat(state.params), strict=True):
    np.testing.assert_array_equal(k, w, err_msg=jax.tree_util.keystr(path))
    averaged += not np.array_equal(w, p)
  assert averaged > 10   # the dense leaves are the average; the tables are the state's own rows


def test_a_write_back_before_the_first_batch_keeps_row_zero():
  """Slot 0 is row 0's from the start but holds row 0's values only once the first plan's fill went out:
  whole tables taken before any batch (a fresh run, or one restored and evaluated before training on) keep
  row 0 and its optimizer state, instead of the empty slot's zeros."""
  run = build(_config(HOST))
  stores = run.tables.tables["ad_id"].store
  want = [np.array(s[0]) for s in stores]
  assert np.any(want[0] != 0)
  run.whole(run.state)
  for w, s in zip(want, stores, strict=True):
    np.testing.assert_array_equal(s[0], w)


@pytest.mark.slow
def test_the_multi_process_fault_drill_resumes_host_tables_bit_for_bit(tmp_path):
  """experiments/fault_drill.py --processes 2 on cpu_2 (each process owns half of every table's rows) with
  ad_id and user_id in host memory behind 20% caches (ad_id evicts from the first steps): process 0 (the
  coordinator) killed at step 7, after checkpoint 4 was committed; process 1 is ended at once (grace 0), the
  group restarts from checkpoint 4 (the host tables' stores restored from it), and the resumed run is bit for
  bit the unbroken one, which is one process holding both devices (`--reference one`: one compile where a
  group start costs two, and so the group also trains exactly what one process trains). One kill keeps the
  test to two group starts, and one GEM layer each start's compile short; the kinds of kill point are the
  single-process drill's (tests/test_fault_tolerance.py), and `--kills 3` on this mesh is the command in the
  README."""
  out = tmp_path / "drill.json"
  cmd = [sys.executable, "experiments/fault_drill.py", "--processes", "2", "--mesh", "meshes/cpu_2.yaml", "--kills",
         "1", "--steps", "8", "--seed", "0", "--grace", "0", "--set", "train.host_tables=user_id,ad_id", "--set",
         "train.host_cache_fraction=0.2", "--set", "train.eval_examples=64", "--set", "model.num_layers=1", "--set",
         "model.hstu.keep_last=[32]", "--reference", "one", "--timeout",
         "300", "--out", str(out), "--workdir", str(tmp_path / "runs")]
  proc = subprocess.run(cmd, cwd=ROOT, env=run_helpers.child_env(), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  drill = json.loads(out.read_text())
  assert drill["identical"] and drill["losses_identical"] and drill["state_identical"] and drill["eval_identical"]
  assert drill["processes"] == 2 and drill["reference_processes"] == 1
  assert drill["steps_compared"] == 8 and drill["leaves_compared"] > 100
  kills = drill["kills"]
  assert [(k["kind"], k["step"], k["process"]) for k in kills] == [("step", 7, 0)]
  assert kills[0]["resumed_from"] == 4 and kills[0]["checkpoints_on_disk"] == [4]
  assert all(set(k["other_processes"]) == {str(1 - k["process"])} for k in kills)


# ---- what is refused --------------------------------------------------------------------------------------

def test_a_table_the_spec_lacks_and_a_task_that_reads_tables_whole_are_refused():
  with pytest.raises(ValueError, match=r"names \['ads'\], which the feature spec has no table of"):
    build(run_helpers.tiny('train.host_tables=["ads"]'), abstract=True)
  with pytest.raises(ValueError, match="must be 'lru' or 'lfu'"):
    run_helpers.tiny("train.host_cache_policy=fifo")
  with pytest.raises(ValueError, match="need train.embedding_update=sparse"):
    build(run_helpers.tiny('train.host_tables=["ad_id"]', "train.embedding_update=dense"), abstract=True)


def test_a_task_that_reads_a_table_whole_refuses_host_tables(tmp_path):
  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from tests.data_helpers import toy_u_data
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [f"data.data_dir={toy_u_data(tmp_path)}",
                                                                 'train.host_tables=["item"]'])
  with pytest.raises(ValueError, match="host tables need the ads task .* NextItem"):
    build(cfg, abstract=True)


def test_tables_larger_than_the_host_are_refused_before_anything_is_allocated():
  cfg = _config(HOST)
  need = host_tables.host_bytes(cfg, cfg.data.spec)
  assert need == {"ad_id": 100_000 * (16 * 4 + 4), "user_id": 100_000 * (16 * 4 + 4)}   # rows + Adagrad's sums
  host_tables.check_host_memory(cfg, cfg.data.spec, available=sum(need.values()))
  with pytest.raises(ValueError, match=r"need 0.01 GiB of host memory \(ad_id 0.01 GiB, user_id 0.01 GiB"):
    host_tables.check_host_memory(cfg, cfg.data.spec, available=sum(need.values()) - 1)


def test_a_cache_too_small_for_one_batch_says_which_table_and_how_many_rows():
  run = build(_config('train.host_tables=["user_id","ad_id"]', "train.host_cache_rows=64"))
  assert list(run.tables.tables) == ["user_id", "ad_id"]   # user_id's plan fits, then ad_id's fails
  before = {name: [_cache_state(c) for c in t.caches] for name, t in run.tables.tables.items()}
  with pytest.raises(CacheTooSmall, match=r"host table 'ad_id', owner shard 0: \d+ rows missed and only 63 of 64"):
    run.feed(run.source.first_batch())
  pins = run.tables.tables["ad_id"].caches[0].pins
  assert not run.tables.staged and pins[0] == 1 and pins.sum() == 1   # only row 0's hold
  for name, t in run.tables.tables.items():   # every table's plan taken back, its row-0 fill still pending
    assert all(_same_cache_state(_cache_state(c), b) for c, b in zip(t.caches, before[name])), name
    assert t._row_zero is not None, name


def test_the_compiled_step_holds_the_cache_not_the_table():
  run = build(_config(HOST, "train.host_cache_fraction=0.01", ads=400_000))
  table = run.tables.tables["ad_id"].store[0]
  batch, _ = run.feed(run.source.first_batch())
  memory = run.train_step.lower(run.state, batch).compile().memory_analysis()
  assert table.nbytes >= 10 * memory.argument_size_in_bytes, (table.nbytes, memory.argument_size_in_bytes)
  assert host_tables.host_leaves(run.state, ["ad_id"])["ad_id"][0].shape == (4_000, 16)


def test_the_bench_hit_rate_is_hits_over_distinct_rows_and_none_when_a_batch_does_not_fit():
  from gem_jax.bench import cache
  same = [np.array([1, 2, 3, 3])] * 8
  assert cache.hit_rate(same, rows=10, fraction=0.5, policy="lru") == 1.0   # every row cached after step 1
  assert cache.hit_rate(same, rows=10, fraction=0.2, policy="lru") is None  # 2 slots, 3 distinct rows
  alternating = [np.array([1, 2]), np.array([3, 4])] * 4
  assert cache.hit_rate(alternating, rows=10, fraction=0.2, policy="lru") == 0.0
  assert cache.hit_rate(alternating, rows=10, fraction=0.4, policy="lfu") == 1.0
