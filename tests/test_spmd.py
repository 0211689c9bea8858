"""The SPMD train step on a mesh file (8 virtual CPU devices, cpu_8: fsdp 2 x sparse 2 x tensor 2).

Checks that the mesh computes the one-device function (losses and parameters), that its compiled program
moves embeddings with all-to-all and never gathers a table, and that its parameter traffic is the HSDP
volume the placement implies, on the dense table path (train.embedding_update=dense: a table's gradient is
synced like a dense weight's); the sparse engine on meshes, the 16-device mesh and 20-step trajectories are
in test_mesh_sweep.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from gem_jax.observe import hlo
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import placement
from gem_jax.run.build import build
from tests.run_helpers import tiny, tiny_cpu8_config

STEPS = 3


@pytest.fixture(scope="module")
def setup():
  cfg = tiny("data.pipeline.batch_size=64", "train.embedding_update=dense")
  one = build(cfg)
  batches = [one.source.sample(64, index=i) for i in range(STEPS)]
  state, ref_losses = one.state, []
  for b in batches:
    state, m = one.train_step(state, one.device_batch(b))
    ref_losses.append(float(m["loss"]))
  ref_params = jax.device_get(nnx.to_pure_dict(state.params))

  run = build(dataclasses.replace(cfg, mesh="meshes/cpu_8.yaml"), first_batch=batches[0])
  device_batches = [run.device_batch(b) for b in batches]
  compiled = run.train_step.lower(run.state, device_batches[0]).compile()
  state, losses, metrics = run.state, [], []
  for b in device_batches:
    state, m = compiled(state, b)
    losses.append(float(m["loss"]))
    metrics.append(jax.device_get(m))
  fresh = lambda: build(dataclasses.replace(cfg, mesh="meshes/cpu_8.yaml"), first_batch=batches[0])
  return dict(cfg=cfg, run=run, compiled=compiled, mesh=run.mesh, losses=losses, ref_losses=ref_losses,
              batches=batches, fresh=fresh, params=jax.device_get(nnx.to_pure_dict(state.params)),
              ref_params=ref_params, metrics=metrics, params_host=build(cfg, abstract=True).state.params)


def test_mesh_step_computes_the_one_device_function(setup):
  np.testing.assert_allclose(setup["losses"], setup["ref_losses"], rtol=1e-5)
  flat = jax.tree_util.tree_leaves_with_path(setup["params"])
  ref = dict(jax.tree_util.tree_leaves_with_path(setup["ref_params"]))
  for path, value in flat:
    np.testing.assert_allclose(value, ref[path], rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_mesh_step_skips_a_non_finite_batch(setup):
  """The guard on the mesh: a NaN in one data shard's dense features makes the global loss NaN, and the
  sharded params and optimizer state come back bit for bit unchanged."""
  run, compiled = setup["run"], setup["compiled"]
  assert all(int(m["nonfinite"]) == 0 for m in setup["metrics"])
  batch = setup["batches"][0]
  dense = np.array(batch.dense_BxG)
  dense[5, 0] = np.nan
  poisoned = run.device_batch(dataclasses.replace(batch, dense_BxG=dense))
  state = setup["fresh"]().state   # run.state went to the fixture's steps
  before = jax.device_get(jax.tree_util.tree_leaves((state.params, state.opt_state)))
  state, m = compiled(state, poisoned)
  assert int(m["nonfinite"]) == 1 and not np.isfinite(float(m["loss"]))
  after = jax.device_get(jax.tree_util.tree_leaves((state.params, state.opt_state)))
  assert all(np.array_equal(a, b) for a, b in zip(before, after))
  assert int(state.step) == 1


def test_the_sparse_engine_on_a_mesh_skips_a_non_finite_batch():
  """The same guard with the sparse engine's table update (the default) on cpu_8: rows sent to their owners and
  merged across copies, and still no row, slot, dense parameter or Adam moment moves."""
  cfg = tiny_cpu8_config()   # the step the tiny_cpu8_run fixture compiles (the session cache serves it)
  assert cfg.train.embedding_update == "sparse"
  run = build(cfg)
  batch = run.source.sample(cfg.data.pipeline.batch_size, index=0)
  dense = np.array(batch.dense_BxG)
  dense[9, 1] = np.inf
  poisoned = run.device_batch(dataclasses.replace(batch, dense_BxG=dense))
  before = jax.device_get(jax.tree_util.tree_leaves((run.state.params, run.state.opt_state)))
  state, m = run.train_step(jax.tree_util.tree_map(jnp.copy, run.state), poisoned)
  assert int(m["nonfinite"]) == 1
  after = jax.device_get(jax.tree_util.tree_leaves((state.params, state.opt_state)))
  assert all(np.array_equal(a, b) for a, b in zip(before, after))
  assert int(state.step) == 1
  state, m = run.train_step(state, run.device_batch(batch))   # the next batch trains
  assert int(m["nonfinite"]) == 0
  assert not all(np.array_equal(a, b) for a, b in zip(before, jax.device_get(jax.tree_util.tree_leaves(state.params))))


def test_placement(setup):
  run = setup["run"]
  assert run.plan.table_axes["ad_id"] == ("sparse",) and run.plan.table_axes["user_id"] == ("sparse",)
  assert run.plan.table_axes["device"] == ()  # small tables are replicated, and the plan says so
  assert any("replicated" in n for n in run.plan.notes)
  state = run.state
  table = state.params["embeddings"]["tables"]["ad_id"]
  assert table.get_value().sharding.spec == jax.sharding.PartitionSpec("sparse", None)
  kernel = state.params["layers"][0]["hstu"]["uvqk"]["kernel"]
  assert kernel.get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert all(k.startswith(("ad_id/", "user_id/")) for k in run.capacities)
  # Row-wise Adagrad state is sharded like its table's rows; AdamW moments like their parameters.
  specs = {jax.tree_util.keystr(path): leaf.sharding.spec
           for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state) if hasattr(leaf, "sharding")}
  accumulators = [v for k, v in specs.items() if ".slots[0]" in k and "ad_id" in k]
  assert accumulators == [jax.sharding.PartitionSpec("sparse")]
  assert any(v == jax.sharding.PartitionSpec("fsdp", "tensor") for k, v in specs.items() if "uvqk" in k)


def test_mesh_file_rules_override_the_placement(setup):
  """A mesh file's `rules` block moves table rows onto fsdp x sparse; nothing else changes."""
  with open("meshes/cpu_8.yaml") as f:
    data = yaml.safe_load(f)
  data["rules"] = {"table_rows": ["fsdp", "sparse"]}
  mesh_spec = mesh_lib.parse(data, "cpu_8 + rules")
  p = placement.of(setup["params_host"], mesh_lib.build_mesh(mesh_spec), mesh_spec)
  assert p.table_axes["ad_id"] == ("fsdp", "sparse")
  table = setup["params_host"]["embeddings"]["tables"]["ad_id"]
  assert p.tree_specs({"t": table})["t"] == jax.sharding.PartitionSpec(("fsdp", "sparse"), None)


