"""The trainer: one function read top to bottom in sections (data, model, restore, loop, eval, summary).

It never blocks the host on the step it just dispatched: step N's metrics are fetched after step N + 1
has been dispatched. It writes into `out_dir`:
  metrics.jsonl   one JSON record per logged train step, per skipped (non-finite) step and per
                  evaluation, and an "event" record per checkpoint fallback and non-finite restore / stop
  checkpoints/    orbax checkpoints (train state with its RNG key, data iterator state, label and
                  non-finite counts), every train.checkpoint_every; a corrupt one is moved to <step>.corrupt
  summary.json    steps, examples/s, and per task eval NE / AUC / calibration next to baseline_ne
                  (predicting the training base rate) and optimal_ne (the planted model, synthetic data);
                  the skipped steps, non-finite restores and checkpoint fallbacks
  report.json     the efficiency report (gem_jax/observe/report.py, meter.py): model vs executed FLOPs,
                  padding waste, MFU/HFU, step time and its profiled breakdown, rank imbalance, comm bytes
                  by kind and mesh axis, memory by kind, compile time; local MFU and scaling efficiency
                  (a mesh run times the same per-device batch on one device after training)
  plots/          PNGs of loss, MFU and step time per step, imbalance, comm by axis, memory by kind
  profile/        the jax.profiler trace of a few steady steps (the report's compute/collective split)
The report's table is printed at the end of the run.
Faults: the config, mesh file and device count are checked (gem_jax/check.py) before anything is built;
a streak of non-finite steps is handled per train.on_nonfinite (see _NonFiniteGuard); a resume takes the
newest checkpoint that passes its integrity hashes. `evaluate_checkpoint` restores a run's checkpoint
onto any mesh.
In a multi-process run every process runs this same function on the same global batches (each places
only its own data shards) and takes part in every checkpoint; only process 0 writes metrics.jsonl,
summary.json and the progress bar, so the run folder looks like that of a single-process run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import check
from gem_jax.config import Config
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.observe import flops
from gem_jax.observe import meter as meter_lib
from gem_jax.observe import report as report_lib
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import spmd
from gem_jax.train import metrics as metrics_lib
from gem_jax.train.checkpoint import Checkpointer, fingerprint
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import TrainState, init_state, make_eval_step, make_train_step

EVAL_START_INDEX = 1 << 30  # eval blocks come from an index range training never reaches


def _jsonable(tree) -> Any:
  return jax.tree_util.tree_map(lambda x: float(x) if np.ndim(x) == 0 else np.asarray(x).tolist(), tree)


class _JsonlWriter:
  """metrics.jsonl; on resume from step k, records past k (written after that checkpoint by the run that
  stopped) are dropped so that every step appears once. path None: write nothing (processes other
  than 0)."""

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
    self._f = open(path, "w")
    self._f.writelines(kept)

  def write(self, record: dict) -> None:
    if self._f is not None:
      self._f.write(json.dumps(record) + "\n")
      self._f.flush()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()


def evaluate(eval_step, params, batches, spec, device_batch=None) -> tuple[dict, dict]:
  """Eval metrics per task for the model and for the planted model (when the data has one).

  device_batch: host batch -> what eval_step takes (on a mesh: placement of an already sharded host
  batch, whose leading data-shard dim the probabilities share).
  """
  model_acc, planted_acc = metrics_lib.TaskMetrics(), metrics_lib.TaskMetrics()
  has_planted = True
  k = len(spec.tasks)
  for batch in batches:
    probs = np.asarray(eval_step(params, device_batch(batch) if device_batch else batch)).reshape(-1, k)
    rows = lambda x: np.asarray(x).reshape(-1, k)
    mask = rows(batch.label_mask_BxK) * np.asarray(batch.example_mask_B).reshape(-1)[:, None]
    model_acc.add(rows(batch.labels_BxK), probs, mask)
    planted = rows(batch.planted_logits_BxK)
    if has_planted and np.all(np.isfinite(planted[mask > 0])):
      planted_acc.add(rows(batch.labels_BxK), 1.0 / (1.0 + np.exp(-planted)), mask)
    else:
      has_planted = False
  names = spec.task_names
  return model_acc.result(names), (planted_acc.result(names) if has_planted else {})


@dataclasses.dataclass
class _Run:
  """Everything a run builds from its config before the first step: data, steps and the placed state."""
  stream: SyntheticAdsStream
  optimizer: Any
  state: TrainState
  train_step: Any
  eval_step: Any
  eval_batches: list
  device_batch: Any = None  # host batch -> the train step's input (None: the batch itself, one device)
  eval_place: Any = None
  mesh_spec: Any = None
  mesh: Any = None

  def abstract_state(self) -> TrainState:
    """The restore target: shapes, dtypes and this run's shardings (a checkpoint from any mesh fits)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                  self.state)


