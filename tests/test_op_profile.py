"""gem_jax/observe/op_profile.py: exclusive times of nested trace events, the source line of each HLO
instruction from the module's frame tables, and a real trace of a loop whose body holds the big matmul
(the time lands on the matmul's line, not on the loop)."""

import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from gem_jax.observe import op_profile, profile

Event = collections.namedtuple("Event", "name start_ns duration_ns")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_nested_events_keep_only_their_own_time():
  # A loop [0, 100) holding two body ops, the second holding a nested one; then a sibling after the loop.
  events = [Event("while.1", 0, 100), Event("fusion.2", 10, 30), Event("dot.3", 50, 40),
            Event("copy.4", 60, 10), Event("fusion.5", 100, 5)]
  got = op_profile._exclusive(events)
  assert got == {"while.1": 30, "fusion.2": 30, "dot.3": 30, "copy.4": 10, "fusion.5": 5}
  assert sum(got.values()) == 105   # the wall time the line was busy


def _loop(w, x):
  def body(_, h):
    return jnp.tanh(h @ w)   # THE MATMUL
  return jax.lax.fori_loop(0, 8, body, x).sum()


def test_instructions_carry_the_line_that_made_them():
  compiled = jax.jit(_loop).lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile()
  ops = op_profile.hlo_ops(op_profile.module_text(compiled), roots=("tests",))
  line = next(i for i, text in enumerate(open(__file__), 1) if "# THE MATMUL" in text)
  places = {op.where for op in ops.values() if op.opcode in ("dot", "fusion:kCustom", "fusion:kOutput")}
  assert f"tests/test_op_profile.py:{line} _loop.<locals>.body" in places, places
  assert not any(op.backward for op in ops.values())
  grads = jax.jit(jax.grad(_loop)).lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile()
  assert any(op.backward for op in op_profile.hlo_ops(op_profile.module_text(grads), roots=("tests",)).values())


def test_a_traced_loop_gives_its_time_to_the_body_line(tmp_path):
  """The matmul line takes most of the traced busy time (the loop itself only its bookkeeping)."""
  w, x = jnp.full((256, 256), 0.01), jnp.ones((256, 256))
  fn = jax.jit(_loop)
  compiled = fn.lower(w, x).compile()
  ops = op_profile.hlo_ops(op_profile.module_text(compiled), roots=("tests",))
  jax.block_until_ready(compiled(w, x))
  jax.profiler.start_trace(str(tmp_path), profiler_options=profile.trace_options())
  for _ in range(3):
    jax.block_until_ready(compiled(w, x))
  jax.profiler.stop_trace()
  busy = op_profile.exclusive_busy(jax.profiler.ProfileData.from_file(profile.latest_trace(str(tmp_path))).planes)
  assert busy and all(name in ops for name in busy)
  rows = op_profile.attribute(busy, ops, steps=3)
  assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-9
  line = next(i for i, text in enumerate(open(__file__), 1) if "# THE MATMUL" in text)
  top = rows[0]
  assert top["place"] == f"tests/test_op_profile.py:{line} _loop.<locals>.body", rows[:3]
  assert top["share"] > 0.5 and top["pass"] == "fwd"
  loop_rows = [r for r in rows if "while" in r["opcodes"]]
  assert all(r["share"] < top["share"] for r in loop_rows)


def test_the_script_profiles_a_step(tmp_path):
  """Stack S of bench_hstu_stack.py: seconds to build and compile, where a config's full model takes a minute."""
  out = tmp_path / "prof.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "profile_step.py"), "--stack", "S",
                         "--warmup", "0", "--steps", "1", "--top", "5", "--out", str(out)],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "ms/step" in proc.stdout and "by pass:" in proc.stdout
  rows = json.loads(out.read_text())["rows"]
  assert rows and rows[0]["ms_per_step"] > 0
  # The HSTU attention is the stack's biggest place; its loops live in pallas_kernels.
  assert any(r["place"].startswith("pallas_kernels/hstu_attention/") for r in rows[:5]), rows[:5]


@pytest.mark.parametrize("flags, message", [
    (["--stack", "S", "--config", "tiny"], "--config and --set do not change"),
    (["--stack", "S", "--set", "model.num_layers=1"], "--config and --set do not change"),
    (["--config", "tiny", "--impl", "reference"], "--impl goes with --stack"),
])
def test_the_script_refuses_flags_it_would_ignore(flags, message):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "profile_step.py"), *flags],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_an_op_made_in_a_library_goes_to_the_caller_under_the_roots():
  """flax's Linear makes the dot (the innermost frame is flax's); the row is the line here that called it."""
  from flax import nnx
  layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))

  def apply(x):
    return layer(x)   # THE CALL

  ops = op_profile.hlo_ops(op_profile.module_text(jax.jit(apply).lower(jnp.ones((2, 8))).compile()),
                           roots=("tests",))
  line = next(i for i, text in enumerate(open(__file__), 1) if "# THE CALL" in text)
  dots = [op for op in ops.values() if "dot_general" in op.op_name]
  assert dots and all(op.where.startswith(f"tests/test_op_profile.py:{line} ") for op in dots), dots


def test_one_compiled_step_runs_on_batches_of_one_shape():
  """A next-item source pads its batches to several token capacities; the profiler keeps the first batch's
  shape, so its one compiled step accepts every batch it runs (it failed on ML-1M's second batch)."""
  import types

  import numpy as np
  sizes = [512, 1024, 512, 1536, 512, 1024]
  run = types.SimpleNamespace(
      source=types.SimpleNamespace(train_iterator=lambda: iter({"ids": np.zeros(n)} for n in sizes)),
      device_batch=lambda b: b)
  assert [b["ids"].shape for b in op_profile.same_shape_batches(run, 3)] == [(512,)] * 3
  # Fewer of that shape than asked for: the ones found, to be reused in turn.
  assert len(op_profile.same_shape_batches(run, 5)) == 3
