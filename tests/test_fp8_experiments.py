"""The FP8 probe and parity jobs (gem_jax/bench/fp8_probe.py, fp8_parity.py: what experiments/fp8_probe.py
and experiments/fp8_parity.py run) end to end on the tiny config, and the FP8 GEMM bench.

The parity numbers themselves (the 0.5% NE criterion) come from `fp8_parity.py --quick`, which takes
minutes; here a few tiny steps check that every policy trains and every reported field is filled.
Compiles dominate the time on CPU; the session's persistent compilation cache (tests/conftest.py) serves the programs
a script compiles twice (fp8_probe's second probe.end_to_end) or that several tests compile (the tiny
bf16 train step of the parity run, test_parity_step_memory and the bench's step table).
"""

import math
import pathlib

import pytest

from gem_jax import configs
from gem_jax.bench import fp8_parity, fp8_probe
from gem_jax.config import apply_overrides



@pytest.mark.slow
def test_probe_gives_rows_and_a_usable_proposal(capsys):
  data = fp8_probe.probe_run(configs.get("tiny"), batches=1, sites="layers.0.hstu.*")
  assert {r["site"] for r in data["sites"]} == {"layers.0.hstu.uvqk", "layers.0.hstu.out"}
  for r in data["sites"]:
    assert all(math.isfinite(v) for q in r["snr_db"].values() for v in q.values())
  assert set(data["proposed"]) == {"layers.0.hstu.uvqk", "layers.0.hstu.out"}
  assert "model.precision.rules=" in data["set_flag"]
  printed = capsys.readouterr().out
  assert "every site's y, dx, dw >= 25.0 dB" in printed and "end-to-end proposal" in printed
  assert data["end_to_end"]["proposed"]["grad_snr_db"] >= 19.0


@pytest.mark.slow
def test_parity_trains_every_policy_and_reports(tmp_path):
  # bf16 against "none" (no policy): the parity machinery is the same for every policy, and an FP8 policy's
  # CPU compile costs a minute more (FP8 training itself: test_precision_policy.py, the bench test below).
  # tiny's own schedule (20 steps, warmup 2): the bf16 run's step is then the very program
  # test_parity_step_memory compiles (the session's compilation cache serves it to both).
  cfg = apply_overrides(configs.get("tiny"), ["train.eval_every=100", "train.checkpoint_every=100",
                                               "model.precision.min_dim=16"])
  data = fp8_parity.parity(cfg, ["bf16", "none"], str(tmp_path / "runs"), str(tmp_path / "parity.json"))
  assert data["baseline"] == "bf16" and set(data["policies"]) == {"bf16", "none"}
  for name, r in data["policies"].items():
    assert set(r["rel_ne_gap"]) == {"click", "conversion"}
    # The tiny eval set may hold no conversion at all (NE undefined); click always has labels.
    assert math.isfinite(r["tasks"]["click"]["eval_ne"]) and math.isfinite(r["rel_ne_gap"]["click"])
    assert "step_memory_bytes" not in r  # only with --memory (test_parity_step_memory)
    assert math.isclose(sum(r["flop_share"].values()), 1.0)
  assert data["policies"]["bf16"]["rel_ne_gap"]["click"] == 0.0
  assert pathlib.Path(data["png"]).stat().st_size > 1000
  # The FLOP shares of an FP8 policy come from the abstract model (nothing compiled).
  assert fp8_parity.flop_shares(cfg, ["fp8"])["fp8"]["mxfp8_rceil"] > 0.3


def test_parity_step_memory():
  """--memory's per-policy numbers: the compiled train step's memory analysis (one policy, one compile;
  tiny's bf16 step, which the parity test's bf16 run has usually compiled into compile_cache already)."""
  cfg = fp8_parity.with_policy(configs.get("tiny"), "bf16")  # the analysis is the same code for every policy
  mem = fp8_parity.step_memory(cfg)
  assert mem["temp_size_in_bytes"] > 0 and mem["argument_size_in_bytes"] > 0


@pytest.mark.slow
def test_fp8_bench_checks_every_kernel_against_the_emulation():
  import numpy as np

  from gem_jax.bench import fp8 as bench
  rng = np.random.default_rng(0)
  gemm = bench.bench_gemm(512, 64, 96, reps=1, rows=bench.gemm_impls(on_gpu=False), rng=rng)
  assert {(r["recipe"], r["impl"]) for r in gemm} >= {("bf16", "xla"), ("rowwise", "xla"), ("mxfp8", "emulate")}
  records = bench.with_ratios(gemm + bench.bench_train_gemm(512, 64, 96, reps=1, rng=rng)
                              + bench.bench_step("tiny", ["bf16", "fp8"], reps=1))
  for r in records:
    if r["table"] == "gemm":
      assert r["error"] is None, r
      assert r["max_rel_err"] <= (0.0 if r["impl"] == "emulate" else 1e-5), r
      assert r["tflops"] > 0 and r["speedup_vs_bf16"] > 0
  assert {r["policy"] for r in records if r["table"] == "step"} == {"bf16", "fp8"}
  assert all(r["median_ms"] > 0 for r in records if r["table"] in ("train", "step"))


@pytest.mark.parametrize("recipe,impl", [("rowwise", "xla"), ("rowwise", "pallas"), ("mxfp8", "pallas")])
def test_gemm_check_passes_kernels_and_fails_a_wrong_scale(recipe, impl, monkeypatch):
  import numpy as np

  from gem_jax.bench import fp8 as bench
  from gem_jax.precision import fp8
  rec = bench.check_gemm(40, 96, 48, recipe, impl, np.random.default_rng(0))
  assert rec["error"] is None and rec["passed"] and 0 <= rec["bound_ratio"] <= 1.0, rec
  # A kernel 1% off (a scale applied slightly wrong) is far outside the summation bound.
  real = fp8.gemm
  monkeypatch.setattr(fp8, "gemm", lambda a, b, r, i: real(a, b, r, i) * (1.0 if i == "emulate" else 1.01))
  assert not bench.check_gemm(40, 96, 48, recipe, impl, np.random.default_rng(0))["passed"]
