"""HSTU jagged attention forward as a Triton kernel: jax_triton on GPU, Triton's interpreter on CPU.

reference.py is the spec (mask, positions, relative bias, normalization by N). One program handles
one query block of one row and one head, on the grid (ceil(N / BLOCK_M), B, H) over the jagged arrays
as stored: it reads its row's offsets (and target count) from int32 inputs, loops only over the key
blocks the causal band, window and contextual prefix let it see, masks every tile with the exact
mask of the reference, accumulates in f32 and stores only its own row's tokens.

The relative bias is a per-distance table bias_HxN[h, d] = rel_bias[h, bucket(d)], built outside the
kernel with reference.relative_position_bucket itself, so the kernel's bias is exact by construction
(|p(i) - p(j)| < N always holds).

`import triton` is optional (AVAILABLE says whether it worked); jax_triton is imported only inside the
GPU entry. run_interpreted needs TRITON_INTERPRET=1 in the environment before this module is imported,
because triton.jit picks the interpreter when it decorates the kernel.
This module must never build a T x T or B x N x N array, and the backward it offers is the
reference's (through jax.vjp), not a kernel.

Letters: T token capacity, B rows, H heads, D q/k width per head, Dv value width per head, N the static
max_seq_len, R relative-position buckets.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.hstu_attention import reference

try:
  import triton
  import triton.language as tl
  AVAILABLE = True
except ImportError:  # CPU-only installs: the module still imports, the entries raise clearly.
  triton = tl = None
  AVAILABLE = False

_INSTALL_HINT = "pip install torch==2.13.0 triton"


def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


if AVAILABLE:

  @triton.jit
  def _pos(idx, max_pos, C: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """p(idx) of the reference: the C contextual tokens share 0, the targets share max_pos."""
    if C > 0:
      p = tl.maximum(idx - C + 1, 0)
    else:
      p = idx
    if HAS_TARGETS:
      p = tl.minimum(p, max_pos)
    return p

  @triton.jit
  def _hstu_fwd_kernel(q_ptr, k_ptr, v_ptr, offsets_ptr, targets_ptr, bias_ptr, out_ptr,
                       ALPHA: tl.constexpr, N: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, W: tl.constexpr, C: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):
    q0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(offsets_ptr + b)
    length = tl.load(offsets_ptr + b + 1) - start
    # The reference pads rows to N: tokens past N neither attend nor are attended to.
    n_in = tl.minimum(length, N)
    # max_pos (M of the reference) uses the full length, as the reference does.
    if C > 0:
      max_pos = length - (C - 1)
    else:
      max_pos = length
    if HAS_TARGETS:
      max_pos = max_pos - tl.load(targets_ptr + b)

    if q0 < n_in:
      offs_m = q0 + tl.arange(0, BLOCK_M)
      offs_d = tl.arange(0, BLOCK_D)
      offs_dv = tl.arange(0, BLOCK_DV)
      valid_m = offs_m < n_in
      # int64 token index: T * H * D may pass 2^31 on big batches.
      tok_m = (start + offs_m).to(tl.int64)
      q_MxD = tl.load(q_ptr + tok_m[:, None] * (H * D) + h * D + offs_d[None, :],
                      mask=valid_m[:, None] & (offs_d < D)[None, :], other=0.0)
      p_m = _pos(offs_m, max_pos, C, HAS_TARGETS)

      # Key blocks [lo, hi) this query block can see (a superset; the tile mask is exact).
      if CAUSAL:
        # p is non-decreasing in the index, so d > 0 needs j < i: keys stop at the last query.
        hi = tl.minimum(q0 + BLOCK_M, n_in)
        lo = q0 * 0
        if W > 0:
          # Keys need p(j) >= p(q0) - W; invert p (p(j) >= P > 0 <=> j >= P + C - 1 when C > 0).
          p_lo = _pos(q0, max_pos, C, HAS_TARGETS) - W
          if C > 0:
            j_lo = tl.where(p_lo > 0, p_lo + (C - 1), 0)
          else:
            j_lo = tl.where(p_lo > 0, p_lo, 0)
          lo = (j_lo // BLOCK_N) * BLOCK_N
        if C > 0:  # contextual queries (i < C) see every history key
          hi = tl.where(q0 < C, n_in, hi)
          lo = tl.where(q0 < C, 0, lo)
      else:
        hi = n_in
        lo = q0 * 0

      acc_MxDv = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
      for k0 in range(lo, hi, BLOCK_N):
        offs_n = k0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < n_in
        tok_n = (start + offs_n).to(tl.int64)
        k_NxD = tl.load(k_ptr + tok_n[:, None] * (H * D) + h * D + offs_d[None, :],
                        mask=valid_n[:, None] & (offs_d < D)[None, :], other=0.0)
        v_NxDv = tl.load(v_ptr + tok_n[:, None] * (H * DV) + h * DV + offs_dv[None, :],
                         mask=valid_n[:, None] & (offs_dv < DV)[None, :], other=0.0)
        if IEEE:  # f32 inputs stay IEEE f32 on GPU (no TF32): the f32 tests compare at 1e-5
          qk_MxN = tl.dot(q_MxD, tl.trans(k_NxD), input_precision="ieee")
        else:
          qk_MxN = tl.dot(q_MxD, tl.trans(k_NxD))
        logits_MxN = ALPHA * qk_MxN

        p_n = _pos(offs_n, max_pos, C, HAS_TARGETS)
        d_MxN = p_m[:, None] - p_n[None, :]
        in_row_MxN = valid_m[:, None] & valid_n[None, :]
        if CAUSAL:
          mask_MxN = (offs_m[:, None] == offs_n[None, :]) | (d_MxN > 0)
          if W > 0:
            mask_MxN = mask_MxN & (d_MxN <= W)
          if C > 0:
            mask_MxN = mask_MxN | ((p_m[:, None] == 0) & (p_n[None, :] < max_pos))
          mask_MxN = mask_MxN & in_row_MxN
        else:
          mask_MxN = in_row_MxN
        if HAS_BIAS:
          # Clamped so that even masked-out pairs gather inside the table.
          dist_MxN = tl.minimum(tl.abs(d_MxN), N - 1)
          logits_MxN += tl.load(bias_ptr + h * N + dist_MxN)

        # `where`, not a multiply: masked logits may be inf and must not become NaN.
        w_MxN = tl.where(mask_MxN, logits_MxN * tl.sigmoid(logits_MxN), 0.0) / N
        if IEEE:
          acc_MxDv += tl.dot(w_MxN, v_NxDv, input_precision="ieee")
        else:
          acc_MxDv += tl.dot(w_MxN.to(v_NxDv.dtype), v_NxDv)

      tl.store(out_ptr + tok_m[:, None] * (H * DV) + h * DV + offs_dv[None, :],
               acc_MxDv.to(out_ptr.dtype.element_ty),
               mask=valid_m[:, None] & (offs_dv < DV)[None, :])


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything known at trace time (hashable: a nondiff argument of the custom_vjp)."""
  max_seq_len: int
  alpha: float
  causal: bool
  has_targets: bool
  max_attn_len: int
  contextual_seq_len: int
  block_m: int
  block_n: int


