"""The model trains the same through every HSTU attention impl (Pallas in interpret mode on CPU)."""

import numpy as np
import pytest
from flax import nnx

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import init_state, make_train_step


def _losses(impl: str, steps: int = 3) -> list[float]:
  cfg = apply_overrides(configs.get("tiny"), [f"model.hstu.attn_impl={impl}", "data.pipeline.batch_size=8",
                                              "data.synthetic.calibration_examples=4096"])
  spec = cfg.data.spec
  batches = pipeline.make_iterator(SyntheticAdsStream(spec, cfg.data.synthetic), spec, cfg.data.pipeline)
  model = GEM(spec, cfg.model, rngs=nnx.Rngs(0))
  optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer)
  step = make_train_step(graphdef, rest, optimizer, spec)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, next(batches))
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.slow
def test_pallas_and_xla_train_the_same():
  xla, pallas = _losses("xla"), _losses("pallas")
  np.testing.assert_allclose(pallas, xla, rtol=2e-2)
  assert xla[0] != xla[-1]  # the steps did update the model
