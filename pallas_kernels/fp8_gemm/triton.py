"""Scaled FP8 GEMMs as Triton kernels: jax_triton on GPU, Triton's interpreter on CPU.

reference.py is the spec: C_MxN = dequant(A_MxK) @ dequant(B_KxN) in float32, both operands quantized
along K. Two kernels, one program per (BLOCK_M, BLOCK_N) tile of C, looping over K tiles into a float32
accumulator, with masked loads and stores for ragged edges:

  scaled_gemm  row-wise (M x 1, 1 x N) or tensor-wise (1 x 1) float32 scales: the Hopper recipe.
               tl.dot of the float8 tiles runs on FP8 tensor cores (sm_89+); the scales factor out of
               the sum, so they are applied once to the accumulator. fast_accum=False asks Hopper to
               promote the FP8 MMA's partial sums to float32 after every instruction
               (max_num_imprecise_acc=0); True is Triton's Hopper default (imprecise accumulation).
               The interpreter ignores the flag (it always sums in float32).
  mx_gemm      OCP MX block scales (one E8M0 byte per 32 values along K).
               use_dot_scaled=True: tl.dot_scaled, native block-scaled MMA on Blackwell (sm_100); on
               Hopper Triton emulates it by upcasting to bf16. use_dot_scaled=False (portable): each
               K tile is dequantized in registers (element * 2^(byte - 127), built from bits; byte 0xFF
               is NaN) and fed to tl.dot in bfloat16 (exact unless a value is under 2^-126, where bf16
               and flushing GPUs may lose bits) or in float32 with input_precision="ieee" (exact).

Elements and E8M0 scales travel as uint8 bit patterns (bitcast outside, bitcast back to float8 inside),
so the kernels do not depend on jax_triton's or torch's float8 support. Triton 3.9's interpreter loads
float8 and runs tl.dot_scaled, but its tl.dot multiplies bfloat16 operands as raw uint16 bits and it
decodes E5M2 subnormals (in tl.dot, tl.dot_scaled) and E4M3 NaN (in tl.dot) wrongly; the run_interpreted_*
entries swap in exact decoders (ml_dtypes) for those two steps while they run, as a GPU decodes in
hardware. (Its .to(float32) also reads float8 Inf / NaN as finite; NaN reaches the portable dequantize
only through a NaN scale, which the kernel decodes itself.)

`import triton` is optional (AVAILABLE says whether it worked); jax_triton is imported only inside the
GPU entries. The run_interpreted_* entries need TRITON_INTERPRET=1 set before this module is imported.
This module must never dequantize a whole operand in memory (only K tiles in registers), never
accumulate in less than float32 unless fast_accum asks for it, never round dequantized float32 tiles to
TF32, and never turn a NaN scale into a finite number.

Letters: M rows of A and C, K the contraction, N columns of B and C, Kb = ceil(K / 32) MX blocks.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mx

try:
  import triton
  import triton.language as tl
  AVAILABLE = True
except ImportError:  # CPU-only installs: the module still imports, the entries raise clearly.
  triton = tl = None
  AVAILABLE = False

_INSTALL_HINT = "pip install torch==2.13.0 triton"
_FORMATS = {jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2"}
_DEQUANT_DTYPES = ("bfloat16", "float32")
_SCALE_DTYPES = (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8))
_PASS_AS_IS = (np.dtype(np.uint8), np.dtype(np.float32))  # every other input is sent as uint8 bits


if AVAILABLE:

  @triton.jit
  def _as_float8(bits, FMT: tl.constexpr):
    if FMT == "e4m3":
      return bits.to(tl.float8e4nv, bitcast=True)
    else:
      return bits.to(tl.float8e5, bitcast=True)

  @triton.jit
  def _e8m0_to_f32(scale_bits):
    """2^(byte - 127) built from bits: byte 0 is the float32 subnormal 2^-127, byte 0xFF is NaN."""
    e = scale_bits.to(tl.int32)
    f_bits = tl.where(e == 0, 0x00400000, e << 23)
    f_bits = tl.where(e == 255, 0x7FC00000, f_bits)
    return f_bits.to(tl.float32, bitcast=True)

  @triton.jit
  def _scaled_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                          K: tl.constexpr, A_FMT: tl.constexpr, B_FMT: tl.constexpr,
                          ROW_A: tl.constexpr, COL_B: tl.constexpr, FAST_ACCUM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < M, offs_n < N
    rows_m = offs_m.to(tl.int64)  # M * K may pass 2^31
    acc_MxN = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
      offs_k = k0 + tl.arange(0, BLOCK_K)
      in_k = offs_k < K
      # Padding bits 0 are +0.0 in both formats: ragged K adds nothing.
      a_MxK = tl.load(a_ptr + rows_m[:, None] * K + offs_k[None, :], mask=in_m[:, None] & in_k[None, :],
                      other=0)
      b_KxN = tl.load(b_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
                      mask=in_k[:, None] & in_n[None, :], other=0)
      a_MxK, b_KxN = _as_float8(a_MxK, A_FMT), _as_float8(b_KxN, B_FMT)
      if FAST_ACCUM:
        acc_MxN = tl.dot(a_MxK, b_KxN, acc_MxN)
      else:
        acc_MxN = tl.dot(a_MxK, b_KxN, acc_MxN, max_num_imprecise_acc=0)
    if ROW_A:
      acc_MxN = acc_MxN * tl.load(sa_ptr + offs_m, mask=in_m, other=1.0)[:, None]
    else:
      acc_MxN = acc_MxN * tl.load(sa_ptr)
    if COL_B:
      acc_MxN = acc_MxN * tl.load(sb_ptr + offs_n, mask=in_n, other=1.0)[None, :]
    else:
      acc_MxN = acc_MxN * tl.load(sb_ptr)
    tl.store(c_ptr + rows_m[:, None] * N + offs_n[None, :], acc_MxN, mask=in_m[:, None] & in_n[None, :])

  @triton.jit
  def _mx_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr,
                      K: tl.constexpr, KB: tl.constexpr, A_FMT: tl.constexpr, B_FMT: tl.constexpr,
                      DOT_SCALED: tl.constexpr, DEQUANT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    SB: tl.constexpr = BLOCK_K // 32  # scale blocks (mx.BLOCK_SIZE values each) per K tile
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < M, offs_n < N
    rows_m = offs_m.to(tl.int64)
    acc_MxN = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
      offs_k = k0 + tl.arange(0, BLOCK_K)
      in_k = offs_k < K
      offs_kb = k0 // 32 + tl.arange(0, SB)
      in_kb = offs_kb < KB
      a_MxK = _as_float8(tl.load(a_ptr + rows_m[:, None] * K + offs_k[None, :],
                                 mask=in_m[:, None] & in_k[None, :], other=0), A_FMT)
      b_KxN = _as_float8(tl.load(b_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
                                 mask=in_k[:, None] & in_n[None, :], other=0), B_FMT)
      # Scale bytes off the edge are 127 (= 1.0). A NaN byte of a partial last block also hits its zero
      # padding, which is harmless: that block's real elements already make the whole row (column) NaN.
      sa_MxSB = tl.load(sa_ptr + rows_m[:, None] * KB + offs_kb[None, :],
                        mask=in_m[:, None] & in_kb[None, :], other=127)
      if DOT_SCALED:
        # dot_scaled wants the rhs scales as N x (BLOCK_K / 32).
        sb_NxSB = tl.load(sb_ptr + offs_kb.to(tl.int64)[None, :] * N + offs_n[:, None],
                          mask=in_n[:, None] & in_kb[None, :], other=127)
        acc_MxN = tl.dot_scaled(a_MxK, sa_MxSB, A_FMT, b_KxN, sb_NxSB, B_FMT, acc_MxN)
      else:
        sb_SBxN = tl.load(sb_ptr + offs_kb.to(tl.int64)[:, None] * N + offs_n[None, :],
                          mask=in_kb[:, None] & in_n[None, :], other=127)
        a3 = tl.reshape(a_MxK.to(tl.float32), (BLOCK_M, SB, 32)) * _e8m0_to_f32(sa_MxSB)[:, :, None]
        b3 = tl.reshape(b_KxN.to(tl.float32), (SB, 32, BLOCK_N)) * _e8m0_to_f32(sb_SBxN)[:, None, :]
        a_deq_MxK = tl.reshape(a3, (BLOCK_M, BLOCK_K))
        b_deq_KxN = tl.reshape(b3, (BLOCK_K, BLOCK_N))
        if DEQUANT_BF16:
          # e4m3 / e5m2 times a power of two fits bf16's 8-bit significand: exact while normal.
          acc_MxN = tl.dot(a_deq_MxK.to(tl.bfloat16), b_deq_KxN.to(tl.bfloat16), acc_MxN)
        else:
          acc_MxN = tl.dot(a_deq_MxK, b_deq_KxN, acc_MxN, input_precision="ieee")
    tl.store(c_ptr + rows_m[:, None] * N + offs_n[None, :], acc_MxN, mask=in_m[:, None] & in_n[None, :])

else:  # the entries raise before they would use a kernel
  _scaled_gemm_kernel = _mx_gemm_kernel = None


def _check_operands(name, a, b, blocks, least_k):
  """Checks shared by both GEMMs (anything with .shape and .dtype); returns (M, K, N, constexprs)."""
  fmts = []
  for label, x in (("a_elems", a), ("b_elems", b)):
    if len(x.shape) != 2 or np.dtype(x.dtype) not in _FORMATS:
      raise ValueError(f"{name}: {label} must be a 2-D float8_e4m3fn or float8_e5m2 array, got "
                       f"{np.dtype(x.dtype)} {tuple(x.shape)}")
    fmts.append(_FORMATS[np.dtype(x.dtype)])
  (m, k), (k_b, n) = a.shape, b.shape
  if k != k_b:
    raise ValueError(f"{name}: a_elems is {m} x {k} but b_elems is {k_b} x {n} (K must agree)")
  for label, block in zip(("block_m", "block_n", "block_k"), blocks):
    # tl.dot needs power-of-two tiles of at least 16; MX K tiles hold whole 32-value blocks.
    least = least_k if label == "block_k" else 16
    if block < least or block & (block - 1):
      raise ValueError(f"{name}: {label} must be a power of two >= {least}, got {block}")
  return m, k, n, dict(A_FMT=fmts[0], B_FMT=fmts[1], BLOCK_M=blocks[0], BLOCK_N=blocks[1],
                       BLOCK_K=blocks[2])


def _check_scaled(a, sa, b, sb, blocks, fast_accum):
  m, k, n, meta = _check_operands("scaled_gemm", a, b, blocks, 16)
  for label, x, row_wise in (("a_scale", sa, (m, 1)), ("b_scale", sb, (1, n))):
    if tuple(x.shape) not in (row_wise, (1, 1)) or np.dtype(x.dtype) != np.float32:
      raise ValueError(f"scaled_gemm: {label} must be float32 of shape {row_wise} (row-wise) or (1, 1) "
                       f"(tensor-wise), got {np.dtype(x.dtype)} {tuple(x.shape)}")
  return m, n, dict(meta, K=k, ROW_A=tuple(sa.shape) == (m, 1) and m != 1,
                    COL_B=tuple(sb.shape) == (1, n) and n != 1, FAST_ACCUM=bool(fast_accum))


def _check_mx(a, sa, b, sb, blocks, use_dot_scaled, dequant_dtype):
  # The kernel's K tiles are whole 32-value blocks (the literal 32 there is mx.BLOCK_SIZE).
  m, k, n, meta = _check_operands("mx_gemm", a, b, blocks, mx.BLOCK_SIZE)
  kb = mx.num_blocks(k)
  for label, x, want in (("a_scales", sa, (m, kb)), ("b_scales", sb, (kb, n))):
    if tuple(x.shape) != want or np.dtype(x.dtype) not in _SCALE_DTYPES:
      raise ValueError(f"mx_gemm: {label} must be float8_e8m0fnu (or its uint8 bits) of shape {want} "
                       f"(Kb = ceil(K / 32) = {kb}), got {np.dtype(x.dtype)} {tuple(x.shape)}")
  if dequant_dtype not in _DEQUANT_DTYPES:
    raise ValueError(f"mx_gemm: dequant_dtype must be one of {_DEQUANT_DTYPES}, got {dequant_dtype!r}")
  return m, n, dict(meta, K=k, KB=kb, DOT_SCALED=bool(use_dot_scaled),
                    DEQUANT_BF16=dequant_dtype == "bfloat16")


def _launch(name, kernel, args, m, n, meta):
  """The kernel through jax_triton, after checking that this process can run it."""
  backend = jax.default_backend()
  if backend != "gpu":
    raise RuntimeError(f"{name} runs only on the JAX 'gpu' backend (jax_triton), but the default backend "
                       f"is {backend!r}; use pallas_kernels.fp8_gemm.reference there, or "
                       f"run_interpreted_{name} to check the kernel on CPU")
  if not AVAILABLE:
    raise ImportError(f"{name} needs triton and jax_triton ({_INSTALL_HINT} jax-triton)")
  if not isinstance(kernel, triton.JITFunction):
    raise RuntimeError(f"{name}: TRITON_INTERPRET=1 was set when this module was imported, so the "
                       f"kernels are interpreter-only; unset it to run on GPU")
  if m == 0 or n == 0 or meta["K"] == 0:
    return jnp.zeros((m, n), jnp.float32)
  import jax_triton  # lazily: only the GPU path needs it

  args = [x if np.dtype(x.dtype) in _PASS_AS_IS else jax.lax.bitcast_convert_type(x, jnp.uint8)
          for x in args]
  big_tile = meta["BLOCK_M"] * meta["BLOCK_N"] >= 128 * 128
  return jax_triton.triton_call(
      *(x.reshape(-1) for x in args), kernel=kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(-(-m // meta["BLOCK_M"]), -(-n // meta["BLOCK_N"])), num_warps=8 if big_tile else 4,
      num_stages=3, M=m, N=n, **meta)


def scaled_gemm(a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN, *, block_m: int = 128,
                block_n: int = 128, block_k: int = 64, fast_accum: bool = False):
  """reference.scaled_gemm as one Triton kernel (GPU only): float32 M x N."""
  args = (a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN)
  m, n, meta = _check_scaled(*args, (block_m, block_n, block_k), fast_accum)
  return _launch("scaled_gemm", _scaled_gemm_kernel, args, m, n, meta)


def mx_gemm(a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN, *, use_dot_scaled: bool = False,
            dequant_dtype: str = "bfloat16", block_m: int = 128, block_n: int = 128, block_k: int = 128):
  """reference.mx_gemm as one Triton kernel (GPU only): float32 M x N. Scales: float8_e8m0fnu or uint8."""
  args = (a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN)
  m, n, meta = _check_mx(*args, (block_m, block_n, block_k), use_dot_scaled, dequant_dtype)
  return _launch("mx_gemm", _mx_gemm_kernel, args, m, n, meta)


@contextlib.contextmanager
def _exact_interpreter_decoding():
  """Patches the interpreter's bf16 / float8 decoding in tl.dot and tl.dot_scaled (module docstring)."""
  import ml_dtypes
  from triton.runtime import interpreter

  as_dtype = {tl.bfloat16: ml_dtypes.bfloat16, tl.float8e4nv: ml_dtypes.float8_e4m3fn,
              tl.float8e5: ml_dtypes.float8_e5m2}

  def to_f32(h):
    return interpreter.TensorHandle(h.data.view(as_dtype[h.dtype]).astype(np.float32), tl.float32)

  builder, dot = interpreter.InterpreterBuilder, interpreter.InterpreterBuilder.create_dot
  mx_decode = interpreter._mxfp_value_handle_to_float32

  def create_dot(self, a, b, *rest):
    a, b = (to_f32(h) if h.dtype in as_dtype else h for h in (a, b))
    return dot(self, a, b, *rest)

  def mx_value_to_f32(h):
    return to_f32(h).data if h.dtype in as_dtype else mx_decode(h)

  builder.create_dot, interpreter._mxfp_value_handle_to_float32 = create_dot, mx_value_to_f32
  try:
    yield
  finally:
    builder.create_dot, interpreter._mxfp_value_handle_to_float32 = dot, mx_decode


