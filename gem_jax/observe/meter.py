"""What the trainer measures for the efficiency report, collected without ever blocking the step loop.

  meter = RunMeter(cfg, num_devices=N, data_shards=S, out_dir=...)
  per step:   meter.batch(step, batch)           host numbers of the batch (before dispatch)
              meter.drained(step)                after step's metrics were fetched (one step late)
              meter.profile_hook(step)           starts / stops the profiler window
  at the end: meter.finish(...) -> report dict   (observe/report.py keys, written to report.json)

Memory per device is XLA's analysis of the compiled step (argument, output, temp = activations and
workspace, peak) plus the shard bytes of the placed parameters and optimizer state.
Per step it keeps the analytic model FLOPs of the real rows, the FLOPs the tiled attention loops execute
(XLA's cost analysis counts a loop body once, observe/flops.py), the rank imbalance of the batch over the
data shards (the pipeline's balanced assignment and a random one; on logged steps only), the host time
spent producing the batch, and the wall time between consecutive metric fetches. The fetch of step N happens after step N + 1
is dispatched, so that interval is the steady-state time of a step; steps around checkpoints, evals and
the profiler window are kept in the per-step series but left out of the median.

The peak FLOP/s per device: the mesh file's peak_bf16_flops, else a jitted GEMM measured in this process
(f32 on CPU). Virtual CPU devices share the host's cores, so on CPU the measured host peak is divided by
the number of devices; the one-device baseline of a mesh run uses the whole host peak.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.observe import flops, hlo, profile, report

PROFILE_AFTER = 3       # steady steps before the window opens
HYPOTHETICAL_SHARDS = 8  # rank imbalance of a one-device run is shown for this many shards


def peak_flops(mesh_spec, num_devices: int) -> tuple[float, str, float, list[str]]:
  """(peak per device, source, whole-host peak, notes) for this run (module docstring)."""
  hw = mesh_spec.hardware if mesh_spec is not None else None
  if hw is not None and hw.peak_bf16_flops:
    return float(hw.peak_bf16_flops), "mesh file", float(hw.peak_bf16_flops), []
  on_cpu = jax.default_backend() == "cpu"
  measured = report.measure_gemm_peak(jnp.float32 if on_cpu else jnp.bfloat16, n=1024 if on_cpu else 8192)
  notes = []
  if on_cpu and num_devices > 1:
    notes.append(f"peak: {num_devices} virtual CPU devices share the host's cores, so the peak per device is "
                 f"the measured host GEMM ({measured:.3g} FLOP/s) / {num_devices}")
    return measured / num_devices, "measured GEMM", measured, notes
  return measured, "measured GEMM", measured, notes


@dataclasses.dataclass
class _Step:
  model_flops: float
  tiled_flops: float
  native_flops: float   # inside the C++ attention kernel's custom calls
  examples: int
  host_s: float
  imbalance: dict | None
  drained_at: float | None = None
  quiet: bool = True    # no eval, checkpoint or profiler work around it


def local_devices(mesh, num_devices: int) -> int:
  """The mesh's devices on this process (a profiler trace holds only those); num_devices for an abstract
  mesh, which has no devices to ask."""
  if not isinstance(mesh, jax.sharding.Mesh):
    return num_devices
  devices = mesh.devices
  me = jax.process_index()
  return sum(1 for d in devices.flat if d.process_index == me)


class RunMeter:
  """Per-step records of one training run (module docstring).

  run: the Run (gem_jax/run/build.py); flop_model: what the FLOPs of a batch are counted with
  (gem_jax/observe/flops.py: train(lengths) of the real rows, tiled_train and native_train(lengths) of every
  row)."""

  def __init__(self, run, *, out_dir: str, start_step: int, end_step: int, flop_model,
               profile_enabled: bool = True, imbalance_every: int = 1, busy_every: tuple[int, ...] = ()):
    self.run, self.flop_model = run, flop_model
    self.num_devices, self.data_shards, self.mesh_spec = run.num_devices, run.data_shards, run.mesh_spec
    self.local_devices = local_devices(run.mesh, self.num_devices)   # what this process's trace holds
    # The balanced assignment is an LPT pass over the batch (~0.6 s at 65k rows): only on logged steps.
    self.imbalance_every = imbalance_every
    self.steps: dict[int, _Step] = {}
    self.notes: list[str] = []
    self.peak, self.peak_source, self.host_peak, notes = peak_flops(self.mesh_spec, self.num_devices)
    self.notes += notes
    self.tiled, self.native = flop_model.tiled, flop_model.native
    self.imbalance_shards = self.data_shards if self.data_shards > 1 else HYPOTHETICAL_SHARDS
    # Readers each balance their own rows over their own shards (report.rank_imbalance); one data shard's
    # hypothetical shards are filled as one reader would.
    self.readers = getattr(run.source, "num_readers", 1) if self.data_shards > 1 else 1
    if self.data_shards == 1:
      self.notes.append(f"rank_imbalance: one data shard; shown for {HYPOTHETICAL_SHARDS} hypothetical shards "
                        "of the same batches")
    self.profile_steps = run.cfg.train.profile_steps  # steps in the profiler window
    self.profile_first = quiet_window(start_step + PROFILE_AFTER, self.profile_steps, busy_every)
    self.profile_last = self.profile_first + self.profile_steps - 1
    self.trace = None
    if not profile_enabled or not self.profile_steps:
      self.notes.append("step_breakdown: profiling disabled")
    elif self.profile_last + 1 >= end_step:
      self.notes.append(f"step_breakdown: the run is too short for a profiler window "
                        f"({PROFILE_AFTER} + {self.profile_steps} steps + 1)")
    else:
      self.trace = profile.StepTrace(os.path.join(out_dir, "profile"))
    self._t_batch = None
    self._state_bytes: dict | None = None

  # ---- during the loop -----------------------------------------------------------------------------

  def batch_started(self) -> None:
    self._t_batch = time.perf_counter()

  def batch(self, step: int, batch) -> None:
    """Host numbers of the step's (global, host) batch; call right before dispatching it."""
    real = self.run.lengths(batch)
    every_row = self.run.lengths(batch, real=False)
    model = self.flop_model.train(real)
    tiled = self.flop_model.tiled_train(every_row) if self.tiled else 0.0
    native = self.flop_model.native_train(every_row) if self.native else 0.0
    imb = None
    if (step + 1) % self.imbalance_every == 0 and every_row.size % self.imbalance_shards == 0:
      imb = report.rank_imbalance(every_row, self.imbalance_shards, seed=step, readers=self.readers)
    host_s = time.perf_counter() - self._t_batch if self._t_batch is not None else 0.0
    self.steps[step] = _Step(model, tiled, native, int(real.size), host_s, imb)
    self._t_batch = None

  def mark_busy(self, step: int) -> None:
    """Step `step` shares its interval with an eval, a checkpoint or the profiler: not in the median."""
    for s in (step, step + 1):
      if s in self.steps:
        self.steps[s].quiet = False

  def profile_hook(self, step: int, wait=None) -> None:
    """Call at the top of the iteration that dispatches `step`. `wait()` blocks until the last dispatched
    step has finished: it runs before the trace starts, so the window holds none of the step before it, and
    before it stops, so the window holds all of its last step (the loop itself never waits for a step it has
    just dispatched; these waits are inside the busy window)."""
    if self.trace is None:
      return
    if step == self.profile_first:
      if wait is not None:   # the step before the window must not run into it
        wait()
      self.trace.start()
    elif step == self.profile_last + 1:
      if wait is not None:
        wait()
      self.trace.stop()
    if self.profile_first <= step <= self.profile_last + 1:
      self.mark_busy(step)

  def drained(self, step: int) -> dict:
    """Record that step's metrics just arrived; returns {"step_time_s", "mfu"} for its log record."""
    now = time.perf_counter()
    rec = self.steps.get(step)
    if rec is None:
      return {}
    rec.drained_at = now
    out = {}
    if rec.imbalance is not None:
      out = {"imbalance_balanced": rec.imbalance["balanced"], "imbalance_random": rec.imbalance["random"]}
    prev = self.steps.get(step - 1)
    if prev is None or prev.drained_at is None:
      return out
    dt = now - prev.drained_at
    return {**out, "step_time_s": dt, "mfu": rec.model_flops / dt / (self.peak * self.num_devices)}

  def state_bytes(self, state) -> None:
    """Bytes per device of the placed parameters and optimizer state (the memory report splits XLA's
    argument bytes into these); call before the first step donates `state`."""
    def per_device(tree) -> float:
      total = 0.0
      for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else np.shape(x)
        total += float(np.prod(shape)) * np.dtype(x.dtype).itemsize
      return total
    self._state_bytes = {"params": per_device(state.params), "optimizer_state": per_device(state.opt_state)}

  # ---- after the loop ------------------------------------------------------------------------------

  def step_times(self) -> dict[int, float]:
    out = {}
    for s, rec in self.steps.items():
      prev = self.steps.get(s - 1)
      if rec.drained_at is not None and prev is not None and prev.drained_at is not None:
        out[s] = rec.drained_at - prev.drained_at
    return out

  def finish(self, *, compiled, mesh, optimizer_flops_per_step: float | None, compile_s: float | None,
             time_to_first_step_s: float | None, one_device: dict | None, history: dict,
             program_steps: set[int] | None = None) -> dict:
    """The report (observe/report.py keys plus the run's own), from the records and the compiled step.
    program_steps: the steps that ran `compiled` when the run compiled several programs (one per batch shape);
    the per-step numbers (model FLOPs, step times) then come from those steps only, so that they and the
    program's executed FLOPs count the same work."""
    times = self.step_times()
    if program_steps is not None:
      times = {s: t for s, t in times.items() if s in program_steps}
    quiet = [t for s, t in times.items() if self.steps[s].quiet]
    if len(quiet) < max(3, len(times) // 2):
      quiet = list(times.values())
    measured = [self.steps[s] for s in times]
    if not measured:
      measured = [r for s, r in self.steps.items() if program_steps is None or s in program_steps]
    model = statistics.fmean(r.model_flops for r in measured) if measured else 0.0
    examples = round(statistics.fmean(r.examples for r in measured)) if measured else 0

    notes = list(self.notes)
    executed = report.executed_flops(compiled) if compiled is not None else None
    source = "XLA cost analysis"
    hlo_text = compiled.as_text() if compiled is not None else None
    loops = report.dynamic_loops(hlo_text) if hlo_text is not None else 0
    if executed is not None:
      executed *= self.num_devices   # the compiled program is one device's
      if self.tiled and loops:
        executed += statistics.fmean(r.tiled_flops for r in measured)
        source = "XLA cost analysis + tiled attention loops (host count of the tiles walked)"
      if self.native:
        executed += statistics.fmean(r.native_flops for r in measured)
        source += " + C++ attention kernel (host count of the pairs its blocks compute)"
    elif compiled is not None:
      notes.append("executed FLOPs: the backend has no cost analysis")
    if not self.tiled and jax.default_backend() == "gpu":
      notes.append("executed FLOPs: attention inside Pallas/Triton custom calls is invisible to XLA's cost "
                   "analysis; HFU and padding_waste exclude it")

    comm = hlo.summarize(hlo.collectives(hlo_text, mesh)) if compiled is not None and mesh is not None else None
    if compiled is not None and mesh is None:
      comm = {"by_kind": {}, "by_axis": {}, "total": 0.0}   # one device: no collectives

    imbalances = [r.imbalance for r in self.steps.values() if r.imbalance is not None]
    imbalance = None
    if imbalances:
      imbalance = {"balanced": statistics.median(i["balanced"] for i in imbalances),
                   "random": statistics.median(i["random"] for i in imbalances),
                   "balanced_max": max(i["balanced"] for i in imbalances),
                   "random_max": max(i["random"] for i in imbalances),
                   "num_shards": self.imbalance_shards, "readers": self.readers, "steps": len(imbalances)}

    out = report.build(
        model_flops_per_step=model, step_times_s=quiet, num_devices=self.num_devices,
        examples_per_step=examples, compiled=None, executed_flops_per_step=executed,
        optimizer_flops_per_step=optimizer_flops_per_step, comm=comm,
        memory=hlo.memory(compiled) if compiled is not None else None,
        peak_flops_per_device=self.peak, measure_peak=False, compile_s=compile_s, one_device=one_device)
    out["peak_source"] = self.peak_source
    out["rank_imbalance"] = imbalance
    out["notes"] = [n for n in out["notes"] if not n.startswith(("rank_imbalance", "executed FLOPs: no"))]
    if imbalance is None:
      notes.append(f"rank_imbalance: batch rows do not split over {self.imbalance_shards} shards")
    if compiled is not None and self.tiled and loops == 0:
      notes.append("executed FLOPs: the tiled attention loops were not found in the program")
    if self._state_bytes is not None and out["memory_bytes_per_device"]:
      out["memory_bytes_per_device"].update(self._state_bytes)
    if self.mesh_spec is not None and self.mesh_spec.hardware.hbm_bytes and out["memory_bytes_per_device"]:
      out["memory_bytes_per_device"]["hbm_bytes"] = float(self.mesh_spec.hardware.hbm_bytes)
    out["executed_flops_source"] = source if executed is not None else None
    out["time_to_first_step_s"] = time_to_first_step_s
    host = [r.host_s for r in measured]
    breakdown = self.trace.breakdown(self.profile_steps, self.local_devices) if self.trace is not None else None
    if breakdown is not None:
      breakdown["host_data_s"] = statistics.median(host) if host else None
      window = [t for s, t in times.items() if self.profile_first <= s <= self.profile_last]
      breakdown["window_step_time_s"] = statistics.median(window) if window else None
      if breakdown["source"].startswith("device") and out["step_time_s"]:
        # Device time not spent in ops: launch gaps, host waits, the data pipeline.
        breakdown["idle_s"] = max(0.0, out["step_time_s"] - breakdown["compute_s"] - breakdown["collective_s"])
      else:
        notes.append("step_breakdown: CPU worker threads overlap, so compute_s / collective_s are thread-busy "
                     "seconds per device; read collective_fraction")
      out["step_breakdown"] = breakdown
    else:
      reason = (self.trace.error if self.trace is not None else None) or "no profiler window"
      out["step_breakdown"] = {"unavailable": reason, "host_data_s": statistics.median(host) if host else None}
      notes.append(f"step_breakdown: compute/collective split unavailable ({reason})")
    out["notes"] = notes + out["notes"]
    out["history"] = history
    return out


def quiet_window(first: int, length: int, busy_every: tuple[int, ...]) -> int:
  """The first step >= `first` of a profiler window of `length` steps during which no evaluation or
  checkpoint runs. A hook with period p runs after dispatching step s when (s + 1) % p == 0, and the window
  closes only when the step after it is dispatched, so those hooks would run inside it: on the tiny cpu_8
  run an evaluation (its compile and 2,048 examples) made the window 303k trace events instead of 13k, and
  stopping the trace took 23 s instead of 1.3 s."""
  periods = [p for p in busy_every if p and p > 0]
  if length <= 0 or not periods or min(periods) <= length:  # no quiet window of that length exists
    return first
  busy = lambda start: any((s + 1) % p == 0 for s in range(start, start + length) for p in periods)
  return next((start for start in range(first, first + max(periods)) if not busy(start)), first)


def one_device_baseline(run, per_device_batch: int, peak_flops: float, steps: int = 5, *, state=None,
                        flop_model=None) -> dict:
  """Step time of the same config at `per_device_batch` rows on one device (the first), for local MFU and
  scaling efficiency: compiled, warmed up once, then the median of `steps` blocked steps, all on the
  source's first batch (one batch shape, so one compile: the history buckets of later batches would each
  compile their own program, ~5 s apiece on the test suite's flags).

  state: the mesh run's train state, copied to the one device (the baseline is then built abstractly:
  nothing is initialized or compiled but its train step); default, or when another process holds part of
  it: a fresh one-device build.
  flop_model: the mesh run's flops.FlopModel (a model's FLOPs per row do not depend on the mesh)."""
  from gem_jax.run.build import build

  cfg = run.cfg
  one = dataclasses.replace(cfg, mesh=None, data=_with_batch_size(cfg.data, per_device_batch))
  if state is not None and not all(getattr(x, "is_fully_addressable", True) for x in jax.tree_util.tree_leaves(state)):
    state = None  # another process holds part of it
  with jax.default_device(jax.devices()[0]):
    single = build(one, devices=jax.devices()[:1], abstract=state is not None)
    if state is not None:
      state = jax.tree_util.tree_map(lambda x, like: jax.device_put(x, like.sharding), state, single.state)
    else:
      state = single.state
    batch = next(single.source.train_iterator())
    device_batch = single.device_batch(batch)
    times = []
    for i in range(steps + 1):
      t = time.perf_counter()
      state, m = single.train_step(state, device_batch)
      jax.block_until_ready(m)
      if i:
        times.append(time.perf_counter() - t)
    model_flops = (flop_model or flops.FlopModel(single)).train(single.source.lengths(batch))
  return {"step_time_s": statistics.median(times), "model_flops_per_step": model_flops,
          "examples_per_step": per_device_batch, "peak_flops_per_device": peak_flops, "steps": steps}


def _with_batch_size(data_cfg, rows: int):
  """A data config with training batches of `rows` rows (the synthetic pipeline or a source's batch_size)."""
  if hasattr(data_cfg, "readers"):  # one reader: one device's batch, whatever order the run reads in
    data_cfg = dataclasses.replace(data_cfg, readers=1)
  if hasattr(data_cfg, "pipeline"):
    return dataclasses.replace(data_cfg, pipeline=dataclasses.replace(data_cfg.pipeline, batch_size=rows))
  return dataclasses.replace(data_cfg, batch_size=rows)


def optimizer_flops_sharded(optimizer, params, opt_state, num_devices: int) -> float | None:
  """Executed FLOPs of one optimizer update on the run's placement (replicated leaves count on every
  device that updates them); the compiled program is one device's, so x num_devices."""
  per_device = report.optimizer_flops(optimizer, params, opt_state)
  return per_device * num_devices if per_device is not None else None
