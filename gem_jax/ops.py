"""One public entry per kernel. `impl` picks the implementation by name from a registry:

  "xla"     pure jnp/lax, runs on every backend (the CPU default of the jagged softmax)
  "reference" the pure-jnp spec (pads to B x N x N)
  "dense"   the spec's padded work, one row per loop step with its own backward (HSTU only)
  "cpp"     a C++ kernel called through XLA's FFI (HSTU only; CPU only; built on first use)
  "pallas"  Pallas kernel (Triton-lowered on GPU; interpret mode elsewhere)
  "triton"  jax-triton forward kernel (GPU only; its backward is the reference's)
  "auto"    pallas on GPU; on CPU cpp for HSTU (xla where it cannot be built, or when tiles are asked for);
            xla elsewhere

"GPU" is the platform of the program being built (gem_jax/runtime.py `platform()`: the target of the mesh a
step is traced for, gem_jax/parallel/target.py), not the host's default backend: a step built for an H200
topology on a CPU machine gets the compiled Triton kernels, and a CPU step the interpreter.
Model code calls these functions only; it never imports a kernel module directly.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax

from gem_jax import runtime
from pallas_kernels.hstu_attention import api as hstu_pallas
from pallas_kernels.hstu_attention import cpu as hstu_cpu
from pallas_kernels.hstu_attention import dense as hstu_dense
from pallas_kernels.hstu_attention import query_block as hstu_query_block
from pallas_kernels.hstu_attention import reference as hstu_reference
from pallas_kernels.hstu_attention import tiled as hstu_tiled
from pallas_kernels.hstu_attention import tune as hstu_tune
from pallas_kernels.jagged_softmax_attention import blocked as softmax_blocked
from pallas_kernels.jagged_softmax_attention import pallas as softmax_pallas
from pallas_kernels.jagged_softmax_attention import reference as softmax_reference
from pallas_kernels.jagged_softmax_attention import tiled as softmax_tiled

def _hstu_pallas(*args, **kwargs):
  return hstu_pallas.hstu_attention(*args, interpret=runtime.platform() != "gpu", **kwargs)


def _softmax_pallas(*args, **kwargs):
  return softmax_pallas.jagged_softmax_attention(*args, interpret=runtime.platform() != "gpu", **kwargs)


# "xla" is the tiled path: a dynamic loop over the (row, q block, k block) tiles the mask needs, so its work
# follows the real lengths (1.2-1.4x the jagged causal pairs on heavy-tailed batches); "reference" is the
# dense spec, which pads every row to max_seq_len and leaves its backward to autodiff; "dense" is the same
# padded work one row per loop step with its own backward (the fast like-for-like dense baseline).
_HSTU_IMPLS: dict[str, Callable] = {"xla": hstu_tiled.hstu_attention, "reference": hstu_reference.hstu_attention,
                                    "dense": hstu_dense.hstu_attention, "pallas": _hstu_pallas}


# Softmax attention: "xla" is the tiled loop (work follows the real lengths, as for HSTU), "blocked" a
# fixed key band per query block (no dynamic loop), "reference" the dense spec.
_SOFTMAX_IMPLS: dict[str, Callable] = {"xla": softmax_tiled.jagged_softmax_attention,
                                       "blocked": softmax_blocked.jagged_softmax_attention,
                                       "reference": softmax_reference.jagged_softmax_attention,
                                       "pallas": _softmax_pallas}


def _hstu_triton(*args, **kwargs):
  # Imported on first use: triton is an optional GPU dependency and slow to import.
  from pallas_kernels.hstu_attention import triton as hstu_triton
  return hstu_triton.hstu_attention_triton(*args, **kwargs)


_HSTU_IMPLS["triton"] = _hstu_triton


def _hstu_cpp(*args, **kwargs):
  if runtime.platform() != "cpu":
    raise ValueError(f"hstu_attention: impl 'cpp' runs on CPU only, not on {runtime.platform()!r}")
  return hstu_cpu.hstu_attention(*args, **kwargs)


_HSTU_IMPLS["cpp"] = _hstu_cpp


def register_hstu_impl(name: str, fn: Callable) -> None:
  _HSTU_IMPLS[name] = fn


def register_softmax_impl(name: str, fn: Callable) -> None:
  _SOFTMAX_IMPLS[name] = fn


def hstu_impls() -> tuple[str, ...]:
  """The registered HSTU attention impls (what `impl=` accepts besides "auto"), sorted."""
  return tuple(sorted(_HSTU_IMPLS))


def softmax_impls() -> tuple[str, ...]:
  """The registered jagged softmax attention impls, sorted."""
  return tuple(sorted(_SOFTMAX_IMPLS))


def hstu_impl(name: str) -> Callable:
  """The HSTU attention function registered as `name` ("auto" resolved for the current platform)."""
  return _resolve(_auto_hstu(name, None), _HSTU_IMPLS, "hstu_attention")


def softmax_impl(name: str) -> Callable:
  """The jagged softmax attention function registered as `name` ("auto" resolved for the current platform)."""
  return _resolve(name, _SOFTMAX_IMPLS, "jagged_softmax_attention")


def _auto(impl: str) -> str:
  return impl if impl != "auto" else "pallas" if runtime.platform() == "gpu" else "xla"


@functools.cache
def _cpp_builds() -> bool:
  ok, why = hstu_cpu.available()
  if not ok:
    warnings.warn(f"hstu_attention: the C++ CPU kernel is unavailable ({why}); impl 'auto' takes 'xla'", stacklevel=3)
  return ok


def _auto_hstu(impl: str, tiles) -> str:
  """HSTU's "auto": the C++ kernel on CPU (3-4x the tiled loop's forward + backward on heavy-tailed rows, README),
  unless `tiles` asks for the tiled loop or the kernel cannot be built here."""
  if impl != "auto" or runtime.platform() != "cpu":
    return _auto(impl)
  return "xla" if tiles is not None or not _cpp_builds() else "cpp"


def _resolve(impl: str, registry: dict[str, Callable], kernel: str) -> Callable:
  impl = _auto(impl)
  if impl not in registry:
    raise ValueError(f"{kernel}: unknown impl {impl!r}; available: {sorted(registry)} (or 'auto')")
  return registry[impl]


def _counted(kind: str, impl: str, q_TxHxD, v_TxHxDv, max_seq_len: int, contextual_seq_len: int,
             block: int | None = None) -> bool:
  """Tells the runtime's recorder about this call (gem_jax/runtime.py); True when the trace is only
  counted and the call should return zeros instead of a kernel. block: the tiled loop's tile edge, None when
  the autotuner picks it per batch (or the impl has no tiles)."""
  rt = runtime.current()
  if rt.recorder is not None:
    runtime.record("attention", kind=kind, impl=_auto(impl), length=q_TxHxD.shape[0], heads=q_TxHxD.shape[1],
                   dh=q_TxHxD.shape[2], dv=v_TxHxDv.shape[2], max_seq_len=max_seq_len,
                   num_contextual=contextual_seq_len, block=block)
  return rt.count_only


def hstu_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, alpha: float,
                   causal: bool = True, num_targets=None, max_attn_len: int = 0,
                   contextual_seq_len: int = 0, rel_bias_HxR=None, impl: str = "auto",
                   tiles: hstu_tiled.TileConfig | str | None = None):
  """HSTU pointwise (SiLU, no softmax) attention over jagged q/k/v; see
  pallas_kernels/hstu_attention/reference.py for the exact mask and normalization.

  rel_bias_HxR: optional learned bias per head and relative-position bucket (R buckets), added to the
  logit alpha * q.k before the SiLU, as HSTU's relative attention bias does.
  tiles: the tile edge and tiles per loop step of the `xla` impl: None for hstu_tiled.DEFAULT_TILES, a
  hstu_tiled.TileConfig, or "auto" for the autotuner's pick for this call's shape bucket on this backend
  (pallas_kernels/hstu_attention/tune.py; cached in memory and in the file $GEM_JAX_HSTU_TILES). Other impls
  have no tiles: they refuse a TileConfig and ignore "auto". With impl "auto" on CPU, tiles pick `xla`.
  """
  impl = _auto_hstu(impl, tiles)
  fn = _resolve(impl, _HSTU_IMPLS, "hstu_attention")
  tiled = fn is hstu_tiled.hstu_attention
  if tiles is not None and tiles != "auto" and not isinstance(tiles, hstu_tiled.TileConfig):
    raise ValueError(f"hstu_attention: tiles must be None, 'auto' or a TileConfig, got {tiles!r}")
  if isinstance(tiles, hstu_tiled.TileConfig) and not tiled:
    raise ValueError(f"hstu_attention: tiles={tiles} is a setting of the 'xla' impl, not of {_auto(impl)!r}")
  block = None if not tiled or tiles == "auto" else (tiles or hstu_tiled.DEFAULT_TILES).block
  if _counted("hstu", impl, q_TxHxD, v_TxHxDv, max_seq_len, contextual_seq_len, block):
    return jax.numpy.zeros_like(v_TxHxDv)
  extra = {}
  if tiled and tiles == "auto":
    tiles = hstu_tune.default().pick(hstu_tune.bucket(
        q_TxHxD, v_TxHxDv, offsets_Bp1, max_seq_len=max_seq_len, causal=causal, has_targets=num_targets is not None,
        max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
        num_buckets=0 if rel_bias_HxR is None else rel_bias_HxR.shape[1]))
  if tiled and tiles is not None:
    extra = dataclasses.asdict(tiles)
  return fn(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, max_seq_len=max_seq_len, alpha=alpha,
            causal=causal, num_targets=num_targets, max_attn_len=max_attn_len,
            contextual_seq_len=contextual_seq_len, rel_bias_HxR=rel_bias_HxR, **extra)


TileConfig = hstu_tiled.TileConfig


def hstu_tile_picks() -> list[dict]:
  """The autotuner's picks this process used (tiles="auto"): bucket, TileConfig and the timings behind it."""
  return hstu_tune.default().report()


