"""Step-time breakdown from a jax.profiler trace: device compute vs collectives, per device and step.

  trace = StepTrace(directory); trace.start(); ...run k steps...; trace.stop()
  trace.breakdown(num_steps=k, num_devices=n) -> {"compute_s", "collective_s", "source", "events"} | None

Where the ops are read from:
  GPU    the device planes ("/device:GPU:*"), line "XLA Ops" (one event per executed HLO op or fusion);
  CPU    the host plane's XLA threads ("tf_XLAEigen*", "tf_XLAPjRtCpuClient*") and the thread that called
         a synchronously dispatched program (it runs part of it), where the CPU runtime records one event
         per thunk (fusions, dots, all-reduce, ...) among its own bookkeeping events; only events named
         like an HLO instruction count.
Only top-level events of a line count (an all-reduce's nested "Rendezvous" is part of it). Collectives
are recognised by HLO op name (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
their -start/-done halves, NCCL kernels). Times are busy time summed over the devices (or the worker
threads, which virtual CPU devices share) divided by devices and steps: on GPU the per-device seconds a
step spends in each class; on CPU thread-busy seconds, which can exceed the wall time when several
worker threads run at once, so there the split (collective_fraction) is the number to read.
Host/data time is not in the trace's XLA lines; the trainer times it itself.
A backend that records neither kind of line gives None, and the report says the breakdown is unavailable.
"""

from __future__ import annotations

import glob
import os
import re

import jax

COLLECTIVE_RE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                           r"AllReduce|AllGather|ReduceScatter|AllToAll|nccl", re.I)
_HOST_XLA_LINE = re.compile(r"^tf_XLA(Eigen|Cpu|PjRtCpuClient)")
# An HLO instruction's name (fusion.3, all-reduce, ynn_fusion, wrapped_copy): the CPU runtime's thunk
# events. Runtime bookkeeping on the same threads (CommonPjRt..., Rendezvous, "end: ...", waits) is not.
_HLO_NAME = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)*$")


def _top_level(events, keep=lambda name: True):
  """(name, duration_ns) of the kept events not nested in an earlier kept event of the same line."""
  out, end = [], -1
  for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
    if not keep(ev.name) or ev.duration_ns <= 0:
      continue
    if ev.start_ns < end:   # inside the previous top-level event
      continue
    out.append((ev.name, ev.duration_ns))
    end = ev.start_ns + ev.duration_ns
  return out


def xla_lines(planes):
  """(lines, keep, source): the trace lines that hold XLA's op events (the device "XLA Ops" lines, else the
  host's XLA worker threads), which event names on them are ops (`keep`), and a name for that choice."""
  planes = list(planes)   # ProfileData hands out a one-pass iterator
  device = [line for p in planes if p.name.startswith("/device:") for line in p.lines if line.name == "XLA Ops"]
  if device:
    return device, lambda name: True, "device XLA Ops lines"
  host = [line for p in planes if p.name.startswith("/host:") for line in p.lines if _runs_xla(line)]
  return host, _HLO_NAME.match, "host XLA worker threads"


def _runs_xla(line) -> bool:
  """A host thread that ran XLA:CPU's instructions: one of XLA's named threads, or a thread of another name
  that has the runtime's "end: <instruction>" markers: the thread that called a program dispatched
  synchronously (gem_jax/malloc_env.py), which runs part of it itself."""
  return bool(_HOST_XLA_LINE.match(line.name)) or any(
      e.name.startswith("end: ") and _HLO_NAME.match(e.name[5:]) for e in line.events)


def latest_trace(directory: str) -> str | None:
  """The newest *.xplane.pb under `directory`, or None."""
  files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  return files[-1] if files else None


def classify(planes) -> dict | None:
  """{"compute_ns", "collective_ns", "events", "source"} summed over the XLA lines of `planes`."""
  lines, keep, source = xla_lines(planes)
  if not lines:
    return None
  compute = collective = count = 0
  for line in lines:
    for name, dur in _top_level(list(line.events), keep):
      count += 1
      if COLLECTIVE_RE.search(name):
        collective += dur
      else:
        compute += dur
  if count == 0:
    return None
  return {"compute_ns": compute, "collective_ns": collective, "events": count, "source": source}


def trace_options():
  """Device and XLA op events only. The Python tracer records every Python call made while the window is
  open, which `classify` never reads; without it the tiny cpu_8 run (3-step window) took 93 s instead of
  108 s."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  return options


class StepTrace:
  """A jax.profiler trace of a window of train steps, written under `directory`."""

  def __init__(self, directory: str):
    self.directory = directory
    self.active = False
    self.error: str | None = None

  def start(self) -> None:
    try:
      jax.profiler.start_trace(self.directory, profiler_options=trace_options())
      self.active = True
    except Exception as e:  # a profiler already running (user's own trace), or no profiler support
      self.error = f"jax.profiler.start_trace failed: {type(e).__name__}: {e}"

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False

  def breakdown(self, num_steps: int, num_devices: int) -> dict | None:
    """Per-device seconds per step in compute and in collectives; None (and self.error) if unavailable."""
    if self.error:
      return None
    path = latest_trace(self.directory)
    if path is None:
      self.error = f"no *.xplane.pb under {self.directory}"
      return None
    try:
      data = jax.profiler.ProfileData.from_file(path)
      counts = classify(data.planes)
    except Exception as e:  # a trace format this jax cannot read
      self.error = f"reading {path}: {type(e).__name__}: {e}"
      return None
    if counts is None:
      self.error = "the trace has no XLA op lines for this backend"
      return None
    scale = 1e-9 / (num_steps * num_devices)
    busy = counts["compute_ns"] + counts["collective_ns"]
    return {"compute_s": counts["compute_ns"] * scale, "collective_s": counts["collective_ns"] * scale,
            "collective_fraction": counts["collective_ns"] / busy if busy else None,
            "events": counts["events"], "source": counts["source"], "steps": num_steps}