def _build(cfg: Config) -> _Run:
  tc, spec = cfg.train, cfg.data.spec
  stream = SyntheticAdsStream(spec, cfg.data.synthetic)
  eval_batches = pipeline.eval_batches(stream, spec, cfg.data.pipeline, num_examples=tc.eval_examples,
                                       start_index=EVAL_START_INDEX)
  model = GEM(spec, cfg.model, rngs=nnx.Rngs(tc.seed))
  optimizer = make_optimizer(tc, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer, tc.seed)
  del model
  if cfg.mesh is None:
    # Committed to the device, like every restored array: a restore then changes no jit cache key.
    state = jax.device_put(state, jax.local_devices()[0])
    return _Run(stream, optimizer, state, make_train_step(graphdef, rest, optimizer, spec),
                make_eval_step(graphdef, rest), eval_batches)
  mesh_spec = mesh_lib.load(cfg.mesh)
  mesh = mesh_lib.build_mesh(mesh_spec, mesh_devices(mesh_spec))
  # The capacity of the embedding all-to-all is sized on the first training batch (block 0).
  first = pipeline.pack(stream.block(0, cfg.data.pipeline.batch_size), spec, cfg.data.pipeline)
  run = spmd.MeshRun.create(mesh_spec, mesh, graphdef, rest, optimizer, state, spec, cfg.data.pipeline,
                            cfg.model.hstu.keep_last[0], first)
  return _Run(stream, optimizer, run.state, run.train_step, run.eval_step, [run.shard(b) for b in eval_batches],
              run.device_batch, run.place, mesh_spec, mesh)


class NonFiniteError(FloatingPointError):
  """Training stopped after consecutive non-finite steps (train.on_nonfinite = "stop", or too many restores)."""


class _NonFiniteGuard:
  """Counts the steps the train step skipped (metrics["nonfinite"]) and decides, per train.on_nonfinite,
  what a streak of train.nonfinite_patience of them in a row calls for."""

  def __init__(self, tc):
    self.patience, self.policy, self.max_restores = tc.nonfinite_patience, tc.on_nonfinite, tc.max_nonfinite_restores
    self.skipped: list[int] = []   # 1-based steps whose update was skipped
    self.restores: list[dict] = []
    self.streak = 0

  def observe(self, step: int, host: dict) -> str | None:
    """step: the 1-based step whose metrics these are. -> None, "restore" or "stop"."""
    if not host.get("nonfinite"):
      self.streak = 0
      return None
    self.skipped.append(step)
    self.streak += 1
    if self.streak < self.patience:
      return None
    return "stop" if self.policy == "stop" or len(self.restores) >= self.max_restores else "restore"

  def summary(self) -> dict:
    return {"skipped_steps": self.skipped, "restores": self.restores, "policy": self.policy,
            "patience": self.patience}