def hstu_attention_query_block(q_QxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, q_start, *, max_seq_len: int,
                               alpha: float, causal: bool = True, num_targets=None, max_attn_len: int = 0,
                               contextual_seq_len: int = 0, rel_bias_HxR=None):
  """HSTU attention for the query slots q_start + [0, Q) against all T key slots (context parallelism);
  the same values as those rows of hstu_attention. XLA only (pallas_kernels/hstu_attention/query_block.py)."""
  return hstu_query_block.hstu_attention_query_block(
      q_QxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, q_start, max_seq_len=max_seq_len, alpha=alpha, causal=causal,
      num_targets=num_targets, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
      rel_bias_HxR=rel_bias_HxR)


def jagged_softmax_attention(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, scale: float,
                             causal: bool = True, num_targets=None, max_attn_len: int = 0,
                             contextual_seq_len: int = 0, impl: str = "auto", block: int | None = None,
                             group: int | None = None):
  """Softmax attention over jagged rows with the HSTU mask semantics (InterFormer-style sequence arches);
  see pallas_kernels/jagged_softmax_attention/reference.py.

  block, group: the tile edge and the tiles per loop step of the `xla` impl (None: softmax_tiled.BLOCK and
  GROUP). Short rows want small tiles and long ones large (README, sequential recommendation). A named other
  impl refuses them; "auto" resolved to another impl (the GPU's pallas) ignores them, so a config that sets
  them for the CPU path still runs on a GPU."""
  fn = _resolve(impl, _SOFTMAX_IMPLS, "jagged_softmax_attention")
  extra = {name: value for name, value in (("block", block), ("group", group)) if value is not None}
  if extra and fn is not softmax_tiled.jagged_softmax_attention:
    if impl != "auto":
      raise ValueError(f"jagged_softmax_attention: {', '.join(f'{k}={v}' for k, v in extra.items())} is a setting "
                       f"of the 'xla' impl, not of {_auto(impl)!r}")
    extra = {}
  if _counted("softmax", impl, q_TxHxD, v_TxHxDv, max_seq_len, contextual_seq_len):
    return jax.numpy.zeros_like(v_TxHxDv)
  return fn(q_TxHxD, k_TxHxD, v_TxHxDv, offsets_Bp1, max_seq_len=max_seq_len, scale=scale, causal=causal,
            num_targets=num_targets, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len, **extra)
