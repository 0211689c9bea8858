"""What a run does when things break: non-finite steps (skip, restore, stop), kills (the fault drill),
and a checkpoint moved to another mesh (resharding restore, same evaluation)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.config import apply_overrides
from gem_jax.data.sources import SyntheticSource
from gem_jax.run.build import build
from gem_jax.train import fault_drill, jobs
from gem_jax.train.hooks import NonFiniteError
from tests.run_helpers import CPU8_SETS, ONE_LAYER, child_env, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(**overrides):
  """12 steps of one-layer tiny (the guard and the restores do not depend on the model's depth)."""
  return tiny(*ONE_LAYER, **{"train.warmup_steps": 1, "train.steps": 12, "train.log_every": 1,
                             "train.checkpoint_every": 4, "train.eval_every": 100, "train.eval_examples": 128,
                             "train.nonfinite_patience": 3, **overrides})


def _bits(tree):
  key = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return [np.asarray(key(x)).tobytes() for x in jax.tree_util.tree_leaves(tree)]


# ---- the guard inside the step -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run():
  run = build(_tiny())
  return run, next(run.source.train_iterator())


def test_train_step_skips_a_batch_with_nan_features(tiny_run):
  run, batch = tiny_run
  before = _bits(run.state)
  poisoned = dataclasses.replace(batch, dense_BxG=np.full_like(batch.dense_BxG, np.nan))
  copy = jax.tree_util.tree_map(jnp.copy, run.state)  # the step donates its input
  skipped, m = run.train_step(copy, run.device_batch(poisoned))
  assert int(m["nonfinite"]) == 1 and not np.isfinite(float(m["loss"]))
  assert _bits(skipped.params) == _bits(run.state.params) and _bits(skipped.opt_state) == _bits(run.state.opt_state)
  assert int(skipped.step) == 1
  stepped, m = run.train_step(jax.tree_util.tree_map(jnp.copy, run.state), run.device_batch(batch))
  assert int(m["nonfinite"]) == 0 and _bits(stepped.params) != _bits(run.state.params)
  assert _bits(run.state) == before


# ---- the loop's policy -------------------------------------------------------------------------------------


class _Poisoned:
  """The training iterator with NaN dense features in the batches of the given 1-based steps."""

  def __init__(self, inner, bad_steps):
    self.inner, self.bad, self.n = inner, set(bad_steps), 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self.inner)
    self.n += 1
    if self.n in self.bad:
      batch = dataclasses.replace(batch, dense_BxG=np.full_like(batch.dense_BxG, np.nan))
    return batch

  def get_state(self):
    return self.inner.get_state()

  def set_state(self, state):
    self.inner.set_state(state)


_TRAIN_ITERATOR = SyntheticSource.train_iterator


def _poison(monkeypatch, bad_steps):
  """The next run reads NaN features at `bad_steps` (replacing any earlier poisoning)."""
  monkeypatch.setattr(SyntheticSource, "train_iterator", lambda self: _Poisoned(_TRAIN_ITERATOR(self), bad_steps))


def _records(out_dir):
  with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_a_short_streak_is_skipped_and_a_long_one_restores_the_checkpoint_before_it(tmp_path, monkeypatch, capsys):
  _poison(monkeypatch, {2, 3, 6, 7, 8})
  summary = jobs.train_config(_tiny(), str(tmp_path), progress=False, report=False)
  # Steps 2 and 3 (a streak under train.nonfinite_patience) are skipped, and that streak does not count
  # towards the next. 6..8 is detected when step 8's metrics are read, which checkpoint step 8 does before it
  # saves (nothing in flight): the restore goes back to 4, the newest from before the streak, and checkpoint
  # 8 holds the restored state.
  [restore] = summary["nonfinite"]["restores"]
  assert restore == {"at_step": 8, "streak": [6, 8], "restored_step": 4, "updates_discarded": 1}
  assert summary["nonfinite"]["skipped_steps"] == [2, 3, 6, 7, 8]
  assert "3 consecutive non-finite steps (6..8" in capsys.readouterr().out
  records = _records(tmp_path)
  assert [r for r in records if r.get("event") == "nonfinite_restore"][0]["restored_step"] == 4
  nonfinite = {r["step"]: r["nonfinite"] for r in records if "nonfinite" in r}
  assert sorted(nonfinite) == list(range(1, 13)) and [s for s in (2, 3) if nonfinite[s]] == [2, 3]
  assert max(r["step"] for r in records if "loss" in r) == 12
  assert np.isfinite(summary["tasks"]["click"]["eval_ne"])


