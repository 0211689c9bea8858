"""End-to-end training on the tiny config through the trainer: outputs, exact resume, metrics records."""

import json
import os
import time

import pytest

from gem_jax.train import fault_drill
from gem_jax.train.jobs import train_config as train
from tests.run_helpers import ONE_LAYER, check_run_report, tiny

STEPS = 12


def _tiny(**overrides):
  """One GEM layer: outputs, resume and hook order do not depend on the model's depth (the golden steps,
  tests/test_step_golden.py, keep two)."""
  return tiny(*ONE_LAYER, **{"train.warmup_steps": 1, "train.steps": STEPS, "train.log_every": 1,
                             "train.checkpoint_every": 4, "train.eval_every": 100, "train.eval_examples": 128,
                             **overrides})


def _losses(out_dir):
  with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def _count_step_traces(monkeypatch) -> list:
  """A list that grows by one each time a train step is traced (the task's loss sums, outside count-only
  traces; the eval step does not call them)."""
  from gem_jax import runtime
  from gem_jax.run import tasks
  traces, original = [], tasks.AdsMultiTask.sums

  def sums(self, model, batch, rng):
    if not runtime.current().count_only:
      traces.append(1)
    return original(self, model, batch, rng)

  monkeypatch.setattr(tasks.AdsMultiTask, "sums", sums)
  return traces


@pytest.mark.slow
def test_tiny_run_writes_outputs_and_resume_is_exact_in_either_hook_order(tmp_path, monkeypatch):
  """A run's outputs; the same run with the standard hooks reversed, stopped after step 8 (a checkpoint and an
  evaluation on the same step) and resumed, gives the same losses, summary and evaluations bit for bit and the
  same metrics.jsonl records (timings aside: keys and every other value): resume is exact and hook order does
  not matter (tests/test_fault_tolerance.py's drill resumes in the standard order)."""
  from gem_jax.run.build import build
  from gem_jax.train import trainer
  from gem_jax.train.jobs import standard_hooks
  cfg = _tiny(**{"train.eval_every": 4, "train.select_metric": "click/ne"})   # best/ too, in either order
  full = str(tmp_path / "full")
  summary = train(cfg, full, progress=False)
  check_run_report(full, num_devices=1)
  assert set(summary["efficiency"]) >= {"mfu", "padding_waste", "step_time_s"}
  for key in ("steps", "examples_per_s"):
    assert summary[key] is not None
  for task in ("click", "conversion"):
    for key in ("eval_ne", "eval_auc", "baseline_ne", "optimal_ne"):
      assert key in summary["tasks"][task]
  assert 0.5 < summary["tasks"]["click"]["optimal_ne"] < 1.0  # the planted model beats the base rate
  with open(os.path.join(full, "summary.json")) as f:
    assert json.load(f)["steps"] == STEPS
  assert os.listdir(os.path.join(full, "checkpoints"))

  # With the standard hooks reversed, interrupted after step 8 (the first part resumes from an empty folder,
  # so it starts at step 0), then resumed: the same losses, bit for bit. Each of the two runs traces its train
  # step once: the state build() places, and the restored one, have the shardings the step returns (else jit
  # traces and compiles the step again at the second step).
  def reversed_run(**kw):
    r = build(cfg)
    return trainer.train(r, str(tmp_path / "reversed"), standard_hooks(r, progress=False)[::-1], **kw)

  traces = _count_step_traces(monkeypatch)
  t0 = time.perf_counter()
  stopped = reversed_run(stop_after=8, resume=True)
  first_process_s = time.perf_counter() - t0
  assert stopped["steps_this_run"] == 8 and max(_losses(tmp_path / "reversed")) == 8 and len(traces) == 1
  assert not os.path.exists(tmp_path / "reversed" / "report.json")   # a stopped run writes no report
  resumed = reversed_run(resume=True)
  assert len(traces) == 2
  # The run's wall time counts the first process through its checkpoint at step 8, not this process alone.
  before = resumed["wall_s"] - resumed["wall_s_this_run"]
  assert 0 < before <= first_process_s, (before, first_process_s)
  expected, got = _losses(full), _losses(tmp_path / "reversed")
  assert sorted(got) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    assert got[step] == expected[step], (step, got[step], expected[step])
  # The summary too, to the bit: the base rate behind baseline_ne comes from label counters summed in float32
  # before and after the restore (restored as float64 they moved it in the ninth digit).
  assert fault_drill.identical(resumed["evaluations"], summary["evaluations"])
  assert fault_drill.identical(json.loads(json.dumps(resumed["tasks"])), json.loads(json.dumps(summary["tasks"])))
  # best/ of step 8 is the checkpoint's own: nothing to drop and replay, whichever hook restores first.
  assert not [r for r in map(json.loads, open(tmp_path / "reversed" / "metrics.jsonl"))
              if r.get("event") == "best_replayed"]
  # The meter's numbers: timings, and rank imbalance only in a run that writes a report (not the stopped one).
  metered = ("examples_per_s", "step_time_s", "mfu", "hfu", "imbalance_balanced", "imbalance_random")
  records = lambda folder: [{k: v for k, v in r.items() if k not in metered}
                            for r in map(json.loads, open(tmp_path / folder / "metrics.jsonl")) if "loss" in r]
  assert [sorted(r) for r in records("reversed")] == [sorted(r) for r in records("full")]
  assert fault_drill.identical(records("reversed"), records("full"))
  # Whichever runs first, the log writes what the meter adds to the step (the resumed part is metered).
  late = [r for r in map(json.loads, open(tmp_path / "reversed" / "metrics.jsonl")) if "loss" in r and r["step"] >= 10]
  assert late and all("step_time_s" in r and "imbalance_balanced" in r for r in late), late[0].keys()
  # A folder that holds checkpoints is not trained into again without resume.
  with pytest.raises(FileExistsError, match="--resume"):
    train(cfg, full, progress=False, report=False)


@pytest.mark.parametrize("flags,message", [
    (["--step", "4"], "--step picks the checkpoint --eval-only evaluates"),
    (["--eval-only", "--resume"], "--eval-only trains nothing, so --resume and --no-report would be ignored"),
    (["--mesh", "meshes/cpu_2.yaml", "--set", "mesh=meshes/cpu_8.yaml"], "--mesh and --set mesh=... name the mesh"),
])
def test_the_train_command_refuses_flags_it_would_ignore(flags, message):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, os.path.join(root, "experiments", "train.py"), *flags], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_a_resumed_log_keeps_its_history_on_disk_before_any_new_record(tmp_path):
  """metrics.jsonl of a resumed run: the records through the checkpoint are on disk as soon as the writer
  exists (a kill before the first new record loses nothing), later ones are dropped, and new ones append."""
  from gem_jax.train.trainer import JsonlWriter
  path = tmp_path / "metrics.jsonl"
  records = [{"step": 5, "loss": 1.0}, {"eval_step": 10, "valid/HR@10": 0.2}, {"step": 15, "loss": 0.9},
             {"step": 10, "final_eval": True}]
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 20, "lo')  # a write cut short
  writer = JsonlWriter(str(path), resume_step=10)
  on_disk = [json.loads(line) for line in path.read_text().splitlines()]
  assert on_disk == records[:2]
  writer.write({"step": 11, "loss": 0.8})
  assert [json.loads(line) for line in path.read_text().splitlines()] == records[:2] + [{"step": 11, "loss": 0.8}]
  writer.close()
  assert not os.path.exists(str(path) + ".tmp")
