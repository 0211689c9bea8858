"""The step-time breakdown from a jax.profiler trace: top-level events only, collectives by op name."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.observe import profile


def _event(name, start, dur):
  return types.SimpleNamespace(name=name, start_ns=start, duration_ns=dur)


def _plane(name, lines):
  return types.SimpleNamespace(name=name, lines=[types.SimpleNamespace(name=n, events=e) for n, e in lines])


def test_classify_counts_top_level_events_and_splits_collectives():
  host = _plane("/host:CPU", [
      ("python", [_event("PjitFunction(f)", 0, 10_000)]),     # not an XLA line: ignored
      ("tf_XLAEigen/1", [_event("fusion.3", 0, 100), _event("ThreadpoolListener::Record", 5, 0),
                         _event("all-reduce.1", 200, 50), _event("Rendezvous", 210, 30),   # nested
                         _event("end: all-reduce.1", 250, 1), _event("dot.2", 300, 40)]),
      ("tf_XLAEigen/2", [_event("all-to-all.7", 0, 20)]),
      # Runtime bookkeeping wraps thunks on the client threads: only the HLO-named events count.
      ("tf_XLAPjRtCpuClient/3", [_event("ThunkExecutor::Execute (wait for completion)", 0, 1000),
                                 _event("all-gather.1", 10, 30), _event("Wait: pending_threads=1/2", 12, 20),
                                 _event("wrapped_copy", 50, 5)]),
  ])
  got = profile.classify([host])
  assert got == {"compute_ns": 145, "collective_ns": 100, "events": 6, "source": "host XLA worker threads"}
  # GPU planes win over host threads when present.
  gpu = _plane("/device:GPU:0", [("XLA Ops", [_event("reduce-scatter.2", 0, 30), _event("gemm_fusion", 40, 60)]),
                                 ("Other", [_event("memcpy", 0, 1000)])])
  got = profile.classify([host, gpu])
  assert got["source"] == "device XLA Ops lines" and (got["compute_ns"], got["collective_ns"]) == (60, 30)
  assert profile.classify([_plane("/host:CPU", [("python", [_event("x", 0, 5)])])]) is None
  # A synchronously dispatched program runs part of itself on the calling thread, whatever its name: its
  # thunks count there too, found by the runtime's "end: <instruction>" markers.
  caller = ("python", [_event("PjitFunction(f)", 0, 10_000), _event("ynn_fusion", 10, 70),
                       _event("end: ynn_fusion", 80, 1), _event("wrapped_add.2", 90, 6)])
  got = profile.classify([_plane("/host:CPU", [caller, ("tf_XLAEigen/1", [_event("fusion.3", 0, 100)])])])
  assert got == {"compute_ns": 176, "collective_ns": 0, "events": 3, "source": "host XLA worker threads"}


def test_trace_of_a_sharded_program_has_compute_and_collectives(tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  x = jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("d")))
  f = jax.jit(lambda x: jnp.sum((x @ x.T) @ x))
  f(x).block_until_ready()
  trace = profile.StepTrace(str(tmp_path / "trace"))
  trace.start()
  for _ in range(3):
    f(x).block_until_ready()
  trace.stop()
  got = trace.breakdown(num_steps=3, num_devices=2)
  assert got is not None, trace.error
  assert got["compute_s"] > 0 and got["collective_s"] > 0 and 0 < got["collective_fraction"] < 1, got


def test_breakdown_without_a_trace_says_why(tmp_path):
  trace = profile.StepTrace(str(tmp_path / "empty"))
  assert trace.breakdown(num_steps=1, num_devices=1) is None
  assert "xplane" in trace.error


def test_profiler_window_avoids_the_steps_an_evaluation_or_checkpoint_follows():
  from gem_jax.observe.meter import quiet_window
  # Hooks of period 4 run after dispatching steps 3, 7, ...; a window opening at 3 would hold one.
  assert quiet_window(3, 1, (4, 4)) == 4
  assert quiet_window(3, 3, (100, 100)) == 3          # nothing due: the window opens where asked
  assert quiet_window(5, 2, (4, 6)) == 8               # steps 8, 9: 9 and 10 are multiples of neither
  for first, length, periods in ((3, 1, (4, 4)), (5, 2, (4, 6)), (0, 3, (10, 7)), (12, 4, (5, 9))):
    start = quiet_window(first, length, periods)
    assert start >= first
    assert all((s + 1) % p for s in range(start, start + length) for p in periods), (first, length, periods)
  # No quiet window of that length exists (a checkpoint every 2 steps): the asked-for start, not a hang.
  assert quiet_window(3, 3, (2, 100)) == 3
  assert quiet_window(3, 0, (4,)) == 3 and quiet_window(3, 2, ()) == 3


def test_the_breakdown_divides_by_this_processs_devices_and_the_window_waits_for_the_step_before(monkeypatch):
  """Only process 0 traces, and its trace holds its own devices: per-device seconds divide by those (a
  4 x 2 mesh over two processes: 4, not 8). The window opens after the step before it has finished."""
  from types import SimpleNamespace
  from gem_jax.observe import meter
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  assert meter.local_devices(mesh, 8) == 8
  monkeypatch.setattr(jax.sharding, "Mesh", SimpleNamespace)
  fake = SimpleNamespace(devices=np.array([SimpleNamespace(process_index=i // 4) for i in range(8)]).reshape(4, 2))
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert meter.local_devices(fake, 8) == 4
  assert meter.local_devices(jax.sharding.AbstractMesh((8,), ("a",)), 8) == 8   # no devices to ask
  monkeypatch.undo()
  events = []
  m = object.__new__(meter.RunMeter)
  m.trace = SimpleNamespace(start=lambda: events.append("start"), stop=lambda: events.append("stop"))
  m.profile_first, m.profile_last, m.steps = 5, 6, {}
  for step in range(4, 9):
    m.profile_hook(step, wait=lambda step=step: events.append(f"wait before {step}"))
  assert events == ["wait before 5", "start", "wait before 7", "stop"]


def test_with_several_programs_the_reports_per_step_numbers_come_from_the_steps_of_the_one_reported():
  """Steps 1-6 alternate two batch shapes (model FLOPs 1e9 at 0.1 s, 2e9 at 0.2 s); the report reads the
  program of the odd steps: its model FLOPs and step time are theirs, not a mix of both."""
  from gem_jax.observe import meter
  m = object.__new__(meter.RunMeter)
  m.steps = {}
  at = 0.0
  for s in range(7):
    small = s % 2 == 1
    at += 0.1 if small else 0.2
    m.steps[s] = meter._Step(1e9 if small else 2e9, 0.0, 0.0, 8, 0.0, None, drained_at=at)
  m.notes, m.tiled, m.native, m.num_devices, m.peak, m.peak_source = [], False, False, 1, 1e12, "given"
  m.imbalance_shards, m._state_bytes, m.mesh_spec, m.trace = 1, None, None, None
  common = dict(compiled=None, mesh=None, optimizer_flops_per_step=None, compile_s=None, time_to_first_step_s=None,
                one_device=None, history={})
  odd = m.finish(program_steps={1, 3, 5}, **common)
  assert odd["model_tflops_per_step"] == pytest.approx(1e-3) and odd["step_time_s"] == pytest.approx(0.1)
  both = m.finish(**common)
  assert both["model_tflops_per_step"] == pytest.approx(1.5e-3)
