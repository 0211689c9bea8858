"""Model FLOPs of a run, derived from traces of its task's loss on single rows, and parameter counts.

Rows are independent (no op mixes examples), so the FLOPs of a batch are the sum over its rows of f(n), the
FLOPs of one row with a sequence of n tokens. f(n) is read off the program itself: the task's forward loss
(task.sums) is traced (jax.make_jaxpr, nothing runs) on a one-row batch whose sequence capacity is exactly
n, and every dot_general in it is counted, 2 x (output elements) x (contracted size), through nested jaxprs.
Attention calls (gem_jax/ops.py) tell the runtime's recorder what they are and return zeros in such a
trace (runtime.count_only), so their FLOPs are counted by the dense convention instead of by whichever
kernel runs: every (query, key) pair of a row once, n^2 per row and head, at 2 (Dh + Dv) matmul FLOPs and,
for HSTU's SiLU attention, ATTN_POINTWISE_FLOPS more (scale, bias, SiLU, mask, divide by N) per pair. A
layer or lookup added to the model is therefore counted without anyone writing its formula.

f is a quadratic in n between the points where the model truncates rows (jagged.keep_last tells the
recorder its k): `FlopModel` traces each such piece at four lengths, fits the quadratic on three and checks
it on the fourth, splits a piece whose check fails, and evaluates f for a batch's lengths with numpy.
Norms, activations and gathers are not counted (XLA's cost analysis counts them, so the two agree to a few
percent); a train step costs TRAIN_FLOPS_FACTOR = 3 forward passes.

For the tiled HSTU kernel ("xla" impl) the trainer adds the tiles its dynamic loops walk, which XLA's cost
analysis counts once: `tiled_train` counts them for every recorded attention call from its row lengths
(`tiled_attention_tiles`, held to the kernel's own count by tests/test_flops.py). The C++ kernel ("cpp" impl) is
a custom call, invisible to that analysis: `native_train` adds the pairs its blocks compute
(pallas_kernels/hstu_attention/cpu.py executed_pairs).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from gem_jax import runtime
from pallas_kernels.hstu_attention import cpu as hstu_cpu
from pallas_kernels.hstu_attention import tiled as hstu_tiled

ATTN_POINTWISE_FLOPS = {"hstu": 8, "softmax": 0}
TRAIN_FLOPS_FACTOR = 3.0
TILED_BLOCK = hstu_tiled.DEFAULT_TILES.block  # the tiled HSTU loop's default tile edge
_CHECK_RTOL = 1e-9


# ---- counting a traced program ------------------------------------------------------------------------

def dot_flops(jaxpr) -> float:
  """2 x output elements x contracted size of every dot_general in a (closed) jaxpr, nested ones included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2.0 * float(np.prod(out, dtype=np.float64)) * float(np.prod([lhs[d] for d in lhs_contract]))
    for sub in _sub_jaxprs(eqn):
      total += dot_flops(sub) * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
  return total


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
        yield item


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """One attention call of a one-row trace, as gem_jax.ops recorded it."""
  kind: str            # "hstu" | "softmax"
  impl: str            # the impl that would run ("xla", "pallas", ...)
  length: int          # the row's tokens (the trace has one row of exact capacity)
  heads: int
  dh: int
  dv: int
  max_seq_len: int
  num_contextual: int
  block: int | None = None   # the tiled HSTU loop's tile edge; None: picked per batch by the autotuner

  @property
  def flops(self) -> float:
    return float(self.length) ** 2 * self.heads * (2 * (self.dh + self.dv) + ATTN_POINTWISE_FLOPS[self.kind])


class _Recorder:
  def __init__(self):
    self.attention: list[AttentionCall] = []
    self.truncations: set[int] = set()

  def record(self, what: str, **facts) -> None:
    if what == "attention":
      self.attention.append(AttentionCall(**facts))
    elif what == "truncate":
      self.truncations.add(int(facts["k"]))


def trace_row(run, n: int) -> tuple[float, list[AttentionCall], set[int]]:
  """(forward FLOPs, attention calls, truncation lengths) of one row with an n-token sequence."""
  batch = run.source.row_batch(n)
  params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.state.params)
  rest = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), run.rest)
  recorder = _Recorder()

  def loss_sums(params, rest, batch):
    from flax import nnx
    return run.task.sums(nnx.merge(run.graphdef, params, rest), batch, None)

  with runtime.using(recorder=recorder, count_only=True):
    jaxpr = jax.make_jaxpr(loss_sums)(params, rest, batch)
  return dot_flops(jaxpr) + sum(c.flops for c in recorder.attention), recorder.attention, recorder.truncations


# ---- a run's FLOP model ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Piece:
  lo: int
  hi: int
  coeffs: np.ndarray                  # f(n) = polyval(coeffs, n) on [lo, hi]
  calls: list[tuple[AttentionCall, float, float]]  # (call at lo, slope, intercept) of its length in n