def test_stop_policy_and_too_many_restores_end_the_run(tmp_path, monkeypatch):
  _poison(monkeypatch, {6, 7, 8})
  with pytest.raises(NonFiniteError, match=r"3 consecutive non-finite steps \(6\.\.8.*stopping "
                                                r"\(train.on_nonfinite=stop\); last checkpoint: step 4"):
    jobs.train_config(_tiny(**{"train.on_nonfinite": "stop"}), str(tmp_path / "stop"), progress=False, report=False)
  assert any(r.get("event") == "nonfinite_stop" for r in _records(tmp_path / "stop"))
  _poison(monkeypatch, {2, 3, 4})  # nothing saved before the streak: nothing to go back to
  with pytest.raises(NonFiniteError, match=r"\(2\.\.4.*no checkpoint from before step 2 to restore "
                                                r"\(steps on disk: \[\]\)"):
    jobs.train_config(_tiny(), str(tmp_path / "early"), progress=False, report=False)
  _poison(monkeypatch, set(range(6, 17)))  # restored once at step 8, then 9..11 in a row again
  with pytest.raises(NonFiniteError, match=r"\(9\.\.11.*already restored 1 times"):
    jobs.train_config(_tiny(**{"train.max_nonfinite_restores": 1, "train.steps": 16}), str(tmp_path / "again"),
               progress=False, report=False)


def test_a_resume_after_every_checkpoint_was_moved_aside_does_not_start_over(tmp_path):
  """The first resume finds every checkpoint unreadable, moves each aside and raises; a second one must not
  take the empty folder for a new run (truncating metrics.jsonl, emptying best/) but say what happened."""
  from gem_jax.train.checkpoint import CheckpointCorruptError
  cfg = _tiny(**{"train.steps": 4, "train.checkpoint_every": 2})
  jobs.train_config(cfg, str(tmp_path), progress=False, report=False)
  for step in ("2", "4"):
    files = [os.path.join(r, f) for r, _, names in os.walk(tmp_path / "checkpoints" / step / "state") for f in names]
    with open(max(files, key=os.path.getsize), "r+b") as f:
      f.truncate(10)
  log = (tmp_path / "metrics.jsonl").read_text()
  with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptError, match="no usable checkpoint"):
    jobs.train_config(cfg, str(tmp_path), progress=False, report=False, resume=True)
  with pytest.raises(CheckpointCorruptError, match=r"nothing to resume from but \['2.corrupt', '4.corrupt'\]"):
    jobs.train_config(cfg, str(tmp_path), progress=False, report=False, resume=True)
  assert (tmp_path / "metrics.jsonl").read_text() == log


def test_the_training_time_limit_counts_the_time_before_a_resume():
  """train.max_train_minutes is the run's budget, not each process's: the checkpointed hook state carries the
  training seconds so far, and a resumed process adds its own."""
  import time
  import types

  from gem_jax.train.hooks import Evaluate
  first = Evaluate(every=100, max_minutes=1.0)
  assert not first.over_time(types.SimpleNamespace(t_first=time.perf_counter() - 20.0, t_start=None))
  state = json.loads(json.dumps(first.state_dict()))   # as a checkpoint's extra holds it
  assert 20.0 <= state["train_s"] < 30.0
  resumed, fresh = Evaluate(every=100, max_minutes=1.0), Evaluate(every=100, max_minutes=1.0)
  resumed.load_state_dict(state)
  later = types.SimpleNamespace(t_first=time.perf_counter() - 45.0, t_start=None)
  assert resumed.over_time(later) and not fresh.over_time(later)