def _run(name, kernel, args, m, n, meta):
  """The kernel through the interpreter on torch CPU tensors (float8 and E8M0 as uint8 bits)."""
  if not AVAILABLE:
    raise ImportError(f"{name} needs triton and torch ({_INSTALL_HINT})")
  from triton.runtime.interpreter import InterpretedFunction
  if not isinstance(kernel, InterpretedFunction):
    raise RuntimeError(f"{name}: set TRITON_INTERPRET=1 before importing pallas_kernels.fp8_gemm.triton "
                       f"(triton.jit picks the interpreter then)")
  import torch  # lazily: only the interpreter path needs it

  # NaN-filled, so that a tile the kernel forgot to store cannot pass as a result.
  out = torch.full((m, n), float("nan"), dtype=torch.float32)
  if m == 0 or n == 0 or meta["K"] == 0:
    return out.zero_().numpy()
  # Copies: torch.from_numpy wants writable arrays (jax-backed ones are read-only).
  bits = [x if x.dtype in _PASS_AS_IS else x.view(np.uint8) for x in map(np.array, args)]
  with _exact_interpreter_decoding():
    kernel[(-(-m // meta["BLOCK_M"]), -(-n // meta["BLOCK_N"]))](
        *(torch.from_numpy(x.reshape(-1)) for x in bits), out, M=m, N=n, **meta)
  return out.numpy()


def run_interpreted_scaled_gemm(a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN, *, block_m: int = 128,
                                block_n: int = 128, block_k: int = 64, fast_accum: bool = False):
  """The scaled_gemm kernel through Triton's interpreter on torch CPU tensors; numpy in, numpy out."""
  args = tuple(np.asarray(x) for x in (a_elems_MxK, a_scale_Mx1, b_elems_KxN, b_scale_1xN))
  m, n, meta = _check_scaled(*args, (block_m, block_n, block_k), fast_accum)
  return _run("run_interpreted_scaled_gemm", _scaled_gemm_kernel, args, m, n, meta)


def run_interpreted_mx_gemm(a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN, *,
                            use_dot_scaled: bool = False, dequant_dtype: str = "bfloat16",
                            block_m: int = 128, block_n: int = 128, block_k: int = 128):
  """The mx_gemm kernel through Triton's interpreter on torch CPU tensors; numpy in, numpy out."""
  args = tuple(np.asarray(x) for x in (a_elems_MxK, a_scales_MxKb, b_elems_KxN, b_scales_KbxN))
  m, n, meta = _check_mx(*args, (block_m, block_n, block_k), use_dot_scaled, dequant_dtype)
  return _run("run_interpreted_mx_gemm", _mx_gemm_kernel, args, m, n, meta)