class FlopModel:
  """f(n) of a run (module docstring): forward(lengths), train(lengths) and the tiled loops' executed FLOPs."""

  def __init__(self, run, max_len: int | None = None):
    self.max_len = int(max_len if max_len is not None else run.source.max_length())
    self._run, self._cache = run, {}
    _, calls, cuts = self._sample(0)
    _, _, cuts_top = self._sample(self.max_len)
    bounds = sorted({0, self.max_len} | {k for k in cuts | cuts_top if 0 < k < self.max_len})
    self.pieces: list[_Piece] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
      self._fit(lo, hi, depth=0)
    self.tiled = any(c.impl == "xla" and c.kind == "hstu" for c in calls)
    self.native = any(c.impl == "cpp" and c.kind == "hstu" for c in calls)
    self.notes = []
    if any(c.impl == "xla" and c.kind == "softmax" for c in calls):
      self.notes.append("tiled softmax attention loops are not added to the executed FLOPs")
    if any(c.impl == "xla" and c.kind == "hstu" and c.block is None for c in calls):
      self.notes.append(f"executed FLOPs count the tiled HSTU loops at {TILED_BLOCK}-token tiles; with "
                        "attn_tiles=auto the autotuner picks per batch (report: hstu_tiles)")
    del self._run

  def _sample(self, n: int):
    if n not in self._cache:
      self._cache[n] = trace_row(self._run, n)
    return self._cache[n]

  def _fit(self, lo: int, hi: int, depth: int) -> None:
    xs = sorted({lo, lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3, hi})
    samples = [self._sample(x) for x in xs]
    fs = np.asarray([s[0] for s in samples], np.float64)
    if len(xs) <= 3:  # too short to check: interpolate exactly through every point
      coeffs = np.polyfit(xs, fs, len(xs) - 1)
      self.pieces.append(_Piece(lo, hi, coeffs, self._lines(xs, samples)))
      return
    fit_x = [xs[0], xs[1], xs[3]]
    coeffs = np.polyfit(fit_x, [fs[0], fs[1], fs[3]], 2)
    ok = abs(np.polyval(coeffs, xs[2]) - fs[2]) <= _CHECK_RTOL * max(abs(fs[2]), 1.0)
    lines = self._lines(xs, samples) if ok else None
    if lines is None and depth < 8:
      mid = (lo + hi) // 2
      self._fit(lo, mid, depth + 1)
      self._fit(mid, hi, depth + 1)
      return
    if lines is None:
      raise ValueError(f"FlopModel: the FLOPs of one row are not quadratic on [{lo}, {hi}] tokens and do not "
                       "become so when split; a layer truncates rows without jagged.keep_last?")
    self.pieces.append(_Piece(lo, hi, coeffs, lines))

  @staticmethod
  def _lines(xs, samples):
    """Each attention call's row length as an affine function of n on the piece (None if not affine or the
    calls differ between the samples)."""
    calls = [s[1] for s in samples]
    if any(len(c) != len(calls[0]) for c in calls):
      return None
    out = []
    for i, call in enumerate(calls[0]):
      lengths = [c[i].length for c in calls]
      if len(xs) == 1:
        out.append((call, 0.0, float(lengths[0])))
        continue
      slope = (lengths[-1] - lengths[0]) / (xs[-1] - xs[0])
      intercept = lengths[0] - slope * xs[0]
      if any(abs(slope * x + intercept - l) > 1e-9 for x, l in zip(xs, lengths)):
        return None
      out.append((call, slope, intercept))
    return out

  def _piece_index(self, lengths) -> np.ndarray:
    n = np.asarray(lengths, np.int64)
    if n.size and (n.min() < 0 or n.max() > self.max_len):
      raise ValueError(f"FlopModel: row lengths must be in [0, {self.max_len}], got {n.min()}..{n.max()}")
    his = np.asarray([p.hi for p in self.pieces])
    return np.minimum(np.searchsorted(his, n, side="left"), len(self.pieces) - 1)

  def forward(self, lengths) -> float:
    """Forward FLOPs of rows with these sequence lengths."""
    n = np.asarray(lengths, np.float64)
    if n.size == 0:
      return 0.0
    which = self._piece_index(n)
    return float(sum(np.polyval(p.coeffs, n[which == i]).sum() for i, p in enumerate(self.pieces)))

  def train(self, lengths) -> float:
    return TRAIN_FLOPS_FACTOR * self.forward(lengths)

  def forward_per_row(self, n: int) -> float:
    return self.forward([n])

  def _hstu_calls(self, lengths, impl: str):
    """(call, its row lengths) for every recorded HSTU attention call of `impl`, over rows of these lengths."""
    n = np.asarray(lengths, np.int64)
    which = self._piece_index(n)
    for i, piece in enumerate(self.pieces):
      rows = n[which == i]
      for call, slope, intercept in piece.calls:
        if call.kind == "hstu" and call.impl == impl:
          yield call, np.rint(slope * rows + intercept).astype(np.int64)

  def tiled_train(self, lengths) -> float:
    """FLOPs a train step spends inside the tiled HSTU loops for rows of these lengths (padding rows
    included: the kernel walks their contextual and target tokens too). Per (pair, head) of a walked tile:
    forward q.k (2 Dh) and w.v (2 Dv); backward recomputes q.k and does dw, dq, dk, dv (2 (3 Dh + 2 Dv));
    pointwise work three times ATTN_POINTWISE_FLOPS (forward, backward)."""
    total = 0.0
    for call, row_lengths in self._hstu_calls(lengths, "xla"):
      block = call.block or TILED_BLOCK
      tiles = tiled_attention_tiles(row_lengths, max_seq_len=call.max_seq_len, num_contextual=call.num_contextual,
                                    block=block)
      per_pair_head = 2 * (4 * call.dh + 3 * call.dv) + 3 * ATTN_POINTWISE_FLOPS["hstu"]
      total += float(tiles) * block * block * call.heads * per_pair_head
    return total

  def native_train(self, lengths) -> float:
    """FLOPs a train step spends inside the C++ HSTU kernel ("cpp" impl) for rows of these lengths (padding rows
    included). Per (pair, head) the forward does q.k (2 Dh) and w.v (2 Dv); the backward recomputes q.k and does
    dw, dv, dk, dq (2 (3 Dh + 2 Dv)); pointwise work ATTN_POINTWISE_FLOPS in the forward, twice it backward."""
    total = 0.0
    pointwise = ATTN_POINTWISE_FLOPS["hstu"]
    for call, row_lengths in self._hstu_calls(lengths, "cpp"):
      fwd, bwd = hstu_cpu.executed_pairs(row_lengths, call.max_seq_len, contextual_seq_len=call.num_contextual)
      total += call.heads * (fwd * (2 * (call.dh + call.dv) + pointwise) +
                             bwd * (2 * (3 * call.dh + 2 * call.dv) + 2 * pointwise))
    return float(total)


