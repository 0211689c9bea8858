"""Layer builders shared by the model files: dtypes from the ModelConfig, logical sharding names.

Sharding metadata: every parameter is an nnx.Param (or a subclass) whose `out_sharding` metadata is a
tuple of logical names, one per dim (None: never sharded), created with eager_sharding=False so that a
model can be built without a mesh; `rules.logical_to_spec(var.get_metadata()["out_sharding"])` gives the
PartitionSpec. Nothing here names a mesh axis.

Tensor parallelism (Megatron pairs). The logical axis "mlp" is the one dim that the rules shard over the
`tensor` mesh axis and that the SPMD step does not gather: a Dense with names (..., "mlp") is then
column parallel (its output holds this device's slice of the hidden dim) and the Dense that consumes it,
names ("mlp", ...), is row parallel (a partial product, summed over the slices by `tensor_sum` before its
bias). What lies between them must be per column (activations, per-head attention) or use a norm that
sums its statistics with `tensor_sum` (LayerNorm(..., tensor_parallel=True)). A layer knows it holds a
slice when its parameter is narrower than its declared size, so the same code runs whole on one device.
`tensor_sum` is the identity until the SPMD step installs the real sum (gem_jax/runtime.py).

Context parallelism: the SPMD step installs a `runtime.ContextParallel` (how many token slices, which one
is this device's, and how to concatenate slices from all devices); the HSTU layer then works on its slice
of the tokens and gathers keys, values and outputs (gem_jax/model/hstu.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import runtime, scopes
from gem_jax.model.config import ModelConfig
from gem_jax.precision import fp8, policy


def tensor_sum(x):
  """Sum of x over the tensor-parallel slices (the identity when the runtime has none)."""
  fn = runtime.current().tensor_sum
  if fn is None:
    return x
  with jax.named_scope(scopes.TENSOR_PARALLEL):
    return fn(x)


def dropout(x, rate: float, rng):
  """Inverted dropout with an explicit key; the identity when rng is None or rate is 0 (evaluation).

  Each element is kept with probability k = round((1 - rate) 2^16) / 2^16, within 2^-17 of 1 - rate, and
  scaled by 1 / k, so the expectation is exactly x. One 32-bit draw decides two neighbours along the last
  axis (its low and high halves): threefry's bits are most of dropout's cost on CPU, and
  jax.random.bernoulli draws 32 bits per element (2.5x the time on a 12,800 x 128 array, one-off timing).
  The draws keep x's leading axes, so a layout sharded over them needs no reshuffle."""
  if rng is None or rate == 0.0:
    return x
  threshold = max(round((1.0 - rate) * 65536), 1)
  d = x.shape[-1] if x.ndim else 1
  bits = jax.random.bits(rng, x.shape[:-1] + (-(-d // 2),), jnp.uint32)
  halves = jnp.stack([bits & 0xFFFF, bits >> 16], axis=-1).reshape(bits.shape[:-1] + (-1,))[..., :d]
  keep = (halves < threshold).reshape(x.shape)
  return jnp.where(keep, x * (65536.0 / threshold), 0.0).astype(x.dtype)


def sharded(init, names: Sequence[str | None]):
  """`init` whose variable carries the logical axis `names` (no mesh needed to build the model)."""
  return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


FP8_SCOPE = "fp8_site="
# Every Dense call runs under this scope with its site, so a compiled program's ops (and a profile's rows:
# gem_jax/observe/op_profile.py) name the layer they belong to.
SITE_SCOPE = "site="


class Dense(nnx.Linear):
  """nnx.Linear in the config's dtypes: f32 accumulation, output cast back to the compute dtype; under a
  precision policy (gem_jax/precision/policy.py) its matmul is the FP8 dot_general of its recipe.

  `names`: logical axes of the (in, out) kernel, e.g. ("embed", "mlp"); the bias takes the out name.
  `site`: the layer's path in the module tree ("layers.0.hstu.uvqk"), which the precision policy matches
  its rules against; the recipe is resolved here, once, when the layer is built (tests/test_model.py holds
  every site to its real path). A probe may swap recipes at call time (gem_jax/runtime.py).
  """

  def __init__(self, in_features: int, out_features: int, names: tuple[str | None, str | None],
               cfg: ModelConfig, *, site: str, rngs: nnx.Rngs, use_bias: bool = True, kernel_init=None):
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    super().__init__(in_features, out_features, use_bias=use_bias, dtype=cfg.dtype,
                     param_dtype=cfg.params_dtype, preferred_element_type=jnp.float32,
                     kernel_init=sharded(kernel_init, names),
                     bias_init=sharded(nnx.initializers.zeros_init(), names[1:]), rngs=rngs)
    self.site = site
    self.recipe: str | None = policy.resolve(site, in_features, out_features, cfg.precision)
    self.fp8_impl = cfg.precision.impl

  def _matmul(self, x, recipe: str | None, bias: bool = True):
    if recipe is None and bias:
      return super().__call__(x)
    x = x.astype(self.dtype)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    kernel = self.kernel[...].astype(self.dtype)
    if recipe is None:
      y = jax.lax.dot_general(x, kernel, dims, preferred_element_type=jnp.float32)
    else:
      # The site in the op names of its three GEMMs (backward ones under transpose(...)): a compiled
      # program's FP8 GEMMs are attributed to sites by it (gem_jax/observe/compiled.py).
      with jax.named_scope(f"{FP8_SCOPE}{self.site}"):
        y = fp8.dot_general(x, kernel, dims, recipe=recipe, impl=self.fp8_impl)
    if bias and self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return y

  def __call__(self, x):
    with jax.named_scope(f"{SITE_SCOPE}{self.site}"):
      return self._call(x)

  def _call(self, x):
    recipe = policy.recipe_at_call(self.site, self.recipe)
    if self.kernel.shape[0] == self.in_features:
      y = self._matmul(x, recipe)
      return policy.intercept(self.site, x, y, lambda recipe: self._matmul(x, recipe)).astype(self.dtype)
    # Row parallel: this device holds a slice of the input dim; sum the partial products, then add the
    # bias once.
    y = self._matmul(x, recipe, bias=False)
    y = policy.intercept(self.site, x, y, lambda recipe: self._matmul(x, recipe, bias=False))
    y = tensor_sum(y.astype(jnp.float32))
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
    return y.astype(self.dtype)


class LayerNorm(nnx.LayerNorm):
  """LayerNorm over the last dim, computed in f32 (norms are precision sensitive), output in the compute
  dtype. Its scale and bias are small and replicated, except with tensor_parallel=True: then the normed
  dim is the "mlp" dim of a column-parallel layer, the parameters are sliced like it, and the mean and
  variance are sums over all slices (`tensor_sum`)."""

  def __init__(self, num_features: int, cfg: ModelConfig, *, rngs: nnx.Rngs, tensor_parallel: bool = False):
    names = ("mlp",) if tensor_parallel else (None,)
    super().__init__(num_features, epsilon=1e-5, dtype=jnp.float32, param_dtype=cfg.params_dtype,
                     scale_init=sharded(nnx.initializers.ones_init(), names),
                     bias_init=sharded(nnx.initializers.zeros_init(), names), rngs=rngs)
    self.out_dtype = cfg.dtype
    self.tensor_parallel = tensor_parallel

  def __call__(self, x):
    if not self.tensor_parallel:
      return super().__call__(x.astype(jnp.float32)).astype(self.out_dtype)
    # Two-pass statistics over the whole (possibly sliced) dim; the same formula with or without slices.
    x = x.astype(jnp.float32)
    n = jnp.float32(self.num_features)
    mean = tensor_sum(jnp.sum(x, axis=-1, keepdims=True)) / n
    centered = x - mean
    var = tensor_sum(jnp.sum(centered * centered, axis=-1, keepdims=True)) / n
    y = centered * jax.lax.rsqrt(var + self.epsilon)
    lead = (1,) * (y.ndim - 1)
    y = y * self.scale[...].astype(jnp.float32).reshape(lead + (-1,)) + self.bias[...].astype(jnp.float32).reshape(
        lead + (-1,))
    return y.astype(self.out_dtype)


def dense_sites(model) -> list[tuple[str, Dense]]:
  """(site name, Dense module) for every Dense layer of the model, in module-tree order."""
  return [(m.site, m) for _, m in nnx.iter_modules(model) if isinstance(m, Dense)]
