"""Layer builders shared by the model files: dtypes from the ModelConfig, logical sharding names.

Sharding metadata: every parameter is an nnx.Param (or a subclass) whose `out_sharding` metadata is a
tuple of logical names, one per dim (None: never sharded), created with eager_sharding=False so that a
model can be built without a mesh; `rules.logical_to_spec(var.get_metadata()["out_sharding"])` gives the
PartitionSpec. Nothing here names a mesh axis.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from gem_jax.model.config import ModelConfig
from gem_jax.precision import fp8, policy


def sharded(init, names: Sequence[str | None]):
  """`init` whose variable carries the logical axis `names` (no mesh needed to build the model)."""
  return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


class Dense(nnx.Linear):
  """nnx.Linear in the config's dtypes: f32 accumulation, output cast back to the compute dtype; under a
  precision policy (gem_jax/precision/policy.py) its matmul is the FP8 dot_general of its recipe.

  `names`: logical axes of the (in, out) kernel, e.g. ("embed", "mlp"); the bias takes the out name.
  """

  def __init__(self, in_features: int, out_features: int, names: tuple[str | None, str | None],
               cfg: ModelConfig, *, rngs: nnx.Rngs, use_bias: bool = True, kernel_init=None):
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    super().__init__(in_features, out_features, use_bias=use_bias, dtype=cfg.dtype,
                     param_dtype=cfg.params_dtype, preferred_element_type=jnp.float32,
                     kernel_init=sharded(kernel_init, names),
                     bias_init=sharded(nnx.initializers.zeros_init(), names[1:]), rngs=rngs)
    # Set by gem_jax.precision.policy.apply once the whole model is built (the site is the module path).
    self.site = ""
    self.recipe: str | None = None
    self.fp8_impl = "auto"

  def _matmul(self, x, recipe: str | None):
    if recipe is None:
      return super().__call__(x)
    x = x.astype(self.dtype)
    y = fp8.dot_general(x, self.kernel[...].astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                        recipe=recipe, impl=self.fp8_impl)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return y

  def __call__(self, x):
    y = self._matmul(x, self.recipe)
    return policy.intercept(self.site, x, y, lambda recipe: self._matmul(x, recipe)).astype(self.dtype)


class LayerNorm(nnx.LayerNorm):
  """LayerNorm over the last dim, computed in f32 (norms are precision sensitive), output in the compute
  dtype. Its scale and bias are small and replicated."""

  def __init__(self, num_features: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
    super().__init__(num_features, epsilon=1e-5, dtype=jnp.float32, param_dtype=cfg.params_dtype,
                     scale_init=sharded(nnx.initializers.ones_init(), (None,)),
                     bias_init=sharded(nnx.initializers.zeros_init(), (None,)), rngs=rngs)
    self.out_dtype = cfg.dtype

  def __call__(self, x):
    return super().__call__(x.astype(jnp.float32)).astype(self.out_dtype)
