"""The train step against parameters saved from an earlier commit: a refactor of the step or of its table
updates must leave what they compute alone.

tests/data/step_golden.json holds, per case (table update x mesh), a fingerprint of the parameters after
STEPS steps of `tiny` on the stream's first batches: per leaf its float64 sum, sum of squares and eight
entries spread over it. It was written by the step before "one step body" (commit 5bad78f) with

  GEM_JAX_WRITE_GOLDEN=1 python -m pytest tests/test_step_golden.py

On the machine that wrote it the fingerprints agree bit for bit. Another CPU rounds differently (XLA:CPU
vectorizes reductions and approximates exp/tanh per instruction set), and three Adam steps carry that
into the parameters: on a Xeon with AVX-512 (2026-12-04) the worst deviation was 2.0e-5 (sparse_cpu_1,
the relative position bias's entries), 1.3e-5 and 1.6e-5 on cpu_8, every leaf within that, where the
writing machine agreed exactly. The test allows 1e-4 relative. A lost row gradient, a learning rate
applied twice or a skipped write-back moves parameters by a sizeable fraction of an update (Adam's
first steps move every touched entry by about the learning rate): a learning rate 5% off moves them by 5e-2.
"""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from gem_jax.run.build import build
from tests.run_helpers import tiny

GOLDEN = pathlib.Path(__file__).parent / "data" / "step_golden.json"
STEPS = 3
TOLERANCE = 1e-4  # relative; the module docstring says why
# The dense form on one device is held to the sparse engine by tests/test_sparse_engine.py; one step body
# moved its one-device program by float32 roundings (5bad78f -> the next commit: sums of squares within 4e-7).
CASES = {"sparse_cpu_1": ("sparse", None), "sparse_cpu_8": ("sparse", "meshes/cpu_8.yaml"),
         "dense_cpu_8": ("dense", "meshes/cpu_8.yaml")}


def _fingerprint(params) -> dict:
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
    flat = np.asarray(x, np.float64).reshape(-1)
    picks = np.linspace(0, flat.size - 1, 8).astype(int) if flat.size else []
    out[jax.tree_util.keystr(path)] = {"sum": float(flat.sum()), "sumsq": float(np.square(flat).sum()),
                                       "entries": [float(flat[i]) for i in picks]}
  return out


def _trained(case: str) -> dict:
  engine, mesh = CASES[case]
  sets = {"train.embedding_update": engine, "train.warmup_steps": 1}
  run = build(tiny(*([f"mesh={mesh}"] if mesh else []), **sets))
  it = run.source.train_iterator()
  state = run.state
  for _ in range(STEPS):
    state, _ = run.train_step(state, run.device_batch(next(it)))
  return _fingerprint(state.params)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_after_three_steps_match_the_saved_ones(case):
  got = _trained(case)
  if os.environ.get("GEM_JAX_WRITE_GOLDEN"):
    saved = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    saved[case] = got
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    pytest.skip(f"wrote {GOLDEN.name}[{case}]")
  want = json.loads(GOLDEN.read_text())[case]
  assert sorted(got) == sorted(want)
  worst = 0.0
  for leaf, w in want.items():
    g = got[leaf]
    for key in ("sum", "sumsq"):
      scale = max(abs(w[key]), w["sumsq"] ** 0.5, 1e-12)
      worst = max(worst, abs(g[key] - w[key]) / scale)
    scale = max(max(abs(e) for e in w["entries"]), 1e-12)
    worst = max(worst, max(abs(a - b) for a, b in zip(g["entries"], w["entries"])) / scale)
  print(f"{case}: worst relative deviation from the saved parameters {worst:.3g}")
  assert worst <= TOLERANCE, (case, worst)
