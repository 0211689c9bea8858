"""Every named config builds; its docstring numbers are the computed ones; --set overrides are checked."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import parquet_source
from gem_jax.observe import flops
from gem_jax.run.build import build
from gem_jax.run.tasks import AdsMultiTaskConfig

_DOC = re.compile(r"params: ([\d.]+)([KMB]) sparse, ([\d.]+)([KMB]) dense; forward FLOPs/example at (\d+) "
                  r"history tokens: ([\d.e+]+)")
_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9}
GEM_CONFIGS = sorted(n for n in configs.CONFIGS if isinstance(configs.get(n).task, AdsMultiTaskConfig))


@pytest.fixture(scope="module")
def built() -> dict:
  """The abstract runs the tests of this module have built, by config name: the docstring test and the
  train-step test of a config share one build (an abstract build of xl traces for 10 s), and
  sharing this fixture keeps them on one xdist worker (conftest.py)."""
  return {}


def _abstract(name, request, built):
  """build(cfg, abstract=True) of a named config, once per module; the next-item configs skip where their data
  is absent, and the Parquet ones read the files the session prepares (conftest.py), or skip where those
  cannot be made."""
  if name not in built:
    cfg = configs.get(name)
    if isinstance(cfg.data, parquet_source.ParquetDataConfig):
      cfg = parquet_source.with_files(cfg, request.getfixturevalue("movielens_prepared"))
    try:
      built[name] = cfg, build(cfg, abstract=True)
    except FileNotFoundError as e:
      built[name] = f"{name}: {e} (set GEM_JAX_DATA_DIR to the shared data root)"
  if isinstance(built[name], str):
    pytest.skip(built[name])
  return built[name]


@pytest.mark.parametrize("name", GEM_CONFIGS)
def test_docstring_numbers_are_the_computed_ones(name, request, built):
  cfg, run = _abstract(name, request, built)
  m = _DOC.search(configs.CONFIGS[name].__doc__)
  assert m, f"config {name}: docstring lacks the params / FLOPs line"
  sparse, dense = float(m[1]) * _SCALE[m[2]], float(m[3]) * _SCALE[m[4]]
  counts = flops.param_counts(run)
  assert counts["sparse"] == pytest.approx(sparse, rel=5e-3)
  assert counts["dense"] == pytest.approx(dense, rel=5e-3)
  per_example, _, _ = flops.trace_row(run, int(m[5]))
  assert per_example == pytest.approx(float(m[6]), rel=5e-3)


@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
def test_every_config_traces_a_train_step(name, request, built):
  """GPU-scale tables cannot be allocated here, so the one train step is traced on abstract values (shapes
  and dtypes all the way through model, loss and optimizer) on a batch of the config's own source."""
  cfg, run = _abstract(name, request, built)
  batch = run.device_batch(run.source.row_batch(min(run.source.max_length(), 8)))
  new_state, metrics = jax.eval_shape(run.train_step, run.state, batch)
  assert metrics["loss"].shape == () and new_state.step.dtype == jnp.int32 and metrics["nonfinite"].shape == ()


def test_overrides_set_nested_fields_and_reject_unknown_keys():
  cfg = apply_overrides(configs.get("tiny"), ["train.steps=7", "model.hstu.keep_last=8,4",
                                              "data.pipeline.batch_size=16"])
  assert cfg.train.steps == 7 and cfg.model.hstu.keep_last == (8, 4) and cfg.data.pipeline.batch_size == 16
  with pytest.raises(ValueError, match="unknown key 'stepz'"):
    apply_overrides(cfg, ["train.stepz=1"])
  with pytest.raises(ValueError, match="cannot parse"):
    apply_overrides(cfg, ["train.steps=many"])
  with pytest.raises(ValueError, match="key=value"):
    apply_overrides(cfg, ["train.steps"])
  with pytest.raises(ValueError, match="keep_last has 1 entries"):
    apply_overrides(cfg, ["model.hstu.keep_last=8"])


@pytest.mark.parametrize("name", ["small"])
def test_cpu_configs_run_a_real_train_step(name):
  """The CPU configs also run: a real step on a real synthetic batch changes the parameters (tiny, the test
  config, trains in most of the suite's tests)."""
  run = build(apply_overrides(configs.get(name), ["data.pipeline.batch_size=16",
                                                  "data.synthetic.calibration_examples=4096"]))
  batch = run.device_batch(next(run.source.train_iterator()))
  state = run.state
  before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(state.params)]
  for _ in range(2):  # the warmup schedule starts at lr 0: dense weights move from the second step on
    state, metrics = run.train_step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 2
  after = jax.tree_util.tree_leaves(state.params)
  assert sum(not np.array_equal(a, b) for a, b in zip(before, after)) > len(before) // 2


@pytest.mark.parametrize("name", ["base", "large", "xl"])
def test_every_gpu_config_names_a_mesh_file_with_a_gpu_target(name):
  """experiments/compile_for.py compiles each GPU config on the mesh file its docstring names (README, "Check
  a GPU config without a GPU"): the file must exist, name a GPU target, and split the config's batch."""
  import os

  from gem_jax.parallel import mesh as mesh_lib
  from gem_jax.parallel import target as target_lib
  named = re.findall(r"meshes/[\w.]+\.yaml", configs.CONFIGS[name].__doc__)
  assert named, f"config {name}: its docstring names no mesh file"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = mesh_lib.load(os.path.join(root, named[0]))
  assert spec.target is not None and target_lib.get(spec.target).platform == "gpu"
  mesh_lib.check_batch(spec, configs.get(name).data.pipeline.batch_size)
