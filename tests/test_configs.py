"""Every named config builds; its docstring numbers are the computed ones; --set overrides are checked."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.model.gem import GEM
from gem_jax.observe import flops
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import TrainState, make_train_step
from tests.test_flops import unpadded_batch

_DOC = re.compile(r"params: ([\d.]+)([KMB]) sparse, ([\d.]+)([KMB]) dense; forward FLOPs/example at (\d+) "
                  r"history tokens: ([\d.e+]+)")
_SCALE = {"K": 1e3, "M": 1e6, "B": 1e9}


@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
def test_docstring_numbers_are_the_computed_ones(name):
  cfg = configs.get(name)
  m = _DOC.search(configs.CONFIGS[name].__doc__)
  assert m, f"config {name}: docstring lacks the params / FLOPs line"
  sparse, dense = float(m[1]) * _SCALE[m[2]], float(m[3]) * _SCALE[m[4]]
  counts = flops.param_counts(cfg.model, cfg.data.spec)
  assert counts["sparse"] == pytest.approx(sparse, rel=5e-3)
  assert counts["dense"] == pytest.approx(dense, rel=5e-3)
  per_example = flops.model_flops_per_example(cfg.model, cfg.data.spec, int(m[5]))
  assert per_example == pytest.approx(float(m[6]), rel=5e-3)


@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
def test_every_config_traces_a_train_step(name):
  """GPU-scale tables cannot be allocated here, so the step is traced on abstract values (shapes and
  dtypes all the way through model, loss and optimizer), with a batch of 4 full-length rows."""
  cfg = configs.get(name)
  spec = cfg.data.spec
  abstract_model = nnx.eval_shape(lambda: GEM(spec, cfg.model, rngs=nnx.Rngs(0)))
  optimizer = make_optimizer(cfg.train, nnx.state(abstract_model, nnx.Param))
  graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
  opt_state = jax.eval_shape(optimizer.init, params)
  state = TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(jax.random.key, 0))
  step = make_train_step(graphdef, rest, optimizer, spec)
  length = min(spec.sequence.max_len, 8)
  batch = unpadded_batch(spec, 4, length)
  new_state, metrics = jax.eval_shape(step, state, batch)
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


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_configs_run_a_real_train_step(name):
  """The CPU configs also run: a real step on a real synthetic batch changes the parameters."""
  from gem_jax.data import pipeline
  from gem_jax.data.synthetic import SyntheticAdsStream
  from gem_jax.train.step import init_state
  cfg = apply_overrides(configs.get(name), ["data.pipeline.batch_size=16", "data.synthetic.calibration_examples=4096"])
  spec = cfg.data.spec
  stream = SyntheticAdsStream(spec, cfg.data.synthetic)
  batch = next(pipeline.make_iterator(stream, spec, cfg.data.pipeline))
  model = GEM(spec, cfg.model, rngs=nnx.Rngs(0))
  optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer)
  before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(state.params)]
  step = make_train_step(graphdef, rest, optimizer, spec)
  for _ in range(2):  # the warmup schedule starts at lr 0: dense weights move from the second step on
    state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 2
  after = jax.tree_util.tree_leaves(state.params)
  assert sum(not np.array_equal(a, b) for a, b in zip(before, after)) > len(before) // 2
