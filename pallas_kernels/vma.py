"""Loop carries that type-check inside shard_map.

Under `jax.shard_map(check_vma=True)` every value carries the set of mesh axes it varies over, and a
fori_loop / scan carry must keep its type through the body. A carry initialized with jnp.zeros is
invariant while the body mixes in the (device-varying) inputs, so the kernels' CPU paths mark their
initial carries as varying over every axis their inputs vary over. Outside shard_map this is a no-op.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """The mesh axes x varies over. jax spells it `aval.vma` in some releases and
  `aval.manual_axis_type.varying` in others (0.10), so read whichever exists."""
  aval = jax.typeof(x)
  found = getattr(aval, "vma", None)
  if found is None:
    found = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return frozenset(found or ())


def like(init, *refs):
  """`init` (a pytree) cast to vary over every mesh axis any of `refs` (arrays or None) varies over."""
  axes = frozenset().union(*(varying_axes(r) for r in jax.tree_util.tree_leaves(refs)))
  if not axes:
    return init

  def cast(x):
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree_util.tree_map(cast, init)


def sum_to(x, ref):
  """x summed (psum) over the mesh axes it varies over and `ref` does not: the cotangent of an input that
  a custom_vjp's forward implicitly broadcast to more axes (JAX's own rules transpose that broadcast into
  this sum; a custom backward must do it itself). Outside shard_map this is a no-op."""
  extra = tuple(sorted(varying_axes(x) - varying_axes(ref)))
  return jax.lax.psum(x, extra) if extra else x


def shape_dtype(shape, dtype, *refs) -> jax.ShapeDtypeStruct:
  """A pallas_call out_shape varying over every mesh axis any of `refs` varies over: inside
  `shard_map(check_vma=True)` an output type must say it, even when it varies over nothing (a mesh whose
  axes all have size 1). jax 0.10 and 0.11 take `manual_axis_type=` (an object built like the refs' own,
  which every aval carries, inside shard_map or not), older releases `vma=`."""
  leaves = jax.tree_util.tree_leaves(refs)
  axes = frozenset().union(*(varying_axes(r) for r in leaves))
  mat = getattr(jax.typeof(leaves[0]), "manual_axis_type", None) if leaves else None
  if mat is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mat)(varying=axes))
  if not axes:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


def interpretable(call, *operands, interpret: bool):
  """call(*operands) for a pallas_call. jax's Pallas interpreter (interpret=True) re-binds a kernel traced
  without varying axes on the blocks it slices, and inside shard_map that mixes varying blocks with
  invariant program ids, which the varying-axes check rejects. There the operands are all-gathered over
  their axes (invariant copies of every device's operands), the call is vmapped over the devices, and each
  device keeps its own result: the same values, at the cost of every device interpreting every device's
  kernel (free on the one-device mesh; interpret mode is a CPU test path). Compiled kernels and calls
  outside shard_map are called as they are."""
  axes = tuple(sorted(frozenset().union(*(varying_axes(x) for x in jax.tree_util.tree_leaves(operands)))))
  if not interpret or not axes:
    return call(*operands)
  # to="invarying": the gathered copies are typed invariant (jax 0.10 and 0.11 spell it so).
  gathered = [jax.lax.all_gather(x, axes, to="invarying") for x in like(list(operands), *operands)]
  per_device = jax.vmap(call)(*gathered)
  index = jax.lax.axis_index(axes)
  return jax.tree_util.tree_map(lambda out: out[index], per_device)
