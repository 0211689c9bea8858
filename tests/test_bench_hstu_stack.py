"""The HSTU stack benchmark (gem_jax/bench/hstu_stack.py): its lengths, its model FLOP count, and one run of a
small stack with each attention impl."""

import numpy as np
import pytest

from gem_jax.bench import hstu_stack


@pytest.fixture
def bench():
  return hstu_stack


def test_lengths_are_heavy_tailed_clipped_and_fixed_by_the_seed(bench):
  m = bench.STACKS["M"]
  a, b = bench.lengths(m, 0), bench.lengths(m, 0)
  assert np.array_equal(a, b) and not np.array_equal(a, bench.lengths(m, 1))
  assert a.shape == (m["batch"],) and a.min() >= 1 and a.max() <= m["max_len"]
  assert np.median(a) < a.mean()  # a long right tail


def test_model_flops_count_real_tokens_and_causal_pairs(bench):
  stack = {"model_dim": 8, "heads": 2, "head_dim": 4, "value_dim": 3, "layers": 2}
  # Rows of 1 and 3 tokens: 4 tokens, 1 + 6 causal pairs.
  proj = 2 * 4 * 8 * (2 * 2 * 3 + 2 * 2 * 4) + 2 * 4 * 2 * 3 * 8
  attn = 2 * 7 * 2 * (4 + 3)
  assert bench.model_flops(stack, [1, 3]) == 3 * 2 * (proj + attn)


def test_a_small_stack_trains_and_reports_its_rates(bench, monkeypatch):
  monkeypatch.setitem(bench.STACKS, "T", {"model_dim": 16, "heads": 2, "head_dim": 8, "value_dim": 8, "layers": 1,
                                          "batch": 4, "max_len": 24, "mean_len": 8})
  for impl in ("xla", "reference"):
    r = bench.child("T", impl, reps=2, seed=0)
    assert r["impl"] == impl and r["tokens"] == int(bench.lengths(bench.STACKS["T"], 0).sum())
    assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["pct_of_gemm_peak"] and np.isfinite(r["loss"])
  assert bench.child("T", "xla", reps=1, seed=0, rel_bias=False)["rel_bias"] is False


def test_tile_configs_time_each_candidate_and_the_default(bench, monkeypatch):
  from pallas_kernels.hstu_attention import tiled
  monkeypatch.setitem(bench.STACKS, "T", {"model_dim": 16, "heads": 2, "head_dim": 8, "value_dim": 8, "layers": 1,
                                          "batch": 4, "max_len": 24, "mean_len": 8})
  rows = bench.tile_configs("T", reps=1, seed=0, candidates=[tiled.TileConfig(8, 2)])
  assert [(r["block"], r["group"], r["default"]) for r in rows] == [
      (8, 2, False), (tiled.DEFAULT_TILES.block, tiled.DEFAULT_TILES.group, True)]
  assert all(r["fwd_bwd_s"] > 0 and r["executed_pairs"] > 0 for r in rows) and rows[1]["vs_default"] == 1.0
  assert "(default)" in bench.tiles_table(rows)


def test_flag_sets_are_columns_of_one_tree_each_run_under_its_flags(bench, monkeypatch):
  seen = []

  def fake_child(tree, stack, impl, reps, seed, rel_bias=True, xla_flags=None):
    seen.append(xla_flags)
    step = 0.02 if xla_flags else 0.04
    return {"step_s": step, "tokens_per_s": 100 / step, "model_flops_per_s": 1.0, "pct_of_gemm_peak": 1.0,
            "compile_s": 1.0, "gemm_peak_flops_per_s": 1e9}

  monkeypatch.setattr(bench, "run_child", fake_child)
  sets = {"default": "", "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
  result = bench.compare({"this": "."}, ["S"], ["xla"], reps=1, rounds=2, seed=0, flag_sets=sets, log=lambda s: None)
  assert sorted(seen) == sorted(["", sets["ynn_dot"]] * 2) and list(result["trees"]) == ["default", "ynn_dot"]
  assert result["medians"]["S/xla"]["ynn_dot"]["step_s"] == 0.02
  table = bench.table(result)
  assert "ynn_dot" in table and "2.00x" in table
  with pytest.raises(ValueError, match="flag sets are compared within one tree"):
    bench.compare({"this": ".", "baseline": "/tmp"}, ["S"], ["xla"], reps=1, rounds=1, seed=0, flag_sets=sets)


def test_dense_dots_time_each_form_and_count_two_calls_a_layer(bench, monkeypatch):
  from gem_jax.bench import timing
  monkeypatch.setitem(bench.STACKS, "T", {"model_dim": 16, "heads": 2, "head_dim": 8, "value_dim": 8, "layers": 3,
                                          "batch": 4, "max_len": 24, "mean_len": 8})
  # The three forms are the products the padded attention makes: w x, w^T x and q k^T per (row, head).
  rng = np.random.default_rng(0)
  w, x, y = rng.standard_normal((2, 1, 5, 5)), rng.standard_normal((2, 1, 5, 3)), rng.standard_normal((2, 1, 5, 3))
  want = {"qk": x @ np.swapaxes(y, -1, -2), "wv": w @ x}
  forms = {spec: np.einsum(spec, *((x, y) if which == "qk" else (w, x))) for _, spec, which in bench.DENSE_DOT_FORMS}
  specs = [spec for _, spec, _ in bench.DENSE_DOT_FORMS]
  np.testing.assert_allclose(forms[specs[0]], want["qk"])
  np.testing.assert_allclose(forms[specs[1]], want["wv"])
  np.testing.assert_allclose(forms[specs[2]], np.swapaxes(w, -1, -2) @ x)
  fake = iter([1.0, 2.0, 4.0])
  monkeypatch.setattr(timing, "median_ms", lambda fn, *args, reps: (fn(*args), next(fake, 5.0))[1])
  r = bench.dense_dots("T", reps=1)
  assert [f["ms"] for f in r["forms"]] == [1.0, 2.0, 4.0]
  assert r["dots_per_step_s"] == pytest.approx(2 * 3 * 7.0 / 1e3)
  assert r["forms"][0]["flops_per_s"] == pytest.approx(2 * 4 * 2 * 24 * 24 * 8 / 1e-3)
  assert r["gemm_peak_flops_per_s"] > 0 and "x3 layers): 42 ms" in bench.dense_dots_table(r)
