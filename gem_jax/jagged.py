"""Jagged (variable-length) arrays: the data format of every user history in gem-jax.

A `Jagged` holds B rows of different lengths packed back to back:

  values_T...   the tokens of row 0, then row 1, ..., then tail padding up to the static capacity T
  offsets_Bp1   int32, offsets[0] = 0, non-decreasing, offsets[B] <= T; row b is values[offsets[b]:offsets[b+1]]

Letters: B rows, T token capacity (static), N a dense max length, L one row's length.

Padding only ever sits at the tail, so a kernel can stop at offsets[B]. The capacity is static (it comes
from a small set of buckets chosen by the data pipeline) so that jit compiles once per bucket.

Every device-side function here is jit-safe and never builds a T x T or B x T matrix: row membership of a
token is found with a binary search over the offsets. `validate` is the host-side check the data pipeline
runs on every batch; device code trusts its input and must never clamp silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import runtime


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Jagged:
  """B variable-length rows packed into `values` (leading dim = capacity T) with `offsets` (B + 1,)."""

  values: Any  # T x ... array
  offsets: Any  # (B + 1,) int32

  # ---- shape facts (static) -------------------------------------------------------------------
  @property
  def capacity(self) -> int:
    return self.values.shape[0]

  @property
  def batch_size(self) -> int:
    return self.offsets.shape[0] - 1

  @property
  def feature_shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape[1:])

  # ---- per-row / per-token facts (traced) -----------------------------------------------------
  def lengths(self):
    """Row lengths, (B,) int32."""
    return self.offsets[1:] - self.offsets[:-1]

  def num_tokens(self):
    """Real (non-padding) tokens, a scalar."""
    return self.offsets[-1]

  def segment_ids(self):
    """Row index of every token, (T,) int32; padding tokens get B so segment ops with B segments drop them."""
    return segment_ids(self.offsets, self.capacity)

  def valid_mask(self):
    """(T,) bool, True on real tokens."""
    return jnp.arange(self.capacity, dtype=jnp.int32) < self.offsets[-1]

  def positions(self):
    """Position of every token inside its row, (T,) int32 (0 for padding)."""
    seg = self.segment_ids()
    starts = jnp.concatenate([self.offsets[:-1], self.offsets[-1:]])[seg]
    return jnp.where(self.valid_mask(), jnp.arange(self.capacity, dtype=jnp.int32) - starts, 0)

  def replace_values(self, values) -> "Jagged":
    if values.shape[0] != self.capacity:
      raise ValueError(f"new values have {values.shape[0]} tokens, the jagged capacity is {self.capacity}")
    return Jagged(values, self.offsets)

  # ---- conversions ----------------------------------------------------------------------------
  def to_dense(self, max_len: int, pad_value=0, keep: str = "first"):
    """Returns (dense_BxNx..., lengths_B) with N = max_len.

    Rows longer than max_len are truncated: keep="first" keeps their first max_len tokens, keep="last"
    their most recent ones (what a recommender wants for a history). The returned lengths are the
    truncated ones, so nothing downstream reads a token that was dropped.
    """
    if keep not in ("first", "last"):
      raise ValueError(f"keep must be 'first' or 'last', got {keep!r}")
    lengths = self.lengths()
    kept = jnp.minimum(lengths, max_len)
    start = self.offsets[:-1] + (lengths - kept if keep == "last" else 0)
    pos_N = jnp.arange(max_len, dtype=jnp.int32)
    src_BxN = start[:, None] + pos_N[None, :]
    valid_BxN = pos_N[None, :] < kept[:, None]
    src_BxN = jnp.where(valid_BxN, src_BxN, 0)
    gathered = self.values[src_BxN] if self.capacity > 0 else jnp.zeros(
        (self.batch_size, max_len) + self.feature_shape, self.values.dtype)
    mask = valid_BxN.reshape(valid_BxN.shape + (1,) * len(self.feature_shape))
    return jnp.where(mask, gathered, jnp.asarray(pad_value, self.values.dtype)), kept

  @staticmethod
  def from_dense(dense_BxN, lengths_B, capacity: int) -> "Jagged":
    """Packs the first lengths[b] entries of each row; the capacity must hold sum(lengths) (not checked
    on device: tokens past the capacity would be dropped, so the host validates lengths first)."""
    B, N = dense_BxN.shape[:2]
    lengths_B = jnp.minimum(jnp.asarray(lengths_B, jnp.int32), N)
    offsets, t, valid, row = _packed(lengths_B, capacity, B)
    pos = jnp.where(valid, t - offsets[row], 0)
    values = dense_BxN[row, pos]
    mask = valid.reshape((capacity,) + (1,) * (dense_BxN.ndim - 2))
    return Jagged(jnp.where(mask, values, jnp.zeros((), dense_BxN.dtype)), offsets)

  @staticmethod
  def from_rows(rows: Sequence[np.ndarray], capacity: int | None = None, dtype=None) -> "Jagged":
    """Host-side builder from a list of per-row numpy arrays (rows may be empty)."""
    rows = [np.asarray(r) for r in rows]
    lengths = np.array([r.shape[0] for r in rows], np.int64)
    total = int(lengths.sum())
    cap = total if capacity is None else capacity
    if total > cap:
      raise ValueError(f"rows hold {total} tokens but the capacity is {cap}")
    tail = next((r.shape[1:] for r in rows if r.size), rows[0].shape[1:] if rows else ())
    dt = dtype or (rows[0].dtype if rows else np.float32)
    values = np.zeros((cap,) + tuple(tail), dt)
    if total:
      values[:total] = np.concatenate([r.reshape((-1,) + tuple(tail)) for r in rows]).astype(dt)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return Jagged(values, offsets)

  def rows(self) -> list[np.ndarray]:
    """Host-side: the real tokens of each row as numpy arrays."""
    values, offsets = np.asarray(self.values), np.asarray(self.offsets)
    return [values[offsets[b]:offsets[b + 1]] for b in range(len(offsets) - 1)]

  # ---- host-side validation -------------------------------------------------------------------
  def validate(self, name: str = "jagged") -> None:
    """Raises ValueError naming `name` (and the row) when the offsets are malformed."""
    validate_offsets(np.asarray(self.offsets), np.shape(self.values)[0], name)


def validate_offsets(offsets: np.ndarray, capacity: int, name: str) -> None:
  """Host-side check of the jagged invariants; the message names the feature and the first bad row."""
  if offsets.ndim != 1 or offsets.shape[0] < 1:
    raise ValueError(f"{name}: offsets must be 1-D of length B + 1, got shape {offsets.shape}")
  if not np.issubdtype(offsets.dtype, np.integer):
    raise ValueError(f"{name}: offsets must be integers, got {offsets.dtype}")
  if offsets[0] != 0:
    raise ValueError(f"{name}: offsets[0] must be 0, got {int(offsets[0])}")
  steps = np.diff(offsets.astype(np.int64))
  bad = np.flatnonzero(steps < 0)
  if bad.size:
    b = int(bad[0])
    raise ValueError(f"{name}: offsets decrease at row {b} ({int(offsets[b])} -> {int(offsets[b + 1])})")
  if offsets[-1] > capacity:
    raise ValueError(f"{name}: offsets[B] = {int(offsets[-1])} exceeds the capacity {capacity}")


def segment_ids(offsets_Bp1, capacity: int):
  """Row of each of `capacity` token slots; padding slots (>= offsets[B]) get B."""
  t = jnp.arange(capacity, dtype=jnp.int32)
  # The last row whose start is <= t; empty rows (equal offsets) are skipped by side="right".
  row = (jnp.searchsorted(offsets_Bp1, t, side="right") - 1).astype(jnp.int32)
  return jnp.where(t < offsets_Bp1[-1], row, offsets_Bp1.shape[0] - 1).astype(jnp.int32)


def _take(values_SxF, src_T, valid_T):
  mask = valid_T.reshape(valid_T.shape + (1,) * (values_SxF.ndim - 1))
  return jnp.where(mask, values_SxF[src_T], jnp.zeros((), values_SxF.dtype))


@jax.custom_vjp
def take_rows(values_SxF, src_T, valid_T):
  """values[src[t]] for every slot t where valid[t], else 0: the row moves of concat_rows, split_rows and
  keep_last. The valid slots must read distinct sources (each token lands in one place), which those moves
  guarantee. Then the gradient is again a gather, by the inverse map, where autodiff of the gather would
  scatter-add into zeros: on CPU the zeros, their copy and a serial scatter cost several times the gather."""
  return _take(values_SxF, src_T, valid_T)


def _take_rows_fwd(values_SxF, src_T, valid_T):
  num_sources, num_slots = values_SxF.shape[0], src_T.shape[0]
  # Invalid slots point past the end and are dropped: inverse[s] is the slot that reads source s, or
  # num_slots for a source no slot reads. One int32 scatter: a byte-wide one (a "read" mask) would make the
  # GPU loop on compare-and-swap (tests/test_gpu_compile.py checks the compiled PTX).
  slot_T = jnp.where(valid_T, src_T, num_sources)
  inverse_S = jnp.full((num_sources,), num_slots, jnp.int32).at[slot_T].set(
      jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
  return _take(values_SxF, src_T, valid_T), inverse_S


def _take_rows_bwd(inverse_S, d_TxF):
  read_S = inverse_S < d_TxF.shape[0]
  return _take(d_TxF, jnp.minimum(inverse_S, d_TxF.shape[0] - 1), read_S), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def concat_rows(a: Jagged, b: Jagged, capacity: int | None = None) -> Jagged:
  """Per-row concatenation: row r of the result is a[r] ++ b[r] (e.g. contextual tokens ++ history)."""
  if a.batch_size != b.batch_size:
    raise ValueError(f"concat_rows: batch sizes differ ({a.batch_size} vs {b.batch_size})")
  if a.feature_shape != b.feature_shape:
    raise ValueError(f"concat_rows: token shapes differ ({a.feature_shape} vs {b.feature_shape})")
  cap = a.capacity + b.capacity if capacity is None else capacity
  if cap < a.capacity + b.capacity:   # tokens past it would be dropped on device without a word
    raise ValueError(f"concat_rows: capacity {cap} < {a.capacity} + {b.capacity}, the tokens both can hold")
  offsets = a.offsets + b.offsets
  t = jnp.arange(cap, dtype=jnp.int32)
  seg = segment_ids(offsets, cap)
  valid = t < offsets[-1]
  row = jnp.minimum(seg, a.batch_size - 1)
  local = t - offsets[row]
  len_a = a.lengths()[row]
  from_a = local < len_a
  src_a = jnp.clip(a.offsets[row] + local, 0, max(a.capacity - 1, 0))
  src_b = jnp.clip(b.offsets[row] + local - len_a, 0, max(b.capacity - 1, 0))
  va = take_rows(a.values, src_a, valid & from_a) if a.capacity else jnp.zeros((cap,) + a.feature_shape,
                                                                                  a.values.dtype)
  vb = take_rows(b.values, src_b, valid & ~from_a) if b.capacity else jnp.zeros((cap,) + b.feature_shape,
                                                                                   b.values.dtype)
  bshape = (cap,) + (1,) * len(a.feature_shape)
  return Jagged(jnp.where(from_a.reshape(bshape), va, vb.astype(va.dtype)), offsets)


def split_rows(x: Jagged, first_lengths_B, capacity_first: int, capacity_second: int) -> tuple[Jagged, Jagged]:
  """Inverse of concat_rows: row r is cut after first_lengths[r] tokens (clipped to the row length). Each
  part's capacity must hold its tokens (the caller knows how many: e.g. C contextual tokens a row); together
  they must hold x's, which is checked."""
  if capacity_first + capacity_second < x.capacity:
    raise ValueError(f"split_rows: capacities {capacity_first} + {capacity_second} < {x.capacity}, the tokens x "
                     "can hold")
  lengths = x.lengths()
  first = jnp.minimum(jnp.asarray(first_lengths_B, jnp.int32), lengths)
  return (_gather_rows(x, x.offsets[:-1], first, capacity_first),
          _gather_rows(x, x.offsets[:-1] + first, lengths - first, capacity_second))


