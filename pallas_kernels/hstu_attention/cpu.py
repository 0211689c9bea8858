"""HSTU jagged attention on the CPU through a C++ kernel (cpu_kernel.cc) called as an XLA FFI custom call.

Same contract as reference.hstu_attention (the spec). The kernel takes f32 (other dtypes are cast in and
out around it), and its bias is the H x N table of bias per distance |p(i) - p(j)| (the buckets gathered here
once, so autodiff sums the kernel's per-distance gradient back into buckets).

The shared library is compiled on first use with the machine's C++ compiler ($CXX, else g++) for this very
CPU (-march=native) against the installed jaxlib's FFI headers, and cached under $GEM_JAX_KERNEL_CACHE
(default ~/.cache/gem_jax/kernels) by a hash of the source, the flags, the headers' jaxlib and the CPU's
flags. `available()` says whether that worked, and why not. This module must never run attention math in
Python and never pick itself: gem_jax.ops decides which impl a call gets.

Letters: T token capacity, B rows, H heads, D q/k width, Dv value width, N max_seq_len, R bias buckets.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import version as jaxlib_version

from pallas_kernels import vma
from pallas_kernels.hstu_attention.reference import relative_position_bucket

SOURCE = pathlib.Path(__file__).with_name("cpu_kernel.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_FORWARD, _BACKWARD = "gem_hstu_cpu_forward", "gem_hstu_cpu_backward"


def _cpu_flags() -> str:
  """The CPU's feature flags (part of the cache key: the library is built for this CPU)."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("GEM_JAX_KERNEL_CACHE") or pathlib.Path.home() / ".cache/gem_jax/kernels")