def test_best_keeps_the_parameters_the_last_two_checkpoints_recorded(tmp_path):
  """best/ after each checkpoint (Evaluate.state_dict, called as one is saved) holds the best step it records
  and the one the checkpoint before recorded, and every later best: a run resumed from either (the last one's
  write may be cut off) finds its best parameters, where one kept entry lost them to a better evaluation after
  the checkpoint, which the resume then dropped."""
  from gem_jax.train.checkpoint import Checkpointer
  from gem_jax.train.hooks import Evaluate
  e = Evaluate(every=1, select="ne")
  e.best_dir = Checkpointer(tmp_path / "best", keep=None, save_every=1, async_save=False)

  def best(step):
    e.best_dir.save(step, {"w": np.full(2, step, np.float32)}, force=True)
    e.best = {"score": float(step), "step": step}

  best(3)
  best(6)
  e.state_dict()                                   # checkpoint 8 records 6
  assert e.best_dir.all_steps() == [6]
  best(9)
  best(11)
  assert e.best_dir.all_steps() == [6, 9, 11]      # a kill now resumes from 8: 9 and 11 go, 6 is there
  e.state_dict()                                   # checkpoint 12 records 11; if its write is cut off, 8's 6
  assert e.best_dir.all_steps() == [6, 9, 11]
  e.state_dict()                                   # checkpoint 16 records 11, and 12 did too
  assert e.best_dir.all_steps() == [11]
  resumed = Evaluate(every=1, select="ne")
  resumed.load_state_dict(json.loads(json.dumps(e.state_dict())))
  resumed.best_dir = e.best_dir
  resumed.state_dict()
  assert resumed.best_dir.all_steps() == [11]


# ---- kills ---------------------------------------------------------------------------------------------


def test_the_drill_comparison_is_exact_but_nan_aware():
  """A NaN metric (no conversions in the eval set) equals itself in the same place; any other difference,
  down to a float's last bit or an int against a float, is a difference."""
  nan = float("nan")
  one = {"click": {"baseline_ne": 1.007438419939963, "eval_auc": 0.7}, "conversion": {"eval_auc": nan}}
  assert fault_drill.identical(one, json.loads(json.dumps(one)))
  bumped = json.loads(json.dumps(one))
  bumped["click"]["baseline_ne"] = float(np.nextafter(1.007438419939963, 2.0))
  assert not fault_drill.identical(one, bumped)
  assert not fault_drill.identical({"x": nan}, {"x": 1.0}) and not fault_drill.identical({"x": 1}, {"x": 1.0})
  assert not fault_drill.identical({"x": [1.0, nan]}, {"x": [1.0]}) and not fault_drill.identical({"x": 1}, {"y": 1})


def test_kill_points_cover_each_kind_in_run_order():
  plan = fault_drill.plan_kills(5, 30, 4, seed=0)
  assert len(set(plan)) == 5 and {k for k, _ in plan} == set(fault_drill.KINDS)
  assert plan == sorted(plan, key=lambda p: (p[1], fault_drill.KINDS.index(p[0])))
  assert all(s % 4 == 0 for k, s in plan if k != "step") and all(0 < s < 30 for _, s in plan)
  assert plan == fault_drill.plan_kills(5, 30, 4, seed=0) != fault_drill.plan_kills(5, 30, 4, seed=1)
  with pytest.raises(ValueError, match="only 5 distinct kill points"):
    fault_drill.plan_kills(6, 4, 2, seed=0)


def test_a_drill_reference_is_a_group_or_one_process():
  assert fault_drill.Drill().reference == "group"
  assert fault_drill.Drill(processes=2, mesh="meshes/cpu_2.yaml", reference="one").reference == "one"
  with pytest.raises(ValueError, match="reference is 'group' or 'one'"):
    fault_drill.Drill(reference="single")
  with pytest.raises(ValueError, match=r"--grace >= 0, got 1 and -1"):
    fault_drill.Drill(grace_s=-1)
  # The kill points follow --steps / --checkpoint-every / --mesh: a --set of those would move the run under them.
  with pytest.raises(ValueError, match=r"set those, not --set mesh train.steps"):
    fault_drill.Drill(sets=("train.steps=40", "mesh=meshes/cpu_2.yaml", "train.host_tables=user_id"))
  assert fault_drill.Drill(sets=("train.host_tables=user_id,ad_id",)).sets


