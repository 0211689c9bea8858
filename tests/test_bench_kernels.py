"""experiments/bench_kernels.py --quick runs and writes one complete record per (kernel, impl, shape, pass)."""

import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_bench_writes_records(tmp_path):
  spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "experiments" / "bench_kernels.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "bench.json"
  assert bench.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
  data = json.loads(out.read_text())
  kernels = {(r["kernel"], r["impl"]) for r in data["records"]}
  assert ("padded_softmax_baseline", "dense") in kernels and ("hstu_attention", "xla") in kernels
  for r in data["records"]:
    assert r["median_ms"] > 0 and r["real_tflops"] > 0 and r["pct_of_peak"] > 0
    if r["pass"] == "fwd":
      assert r["max_rel_err"] <= 1e-5, r
  assert data["speedups_heavy"] and all(math.isfinite(x["speedup_vs_padded"]) for x in data["speedups_heavy"])