def keep_last(x: Jagged, k: int, capacity: int | None = None) -> Jagged:
  """Keeps the most recent k tokens of every row (the pyramid schedule of deeper sequence layers)."""
  runtime.record("truncate", k=k)  # where a row's FLOPs change form (gem_jax/observe/flops.py)
  lengths = x.lengths()
  kept = jnp.minimum(lengths, k)
  need = min(x.capacity, x.batch_size * k)   # the most tokens the kept rows can hold
  cap = need if capacity is None else capacity
  if cap < need:
    raise ValueError(f"keep_last: capacity {cap} < {need} (min of x's capacity and {x.batch_size} rows x {k}): "
                     "kept tokens past it would be dropped")
  return _gather_rows(x, x.offsets[1:] - kept, kept, cap)


def _packed(lengths_B, capacity: int, batch_size: int):
  """Rows of lengths_B packed from slot 0 into `capacity` slots: (offsets, each slot's index, whether it holds
  a token, its row, the last row for a padding slot)."""
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths_B, dtype=jnp.int32)])
  t = jnp.arange(capacity, dtype=jnp.int32)
  valid = t < offsets[-1]
  row = jnp.minimum(segment_ids(offsets, capacity), batch_size - 1)
  return offsets, t, valid, row


def _gather_rows(x: Jagged, starts_B, lengths_B, capacity: int) -> Jagged:
  """New jagged array whose row r is x.values[starts[r] : starts[r] + lengths[r]]."""
  offsets, t, valid, row = _packed(lengths_B, capacity, x.batch_size)
  src = jnp.clip(starts_B[row] + t - offsets[row], 0, max(x.capacity - 1, 0))
  if x.capacity == 0:
    return Jagged(jnp.zeros((capacity,) + x.feature_shape, x.values.dtype), offsets)
  return Jagged(take_rows(x.values, src, valid), offsets)


