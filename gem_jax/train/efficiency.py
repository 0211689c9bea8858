"""The efficiency meter as a trainer hook: report.json, plots/, profile/ and the console table of a run.

What is measured and how is gem_jax/observe/meter.py (per-step records without blocking the loop) and
gem_jax/observe/report.py (the report's keys); this hook feeds them from the trainer: the host batch before
each dispatch, each step's drained metrics, the steps an evaluation or a checkpoint shares its time with,
and, after the final evaluation, the compiled program most steps ran. A mesh run also times the same
per-device batch on one device (local MFU, scaling efficiency); a run with the sparse engine gets
"embedding_update" (observe/embedding_update.py: its sync and update bytes against the touched rows).
Only process 0 reports, and only a run that reaches its last step (a run stopped early writes no report).
"""

from __future__ import annotations

import json
import os

import jax

from gem_jax import ops
from gem_jax.observe import embedding_update, flops, hlo, meter as meter_lib, report as report_lib
from gem_jax.run import table_update
from gem_jax.train import trainer as trainer_lib
from gem_jax.train.hooks import Hook


def dense_update_flops(optimizer, params, opt_state, num_devices: int) -> float | None:
  """Executed FLOPs of the optimizer update a sparse-engine step runs on the dense parameters (the whole
  optimizer would update every table row: V x E elements the step never touches), x num_devices."""
  from flax import nnx

  from gem_jax.model.embeddings import Table
  from gem_jax.run.step import dense_update

  def update(params, opt_state, grads):
    return dense_update(optimizer, params, opt_state, nnx.split_state(grads, Table, ...)[1])

  per_device = report_lib.executed_flops(jax.jit(update).lower(params, opt_state, params).compile())
  return per_device * num_devices if per_device is not None else None


class Meter(Hook):
  key = "meter"

  def __init__(self, imbalance_every: int):
    self.imbalance_every = imbalance_every
    self.meter = None
    self.flop_model = None
    self.history = {"loss": [], "mfu": [], "step_time_s": []}
    self.report: dict | None = None
    self.examples = self.tokens = 0
    self.model_flops = 0.0
    self.sparse_engine, self.engine_stats = False, []

  def begin(self, t) -> None:
    if not (t.writes_files and t.end_step == t.total_steps):
      return
    self.flop_model = flops.FlopModel(t.run)
    self.sparse_engine = t.run.cfg.train.embedding_update == "sparse"
    self.meter = meter_lib.RunMeter(t.run, out_dir=t.out_dir, start_step=t.step, end_step=t.end_step,
                                    flop_model=self.flop_model, imbalance_every=self.imbalance_every,
                                    busy_every=(t.run.cfg.train.checkpoint_every, trainer_lib.eval_every(t.run)))
    self.meter.notes += self.flop_model.notes
    # Before the first step donates the state.
    if self.sparse_engine:
      self.optimizer_flops = dense_update_flops(t.run.optimizer, t.state.params, t.state.opt_state,
                                                t.run.num_devices)
      self.meter.notes.append("optimizer FLOPs: the dense parameters' update; the sparse engine updates only "
                              "the rows a batch touched, inside the step (counted in its executed FLOPs)")
    else:
      self.optimizer_flops = meter_lib.optimizer_flops_sharded(t.run.optimizer, t.state.params, t.state.opt_state,
                                                               t.run.num_devices)
    self.meter.state_bytes(t.state)

  def before_batch(self, t) -> None:
    if self.meter is not None:
      self.meter.profile_hook(t.step, wait=lambda: jax.block_until_ready(t.state))
      self.meter.batch_started()

  def before_dispatch(self, t, host_batch) -> None:
    if self.meter is not None:
      self.meter.batch(t.step, host_batch)
      lengths = t.run.lengths(host_batch)
      self.examples += lengths.size
      self.tokens += int(lengths.sum())
      self.model_flops += self.meter.steps[t.step].model_flops / flops.TRAIN_FLOPS_FACTOR

  def step_metrics(self, t, step: int, metrics) -> dict:
    return {} if self.meter is None else self.meter.drained(step - 1)

  def drained(self, t, step: int, host) -> None:
    if self.meter is None:
      return
    if self.sparse_engine:
      self.engine_stats.append({k: float(v) for k, v in host.items() if k.startswith("emb/")})
    for key in self.history:
      self.history[key].append(host.get(key))

  def busy(self, t, step: int) -> None:
    if self.meter is not None:
      self.meter.mark_busy(step)

  def final_eval(self, t, evaluation: dict, task_summary: dict) -> None:
    if self.meter is None:
      return
    key, (compiled, _) = max(t.programs.items(), key=lambda kv: kv[1][1])
    program_steps = None
    if len(t.programs) > 1:
      program_steps = {s for s, k in t.step_programs.items() if k == key}
      self.meter.notes.append(f"compile_s: {len(t.programs)} programs (one per batch shape); FLOPs, comm, memory, "
                              f"step time, MFU/HFU and padding_waste are those of the {len(program_steps)} steps "
                              "that ran the one most steps ran")
    run, one_device = t.run, None
    if run.num_devices > 1:
      rows = run.source.batch_size
      per_device = rows // run.num_devices
      if per_device >= 1:
        one_device = meter_lib.one_device_baseline(run, per_device, self.meter.host_peak, state=t.state,
                                                    flop_model=self.flop_model)
      else:
        self.meter.notes.append(f"local_mfu / scaling_efficiency: batch {rows} is smaller than the "
                                f"{run.num_devices} devices")
    rep = self.meter.finish(compiled=compiled, mesh=run.mesh, optimizer_flops_per_step=self.optimizer_flops,
                            program_steps=program_steps,
                            compile_s=t.compile_s,
                            time_to_first_step_s=t.t_first - t.t_start if t.t_first else None,
                            one_device=one_device, history=self.history)
    if one_device is not None:
      rep["one_device_baseline"] = one_device
      if jax.default_backend() == "cpu":
        rep["notes"].append(f"scaling_efficiency: the {run.num_devices} virtual CPU devices share this host's "
                            f"{os.cpu_count()} cores, so its ceiling here is about {os.cpu_count()}/"
                            f"{run.num_devices}, not 1")
    if self.sparse_engine:
      colls = hlo.collectives(compiled.as_text(), run.mesh) if run.num_devices > 1 else []
      rep["embedding_update"] = embedding_update.account(
          colls, self.engine_stats, table_update.row_bytes(t.state.params, run.optimizer, t.state.opt_state))
    if run.tables is not None:
      rep["host_tables"] = run.tables.report(t.step - t.start_step)
    if ops.hstu_tile_picks():
      rep["hstu_tiles"] = ops.hstu_tile_picks()
    plots = report_lib.plot(rep, self.history, os.path.join(t.out_dir, "plots"))
    rep["plots"] = [os.path.relpath(p, t.out_dir) for p in plots]
    with open(os.path.join(t.out_dir, "report.json"), "w") as f:
      json.dump(rep, f, indent=2, default=float)
    print(f"\nefficiency report ({os.path.join(t.out_dir, 'report.json')}):\n" + report_lib.console_table(rep),
          flush=True)
    self.report = rep

  def summary(self, t) -> dict:
    out = {}
    if self.examples:
      out["forward_flops_per_example"] = self.model_flops / self.examples   # analytic, real tokens (flops.py)
      out["mean_sequence_length"] = self.tokens / self.examples
    if self.report is not None:
      out["efficiency"] = {k: self.report[k] for k in ("mfu", "hfu", "padding_waste", "step_time_s", "local_mfu",
                                                       "scaling_efficiency")}
    return out

