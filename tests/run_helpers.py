"""Helpers shared by the tests of the spine and the trainer: tiny configs, and what a run folder must hold."""

import json
import math
import os

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.observe import report
from gem_jax.parallel import distributed


def child_env(cpu_devices: int | None = None, **extra) -> dict:
  """The environment of a subprocess a test starts: on CPU, with `cpu_devices` virtual devices (None: as
  many as its own flags or mesh ask for) and every other XLA flag of the session (conftest.py), so the
  child compiles its programs the way this process does."""
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=distributed.cpu_device_flags(os.environ.get("XLA_FLAGS"), cpu_devices), **extra)


# One GEM layer of tiny ("key=value" sets): for tests of what does not depend on the model's depth.
ONE_LAYER = ("model.num_layers=1", "model.hstu.keep_last=[32]")


def tiny(*sets: str, **named):
  """The tiny config with `sets` ("key=value") and `named` ({"train.steps": 3}) applied together."""
  return apply_overrides(configs.get("tiny"), list(sets) + [f"{k}={v}" for k, v in named.items()])


# The tiny run on meshes/cpu_8.yaml that several slow tests read (conftest.py's tiny_cpu8_run trains it once
# per session, whichever worker asks first): the single-process reference of the multi-process run, a user's
# cpu_8 efficiency report, and the checkpoint the resharding restore reads on other meshes.
# Tables by the sparse engine (the default), so its row sync runs across processes and its state is
# checkpointed and restored on other meshes. One GEM layer: what these tests check is how the run is laid out
# over devices and processes, and a second layer only adds compile time to each of their processes.
CPU8_SETS = {"train.steps": 8, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 4,
             "train.checkpoint_every": 4, "train.eval_examples": 512, "model.num_layers": 1,
             "model.hstu.keep_last": "[32]"}


def tiny_cpu8_config(*sets: str):
  return tiny("mesh=meshes/cpu_8.yaml", *sets, **CPU8_SETS)


RUN_NUMBERS = ("model_tflops_per_step", "executed_tflops_per_step", "optimizer_tflops_per_step", "padding_waste",
               "mfu", "hfu", "peak_flops_per_device", "step_time_s", "examples_per_s", "compile_s", "local_mfu",
               "scaling_efficiency", "time_to_first_step_s")


def check_run_report(out_dir, num_devices: int, log=None) -> dict:
  """What a training run promises in its folder: report.json with numbers (no placeholders) for every key,
  the PNGs, and (log given) the console table in the run's output."""
  out_dir = str(out_dir)
  with open(os.path.join(out_dir, "report.json")) as f:
    r = json.load(f)
  assert set(report.KEYS) <= set(r), set(report.KEYS) - set(r)
  for key in RUN_NUMBERS:
    assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
  assert r["num_devices"] == num_devices
  assert 0 < r["mfu"] <= r["hfu"] and -0.2 < r["padding_waste"] < 1, r
  assert r["peak_source"] in ("mesh file", "measured GEMM")
  imb = r["rank_imbalance"]
  assert 1.0 <= imb["balanced"] <= imb["random"], imb
  comm = r["comm_bytes_per_step"]
  assert set(comm) == {"by_kind", "by_axis", "total"}
  if num_devices > 1:
    assert comm["total"] > 0 and comm["by_axis"] and comm["by_kind"], comm
    assert r["one_device_baseline"]["step_time_s"] > 0
  else:
    assert comm["total"] == 0 and r["scaling_efficiency"] == 1.0
  memory = r["memory_bytes_per_device"]
  assert memory["argument"] > 0 and memory["temp"] > 0, memory
  engine = r.get("embedding_update")
  if engine is not None:  # train.embedding_update=sparse: its accounting against the touched rows
    assert engine["update_bytes"] >= engine["update_ideal_bytes"] > 0, engine
    assert all(t["touched"] > 0 for t in engine["tables"].values()), engine["tables"]
    if num_devices > 1:
      assert engine["sync_bytes"] > 0 and engine["sync_ideal_bytes"] > 0 and engine["sync_bytes_by_axis"], engine
  breakdown = r["step_breakdown"]
  assert "unavailable" in breakdown or breakdown["compute_s"] > 0, breakdown
  if num_devices > 1 and "unavailable" not in breakdown:
    assert breakdown["collective_s"] > 0, breakdown
  assert len(r["history"]["loss"]) == len(r["history"]["mfu"]) > 0
  expected = {"loss.png", "mfu.png", "step_time_s.png", "rank_imbalance.png", "memory_by_kind.png"}
  if num_devices > 1:
    expected.add("comm_by_axis.png")
  assert {os.path.basename(p) for p in r["plots"]} == expected
  for p in r["plots"]:
    with open(os.path.join(out_dir, p), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  if log is not None:
    text = open(log).read()
    assert "efficiency report" in text and "padding_waste" in text and "scaling_efficiency" in text
  return r


COMM_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def assert_matches_hlo(sim: dict, measured: dict, where: str):
  """Simulated comm against hlo.summarize of the compiled step: totals, each kind, and every axis set that
  carries more than 1 KB (scalar sums of losses and counts are not modelled), each within 10%."""
  assert math.isclose(sim["total"], measured["total"], rel_tol=0.1), (where, sim["total"], measured["total"])
  for kind in COMM_KINDS:
    s, m = sim["by_kind"].get(kind, 0.0), measured["by_kind"].get(kind, 0.0)
    assert math.isclose(s, m, rel_tol=0.1), (where, kind, s, m)
  for axes, m in measured["by_axis"].items():
    if m > 1024:
      assert math.isclose(sim["by_axis"].get(axes, 0.0), m, rel_tol=0.1), (where, axes, sim["by_axis"], m)