def dense_to_jagged(x_BxNx, capacity: int | None = None) -> Jagged:
  """Every row has exactly N tokens (e.g. the candidate target token, N = 1, or N contextual tokens)."""
  B, N = x_BxNx.shape[:2]
  values = x_BxNx.reshape((B * N,) + x_BxNx.shape[2:])
  cap = B * N if capacity is None else capacity
  if cap > B * N:
    values = jnp.concatenate([values, jnp.zeros((cap - B * N,) + values.shape[1:], values.dtype)])
  elif cap < B * N:
    raise ValueError(f"capacity {cap} cannot hold {B} rows of {N} tokens")
  return Jagged(values, jnp.arange(B + 1, dtype=jnp.int32) * N)


def segment_sum(values_Tx, x: Jagged):
  """Sum of every row's tokens, (B, ...). Padding tokens are dropped."""
  return jax.ops.segment_sum(values_Tx, x.segment_ids(), num_segments=x.batch_size)


def segment_mean(values_Tx, x: Jagged):
  """Mean over every row's tokens; empty rows give 0."""
  s = segment_sum(values_Tx, x)
  n = jnp.maximum(x.lengths(), 1).astype(s.dtype)
  return s / n.reshape((-1,) + (1,) * (s.ndim - 1))


def last_token(x: Jagged, fill=0):
  """The last token of each row, (B, ...); empty rows get `fill`."""
  lengths = x.lengths()
  idx = jnp.clip(x.offsets[1:] - 1, 0, max(x.capacity - 1, 0))
  out = x.values[idx]
  mask = (lengths > 0).reshape((-1,) + (1,) * len(x.feature_shape))
  return jnp.where(mask, out, jnp.asarray(fill, out.dtype))