def test_every_drill_process_compiles_for_one_intra_op_thread_count(monkeypatch, tmp_path):
  """XLA:CPU plans a loop's parallel split for max(cores, the process's devices) threads: a one-process
  reference with both of cpu_2's devices and group processes with one each must be told one count, or on a
  single core they compile differently split loops (and train 1 ulp apart)."""
  one = fault_drill.Drill(processes=2, mesh="meshes/cpu_2.yaml", reference="one")
  monkeypatch.delenv("PJRT_NPROC", raising=False)
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
  assert fault_drill._env(one, str(tmp_path))["PJRT_NPROC"] == "2"   # the reference's two devices
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
  assert fault_drill._env(one, str(tmp_path))["PJRT_NPROC"] == "6"   # the cores
  monkeypatch.setenv("PJRT_NPROC", "1")
  assert fault_drill._env(one, str(tmp_path))["PJRT_NPROC"] == "2"


@pytest.mark.slow
def test_fault_drill_resumes_bit_for_bit(tmp_path):
  """The CI size of `experiments/fault_drill.py --kills 5`: three kills, one of each kind, of one-layer tiny
  (each of the drill's five process starts compiles its steps; a second layer would only add to that)."""
  out = tmp_path / "drill.json"
  proc = subprocess.run([sys.executable, "experiments/fault_drill.py", "--kills", "3", "--steps", "12",
                         "--set", "model.num_layers=1", "--set", "model.hstu.keep_last=[32]",
                         "--out", str(out), "--workdir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  drill = json.loads(out.read_text())
  assert drill["identical"] and drill["losses_identical"] and drill["state_identical"] and drill["eval_identical"]
  assert drill["steps_compared"] == 12 and drill["leaves_compared"] > 100
  assert [k["kind"] for k in drill["kills"]] == ["save_started", "step", "save_begin"]
  for k in drill["kills"]:
    assert k["steps_lost"] == k["last_step_dispatched"] - k["resumed_from"] >= 0
    assert k["resumed_from"] in [0] + k["checkpoints_on_disk"]


# ---- resharding restore ----------------------------------------------------------------------------------


def _eval_on(mesh: str, run_dir) -> dict:
  """experiments/train.py --eval-only in a process with exactly the mesh's CPU devices."""
  cmd = [sys.executable, "experiments/train.py", "--config", "tiny", "--mesh", f"meshes/{mesh}.yaml",
         "--out", str(run_dir), "--eval-only"]
  for k, v in CPU8_SETS.items():
    cmd += ["--set", f"{k}={v}"]
  proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout[proc.stdout.index("{"):])


@pytest.mark.slow
def test_a_checkpoint_written_on_cpu_8_evaluates_the_same_on_cpu_1_and_cpu_16_5d(tiny_cpu8_run):
  cfg, run_dir, _ = tiny_cpu8_run  # trained on cpu_8 (conftest.py), checkpoints at steps 4 and 8
  last = cfg.train.steps
  # The reference: the run's own final evaluation on cpu_8, of the state its last checkpoint holds.
  tasks = json.loads((run_dir / "summary.json").read_text())["tasks"]
  ref = {task: {k[len("eval_"):]: v for k, v in m.items() if k.startswith("eval_")} for task, m in tasks.items()}
  assert ref["click"]["count"] == 512 and set(ref["click"]) >= {"ne", "auc", "calibration", "base_rate"}
  results = {"cpu_1": jobs.evaluate_checkpoint(apply_overrides(cfg, ["mesh=meshes/cpu_1.yaml"]), str(run_dir),
                                               devices=jax.devices()[:1]),
             "cpu_16_5d": _eval_on("cpu_16_5d", run_dir)}  # 16 devices: its own process
  for mesh, got in results.items():
    assert got["mesh"] == mesh and got["step"] == last and not got["checkpoint_fallbacks"]
    # Every leaf restored bit for bit on every layout (the integrity hashes do not depend on the mesh) ...
    assert got["state_fingerprint"] == results["cpu_1"]["state_fingerprint"], mesh
    # ... so the metrics differ only by the order of the forward pass's additions on each mesh.
    assert set(ref) <= set(got["evaluation"]["eval"])
    for task, metrics in ref.items():
      for name, value in metrics.items():
        assert got["evaluation"]["eval"][task][name] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), \
            (mesh, task, name)
