"""The trainer: train(run, out_dir, hooks) runs the one train step over the run's data, read top to bottom.

  restore   the checkpoint hook restores state, data position, task counters and every hook's own state
  loop      next batch -> hooks.before_dispatch -> train_step -> hooks.step_metrics + drained(step N - 1)
            -> hooks.after_step -> hooks.end_step (the checkpoint saves there)
  final     the final evaluation of every split with the selected parameters, the task's summary, each
            hook's part, summary.json

It never blocks the host on the step it just dispatched: step N's metrics are fetched (and handed to the
hooks' `drained`) after step N + 1 has been dispatched. Everything else a run does is a hook
(gem_jax/train/hooks.py): metrics.jsonl and the progress bar, checkpoints, periodic and selecting
evaluation, the non-finite guard, the efficiency meter, events. A hook may end the run early
(`trainer.stop(reason)`) or replace the state (the guard's restore).

In a multi-process run every process runs this same function on the same global batches (each places
only its own data shards) and takes part in every checkpoint; only process 0 writes files.
"""

from __future__ import annotations

import json
import os
import time
import types
from typing import Any, Callable

import jax
import numpy as np

from gem_jax.observe import flops


def jsonable(tree) -> Any:
  return jax.tree_util.tree_map(lambda x: float(x) if np.ndim(x) == 0 else np.asarray(x).tolist(), tree)


class JsonlWriter:
  """metrics.jsonl; on resume from step k, records past k (written after that checkpoint by the run that
  stopped) are dropped so that every step appears once, and the file is replaced only once the kept
  records are on disk. path None: write nothing (processes other than 0)."""

  def __init__(self, path: str | None, resume_step: int | None):
    self._f = None
    if path is None:
      return
    kept = []
    if resume_step is not None and os.path.exists(path):
      with open(path) as f:
        lines = f.readlines()
      for i, line in enumerate(lines):
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          if i == len(lines) - 1:  # the write a kill cut short
            break
          raise ValueError(f"{path}:{i + 1}: not a JSON record: {line[:80]!r}") from None
        if record.get("step", record.get("eval_step", 0)) <= resume_step and "final_eval" not in record:
          kept.append(line if line.endswith("\n") else line + "\n")
    # The kept records reach the disk before the old file goes: a run killed before its first new record
    # (a resume, then a kill during compile) must not lose the history it resumed from.
    tmp = path + ".tmp"
    try:
      with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):  # a failed write leaves the old file whole and no stray copy
        os.unlink(tmp)
    self._f = open(path, "a")

  def write(self, record: dict) -> None:
    if self._f is not None:
      self._f.write(json.dumps(record) + "\n")
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