def train(cfg: Config, out_dir: str, *, resume: bool = False, progress: bool = True,
          stop_after: int | None = None, report: bool = True,
          on_event: Callable[[str, int], None] | None = None) -> dict:
  """Trains `cfg` and returns the summary (also written to out_dir/summary.json).

  stop_after: end this process after that step (with a checkpoint there), as if interrupted; a later
  call with resume=True continues the same run (same schedule, same data) to cfg.train.steps.
  report: write report.json, plots/ and the console table (a run that stops early writes none).
  on_event(name, step): called as the run passes "start" (the step it starts from), "step" (step N
  dispatched), "save_begin" / "save_started" (around handing checkpoint N to the async writer) and "done";
  experiments/fault_drill.py kills the process at these points.
  """
  check.check_config(cfg, None if cfg.mesh is None else mesh_lib.load(cfg.mesh), len(jax.devices()))
  os.makedirs(out_dir, exist_ok=True)
  tc, spec = cfg.train, cfg.data.spec
  writes_files = jax.process_index() == 0
  t_start = time.perf_counter()
  event = on_event or (lambda name, step: None)

  # ---- data, model, optimizer, steps (one device or a mesh) ---------------------------------------
  run = _build(cfg)
  train_iter = pipeline.make_iterator(run.stream, spec, cfg.data.pipeline)
  optimizer, state, train_step, eval_step = run.optimizer, run.state, run.train_step, run.eval_step
  eval_batches, eval_place, device_batch = run.eval_batches, run.eval_place, run.device_batch
  mesh_spec, mesh = run.mesh_spec, run.mesh

  # ---- restore -----------------------------------------------------------------------------------
  ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), keep=tc.keep_checkpoints,
                      save_every=tc.checkpoint_every)
  start_step, positives, seen = 0, np.zeros(len(spec.tasks)), np.zeros(len(spec.tasks))
  guard = _NonFiniteGuard(tc)
  if resume and ckpt.latest_step() is not None:
    start_step, state, extra = ckpt.restore(abstract_state=run.abstract_state())
    train_iter.set_state(extra["data"])
    positives, seen = np.asarray(extra["label_positives"]), np.asarray(extra["label_counts"])
    guard.skipped, guard.restores = extra["nonfinite_skipped"], extra["nonfinite_restores"]
  elif ckpt.latest_step() is not None:
    raise FileExistsError(f"{out_dir} already holds checkpoints (last step {ckpt.latest_step()}): pass "
                          "--resume to continue that run, or choose another --out")
  event("start", start_step)
  log = _JsonlWriter(os.path.join(out_dir, "metrics.jsonl") if writes_files else None,
                     start_step if start_step > 0 else None)
  for fb in ckpt.fallbacks:  # corrupt checkpoints skipped by the restore (each also warned about)
    log.write({"event": "checkpoint_fallback", "step": start_step, **fb.as_dict()})

  # ---- efficiency meter (observe/meter.py): numbers on the host, never a block in the loop ------------
  batch_size = cfg.data.pipeline.batch_size
  end_step = tc.steps if stop_after is None else min(stop_after, tc.steps)
  reporting = report and writes_files and end_step == tc.steps
  meter = optimizer_flops = None
  if reporting:
    num_devices = 1 if mesh_spec is None else mesh_spec.num_devices
    meter = meter_lib.RunMeter(cfg, num_devices=num_devices, mesh_spec=mesh_spec, out_dir=out_dir,
                               data_shards=1 if mesh_spec is None else mesh_spec.data_shards,
                               start_step=start_step, end_step=end_step, imbalance_every=tc.log_every)
    # Before the first step donates the state.
    optimizer_flops = meter_lib.optimizer_flops_sharded(optimizer, state.params, state.opt_state, num_devices)
    meter.state_bytes(state)
  history = {"loss": [], "mfu": [], "step_time_s": []}

  # ---- loop --------------------------------------------------------------------------------------
  bar = None
  if progress and writes_files:
    from tqdm import tqdm
    bar = tqdm(total=tc.steps, initial=start_step, unit="step", dynamic_ncols=True)
  pending = None  # (step, metrics on device) of the last dispatched step, read one step later
  compile_s, t_first = None, None
  programs: dict[tuple, list] = {}  # batch shapes -> [compiled step, steps run]
  model_flops, examples, history_tokens = 0.0, 0, 0  # over the batches of this run (real rows only)


  def drain(pending) -> tuple[int, dict]:
    step, dev_metrics = pending
    host = _jsonable(jax.device_get(dev_metrics))
    if meter is not None:
      host.update(meter.drained(step))
    for key in history:
      history[key].append(host.get(key))
    return step, host

  def on_nonfinite(s: int, action: str, state: TrainState, step_batches: int, in_flight_applied: bool) -> TrainState:
    """A streak of non-finite steps ending at step s (1-based; step_batches batches consumed so far):
    stop, or restore the newest checkpoint from before the streak and go on with the data where it is
    (the batches of the streak are skipped, not replayed)."""
    first = s - guard.streak + 1
    what = (f"{guard.streak} consecutive non-finite steps ({first}..{s}: loss or gradient norm NaN/Inf, "
            f"updates skipped)")
    if action == "stop":
      ckpt.wait()
      log.write({"event": "nonfinite_stop", "step": s, "streak": [first, s]})
      log.close()
      reason = ("train.on_nonfinite=stop" if guard.policy == "stop" else
                f"already restored {len(guard.restores)} times (train.max_nonfinite_restores)")
      raise NonFiniteError(f"{what}; stopping ({reason}); last checkpoint: step {ckpt.latest_step()} in "
                           f"{ckpt.directory}")
    try:
      restored_step, restored, _ = ckpt.restore(abstract_state=run.abstract_state(), max_step=first - 1)
    except FileNotFoundError:
      ckpt.wait()
      log.write({"event": "nonfinite_stop", "step": s, "streak": [first, s]})
      log.close()
      raise NonFiniteError(f"{what}; no checkpoint from before step {first} to restore (steps on disk: "
                           f"{ckpt.all_steps()}); stopping") from None
    # Keep the batch count and the key: the run goes on with new data, not a replay of the bad batches.
    state = TrainState(restored.params, restored.opt_state, state.step, state.rng)
    record = {"at_step": step_batches, "streak": [first, s], "restored_step": restored_step,
              "updates_discarded": first - 1 - restored_step + int(in_flight_applied)}
    guard.restores.append(record)
    guard.streak = 0
    log.write({"event": "nonfinite_restore", "step": step_batches, **record})
    print(f"gem_jax: {what}; restored the weights and optimizer state of checkpoint step {restored_step} "
          f"and continue with the next batch", flush=True)
    return state

  for step in range(start_step, end_step):
    if meter is not None:
      meter.profile_hook(step)
      meter.batch_started()
    batch = next(train_iter)
    labels = np.asarray(batch.labels_BxK) * np.asarray(batch.label_mask_BxK)
    positives += labels.sum(0)
    seen += (np.asarray(batch.label_mask_BxK) * np.asarray(batch.example_mask_B)[:, None]).sum(0)
    lengths = np.asarray(batch.history.lengths())[np.asarray(batch.example_mask_B) > 0]
    model_flops += flops.model_flops(cfg.model, spec, lengths)
    examples += lengths.size
    history_tokens += int(lengths.sum())
    step_batch = device_batch(batch) if device_batch else batch
    if meter is not None:
      meter.batch(step, batch)
    if meter is not None or compile_s is None:
      # Each new batch shape (history bucket) is compiled ahead of time, to time the compile alone and
      # read the program; the call below hits jit's cache.
      shapes = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(step_batch))
      if shapes not in programs:
        t0 = time.perf_counter()
        programs[shapes] = [train_step.lower(state, step_batch).compile(), 0]
        compile_s = (compile_s or 0.0) + time.perf_counter() - t0
      programs[shapes][1] += 1
    state, dev_metrics = train_step(state, step_batch)
    event("step", step + 1)
    if t_first is None:
      jax.block_until_ready(dev_metrics)
      t_first = time.perf_counter()
    if pending is not None:
      s, host = drain(pending)
      action = guard.observe(s + 1, host)
      if (s + 1) % tc.log_every == 0 or host["nonfinite"]:
        elapsed = time.perf_counter() - t_first
        done = s + 1 - start_step - 1
        host.update(step=s + 1, examples_per_s=done * batch_size / elapsed if done > 0 else None)
        log.write(host)
        if bar is not None:
          bar.set_postfix(loss=f"{host['loss']:.4f}", ex_s=f"{host['examples_per_s'] or 0:.0f}")
      if action is not None:
        # The step in flight ran on the streak's state and is discarded with it: read and log it first.
        _, last = drain((step, dev_metrics))
        log.write({**last, "step": step + 1})
        if last["nonfinite"]:
          guard.skipped.append(step + 1)
        state = on_nonfinite(s + 1, action, state, step + 1, in_flight_applied=not last["nonfinite"])
        dev_metrics = None
    pending = None if dev_metrics is None else (step, dev_metrics)
    if bar is not None:
      bar.update(1)
    if ckpt.should_save(step + 1) or step + 1 in (tc.steps, end_step):
      if meter is not None:
        meter.mark_busy(step + 1)
      event("save_begin", step + 1)
      # A copy: the next step donates `state`, and an async save must not read donated buffers.
      ckpt.save(step + 1, jax.tree_util.tree_map(jnp.copy, state),
                {"data": train_iter.get_state(), "label_positives": positives.tolist(),
                 "label_counts": seen.tolist(), "nonfinite_skipped": guard.skipped,
                 "nonfinite_restores": guard.restores}, force=True)
      event("save_started", step + 1)
    if (step + 1) % tc.eval_every == 0 and step + 1 < tc.steps:
      if meter is not None:
        meter.mark_busy(step + 1)
      model_metrics, _ = evaluate(eval_step, state.params, eval_batches, spec, eval_place)
      rec = {"eval_step": step + 1, **{f"{t}/{k}": v for t, m in model_metrics.items() for k, v in m.items()}}
      log.write(rec)
  if pending is not None:
    s, host = drain(pending)
    guard.observe(s + 1, host)  # the run is over: a streak here only shows in the summary
    host.update(step=s + 1)
    log.write(host)
  jax.block_until_ready(state)
  train_s = time.perf_counter() - (t_first or time.perf_counter())
  if bar is not None:
    bar.close()
  ckpt.wait()
  event("done", end_step)
  faults = {"nonfinite": guard.summary(), "checkpoint_fallbacks": [fb.as_dict() for fb in ckpt.fallbacks]}
  if end_step < tc.steps:
    log.close()
    return {"config": cfg.name, "stopped_at": end_step, "steps_this_run": end_step - start_step, **faults}

  # ---- final evaluation and summary ----------------------------------------------------------------
  model_metrics, planted_metrics = evaluate(eval_step, state.params, eval_batches, spec, eval_place)
  base_rates = positives / np.maximum(seen, 1)
  tasks = {}
  for k, task in enumerate(spec.task_names):
    m = model_metrics[task]
    labels, mask = _eval_labels(eval_batches, k)
    baseline = metrics_lib.normalized_entropy(labels, np.full_like(labels, base_rates[k]), mask)
    optimal = planted_metrics.get(task, {}).get("ne", float("nan"))
    tasks[task] = {"eval_ne": m["ne"], "eval_auc": m["auc"], "eval_calibration": m["calibration"],
                   "eval_base_rate": m["base_rate"], "eval_count": m["count"], "baseline_ne": baseline,
                   "optimal_ne": optimal, "optimal_auc": planted_metrics.get(task, {}).get("auc", float("nan")),
                   "gap_closed": (baseline - m["ne"]) / (baseline - optimal) if baseline > optimal else None}
    log.write({"final_eval": task, **tasks[task]})
  log.close()
  steps_run = tc.steps - start_step
  summary = {
      "config": cfg.name,
      "steps": tc.steps,
      "steps_this_run": steps_run,
      "batch_size": batch_size,
      "examples_per_s": (steps_run - 1) * batch_size / train_s if steps_run > 1 and train_s > 0 else None,
      "compile_s": compile_s,
      "wall_s": time.perf_counter() - t_start,
      "params": flops.param_counts(cfg.model, spec),
      "model_flops_per_example": model_flops / max(examples, 1),
      "mean_history_length": history_tokens / max(examples, 1),
      "tasks": tasks,
      **faults,
  }
  if meter is not None:
    # The report reads the program most steps ran (one per history bucket).
    compiled, _ = max(programs.values(), key=lambda p: p[1])
    if len(programs) > 1:
      meter.notes.append(f"compile_s: {len(programs)} programs (one per history bucket); FLOPs, comm and "
                         f"memory are those of the one most steps ran")
    eff = _efficiency_report(cfg, out_dir, meter, compiled=compiled, mesh=mesh, mesh_spec=mesh_spec,
                             optimizer_flops=optimizer_flops, compile_s=compile_s,
                             time_to_first_step_s=t_first - t_start if t_first else None, history=history)
    summary["efficiency"] = {k: eff[k] for k in ("mfu", "hfu", "padding_waste", "step_time_s", "local_mfu",
                                                 "scaling_efficiency")}
  if writes_files:
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary


