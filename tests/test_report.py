"""The efficiency report: analytic vs executed FLOPs of a real train step, rank imbalance, every key rendered."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.observe import flops, report
from gem_jax.run.build import build
from tests.data_helpers import make_examples
from tests.run_helpers import tiny

B = 4


@pytest.mark.slow   # one train-step compile: ~40 s CPU
def test_derived_flops_match_xla_and_padding_waste_is_the_padded_fraction():
  # Dense reference attention: the tiled "xla" impl is a while loop whose body XLA counts once.
  # Wider than tiny (D=128, 64-wide heads): at tiny's 16-wide heads XLA's pointwise ops (mask, bias
  # buckets, SiLU, norms) add ~20% to the matmuls, which the model count leaves out by design.
  cfg = tiny("model.hstu.attn_impl=reference", f"data.pipeline.batch_size={B}", "model.model_dim=128",
             "model.hstu.head_dim=64", "model.hstu.value_dim=64")
  spec, L = cfg.data.spec, cfg.data.spec.sequence.max_len
  run = build(cfg)
  flop_model = flops.FlopModel(run)

  # Unpadded: every row holds max_len >= every keep_last tokens and the capacity is exactly B x max_len.
  full = pipeline.pack(make_examples(spec, np.random.default_rng(0), B, np.full(B, L)), spec, cfg.data.pipeline)
  short = np.array([4, 8, 2, 10])
  padded = pipeline.pack(make_examples(spec, np.random.default_rng(1), B, short), spec, cfg.data.pipeline)
  assert full.history.capacity == int(np.asarray(full.history.offsets)[-1]) == B * L
  # Same shapes, so one compiled program serves both: what XLA executes does not depend on real lengths.
  shapes = lambda b: jax.tree_util.tree_map(np.shape, b)
  assert shapes(full) == shapes(padded)

  compiled = run.train_step.lower(run.state, run.device_batch(full)).compile()
  executed = report.executed_flops(compiled)
  opt = report.optimizer_flops(run.optimizer, run.state.params, run.state.opt_state)
  assert executed and opt and 0 < opt < executed
  model_full = flop_model.train(np.full(B, L))
  assert abs((executed - opt) / model_full - 1) < 0.10, (executed, opt, model_full)

  common = dict(step_times_s=[1.0], num_devices=1, examples_per_step=B, executed_flops_per_step=executed,
                optimizer_flops_per_step=opt, peak_flops_per_device=1e12)
  r_full = report.build(model_flops_per_step=model_full, **common)
  assert abs(r_full["padding_waste"]) < 0.10
  model_short = flop_model.train(short)
  r_pad = report.build(model_flops_per_step=model_short, **common)
  # The padded fraction in FLOPs: the work of the real rows vs the work of full rows (tokens alone miss
  # the quadratic attention and the per-row work that padding does not change).
  padded_fraction = 1 - model_short / model_full
  assert padded_fraction > 0.5
  assert abs(r_pad["padding_waste"] - padded_fraction) < 0.05, (r_pad["padding_waste"], padded_fraction)


def test_balanced_assignment_evens_a_heavy_tailed_batch():
  rng = np.random.default_rng(0)
  # Log-normal lengths cut at max_len 128, as the synthetic stream draws them (len^2 attention cost).
  lengths = np.minimum(rng.lognormal(3.0, 0.8, 256).astype(np.int64) + 1, 128)
  r = report.rank_imbalance(lengths, num_shards=8, seed=0)
  assert r["balanced"] <= 1.05, r
  assert r["random"] >= 1.2, r


def _sharded_program():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("replica",))
  x = jax.device_put(jnp.ones((8, 16), jnp.float32),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica")))
  w = jnp.ones((16, 16), jnp.float32)
  f = jax.jit(lambda x, w: jnp.sum(jnp.matmul(x, w, preferred_element_type=jnp.float32)))
  return f.lower(x, w).compile(), mesh


def test_build_has_every_key_and_renders(tmp_path):
  compiled, mesh = _sharded_program()
  r = report.build(model_flops_per_step=2 * 8 * 16 * 16, step_times_s=[0.3, 0.1, 0.2], num_devices=2,
                   examples_per_step=8, compiled=compiled, mesh=mesh, optimizer_flops_per_step=0.0,
                   peak_flops_per_device=1e9, history_lengths=[1, 2, 3, 40], num_shards=2, compile_s=0.5,
                   one_device={"step_time_s": 0.15, "model_flops_per_step": 2 * 4 * 16 * 16,
                               "examples_per_step": 4})
  assert set(report.KEYS) <= set(r)
  for key in report.KEYS:
    assert r[key] is not None, key
  assert r["step_time_s"] == 0.2 and r["peak_source"] == "mesh file"
  assert r["mfu"] == (2 * 8 * 16 * 16 / 0.2) / (1e9 * 2)
  assert abs(r["scaling_efficiency"] - (8 / 0.2) / (2 * 4 / 0.15)) < 1e-12
  assert r["comm_bytes_per_step"]["by_axis"]["replica"] > 0    # the sum's all-reduce over the two devices
  assert r["memory_bytes_per_device"]["argument"] > 0

  table = report.console_table(r)
  for key in report.KEYS[:-1]:
    assert key in table, key
  assert "all-reduce" in table

  history = {"loss": [1.0, 0.8, 0.7], "mfu": [0.1, 0.2, None]}
  paths = report.plot(r, history, str(tmp_path))
  names = {os.path.basename(p) for p in paths}
  assert names == {"loss.png", "mfu.png", "rank_imbalance.png", "comm_by_axis.png", "memory_by_kind.png"}
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 1000


def test_missing_inputs_give_none_and_a_note():
  r = report.build(model_flops_per_step=1e9, step_times_s=[0.1], num_devices=4, examples_per_step=8,
                   measure_peak=False)
  for key in ("executed_tflops_per_step", "mfu", "hfu", "rank_imbalance", "comm_bytes_per_step",
              "memory_bytes_per_device", "compile_s", "local_mfu", "scaling_efficiency"):
    assert r[key] is None, key
  assert len(r["notes"]) >= 6
  assert "-" in report.console_table(r)


def test_measured_gemm_peak_and_dynamic_loop_note():
  peak = report.measure_gemm_peak(n=128, reps=3)
  assert 1e6 < peak < 1e15
  loop = jax.jit(lambda x, n: jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ c[0], c[1] + 1),
                                                 (x, 0))[0]).lower(jnp.ones((4, 4)), 3).compile()
  r = report.build(model_flops_per_step=1.0, step_times_s=[0.1], num_devices=1, examples_per_step=1,
                   compiled=loop, peak_flops_per_device=None, measure_peak=True)
  assert r["peak_source"] == "measured GEMM" and r["peak_flops_per_device"] > 0
  assert any("while loop" in n for n in r["notes"])


def test_padding_waste_is_none_with_a_note_when_the_optimizer_is_not_below_the_step():
  r = report.build(model_flops_per_step=50.0, step_times_s=[1.0], num_devices=1, examples_per_step=8,
                   executed_flops_per_step=100.0, optimizer_flops_per_step=200.0, peak_flops_per_device=1e12)
  assert r["padding_waste"] is None
  assert any(n.startswith("padding_waste: None, the optimizer's FLOPs (200)") for n in r["notes"]), r["notes"]


def test_a_sparse_engine_runs_optimizer_flops_count_the_dense_update_not_every_table_row():
  from flax import nnx
  from gem_jax.model.embeddings import Table
  from gem_jax.train.efficiency import dense_update_flops
  run = build(tiny("train.embedding_update=sparse"))
  tables, dense = nnx.split_state(run.state.params, Table, ...)
  size = lambda tree: sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tree))
  got = dense_update_flops(run.optimizer, run.state.params, run.state.opt_state, num_devices=1)
  whole = report.optimizer_flops(run.optimizer, run.state.params, run.state.opt_state)
  # AdamW with clipping: ~20 FLOPs an element; row-wise Adagrad over every row: ~7 an element.
  assert 5 * size(dense) <= got <= 40 * size(dense), (got, size(dense))
  assert whole - got >= 3 * size(tables), (whole, got, size(tables))