def test_lookup_moves_ids_and_rows_never_tables(setup):
  colls = hlo.collectives(setup["compiled"].as_text(), setup["mesh"])
  lookup = hlo.select(colls, op_name_contains="embedding_lookup")
  kinds = {c.kind for c in lookup if not c.conditional}
  assert "all-to-all" in kinds and "all-gather" not in kinds
  assert {c.axes for c in lookup if c.kind == "all-to-all"} == {("sparse",)}
  spec = setup["cfg"].data.spec
  sharded = [spec.table(t) for t, axes in setup["run"].plan.table_axes.items() if axes]
  table_bytes = {t.vocab_size * t.dim * 4 // k for t in sharded for k in (1, 2)}  # whole table or a block
  gathered = {c.result_bytes for c in colls if c.kind == "all-gather"}
  assert gathered and not gathered & table_bytes
  # The step reports how many distinct ids each lookup moved, and no round overflowed silently.
  m = setup["metrics"][-1]
  assert any(k.endswith("/remote_unique") and v > 0 for k, v in m.items())


def test_parameter_traffic_is_the_hsdp_volume(setup):
  colls = hlo.collectives(setup["compiled"].as_text(), setup["mesh"])
  # Everything but the lookups, the tensor-parallel activation sums and scalars (loss, counts, norms).
  skip = ("embedding_lookup", "tensor_parallel")
  params = [c for c in colls if not any(k in c.op_name for k in skip) and c.operand_bytes > 64]
  measured = sum(c.moved_bytes * c.count for c in params)
  analytic = placement.analytic_comm(setup["run"].plan, setup["params_host"])
  expected = analytic["dense_total"] + analytic["table_grad_sync"]
  assert 0.9 <= measured / expected <= 1.1, (measured, analytic)
  by_kind = hlo.summarize(params)["by_kind"]
  assert abs(by_kind["all-gather"] / analytic["all-gather"] - 1) < 0.1
  assert abs(by_kind["reduce-scatter"] / analytic["reduce-scatter"] - 1) < 0.1


def test_tensor_parallel_pairs_sum_over_tensor_only(setup):
  """uvqk / out (and the Wukong and tower MLPs) run on slices: their weights are never gathered over
  `tensor`, and their partial products are summed over `tensor` in the forward and backward pass."""
  colls = hlo.collectives(setup["compiled"].as_text(), setup["mesh"])
  tp = hlo.select(colls, op_name_contains="tensor_parallel")
  assert tp and {c.axes for c in tp} == {("tensor",)} and {c.kind for c in tp} == {"all-reduce"}
  assert any("transpose(" in c.op_name for c in tp) and any("transpose(" not in c.op_name for c in tp)
  assert not [c for c in colls if c.kind == "all-gather" and "tensor" in c.axes]
  kernel = setup["run"].state.params["layers"][0]["hstu"]["out"]["kernel"].get_value()
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_context_parallel_mesh_computes_the_one_device_function(setup):
  """cpu_8_cp (fsdp 2, context 2, tensor 2): each HSTU layer splits its token slots over `context`,
  gathers keys / values / outputs, and the losses are still the one-device losses."""
  run = build(dataclasses.replace(setup["cfg"], mesh="meshes/cpu_8_cp.yaml"), first_batch=setup["batches"][0])
  mesh = run.mesh
  device_batches = [run.device_batch(b) for b in setup["batches"]]
  compiled = run.train_step.lower(run.state, device_batches[0]).compile()
  state, losses = run.state, []
  for b in device_batches:
    state, m = compiled(state, b)
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses, setup["ref_losses"], rtol=1e-5)
  cp = hlo.select(hlo.collectives(compiled.as_text(), mesh), op_name_contains="context_parallel")
  assert cp and {c.axes for c in cp} == {("context",)}
  assert {c.kind for c in cp} >= {"all-gather", "reduce-scatter"}  # forward gathers, their transposes


def test_rules_may_not_put_other_axes_on_tensor(setup):
  with open("meshes/cpu_8.yaml") as f:
    data = yaml.safe_load(f)
  data["rules"] = {"embed": "tensor"}
  mesh_spec = mesh_lib.parse(data, "cpu_8 + rules")
  with pytest.raises(mesh_lib.MeshFileError, match="logical axis 'embed'.*only \\('mlp', 'heads'\\)"):
    placement.of(setup["params_host"], mesh_lib.build_mesh(mesh_spec), mesh_spec)


def test_wrong_device_count_names_the_axes():
  spec = mesh_lib.load("meshes/cpu_16_5d.yaml")
  with pytest.raises(mesh_lib.MeshFileError, match=r"needs 16 devices .*replica=2 x fsdp=2 x sparse=2"):
    mesh_lib.check_devices(spec, len(jax.devices()))


def test_batch_not_divisible_over_data_shards():
  spec = mesh_lib.load("meshes/cpu_8.yaml")
  with pytest.raises(mesh_lib.MeshFileError, match="batch size 30 does not divide"):
    mesh_lib.check_batch(spec, 30)