def evaluate_checkpoint(cfg: Config, out_dir: str, step: int | None = None) -> dict:
  """Evaluates checkpoint `step` (default: the newest usable) of the run in out_dir on cfg's mesh, which
  need not be the mesh that wrote it: the checkpoint is resharded on restore.

  -> {"step", "mesh", "devices", "tasks": {task: eval metrics}, "state_fingerprint"}; the fingerprint
  (hex of the train state's integrity hashes) is the same on every mesh when the restore is bit-exact.
  """
  check.check_config(cfg, None if cfg.mesh is None else mesh_lib.load(cfg.mesh), len(jax.devices()))
  run = _build(cfg)
  with Checkpointer(os.path.join(out_dir, "checkpoints"), keep=cfg.train.keep_checkpoints,
                    save_every=cfg.train.checkpoint_every) as ckpt:
    step, state, _ = ckpt.restore(step, abstract_state=run.abstract_state())
    fallbacks = [fb.as_dict() for fb in ckpt.fallbacks]
  model_metrics, _ = evaluate(run.eval_step, state.params, run.eval_batches, cfg.data.spec, run.eval_place)
  return {"step": step, "mesh": run.mesh_spec.name if run.mesh_spec else None,
          "devices": run.mesh_spec.num_devices if run.mesh_spec else 1, "tasks": model_metrics,
          "state_fingerprint": hashlib.sha256(fingerprint(state).tobytes()).hexdigest()[:16],
          "checkpoint_fallbacks": fallbacks}


