"""The cluster simulator (gem_jax/observe/simulate.py): its behaviour at scale and its helpers.

Its bytes against the compiled HLO (issue 6: within 10% on cpu_8 and cpu_16_5d) are checked in
tests/test_mesh_sweep.py, on the programs the mesh sweep already compiles (`assert_matches_hlo` here).
"""

import math
import os

import pytest

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.observe.simulate import expected_distinct, simulate
from gem_jax.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _tiny(batch=256):
  return apply_overrides(configs.get("tiny"), [f"data.pipeline.batch_size={batch}"])


def _mesh(name):
  return mesh_lib.load(os.path.join(ROOT, "meshes", f"{name}.yaml"))


def assert_matches_hlo(sim: dict, measured: dict, where: str):
  """Simulated comm against hlo.summarize of the compiled step: totals, each kind, and every axis set that
  carries more than 1 KB (scalar sums of losses and counts are not modelled), each within 10%."""
  assert math.isclose(sim["total"], measured["total"], rel_tol=0.1), (where, sim["total"], measured["total"])
  for kind in KINDS:
    s, m = sim["by_kind"].get(kind, 0.0), measured["by_kind"].get(kind, 0.0)
    assert math.isclose(s, m, rel_tol=0.1), (where, kind, s, m)
  for axes, m in measured["by_axis"].items():
    if m > 1024:
      assert math.isclose(sim["by_axis"].get(axes, 0.0), m, rel_tol=0.1), (where, axes, sim["by_axis"], m)


def test_large_on_1024_gpus():
  sim = simulate(configs.get("large"), _mesh("h200_1024_5d"))
  t = sim["time"]
  assert sim["devices"] == 1024
  for key in ("compute_s", "params_comm_s", "exposed_comm_s", "step_s"):
    assert math.isfinite(t[key]) and t[key] > 0, (key, t)
  assert t["step_s"] >= t["compute_s"] + t["exposed_comm_s"]
  assert 0 < sim["mfu"] < 1
  mem = sim["memory"]
  assert mem["fits"] == (mem["total"] <= mem["hbm_bytes"])
  # Tables live on `sparse` (4) only: a device holds a quarter of the 154B rows, f32.
  assert mem["params"] > 154e9 * 4 / 4 * 0.99
  # sparse and tensor sit inside a node (intra bandwidth); fsdp and replica groups cross nodes.
  assert t["bandwidth_by_axis"]["sparse"] == "intra" and t["bandwidth_by_axis"]["fsdp"] == "inter"


def test_bytes_scale_with_fsdp():
  """Doubling fsdp (at fixed replica x fsdp and global batch) moves a parameter's gather to
  W (n-1)/n of a larger n, halves the gradient-sync block and leaves the per-shard lookups alone."""
  base = _mesh("h200_1024_5d")
  axes = dict(base.axes)

  def with_axes(replica, fsdp):
    a = {**axes, "replica": replica, "fsdp": fsdp}
    return mesh_lib.MeshSpec(base.name, "", tuple((k, a[k]) for k in mesh_lib.MESH_AXES), base.devices_per_node,
                             base.intra_node, base.hardware, base.rules)

  cfg = configs.get("base")
  s8, s16 = simulate(cfg, with_axes(8, 8)), simulate(cfg, with_axes(4, 16))
  p8, p16 = s8["comm"]["parts"]["params"]["by_kind"], s16["comm"]["parts"]["params"]["by_kind"]
  ratio = (15 / 16) / (7 / 8)
  assert math.isclose(p16["all-gather"] / p8["all-gather"], ratio, rel_tol=0.02)
  assert math.isclose(p16["reduce-scatter"] / p8["reduce-scatter"], ratio, rel_tol=0.02)
  for part in ("embedding_forward", "embedding_backward", "tensor_parallel"):
    assert math.isclose(s16["comm"]["parts"][part]["total"], s8["comm"]["parts"][part]["total"], rel_tol=0.1)
  assert s16["memory"]["optimizer"] < s8["memory"]["optimizer"]


def test_expected_distinct_matches_sampling():
  import numpy as np
  rng = np.random.default_rng(0)
  v, n, s = 5000, 3000, 1.1
  p = np.arange(1, v + 1, dtype=np.float64) ** -s
  draws = rng.choice(v, size=(20, n), p=p / p.sum())
  sampled = np.mean([len(np.unique(d)) for d in draws])
  assert math.isclose(expected_distinct(v, n, s), sampled, rel_tol=0.02)
  # The tail integral of a huge table stays consistent with the exact sum at the head boundary.
  assert expected_distinct(10**9, 1000, s) <= 1000
  assert expected_distinct(10**9, 10**6, s) > expected_distinct(10**6, 10**6, s)


def test_bad_batch_is_refused():
  with pytest.raises(mesh_lib.MeshFileError, match="batch size 98"):
    simulate(_tiny(), _mesh("cpu_8"), batch_size=98)
