"""The cluster simulator (gem_jax/observe/simulate.py): its behaviour at scale and its helpers.

Its bytes against the compiled HLO (issue 6: within 10% on cpu_8 and cpu_16_5d) are checked in
tests/test_mesh_sweep.py, on the programs the mesh sweep already compiles (tests/run_helpers.py
`assert_matches_hlo`).
"""

import math
import os

import numpy as np
import pytest

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.observe.simulate import model_shapes, simulate
from gem_jax.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(batch=256):
  return apply_overrides(configs.get("tiny"), [f"data.pipeline.batch_size={batch}"])


def _mesh(name):
  return mesh_lib.load(os.path.join(ROOT, "meshes", f"{name}.yaml"))


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
  # Table rows over sparse x fsdp (32 shards): a device holds 1/32 of the 154B rows, f32, and fits.
  assert 154e9 * 4 / 32 * 0.99 < mem["params"] < 154e9 * 4 / 32 * 1.1 and mem["fits"]
  # The sparse engine's largest merge (ad_id: 8 replica copies x 32 owners x the ids a device reads) sets
  # the update's working set, which is larger than the backward's here and never overlaps it.
  assert mem["embedding_update"] > mem["gathered_params"] + mem["activations"]
  assert mem["total"] == mem["params"] + mem["optimizer"] + mem["gradients"] + mem["embedding_update"]
  # tensor sits inside a node (intra bandwidth); fsdp and the table rows over fsdp x sparse cross nodes.
  links = t["bandwidth_by_axis"]
  assert links["tensor"] == "intra" and links["fsdp"] == "inter" and links["fsdp,sparse"] == "inter"


def test_bytes_scale_with_fsdp():
  """Doubling fsdp (at fixed replica x fsdp and global batch) moves a parameter's gather to
  W (n-1)/n of a larger n, halves the gradient-sync block and leaves the per-shard lookups alone."""
  base = _mesh("h200_1024_5d")
  axes = dict(base.axes)

  def with_axes(replica, fsdp):
    a = {**axes, "replica": replica, "fsdp": fsdp}
    # The default rules (table rows over `sparse` alone): the owners of a row stay put as fsdp grows.
    return mesh_lib.MeshSpec(base.name, "", tuple((k, a[k]) for k in mesh_lib.MESH_AXES), base.devices_per_node,
                             base.intra_node, base.hardware)

  cfg = configs.get("base")
  shapes = model_shapes(cfg)  # traced once for both layouts
  s8, s16 = simulate(cfg, with_axes(8, 8), shapes=shapes), simulate(cfg, with_axes(4, 16), shapes=shapes)
  p8, p16 = s8["comm"]["parts"]["params"]["by_kind"], s16["comm"]["parts"]["params"]["by_kind"]
  ratio = (15 / 16) / (7 / 8)
  assert math.isclose(p16["all-gather"] / p8["all-gather"], ratio, rel_tol=0.02)
  assert math.isclose(p16["reduce-scatter"] / p8["reduce-scatter"], ratio, rel_tol=0.02)
  for part in ("embedding_forward", "embedding_backward", "tensor_parallel"):
    assert math.isclose(s16["comm"]["parts"][part]["total"], s8["comm"]["parts"][part]["total"], rel_tol=0.1)
  assert s16["memory"]["optimizer"] < s8["memory"]["optimizer"]


def test_lookups_are_read_off_the_trace_on_samples_of_the_source():
  """Every table the model reads appears with its calls, each call's ids scale with the shard's rows, and
  the distinct ids are those of the sample (Zipf ids repeat: fewer distinct than read, more with more rows)."""
  shapes = model_shapes(_tiny())
  small, large = shapes.lookups(8), shapes.lookups(64)
  assert {k.split("/")[0] for k, _ in small} == {t.name for t in shapes.run.source.spec.tables}
  assert len(small) == len(large)
  distinct = lambda ids_SxN: float(np.mean([np.unique(row).size for row in ids_SxN]))
  for (key, ids), (key64, ids64) in zip(small, large):
    n, n64 = ids.shape[1], ids64.shape[1]
    assert ids.shape[0] == ids64.shape[0] == 8  # the sample shards
    assert key.split("/")[0] == key64.split("/")[0] and n64 == 8 * n, (key, key64)
    assert 1 <= distinct(ids) <= n and distinct(ids) <= distinct(ids64) <= n64, key
  ad_history = next(distinct(ids) / ids.shape[1] for k, ids in large if k.startswith("ad_id/") and ids.shape[1] > 64)
  assert ad_history < 0.5  # the history's ad ids repeat: the capacity is sized on distinct ids, not reads


def test_bad_batch_is_refused():
  with pytest.raises(mesh_lib.MeshFileError, match="batch size 98"):
    simulate(_tiny(), _mesh("cpu_8"), batch_size=98)


def test_host_tables_count_their_caches_on_the_device_and_their_misses_on_the_host_link():
  """tiny with 100,000-row user and ad tables on h200_2x4 (row sharded over sparse 2): ad_id and user_id
  behind 20% caches. The device holds a fifth of their rows and Adagrad sums; every other number is the
  device tier's; the host link's time is the step's bytes over its bandwidth, waited for only past the
  step (a slow link)."""
  import dataclasses

  from gem_jax.data.spec import ads_feature_spec
  mesh = _mesh("h200_2x4")
  cfg = _tiny()
  spec = ads_feature_spec(users=100_000, ads=100_000, advertisers=100, categories=20, embed_dim=16, max_history=32,
                          max_interests=4, num_domains=2)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=spec))
  hosted = apply_overrides(cfg, ["train.host_tables=user_id,ad_id", "train.host_cache_fraction=0.2"])
  device, host = simulate(cfg, mesh), simulate(hosted, mesh)
  assert "host_tables" not in device
  tables = host["host_tables"]["tables"]
  saved = 0.0
  for name, t in tables.items():
    rows, dim = cfg.data.spec.table(name).vocab_size, cfg.data.spec.table(name).dim
    assert t["row_bytes"] == 4 * dim + 4  # f32 row and its row-wise Adagrad sum
    assert t["owners"] == 2 and t["cache_rows_per_owner"] == math.ceil(math.ceil(0.2 * rows) / 2)
    assert t["host_store_bytes"] == rows * t["row_bytes"]
    assert 0 < t["misses_per_step_per_device"] <= t["cache_rows_per_owner"]
    assert t["h2d_bytes_per_step"] == t["misses_per_step_per_device"] * t["row_bytes"] == t["d2h_bytes_per_step"]
    saved += (rows - 2 * t["cache_rows_per_owner"]) * t["row_bytes"] / 2  # per device: its owner shard
  got = device["memory"]["params"] + device["memory"]["optimizer"] - host["memory"]["params"] - host["memory"]["optimizer"]
  assert got == pytest.approx(saved, rel=1e-6)
  assert host["comm"]["total"] == device["comm"]["total"] and host["flops"] == device["flops"]
  t = host["time"]
  link = host["host_tables"]["h2d_bytes_per_step"] / mesh.hardware.host_link_bandwidth
  assert t["host_link_s"] == pytest.approx(link) and t["host_wait_s"] == 0.0 < link < t["step_s"]
  slow = dataclasses.replace(mesh, hardware=dataclasses.replace(mesh.hardware, host_link_bandwidth=1e3))
  t_slow = simulate(hosted, slow)["time"]
  assert t_slow["host_wait_s"] > 0 and t_slow["host_wait_s"] == pytest.approx(t_slow["host_link_s"] - t["step_s"])
  assert t_slow["step_s"] == pytest.approx(t["step_s"] + t_slow["host_wait_s"])
