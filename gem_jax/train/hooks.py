"""The trainer's hooks (gem_jax/train/trainer.py): everything a run does besides stepping.

  Checkpoint   restore on resume (state, data position, task counters, every hook's state); save every
               train.checkpoint_every steps and at the end, asynchronously; corrupt checkpoints fall back
  MetricsLog   metrics.jsonl (every train.log_every steps, every skipped step, every event) and the bar
  Evaluate     every `every` steps on the source's first split; with train.select_metric, keeps the best
               parameters for the final evaluation and stops after train.patience evaluations without a
               better one, or after train.max_train_minutes
  Guard        the non-finite guard: a streak of train.nonfinite_patience skipped steps restores the newest
               checkpoint from before it (train.on_nonfinite=restore) or stops (stop)
  Meter        the efficiency report: report.json, plots/, the console table (gem_jax/observe/meter.py)

A hook overrides only the calls it needs; each call gets the Trainer. Hooks with state that a resume must
see return it from state_dict() (JSON), and it comes back through load_state_dict() from the checkpoint.

Hooks do not know each other, and their order does not matter (tests/test_train.py shuffles it):
  - a drained step's record is the step's metrics plus what every hook's step_metrics() adds (the meter's
    step time and MFU), and drained() sees it read-only;
  - the checkpoint saves in end_step(), after every hook's after_step() (an evaluation at that step
    included), and sets the trainer's `checkpointer`; the guard restores through the trainer
    (`restore_before`, `checkpointer`), not through the checkpoint hook;
  - cadences come from the config (trainer.eval_every, train.checkpoint_every), not from other hooks.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.train import trainer as trainer_lib
from gem_jax.train.checkpoint import CheckpointCorruptError, Checkpointer


class Hook:
  key = "hook"     # the name of its state in a checkpoint

  def restore(self, t, resume: bool) -> None: ...
  def begin(self, t) -> None: ...
  def before_batch(self, t) -> None: ...
  def before_dispatch(self, t, host_batch) -> None: ...
  def step_metrics(self, t, step: int, metrics) -> dict:
    """What this hook adds to drained step `step`'s record, from the step's own (read-only) metrics."""
    return {}

  def drained(self, t, step: int, host) -> None: ...   # host: the step's whole record, read-only
  def after_step(self, t) -> None: ...
  def end_step(self, t) -> None: ...                   # after every hook's after_step
  def busy(self, t, step: int) -> None: ...
  def end_training(self, t) -> None: ...
  def final_eval(self, t, evaluation: dict, task_summary: dict) -> None: ...

  def summary(self, t) -> dict:
    return {}

  def partial_summary(self, t) -> dict:
    return {}

  def state_dict(self) -> dict | None:
    return None

  def load_state_dict(self, state: dict) -> None: ...


# One program for the whole state (a copy per leaf would compile one small program per leaf shape).
_copy = jax.jit(lambda tree: jax.tree_util.tree_map(jnp.copy, tree))


def _kept(t):
  """A copy of the parameters an evaluation of the train state reads (Run.eval_params, the dense average
  with train.ema_decay), with host tables whole: what best/ keeps. A copy, since the next step donates the
  state."""
  if t.run.tables is None:
    return _copy(t.run.optimizer.averaged(t.state.params, t.state.opt_state))
  whole = t.run.whole(t.state).params   # host tables copied out of their stores
  average = t.run.optimizer.average_state(t.state.opt_state)
  if average is None:
    return whole   # nothing else to copy
  return t.run.optimizer.averaged(whole, _copy(average))   # the average alone, not Adam's moments too


class Checkpoint(Hook):
  key = "checkpoint"

  def __init__(self, every: int, keep: int):
    self.every, self.keep = every, keep
    self.checkpointer: Checkpointer | None = None

  def restore(self, t, resume: bool) -> None:
    self.checkpointer = t.checkpointer = ckpt = Checkpointer(os.path.join(t.out_dir, "checkpoints"),
                                                             keep=self.keep, save_every=self.every)
    latest = ckpt.latest_step()
    if latest is None:
      moved = ckpt.quarantined()
      if resume and moved:   # starting over would truncate metrics.jsonl and empty best/
        raise CheckpointCorruptError(
            f"{ckpt.directory}: nothing to resume from but {moved}, which an earlier restore moved aside as "
            "unreadable; not starting over. If that read failed for another reason (memory, a file system "
            "error), rename them back to their step numbers and resume again; else use another output folder")
      return
    if not resume:
      raise FileExistsError(f"{t.out_dir} already holds checkpoints (last step {latest}): pass --resume to "
                            "continue that run, or choose another --out")
    step, state, extra = ckpt.restore(abstract_state=t.run.restore_target())
    state = t.run.load_whole(state)
    # The schedule's numbers are this config's, not the checkpoint's (optim.ScheduleState).
    t.state = type(state)(state.params, t.run.optimizer.with_schedule(state.opt_state), state.step, state.rng)
    t.step = t.start_step = step
    t.data.set_state(extra["data"])
    t.wall_before = float(extra.get("wall_s", 0.0))   # checkpoints written before it was recorded: 0
    # In the dtype they were summed in (float32 label sums): JSON gives float64, and summing on in float64
    # would move the base rate in its ninth digit against an unbroken run.
    dtypes = extra.get("counter_dtypes", {})
    t.counters = {k: np.asarray(v, dtype=dtypes.get(k)) for k, v in extra["counters"].items()}
    for h in t.hooks:
      if extra["hooks"].get(h.key) is not None:
        h.load_state_dict(extra["hooks"][h.key])

  def begin(self, t) -> None:
    for fb in self.checkpointer.fallbacks:  # corrupt checkpoints skipped by the restore (each also warned about)
      t.log({"event": "checkpoint_fallback", "step": t.step, **fb.as_dict()})

  def end_step(self, t) -> None:
    if not (self.checkpointer.should_save(t.step) or t.step in (t.total_steps, t.end_step)):
      return
    # The step's own metrics first, so that every hook's state saved here has seen them (the evaluation's
    # mean train loss, the guard's skipped steps): a run resumed from this checkpoint never drains them.
    t.drain()
    t.mark_busy(t.step)
    t.event("save_begin", t.step)
    extra = {"data": t.data.get_state(), "wall_s": t.wall_s(),
             "counters": {k: np.asarray(v).tolist() for k, v in t.counters.items()},
             "counter_dtypes": {k: str(np.asarray(v).dtype) for k, v in t.counters.items()},
             "hooks": {h.key: h.state_dict() for h in t.hooks}}
    # A copy: the next step donates the state, and an async save must not read donated buffers.
    self.checkpointer.save(t.step, _copy(t.state) if t.run.tables is None else t.run.whole(t.state), extra,
                           force=True)
    t.event("save_started", t.step)

  def end_training(self, t) -> None:
    self.checkpointer.wait()

  def summary(self, t) -> dict:
    return {"checkpoint_fallbacks": [fb.as_dict() for fb in self.checkpointer.fallbacks]}

  partial_summary = summary


class MetricsLog(Hook):
  """Logged train records carry the step, the loss and the task's metrics, examples/s so far, and what other
  hooks add to the drained metrics (the meter's step time and MFU)."""
  key = "log"

  def __init__(self, every: int, progress: bool = True):
    self.every, self.progress, self.bar = every, progress, None

  def begin(self, t) -> None:
    if self.progress and t.writes_files:
      from tqdm import tqdm
      self.bar = tqdm(total=t.total_steps, initial=t.step, unit="step", dynamic_ncols=True)

  def drained(self, t, step: int, host: dict) -> None:
    if step % self.every == 0 or host.get("nonfinite") or step == t.total_steps:
      done = step - t.start_step - 1
      elapsed = time.perf_counter() - t.t_first if t.t_first else 0.0
      rows = t.run.source.batch_size
      t.log({**host, "step": step, "examples_per_s": done * rows / elapsed if done > 0 and elapsed > 0 else None})
      if self.bar is not None:
        self.bar.set_postfix(loss=f"{host['loss']:.4f}")

  def after_step(self, t) -> None:
    if self.bar is not None:
      self.bar.update(1)

  def end_training(self, t) -> None:
    if self.bar is not None:
      self.bar.close()

  def final_eval(self, t, evaluation: dict, task_summary: dict) -> None:
    for task, m in task_summary.get("tasks", {}).items():
      t.log({"final_eval": task, **m})


class Evaluate(Hook):
  """Periodic evaluation of the source's monitor split (default: its first evaluation split); with `select` (a
  metric name), model selection."""
  key = "evaluate"

  def __init__(self, every: int, *, select: str = "", patience: int = 0, max_minutes: float = 0.0,
               steps_per_epoch: int | None = None):
    self.every, self.select, self.patience, self.max_minutes = every, select, patience, max_minutes
    self.steps_per_epoch = steps_per_epoch
    self.best = {"score": None, "step": None}
    self.bad, self.history, self.losses = 0, [], []
    self.best_dir = None
    self.replayed = []   # best-parameter steps newer than the restored checkpoint, deleted by restore
    self.train_s_before = 0.0   # training seconds of the processes before this one (train.max_train_minutes)
    self._kept_from = None      # the best step as of the last checkpoint: best/ keeps it and every later one
    self._train_s = 0.0         # this process's, as of its last step

  def restore(self, t, resume: bool) -> None:
    if self.select:
      # Kept until a checkpoint no longer needs them (state_dict): a run resumed from the last checkpoint, or
      # from the one before if the last one's write was cut off, finds the best parameters it recorded.
      self.best_dir = Checkpointer(os.path.join(t.out_dir, "best"), keep=None, save_every=1, async_save=False)

  def begin(self, t) -> None:
    if self.select:
      # A run stopped between a selecting evaluation and its next checkpoint left parameters of a step that
      # this run takes again from the checkpoint, to the same bits: they go, and the replay saves them anew.
      # Here, not in restore: t.step is the restored step only once every hook has restored.
      self.replayed = self.best_dir.drop_after(t.step)
    if self.replayed:
      t.log({"event": "best_replayed", "step": t.step, "dropped_steps": self.replayed})

  def drained(self, t, step: int, host: dict) -> None:
    self.losses.append(host["loss"])

  def over_time(self, t) -> bool:
    """Whether the run's training time, this process's and its earlier processes' (a resumed run), passed
    train.max_train_minutes."""
    self._train_s = time.perf_counter() - (t.t_first or t.t_start)
    return self.max_minutes > 0 and self.train_s_before + self._train_s > 60 * self.max_minutes

  def after_step(self, t) -> None:
    over_time = self.over_time(t)
    last = t.step == t.total_steps
    if t.step % self.every and not over_time and not (last and self.select):
      return
    if last and not self.select:
      return  # the final evaluation reads every split anyway
    # A source may name the split training may read (None: nothing held out, e.g. the next-item data trained
    # through its validation item); by default its first evaluation split.
    split = getattr(t.run.source, "monitor_split", t.run.source.eval_splits[0])
    if split is None:
      if over_time:
        t.stop(f"time limit: {self.max_minutes} training minutes")
      return
    t.mark_busy(t.step)
    t.drain()  # the mean train loss since the last evaluation includes this step
    evaluation = trainer_lib.evaluate(t.run, t.run.eval_params(t.state), split)
    record = {"eval_step": t.step, **_loggable(evaluation, split)}
    if self.steps_per_epoch:
      record["epoch"] = t.step // self.steps_per_epoch
    if self.losses:
      record["train_loss"] = float(np.mean(self.losses))
    self.losses = []
    t.log(record)
    self.history.append(record)
    if self.select:
      self._select(t, evaluation, split)
    if over_time:
      t.stop(f"time limit: {self.max_minutes} training minutes")

  def _select(self, t, evaluation: dict, split: str) -> None:
    flat = {k.removeprefix("/"): v for k, v in _loggable(evaluation, "").items()}
    direction = t.run.task.selectable().get(self.select)
    if direction is None or self.select not in flat:
      raise KeyError(f"train.select_metric={self.select!r} is not a selectable metric of the {split!r} "
                     f"evaluation: {sorted(t.run.task.selectable())}")
    score = direction * flat[self.select]   # higher is better after the task's sign
    if self.best["score"] is None or score > self.best["score"]:
      self.best = {"score": score, "step": t.step}
      self.bad = 0
      self.best_dir.save(t.step, _kept(t), force=True)
    else:
      self.bad += 1
    if self.patience and self.bad >= self.patience:
      t.stop(f"early stop: no better {split} {self.select} in {self.patience} evaluations")

  def end_training(self, t) -> None:
    if self.select and self.best["step"] is not None:
      _, t.params_for_eval, _ = self.best_dir.restore(self.best["step"], abstract_state=t.run.restore_target().params)

  def summary(self, t) -> dict:
    out = {"evaluations": self.history}
    if self.select:
      out["selected"] = {"metric": self.select, **self.best}
    return out

  def state_dict(self) -> dict:
    # Called as a checkpoint is saved, which records the best step now: best/ drops what neither it nor the
    # checkpoint before (in case this one's write is cut off) can resume to.
    if self.best_dir is not None and self.best["step"] is not None:
      self.best_dir.drop_before(self.best["step"] if self._kept_from is None else self._kept_from)
      self._kept_from = self.best["step"]
    # JSON has no NaN (a task without labels in a small eval set): those metrics are stored by name.
    return _finite({"best": self.best, "bad": self.bad, "history": self.history, "losses": self.losses,
                    "train_s": self.train_s_before + self._train_s})

  def load_state_dict(self, state: dict) -> None:
    state = _floats(state)
    self.best, self.bad, self.history, self.losses = state["best"], state["bad"], state["history"], state["losses"]
    self.train_s_before = state.get("train_s", 0.0)   # checkpoints written before it was kept: 0
    self._kept_from = self.best["step"]


def _loggable(evaluation: dict, split: str) -> dict:
  """{"<split>/<metric>" or "<task>/<metric>": scalar} of an evaluation (entries starting with "_" stay out)."""
  out = {}
  for key, value in evaluation.items():
    if key.startswith("_"):
      continue
    if isinstance(value, dict):
      out.update({f"{key}/{k}": v for k, v in value.items()})
    else:
      out[f"{split}/{key}"] = value
  return out


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _finite(tree):
  """`tree` with every non-finite float as its JSON name ("NaN", "Infinity", "-Infinity"): a checkpoint's JSON
  has no NaN, and `_floats` gives them back, so a resumed run's records equal an unbroken run's."""
  if isinstance(tree, dict):
    return {k: _finite(v) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_finite(v) for v in tree]
  if isinstance(tree, float) and not np.isfinite(tree):
    return "NaN" if np.isnan(tree) else "Infinity" if tree > 0 else "-Infinity"
  return tree


def _floats(tree):
  """The inverse of `_finite`."""
  if isinstance(tree, dict):
    return {k: _floats(v) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_floats(v) for v in tree]
  return _NONFINITE.get(tree, tree) if isinstance(tree, str) else tree


class NonFiniteError(FloatingPointError):
  """Training stopped after consecutive non-finite steps (train.on_nonfinite = "stop", or too many restores)."""


class Guard(Hook):
  """Counts the steps the train step skipped (metrics["nonfinite"]) and, after `patience` of them in a row,
  restores the newest checkpoint from before the streak ("restore", at most `max_restores` times; the data
  goes on, so the streak's batches are skipped, not replayed) or stops ("stop")."""
  key = "guard"

  def __init__(self, patience: int, policy: str, max_restores: int):
    self.patience, self.policy, self.max_restores = patience, policy, max_restores
    self.skipped: list[int] = []
    self.restores: list[dict] = []
    self.streak = 0

  def drained(self, t, step: int, host: dict) -> None:
    if not host.get("nonfinite"):
      self.streak = 0
      return
    self.skipped.append(step)
    self.streak += 1
    if self.streak < self.patience or step == t.total_steps:  # at the end a streak only shows in the summary
      return
    first = step - self.streak + 1
    what = (f"{self.streak} consecutive non-finite steps ({first}..{step}: loss or gradient norm NaN/Inf, "
            "updates skipped)")
    # The step in flight ran on the streak's state and is thrown away with it: read and log it first.
    in_flight = t.take_in_flight()
    applied = False
    if in_flight is not None:
      t.log({**in_flight[1], "step": in_flight[0]})
      applied = not in_flight[1]["nonfinite"]
      if not applied:
        self.skipped.append(in_flight[0])
    ckpt = t.checkpointer
    if self.policy == "stop" or len(self.restores) >= self.max_restores:
      reason = ("train.on_nonfinite=stop" if self.policy == "stop" else
                f"already restored {len(self.restores)} times (train.max_nonfinite_restores)")
      where = f"step {ckpt.latest_step()} in {ckpt.directory}" if ckpt is not None else "none (no checkpoints kept)"
      self._stop(t, step, first, f"{what}; stopping ({reason}); last checkpoint: {where}")
    try:
      restored_step, restored = t.restore_before(first - 1)
    except FileNotFoundError:
      on_disk = ckpt.all_steps() if ckpt is not None else []
      self._stop(t, step, first, f"{what}; no checkpoint from before step {first} to restore (steps on disk: "
                                 f"{on_disk}); stopping")
    # Keep the batch count and the key: the run goes on with new data, not a replay of the bad batches.
    t.state = type(t.state)(restored.params, restored.opt_state, t.state.step, t.state.rng)
    record = {"at_step": t.step, "streak": [first, step], "restored_step": restored_step,
              "updates_discarded": first - 1 - restored_step + int(applied)}
    self.restores.append(record)
    self.streak = 0
    t.log({"event": "nonfinite_restore", "step": t.step, **record})
    print(f"gem_jax: {what}; restored the weights and optimizer state of checkpoint step {restored_step} and "
          "continue with the next batch", flush=True)

  def _stop(self, t, step: int, first: int, message: str):
    if t.checkpointer is not None:
      t.checkpointer.wait()
    t.log({"event": "nonfinite_stop", "step": step, "streak": [first, step]})
    t.writer.close()
    raise NonFiniteError(message)

  def summary(self, t) -> dict:
    return {"nonfinite": {"skipped_steps": self.skipped, "restores": self.restores, "policy": self.policy,
                          "patience": self.patience}}

  partial_summary = summary

  def state_dict(self) -> dict:
    return {"skipped": self.skipped, "restores": self.restores, "streak": self.streak}

  def load_state_dict(self, state: dict) -> None:
    self.skipped, self.restores = state["skipped"], state["restores"]
    self.streak = state.get("streak", 0)   # checkpoints written before it was kept: 0