def _efficiency_report(cfg, out_dir, meter, *, compiled, mesh, mesh_spec, optimizer_flops, compile_s,
                       time_to_first_step_s, history) -> dict:
  """report.json, plots/ and the console table (process 0, after training and the final eval)."""
  one_device = None
  if mesh_spec is not None and mesh_spec.num_devices > 1:
    per_device = cfg.data.pipeline.batch_size // mesh_spec.num_devices
    if per_device >= 1:
      one_device = meter_lib.one_device_baseline(cfg, per_device, meter.host_peak)
    else:
      meter.notes.append(f"local_mfu / scaling_efficiency: batch {cfg.data.pipeline.batch_size} is smaller "
                         f"than the {mesh_spec.num_devices} devices")
  rep = meter.finish(compiled=compiled, mesh=mesh, optimizer_flops_per_step=optimizer_flops,
                     compile_s=compile_s, time_to_first_step_s=time_to_first_step_s, one_device=one_device,
                     history=history)
  if one_device is not None:
    rep["one_device_baseline"] = one_device
    if jax.default_backend() == "cpu":
      rep["notes"].append(f"scaling_efficiency: the {mesh_spec.num_devices} virtual CPU devices share this host's "
                          f"{os.cpu_count()} cores, so its ceiling here is about {os.cpu_count()}/"
                          f"{mesh_spec.num_devices}, not 1")
  plots = report_lib.plot(rep, history, os.path.join(out_dir, "plots"))
  rep["plots"] = [os.path.relpath(p, out_dir) for p in plots]
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(rep, f, indent=2, default=float)
  print(f"\nefficiency report ({os.path.join(out_dir, 'report.json')}):\n" + report_lib.console_table(rep),
        flush=True)
  return rep


def _eval_labels(batches, k: int):
  num = lambda b: np.asarray(b.labels_BxK).shape[-1]
  labels = np.concatenate([np.asarray(b.labels_BxK).reshape(-1, num(b))[:, k] for b in batches])
  mask = np.concatenate([np.asarray(b.label_mask_BxK).reshape(-1, num(b))[:, k] *
                         np.asarray(b.example_mask_B).reshape(-1) for b in batches])
  return labels, mask


def mesh_devices(mesh_spec) -> list:
  """The devices a mesh file runs on: all of them, which must be exactly as many as the file needs."""
  devices = jax.devices()
  mesh_lib.check_devices(mesh_spec, len(devices))
  return devices
