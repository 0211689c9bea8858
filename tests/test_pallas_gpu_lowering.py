"""The jagged-attention Pallas kernels lower to Pallas-Triton for CUDA, checked from CPU with jax.export.

Since jax 0.10 a pallas_call without compiler params lowers to Mosaic GPU on NVIDIA, which rejects these
kernels (or would run code they were not written for). Each test exports the forward or the gradient
through the custom_vjp (interpret=False) and reads the Triton custom calls back from the module: every
kernel must be there by name, with the warps/stages the kernel module chose, and nothing may be Mosaic.

Letters: T token capacity, B rows, H heads, D q/k/v width, R rel_bias buckets.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.hstu_attention import api as hstu_api
from pallas_kernels.hstu_attention.config import HSTUBlockConfig
from pallas_kernels.jagged_softmax_attention import pallas as softmax_pallas

_TRITON_CALL = "__gpu$xla.gpu.triton"
T, H, D, R = 48, 2, 16, 8
N = 32  # max_seq_len: two rows of up to 32 tokens in 48 slots
SMALL, LARGE = HSTUBlockConfig(16, 16), HSTUBlockConfig(128, 64)


def _h200_mesh(shape=(1,), names=("x",)):
  """Since jax 0.11 the Pallas-Triton lowering reads the GPU it compiles for from the device, or, without
  one, from the abstract device of the context mesh: an H200 here (0.10 lowers without asking)."""
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
  return jax.sharding.AbstractMesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                                   abstract_device=h200)


def _triton_kernels(fn, *args, mesh=None):
  """[(kernel name, num_warps, num_stages)] of the Triton calls in fn exported for CUDA, sorted.

  Fails if any custom call is not a Triton call (a Mosaic GPU lowering would be one).
  """
  with jax.sharding.use_abstract_mesh(mesh or _h200_mesh()):
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_CALL)])(*args)
  calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @" in line]
  targets = {re.search(r"custom_call @([^(\s]+)", line).group(1) for line in calls}
  assert targets <= {_TRITON_CALL}, f"not lowered to Triton: custom calls {sorted(targets)}"
  kernels = []
  for line in calls:
    field = lambda pattern: re.search(pattern, line).group(1)
    kernels.append((field(r'name = "([^"]+)"'), int(field(r"num_warps = (\d+)")),
                    int(field(r"num_stages = (\d+)"))))
  return sorted(kernels)


def _operands(dtype):
  q_TxHxD = jax.ShapeDtypeStruct((T, H, D), dtype)
  return q_TxHxD, q_TxHxD, q_TxHxD, jax.ShapeDtypeStruct((3,), jnp.int32)


def _hstu(block):
  def fn(q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, bias_HxR):
    return hstu_api.hstu_attention(
        q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, max_seq_len=N, alpha=0.5, num_targets=jnp.array([2, 1]),
        max_attn_len=8, contextual_seq_len=2, rel_bias_HxR=bias_HxR, block=block, interpret=False)
  return fn


def _softmax(block):
  def fn(q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, bias_HxR):
    del bias_HxR  # softmax attention has no relative bias
    return softmax_pallas.jagged_softmax_attention(
        q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, max_seq_len=N, scale=0.25, num_targets=jnp.array([2, 1]),
        max_attn_len=8, contextual_seq_len=2, block=block, interpret=False)
  return fn


def _grad(attention):
  """sum(out) and its gradient in (q, k, v, rel_bias): the forward kernel plus both backward kernels
  (value_and_grad, as training does: HSTU's backward does not need `out`, so grad alone drops it)."""
  def loss(q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, bias_HxR):
    return attention(q_TxHxD, k_TxHxD, v_TxHxD, offsets_Bp1, bias_HxR).astype(jnp.float32).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 4))


KERNELS = {"hstu": (_hstu, "hstu_attention"), "softmax": (_softmax, "jagged_softmax_attention")}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_forward_lowers_to_triton(kernel, dtype):
  attention, prefix = KERNELS[kernel]
  bias_HxR = jax.ShapeDtypeStruct((H, R), jnp.float32)
  assert _triton_kernels(attention(SMALL), *_operands(dtype), bias_HxR) == [(f"{prefix}_fwd", 4, 3)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gradient_lowers_to_triton(kernel, dtype):
  attention, prefix = KERNELS[kernel]
  bias_HxR = jax.ShapeDtypeStruct((H, R), jnp.float32)
  assert _triton_kernels(_grad(attention(SMALL)), *_operands(dtype), bias_HxR) == [
      (f"{prefix}_dkv", 4, 2), (f"{prefix}_dq", 4, 2), (f"{prefix}_fwd", 4, 3)]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_large_tiles_get_eight_warps(kernel):
  attention, prefix = KERNELS[kernel]
  bias_HxR = jax.ShapeDtypeStruct((H, R), jnp.float32)
  assert _triton_kernels(_grad(attention(LARGE)), *_operands(jnp.bfloat16), bias_HxR) == [
      (f"{prefix}_dkv", 8, 2), (f"{prefix}_dq", 8, 2), (f"{prefix}_fwd", 8, 3)]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gradient_lowers_inside_shard_map_with_operands_on_different_axes(kernel):
  """In the SPMD step a kernel's operands vary over different mesh axes (q/k/v here over `model`, the
  offsets over `data`): the outputs must be typed varying over all of them, and each cotangent summed back
  to its input's axes, or tracing the step fails."""
  from jax.sharding import PartitionSpec as P
  attention, prefix = KERNELS[kernel]
  mesh = _h200_mesh((1, 1), ("data", "model"))

  def local(q, k, v, offsets_1xBp1, bias_HxR):
    q, k, v, bias_HxR = (jax.lax.pcast(x, ("model",), to="varying") for x in (q, k, v, bias_HxR))
    out = attention(SMALL)(q, k, v, offsets_1xBp1[0], bias_HxR)
    return jax.lax.psum(out.astype(jnp.float32).sum(), ("data", "model"))

  def loss(q, k, v, offsets_1xBp1, bias_HxR):
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("data"), P()), out_specs=P())(
        q, k, v, offsets_1xBp1, bias_HxR)

  q, k, v, _ = _operands(jnp.bfloat16)
  args = (q, k, v, jax.ShapeDtypeStruct((1, 3), jnp.int32), jax.ShapeDtypeStruct((H, R), jnp.float32))
  assert _triton_kernels(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)), *args, mesh=mesh) == [
      (f"{prefix}_dkv", 4, 2), (f"{prefix}_dq", 4, 2), (f"{prefix}_fwd", 4, 3)]