def _build() -> pathlib.Path:
  compiler = os.environ.get("CXX", "g++")
  if shutil.which(compiler) is None:
    raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set $CXX)")
  include = jax.ffi.include_dir()
  source = SOURCE.read_bytes()
  key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(), include.encode(),
                                   jaxlib_version.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:20]
  target = cache_dir() / f"hstu_cpu_{key}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  # Built beside the target and renamed into place, so concurrent builds (test workers) never load a half file.
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    built = pathlib.Path(tmp) / target.name
    cmd = [compiler, *FLAGS, "-isystem", include, str(SOURCE), "-o", str(built)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    os.replace(built, target)
  return target


@functools.cache
def _register() -> str:
  """'' once the kernel is built and registered with XLA, else why it is not."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
  except (RuntimeError, OSError) as e:
    return str(e)
  jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(lib.GemHstuForward), platform="cpu")
  jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(lib.GemHstuBackward), platform="cpu")
  return ""


def available() -> tuple[bool, str]:
  """(True, '') when the kernel builds and loads on this machine, else (False, why)."""
  why = _register()
  return not why, why


@dataclasses.dataclass(frozen=True)
class Static:
  max_seq_len: int
  alpha: float
  causal: bool
  has_targets: bool
  max_attn_len: int
  contextual_seq_len: int
  has_bias: bool

  def attrs(self) -> dict:
    return dict(max_seq_len=np.int64(self.max_seq_len), alpha=np.float32(self.alpha),
                causal=np.int64(self.causal), has_targets=np.int64(self.has_targets),
                max_attn_len=np.int64(self.max_attn_len), contextual_seq_len=np.int64(self.contextual_seq_len),
                has_bias=np.int64(self.has_bias))


def _ffi(target: str, s: Static, results, operands):
  """The custom call on f32 results shaped like `results`. Inside shard_map(check_vma=True) an FFI call wants its
  operands to vary over the same mesh axes and types its results as varying over none (jax 0.10 cannot type
  them otherwise): the operands are cast to vary over every axis one of them does, and the results (per-device
  values, like everything else here) are typed so too."""
  operands = vma.like(operands, *operands)
  out_types = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in results)
  outs = jax.ffi.ffi_call(target, out_types, vmap_method="sequential")(*operands, **s.attrs())
  return vma.like(tuple(outs), *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(s: Static, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxN):
  operands = (q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxN)
  return _ffi(_FORWARD, s, (v_TxHxDv,), operands)[0]


def _attention_fwd(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxN):
  out = _attention(s, q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxN)
  return out, (q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, targets_B, bias_HxN)


def _attention_bwd(s, residuals, dout_TxHxDv):
  q, k, v, offsets_Bp1, targets_B, bias_HxN = residuals
  grads = _ffi(_BACKWARD, s, (q, k, v, bias_HxN), (q, k, v, dout_TxHxDv, offsets_Bp1, targets_B, bias_HxN))
  # Under shard_map each cotangent takes its input's varying axes (as in api.py).
  dq, dk, dv, dbias = (vma.sum_to(g, x) for g, x in zip(grads, (q, k, v, bias_HxN)))
  int_zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return dq, dk, dv, int_zero(offsets_Bp1), int_zero(targets_B), dbias


_attention.defvjp(_attention_fwd, _attention_bwd)


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None):
  """HSTU attention over jagged rows (reference.hstu_attention's contract); out_TxHxDv in v's dtype.

  Rows longer than N are outside the contract (as in the reference); here their tokens past N get 0.
  """
  capacity, num_heads, _ = q_TxHxD.shape
  if k_TxHxD.shape != q_TxHxD.shape or v_TxHxDv.shape[:2] != (capacity, num_heads):
    raise ValueError(f"hstu_attention: q {q_TxHxD.shape}, k {k_TxHxD.shape}, v {v_TxHxDv.shape} disagree")
  if max_seq_len < 1 or max_attn_len < 0 or contextual_seq_len < 0:
    raise ValueError(f"hstu_attention: max_seq_len {max_seq_len} must be >= 1, max_attn_len {max_attn_len} and "
                     f"contextual_seq_len {contextual_seq_len} >= 0")
  num_rows = offsets_Bp1.shape[0] - 1
  if num_targets is not None and jnp.shape(num_targets) != (num_rows,):
    raise ValueError(f"hstu_attention: num_targets has shape {jnp.shape(num_targets)}, expected ({num_rows},)")
  if rel_bias_HxR is not None and (rel_bias_HxR.ndim != 2 or rel_bias_HxR.shape[0] != num_heads):
    raise ValueError(f"hstu_attention: rel_bias has shape {rel_bias_HxR.shape}, expected ({num_heads}, R)")
  if capacity == 0 or num_rows == 0:  # no tokens or no rows: nothing to attend
    return jnp.zeros_like(v_TxHxDv)
  ok, why = available()
  if not ok:
    raise RuntimeError(f"hstu_attention impl 'cpp': the C++ kernel is unavailable: {why}")
  targets_B = (jnp.zeros((num_rows,), jnp.int32) if num_targets is None
               else jnp.asarray(num_targets, jnp.int32))
  if rel_bias_HxR is None:  # never read by the kernel; a stand-in keeps one custom_vjp signature
    bias_HxN = jnp.zeros((num_heads, 1), jnp.float32)
  else:
    bucket_N = relative_position_bucket(jnp.arange(max_seq_len), rel_bias_HxR.shape[1])
    bias_HxN = rel_bias_HxR.astype(jnp.float32)[:, bucket_N]
  s = Static(max_seq_len, float(alpha), bool(causal), num_targets is not None, max_attn_len, contextual_seq_len,
             rel_bias_HxR is not None)
  f32 = lambda x: x.astype(jnp.float32)
  out = _attention(s, f32(q_TxHxD), f32(k_TxHxD), f32(v_TxHxDv), jnp.asarray(offsets_Bp1, jnp.int32), targets_B,
                   bias_HxN)
  return out.astype(v_TxHxDv.dtype)


QUERY_BLOCK = KEY_BLOCK = 64   # cpu_kernel.cc's kQueryBlock and kKeyBlock
LANES = 16                      # and kLanes: key (forward) and query (backward) ranges round up to it


@functools.lru_cache(maxsize=4096)
def _row_pairs(n: int, contextual_seq_len: int, causal: bool) -> tuple[int, int]:
  """(forward, backward) pairs the kernel computes for one row of n used tokens, without a window: the loop
  bounds of ForwardItem / KeyRange and BackwardItem in cpu_kernel.cc."""
  up = lambda x: -(-x // LANES) * LANES
  c = contextual_seq_len
  fwd = bwd = 0
  for q0 in range(0, n, QUERY_BLOCK):
    qn = min(QUERY_BLOCK, n - q0)
    hi = n if not causal or (c > 0 and q0 < c) else q0 + qn
    fwd += qn * up(hi)
  for k0 in range(0, n, KEY_BLOCK):
    kn = min(KEY_BLOCK, n - k0)
    queries = up(n)
    if causal:
      ctx_end = up(min(c, k0)) if c > 0 else 0
      queries = up(n) - (0 if ctx_end >= k0 else k0 - ctx_end)
    bwd += kn * queries
  return fwd, bwd


def executed_pairs(lengths_B, max_seq_len: int, *, contextual_seq_len: int = 0, causal: bool = True) -> tuple[int, int]:
  """(forward, backward) (query, key) pairs per head the kernel computes for rows of these lengths (host ints;
  no window: with max_attn_len it computes fewer). Its blocks round each row's pairs up, so these exceed the
  mask's pairs by a block's edge per row, where XLA's cost analysis sees none of them (a custom call)."""
  n_B = np.minimum(np.asarray(lengths_B, np.int64), max_seq_len)
  if np.any(n_B < 0):
    raise ValueError("executed_pairs: lengths must be >= 0")
  fwd = bwd = 0
  for n, count in zip(*np.unique(n_B, return_counts=True)):
    f, b = _row_pairs(int(n), contextual_seq_len, causal)
    fwd, bwd = fwd + f * int(count), bwd + b * int(count)
  return fwd, bwd


__all__ = ["available", "cache_dir", "executed_pairs", "hstu_attention"]