class Trainer:
  """One training run's state, shared with its hooks."""

  def __init__(self, run, out_dir: str, hooks: list, *, stop_after: int | None = None,
               on_event: Callable[[str, int], None] | None = None):
    self.run, self.out_dir, self.hooks = run, out_dir, list(hooks)
    self.writes_files = jax.process_index() == 0
    self.t_start = time.perf_counter()
    self.wall_before = 0.0                    # wall seconds of the earlier processes of a resumed run, through
                                              # the checkpoint this one restored (the checkpoint hook sets it)
    self.total_steps = total_steps(run)
    self.end_step = self.total_steps if stop_after is None else min(stop_after, self.total_steps)
    self.state = run.state
    self.data = run.train_iterator()
    self.step = self.start_step = 0           # batches consumed
    self.counters: dict[str, np.ndarray] = {}  # the task's host counters, summed over training batches
    self.stop_reason: str | None = None
    self.t_first: float | None = None         # when the first step finished (compile excluded after it)
    self.params_for_eval = None               # set by a selecting evaluation hook: the kept parameters
    self.event = on_event or (lambda name, step: None)
    self.programs: dict[tuple, list] = {}      # batch shapes -> [compiled train step, steps run with it]
    self.step_programs: dict[int, tuple] = {}  # step -> the batch shapes (self.programs' key) it ran
    self.compile_s: float | None = None
    self.writer = None                        # metrics.jsonl (gem_jax/train/hooks.py JsonlWriter), process 0
    self.checkpointer = None                  # the run's checkpoints (set by the checkpoint hook's restore)
    self._pending = None
    os.makedirs(out_dir, exist_ok=True)

  def wall_s(self) -> float:
    """The run's wall seconds so far: this process's, plus its earlier processes' through the checkpoint it
    resumed from (time they spent after their last checkpoint was lost with them and is not counted)."""
    return self.wall_before + time.perf_counter() - self.t_start

  def stop(self, reason: str) -> None:
    self.stop_reason = self.stop_reason or reason

  def dispatched(self, dev_metrics) -> None:
    """Step self.step was dispatched: its metrics wait in flight; the previous step's are fetched and
    handed to every hook now (one step late, by design)."""
    previous, self._pending = self._pending, (self.step, dev_metrics)
    self._drain(previous)

  def drain(self) -> None:
    """Fetches the step in flight now (the end of the loop)."""
    pending, self._pending = self._pending, None
    self._drain(pending)

  def take_in_flight(self) -> tuple[int, dict] | None:
    """(step, host metrics) of the step in flight, which no hook will see drained: the guard reads and
    logs it before it throws the state it ran on away."""
    pending, self._pending = self._pending, None
    return None if pending is None else (pending[0], jsonable(jax.device_get(pending[1])))

  def _drain(self, pending) -> None:
    """Every hook first says what it adds to the step's record (step_metrics, from the step's own metrics),
    then every hook sees the whole record, read-only (drained): no hook reads what another hook changes, so
    their order does not matter."""
    if pending is None:
      return
    step, dev_metrics = pending
    metrics = jsonable(jax.device_get(dev_metrics))
    added: dict = {}
    for h in self.hooks:
      extra = h.step_metrics(self, step, types.MappingProxyType(metrics))
      clash = set(extra) & (set(metrics) | set(added))
      if clash:
        raise ValueError(f"hook {type(h).__name__} adds step metrics {sorted(clash)} that are already there")
      added.update(extra)
    record = types.MappingProxyType({**metrics, **added})
    for h in self.hooks:
      h.drained(self, step, record)

  def restore_before(self, step: int):
    """(step, state) of the newest usable checkpoint at or before `step`, in this config's schedule numbers
    (optim.ScheduleState); FileNotFoundError when there is none (or no checkpoints at all)."""
    if self.checkpointer is None:
      raise FileNotFoundError("this run keeps no checkpoints")
    restored_step, state, _ = self.checkpointer.restore(abstract_state=self.run.restore_target(), max_step=step)
    state = self.run.load_whole(state)
    return restored_step, type(state)(state.params, self.run.optimizer.with_schedule(state.opt_state), state.step,
                                      state.rng)

  def compile_if_new(self, device_batch) -> None:
    """Each new batch shape (history bucket) is compiled ahead of time, to time the compile alone and let
    the meter read the program; the call that follows hits jit's cache."""
    shapes = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(device_batch))
    if shapes not in self.programs:
      t0 = time.perf_counter()
      self.programs[shapes] = [self.run.train_step.lower(self.state, device_batch).compile(), 0]
      self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - t0
    self.programs[shapes][1] += 1
    self.step_programs[self.step] = shapes

  def mark_busy(self, step: int) -> None:
    """Step `step` shares its time with an evaluation or a checkpoint (the meter leaves it out of medians)."""
    for h in self.hooks:
      h.busy(self, step)

  def log(self, record: dict) -> None:
    if self.writer is not None:
      self.writer.write(record)


def eval_every(run) -> int:
  """Steps between periodic evaluations: train.eval_every_epochs x the steps of an epoch, else train.eval_every."""
  tc = run.cfg.train
  per_epoch = run.source.steps_per_epoch()
  return tc.eval_every_epochs * per_epoch if tc.eval_every_epochs and per_epoch else tc.eval_every


def total_steps(run) -> int:
  """train.steps, or train.epochs x the source's steps per epoch."""
  tc = run.cfg.train
  if tc.epochs:
    per_epoch = run.source.steps_per_epoch()
    if not per_epoch:
      raise ValueError(f"train.epochs={tc.epochs} needs a source with epochs; {run.source.name} is endless")
    return tc.epochs * per_epoch
  return tc.steps


