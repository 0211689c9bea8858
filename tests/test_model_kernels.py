"""The model trains the same through every HSTU attention impl, in the one train step (shard_map on the
one-device mesh; Pallas in interpret mode on CPU)."""

import numpy as np
import pytest

from gem_jax.run.build import build
from tests.run_helpers import tiny


def _losses(impl: str, steps: int = 3) -> list[float]:
  # One GEM layer (its HSTU truncates the history to 16 tokens): a second is the same kernel at a shorter length.
  run = build(tiny(f"model.hstu.attn_impl={impl}", "data.pipeline.batch_size=8", "model.num_layers=1",
                   "model.hstu.keep_last=[16]", "data.synthetic.calibration_examples=4096"))
  batches, state, losses = run.source.train_iterator(), run.state, []
  for _ in range(steps):
    state, metrics = run.train_step(state, run.device_batch(next(batches)))
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.slow
def test_pallas_and_xla_train_the_same():
  xla, pallas = _losses("xla"), _losses("pallas")
  np.testing.assert_allclose(pallas, xla, rtol=2e-2)
  assert xla[0] != xla[-1]  # the steps did update the model