def _check(q_shape, k_shape, v_shape, offsets_shape, *, max_seq_len, max_attn_len, contextual_seq_len,
           num_targets_shape, rel_bias_shape, block_m, block_n):
  """Static argument checks shared by both entries; raises ValueError naming the bad argument."""
  name = "hstu_attention_triton"
  if len(q_shape) != 3 or tuple(k_shape) != tuple(q_shape) or len(v_shape) != 3 or \
     tuple(v_shape[:2]) != tuple(q_shape[:2]):
    raise ValueError(f"{name}: q {q_shape}, k {k_shape}, v {v_shape} disagree (want T x H x D, T x H x Dv)")
  if len(offsets_shape) != 1 or offsets_shape[0] < 1:
    raise ValueError(f"{name}: offsets must be 1-D with B + 1 >= 1 entries, got {offsets_shape}")
  if max_seq_len < 1:
    raise ValueError(f"{name}: max_seq_len must be >= 1, got {max_seq_len}")
  if max_attn_len < 0 or contextual_seq_len < 0:
    raise ValueError(f"{name}: max_attn_len {max_attn_len} and contextual_seq_len "
                     f"{contextual_seq_len} must be >= 0")
  num_rows = offsets_shape[0] - 1
  if num_targets_shape is not None and tuple(num_targets_shape) != (num_rows,):
    raise ValueError(f"{name}: num_targets shape {num_targets_shape}, expected ({num_rows},)")
  if rel_bias_shape is not None and (len(rel_bias_shape) != 2 or rel_bias_shape[0] != q_shape[1]
                                     or rel_bias_shape[1] < 1):
    raise ValueError(f"{name}: rel_bias shape {rel_bias_shape}, expected ({q_shape[1]}, R >= 1)")
  for label, block in (("block_m", block_m), ("block_n", block_n)):
    # tl.dot needs power-of-two tiles of at least 16.
    if block < 16 or block != _next_pow2(block):
      raise ValueError(f"{name}: {label} must be a power of two >= 16, got {block}")


def _constexprs(s: _Static, num_heads: int, d: int, dv: int, has_bias: bool, ieee: bool):
  return dict(ALPHA=float(s.alpha), N=s.max_seq_len, H=num_heads, D=d, DV=dv, CAUSAL=s.causal,
              HAS_TARGETS=s.has_targets, HAS_BIAS=has_bias, W=s.max_attn_len, C=s.contextual_seq_len,
              BLOCK_M=s.block_m, BLOCK_N=s.block_n, BLOCK_D=max(16, _next_pow2(d)),
              BLOCK_DV=max(16, _next_pow2(dv)), IEEE=ieee)