def train(run, out_dir: str, hooks: list, *, resume: bool = False, stop_after: int | None = None,
          on_event: Callable[[str, int], None] | None = None) -> dict:
  """Trains `run` (gem_jax/run/build.py) with `hooks`; returns the summary (also out_dir/summary.json).

  resume: continue from the newest usable checkpoint in out_dir (the checkpoint hook restores it).
  stop_after: end this process after that step (with a checkpoint there), as if interrupted; a later call
  with resume=True continues the same run to its last step.
  on_event(name, step): "start", "step" (step N dispatched), "save_begin" / "save_started", "done".
  """
  t = Trainer(run, out_dir, hooks, stop_after=stop_after, on_event=on_event)

  # ---- restore -----------------------------------------------------------------------------------------
  for h in t.hooks:
    h.restore(t, resume)
  t.writer = JsonlWriter(os.path.join(out_dir, "metrics.jsonl") if t.writes_files else None,
                         t.step if t.step > 0 else None)
  t.event("start", t.step)
  for h in t.hooks:
    h.begin(t)

  # ---- loop ---------------------------------------------------------------------------------------------
  while t.step < t.end_step and t.stop_reason is None:
    for h in t.hooks:
      h.before_batch(t)
    batch = next(t.data)
    device_batch, counts = run.feed(batch)
    for name, value in counts.items():
      t.counters[name] = t.counters.get(name, 0) + value
    for h in t.hooks:
      h.before_dispatch(t, batch)
    t.compile_if_new(device_batch)
    t.state, dev_metrics = run.train_step(t.state, device_batch)
    t.step += 1
    t.event("step", t.step)
    if t.t_first is None:
      jax.block_until_ready(dev_metrics)
      t.t_first = time.perf_counter()
    t.dispatched(dev_metrics)
    for h in t.hooks:
      h.after_step(t)
    for h in t.hooks:  # after every hook's work on the step: a checkpoint holds all of it
      h.end_step(t)
  t.drain()
  jax.block_until_ready(t.state)
  train_s = time.perf_counter() - (t.t_first or time.perf_counter())
  for h in t.hooks:
    h.end_training(t)
  t.event("done", t.step)
  if t.step < t.total_steps and t.stop_reason is None:  # interrupted on purpose (stop_after)
    t.writer.close()
    return {"config": run.cfg.name, "stopped_at": t.step, "steps_this_run": t.step - t.start_step,
            **_parts(t, "partial")}

  # ---- final evaluation and summary ----------------------------------------------------------------------
  params = t.params_for_eval if t.params_for_eval is not None else run.eval_params(t.state)
  evaluation = {split: evaluate(run, params, split) for split in run.source.eval_splits}
  task_summary = run.task.summarize(evaluation, t.counters)
  for h in t.hooks:
    h.final_eval(t, evaluation, task_summary)
  steps_run = t.step - t.start_step
  batch_rows = run.source.batch_size
  summary = {
      "config": run.cfg.name, "steps": t.step, "steps_this_run": steps_run, "batch_size": batch_rows,
      "stop_reason": t.stop_reason or "steps",
      "examples_per_s": (steps_run - 1) * batch_rows / train_s if steps_run > 1 and train_s > 0 else None,
      "compile_s": t.compile_s, "wall_s": t.wall_s(), "wall_s_this_run": time.perf_counter() - t.t_start,
      "params": flops.param_counts(run),
      # What a tolerating input policy did (hashed ids, truncated histories, masked labels); {} for most sources.
      "input_counters": run.input_counters(),
      **task_summary, **_parts(t, "summary")}
  t.writer.close()
  if t.writes_files:
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
      json.dump(jsonable_summary(summary), f, indent=2)
  return summary


def _parts(t: Trainer, kind: str) -> dict:
  out = {}
  for h in t.hooks:
    out.update(h.summary(t) if kind == "summary" else h.partial_summary(t))
  return out


def evaluate(run, params, split: str) -> dict:
  """The task's metrics of `params` on an evaluation split of the run's source (sharded, placed, predicted
  on the mesh; metrics on the host)."""
  batches = run.eval_batches(split)
  if run.tables is None:
    predictions = [np.asarray(run.eval_step(params, run.place(b))) for b in batches]
  else:  # `params` hold host tables whole (Run.whole_params): each batch gets just the rows it reads
    views = run.tables.eval_views(params, batches)
    predictions = [np.asarray(run.eval_step(p, run.place(b))) for p, b in views]
  return run.task.evaluate(predictions, batches)


def jsonable_summary(summary: dict) -> dict:
  """The summary without the task's internal entries (names starting with "_")."""
  def clean(x):
    if isinstance(x, dict):
      return {k: clean(v) for k, v in x.items() if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(x, (np.floating, np.integer)):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
    return x
  return clean(summary)