def param_counts(run) -> dict:
  """{'sparse': embedding-table parameters, 'dense': every other parameter} of a (possibly abstract) run."""
  from flax import nnx

  from gem_jax.model.embeddings import Table
  total = sparse = 0
  for path, var in jax.tree_util.tree_leaves_with_path(run.state.params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    size = int(np.prod(np.shape(var.get_value())))
    total += size
    sparse += size if isinstance(var, Table) else 0
  return {"sparse": sparse, "dense": total - sparse}


def hstu_pairs(seq_lengths_B, *, num_contextual: int = 0, num_targets: int = 0, exact_mask: bool = False,
               causal: bool = True) -> int:
  """(query, key) pairs of jagged attention rows: n^2 per row, or (exact_mask) only the pairs the HSTU
  mask keeps (causal history, contextual tokens see all non-targets, targets see history + themselves)."""
  n = np.asarray(seq_lengths_B, np.int64)
  if not exact_mask or not causal:
    return int((n * n).sum())
  c, t = num_contextual, num_targets
  total = 0
  for ni in n:
    hist = max(int(ni) - c - t, 0)
    ctx = min(c, int(ni))
    # contextual rows: every non-target token; history rows: contextual + causal history;
    # target rows: contextual + history + themselves.
    total += ctx * (ctx + hist) + hist * ctx + hist * (hist + 1) // 2 + min(t, int(ni) - ctx) * (ctx + hist + 1)
  return total


def tiled_attention_tiles(seq_lengths_B, *, max_seq_len: int, num_contextual: int, block: int = TILED_BLOCK) -> int:
  """Tiles the tiled HSTU kernel ("xla" impl, causal) walks for rows of these lengths, counted on the host.

  Per row of n tokens (clipped to max_seq_len), nb = ceil(n / block) query blocks: a query block that
  starts inside the contextual tokens sees every key block (nb tiles), any other block qb sees key
  blocks 0..qb (qb + 1 tiles); the same enumeration as tiled._key_block_range without max_attn_len.
  """
  n_B = np.minimum(np.asarray(seq_lengths_B, np.int64), max_seq_len)
  if block < 1 or np.any(n_B < 0):
    raise ValueError(f"tiled_attention_tiles: block ({block}) must be >= 1 and lengths >= 0")
  nb_B = -(-n_B // block)
  ctx_blocks = -(-num_contextual // block) if num_contextual > 0 else 0
  ctx_B = np.minimum(ctx_blocks, nb_B)   # query blocks starting inside the contextual tokens
  causal = nb_B * (nb_B + 1) // 2
  # Contextual blocks qb < ctx see nb tiles instead of qb + 1: extra sum over qb < ctx of (nb - qb - 1).
  extra = ctx_B * nb_B - ctx_B * (ctx_B + 1) // 2
  return int((causal + extra).sum())
