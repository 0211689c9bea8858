"""The attention benchmark (gem_jax/bench/attention.py) writes one complete record per (kernel, impl, pass):
timed ones with positive rates and a forward that matches the reference, the rest with a reason."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import ops
from gem_jax.bench import attention


def test_every_registered_impl_and_both_baselines_get_a_record():
  shape = attention.Shape(4, 32, 2, 16, "heavy")
  impls = attention.registered_impls(on_gpu=False)
  records = attention.bench_shape(shape, impls=impls, reps=1, peak=1e10, rng=np.random.default_rng(0))
  got = {(r["kernel"], r["impl"], r["pass"]) for r in records}
  want = {(k, i, p) for k, names in (("hstu_attention", ops.hstu_impls()),
                                     ("jagged_softmax_attention", ops.softmax_impls()))
          for i in names if i != "reference" for p in ("fwd", "fwd+bwd")}
  want |= {(k, i, p) for k, i in (("padded_softmax_baseline", "dense"), ("padded_hstu_baseline", "dense"),
                                  ("dot_product_attention", "xla"))
           for p in ("fwd", "fwd+bwd")}
  assert got == want
  for r in records:
    assert r["error"] is None, r
    if r["skipped"]:
      assert r["impl"] == "triton" and r["median_ms"] is None
      continue
    assert r["median_ms"] > 0 and r["real_tflops"] > 0 and r["pct_of_peak"] > 0
    if r["pass"] == "fwd":
      assert r["max_rel_err"] <= 1e-5, r
  ratios = attention.speedups(records)
  assert ratios and all(math.isfinite(x[k]) for x in ratios for k in ("vs_padded", "vs_padded_same_op", "vs_cudnn"))
  # Each impl against the padded baseline of its own operation, and every impl against the softmax one.
  ms = {(r["kernel"], r["pass"]): r["median_ms"] for r in records if r["impl"] in ("xla", "dense")}
  for x in ratios:
    if x["impl"] == "xla":
      own = ms[("padded_hstu_baseline" if x["kernel"] == "hstu_attention" else "padded_softmax_baseline", x["pass"])]
      assert x["vs_padded_same_op"] == own / ms[(x["kernel"], x["pass"])]
      assert x["vs_padded"] == ms[("padded_softmax_baseline", x["pass"])] / ms[(x["kernel"], x["pass"])]


def test_the_padded_baseline_is_skipped_above_its_memory_limit():
  shape = attention.Shape(2, 32, 2, 16, "full")
  impls = {"hstu_attention": {"xla": ops.hstu_impl("xla")}}
  records = attention.bench_shape(shape, impls=impls, reps=1, peak=1e10, rng=np.random.default_rng(0),
                                  dense_limit_bytes=100)
  padded = [r for r in records if r["kernel"] in ("padded_softmax_baseline", "padded_hstu_baseline")]
  assert len(padded) == 4 and all("GB" in r["skipped"] for r in padded)
  # Without the dense reference the forward is checked against the tiled XLA path.
  assert next(r for r in records if r["kernel"] == "hstu_attention" and r["pass"] == "fwd")["max_rel_err"] == 0.0


def test_dot_product_attention_matches_the_jagged_reference():
  shape = attention.Shape(3, 16, 2, 8, "heavy")
  records = attention.bench_shape(shape, impls={}, reps=1, peak=1e10, dtype=jnp.float32,
                                  rng=np.random.default_rng(1))
  fwd = next(r for r in records if r["kernel"] == "dot_product_attention" and r["pass"] == "fwd")
  assert fwd["max_rel_err"] <= 1e-5


def test_interleaved_medians_give_two_identical_calls_the_same_median_on_a_drifting_clock(monkeypatch):
  """A clock whose every interval is longer than the last (a machine slowing down) gives the call timed second a
  larger median when the reps run back to back (all of one call's, then the other's), and still one when they
  alternate A B A B; in the order A B B A over an even number of reps both medians agree."""
  import time as time_lib
  from gem_jax.bench import timing
  readings = []

  def drifting():
    readings.append(None)
    n = len(readings)
    return n * n * 1e-3   # each interval longer than the last

  monkeypatch.setattr(time_lib, "perf_counter", drifting)
  f = lambda x: x + 1
  a, b, failed = timing.interleaved_medians([(f, (1,)), (f, (2,)), (lambda: 1 / 0, ())], reps=6)
  assert a == pytest.approx(b, rel=0.05) and isinstance(failed, ZeroDivisionError)
  assert timing.interleaved_medians([(f, (1,))], reps=3, deadline=0.0) == [None]