def _bias_table_HxN(rel_bias_HxR, max_seq_len: int):
  """bias_HxN[h, d] = rel_bias[h, bucket(d)] in f32: the reference's own bucketing, so exact."""
  buckets_N = reference.relative_position_bucket(jnp.arange(max_seq_len), rel_bias_HxR.shape[1])
  return jnp.asarray(rel_bias_HxR, jnp.float32)[:, buckets_N]


def _owned_T(offsets_Bp1, capacity: int, max_seq_len: int):
  """Token slots that a row owns within its first N positions: the only slots the kernel writes."""
  t_T = jnp.arange(capacity, dtype=jnp.int32)
  row_T = jnp.clip(jnp.searchsorted(offsets_Bp1, t_T, side="right").astype(jnp.int32) - 1,
                   0, offsets_Bp1.shape[0] - 2)
  return (t_T < offsets_Bp1[-1]) & (t_T - offsets_Bp1[row_T] < max_seq_len)


def _launch(s: _Static, q_TxHxD, k_TxHxD, v_TxHxDv, bias_HxR, offsets_Bp1, targets_B):
  """The kernel through jax_triton; slots it does not write are zeroed afterwards."""
  import jax_triton  # lazily: only the GPU path needs it

  capacity, num_heads, d = q_TxHxD.shape
  num_rows = offsets_Bp1.shape[0] - 1
  has_bias = bias_HxR is not None
  bias = _bias_table_HxN(bias_HxR, s.max_seq_len) if has_bias else jnp.zeros((1,), jnp.float32)
  ieee = q_TxHxD.dtype == jnp.float32 and v_TxHxDv.dtype == jnp.float32
  out_TxHxDv = jax_triton.triton_call(
      q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias,
      kernel=_hstu_fwd_kernel,
      out_shape=jax.ShapeDtypeStruct(v_TxHxDv.shape, v_TxHxDv.dtype),
      grid=(-(-s.max_seq_len // s.block_m), num_rows, num_heads),
      num_warps=4, num_stages=2,
      **_constexprs(s, num_heads, d, v_TxHxDv.shape[2], has_bias, bool(ieee)))
  owned_T = _owned_T(offsets_Bp1, capacity, s.max_seq_len)
  return jnp.where(owned_T[:, None, None], out_TxHxDv, jnp.zeros((), out_TxHxDv.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s, q, k, v, bias_HxR, offsets_Bp1, targets_B):
  return _launch(s, q, k, v, bias_HxR, offsets_Bp1, targets_B)


def _attention_fwd(s, q, k, v, bias_HxR, offsets_Bp1, targets_B):
  return _launch(s, q, k, v, bias_HxR, offsets_Bp1, targets_B), (q, k, v, bias_HxR, offsets_Bp1,
                                                                  targets_B)


def _attention_bwd(s, residuals, do_TxHxDv):
  # No Triton backward yet: differentiate the reference (O(B N^2) memory, correct, slow).
  q, k, v, bias_HxR, offsets_Bp1, targets_B = residuals

  def ref(q, k, v, bias_HxR):
    return reference.hstu_attention(
        q, k, v, offsets_Bp1, max_seq_len=s.max_seq_len, alpha=s.alpha, causal=s.causal,
        num_targets=targets_B if s.has_targets else None, max_attn_len=s.max_attn_len,
        contextual_seq_len=s.contextual_seq_len, rel_bias_HxR=bias_HxR)

  _, vjp = jax.vjp(ref, q, k, v, bias_HxR)
  int_zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return (*vjp(do_TxHxDv), int_zero(offsets_Bp1), int_zero(targets_B))


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention_triton(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                          causal: bool = True, num_targets=None, max_attn_len: int = 0,
                          contextual_seq_len: int = 0, rel_bias_HxR=None, block_m: int = 64,
                          block_n: int = 64):
  """reference.hstu_attention with the Triton forward kernel (GPU only, through jax_triton).

  Differentiable: the backward is jax.vjp of the reference. Slots past offsets[B] (and past N inside
  a row) are zero. Raises RuntimeError off GPU and ImportError without triton.
  """
  backend = jax.default_backend()
  if backend != "gpu":
    raise RuntimeError(f"hstu_attention_triton runs only on the JAX 'gpu' backend (jax_triton), but the "
                       f"default backend is {backend!r}; use reference.hstu_attention or the Pallas "
                       f"kernel (api.hstu_attention) there, or run_interpreted to check the kernel on CPU")
  if not AVAILABLE:
    raise ImportError(f"hstu_attention_triton needs triton and jax_triton ({_INSTALL_HINT} jax-triton)")
  if not isinstance(_hstu_fwd_kernel, triton.JITFunction):
    raise RuntimeError("hstu_attention_triton: TRITON_INTERPRET=1 was set when this module was "
                       "imported, so the kernel is interpreter-only; unset it to run on GPU")
  _check(q_TxHxD.shape, k_TxHxD.shape, v_TxHxDv.shape, jnp.shape(offsets_Bp1), max_seq_len=max_seq_len,
         max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
         num_targets_shape=None if num_targets is None else jnp.shape(num_targets),
         rel_bias_shape=None if rel_bias_HxR is None else rel_bias_HxR.shape,
         block_m=block_m, block_n=block_n)
  num_rows = jnp.shape(offsets_Bp1)[0] - 1
  if q_TxHxD.shape[0] == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  s = _Static(max_seq_len=max_seq_len, alpha=float(alpha), causal=causal,
              has_targets=num_targets is not None, max_attn_len=max_attn_len,
              contextual_seq_len=contextual_seq_len, block_m=block_m, block_n=block_n)
  offsets_Bp1 = jnp.asarray(offsets_Bp1, jnp.int32)
  targets_B = (jnp.zeros((num_rows,), jnp.int32) if num_targets is None
               else jnp.asarray(num_targets, jnp.int32))
  return _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, rel_bias_HxR, offsets_Bp1, targets_B)


def run_interpreted(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                    causal: bool = True, num_targets=None, max_attn_len: int = 0,
                    contextual_seq_len: int = 0, rel_bias_HxR=None, block_m: int = 64,
                    block_n: int = 64):
  """The same kernel through Triton's interpreter on torch CPU tensors; numpy in, numpy out.

  Needs torch, triton and TRITON_INTERPRET=1 set before this module was imported. Offsets and
  num_targets are concrete here, so they are checked (non-decreasing, inside T, targets >= 0).
  """
  if not AVAILABLE:
    raise ImportError(f"run_interpreted needs triton and torch ({_INSTALL_HINT})")
  from triton.runtime.interpreter import InterpretedFunction
  if not isinstance(_hstu_fwd_kernel, InterpretedFunction):
    raise RuntimeError("run_interpreted: set TRITON_INTERPRET=1 before importing "
                       "pallas_kernels.hstu_attention.triton (triton.jit picks the interpreter then)")
  import torch  # lazily: only the interpreter path needs it

  # Copies: torch.from_numpy wants writable arrays (jax-backed ones are read-only).
  q, k, v = (np.array(x, order="C") for x in (q_TxHxD, k_TxHxD, v_TxHxDv))
  offsets = np.asarray(offsets_Bp1)
  _check(q.shape, k.shape, v.shape, offsets.shape, max_seq_len=max_seq_len, max_attn_len=max_attn_len,
         contextual_seq_len=contextual_seq_len,
         num_targets_shape=None if num_targets is None else np.shape(num_targets),
         rel_bias_shape=None if rel_bias_HxR is None else np.shape(rel_bias_HxR),
         block_m=block_m, block_n=block_n)
  capacity, num_heads, d = q.shape
  num_rows = offsets.shape[0] - 1
  if offsets[0] < 0 or np.any(np.diff(offsets) < 0) or offsets[-1] > capacity:
    raise ValueError(f"run_interpreted: offsets {offsets.tolist()} must be non-decreasing in [0, T={capacity}]")
  targets = np.zeros((max(num_rows, 1),), np.int32)
  if num_targets is not None:
    if np.any(np.asarray(num_targets) < 0):
      raise ValueError(f"run_interpreted: num_targets {np.asarray(num_targets).tolist()} must be >= 0")
    targets[:num_rows] = np.asarray(num_targets, np.int32)
  out = torch.zeros(v.shape, dtype=torch.from_numpy(v[:0]).dtype)
  if capacity == 0 or num_rows == 0:
    return out.numpy()
  has_bias = rel_bias_HxR is not None
  bias = (np.asarray(_bias_table_HxN(np.asarray(rel_bias_HxR), max_seq_len)) if has_bias
          else np.zeros((1,), np.float32))
  s = _Static(max_seq_len=max_seq_len, alpha=float(alpha), causal=causal,
              has_targets=num_targets is not None, max_attn_len=max_attn_len,
              contextual_seq_len=contextual_seq_len, block_m=block_m, block_n=block_n)
  ieee = q.dtype == np.float32 and v.dtype == np.float32
  grid = (-(-max_seq_len // block_m), num_rows, num_heads)
  _hstu_fwd_kernel[grid](
      torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
      torch.from_numpy(offsets.astype(np.int32)), torch.from_numpy(targets),
      torch.from_numpy(np.array(bias, np.float32)), out,
      **_constexprs(s, num_heads, d, v.shape[2], has_bias, bool(ieee)))
  return out.numpy()
