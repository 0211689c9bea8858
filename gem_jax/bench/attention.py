"""Jagged attention benchmark: every registered impl of gem_jax.ops side by side with padded baselines.

For one Shape (B rows, max length N, H heads, head width D, "full" or "heavy"-tailed lengths) and each impl
it times the forward and the forward + backward and writes one record per (kernel, impl, pass):
median_ms, real_tflops (FLOPs of the unmasked causal pairs only / time, so padding and skipped tiles earn
nothing), pct_of_peak, and max_rel_err of the forward against the reference. The baselines are what runs
without jagged kernels:
  padded_softmax_baseline  dense softmax attention over B x N x N (the jagged softmax reference)
  padded_hstu_baseline     dense HSTU attention over B x N x N (the HSTU reference: the same operation as
                           the HSTU impls, padded)
  dot_product_attention    jax.nn.dot_product_attention on the padded B x N x H x D layout with per-row
                           lengths and a causal mask: cuDNN flash attention on GPU, XLA elsewhere
                           (inputs already padded: the jagged-to-padded copy is not timed)

Letters: B rows, N max length, H heads, D head width, T tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax import ops
from gem_jax.bench.timing import interleaved_medians
from pallas_kernels.conformance import max_rel_err
from pallas_kernels.hstu_attention import reference as hstu_reference
from pallas_kernels.jagged_softmax_attention import reference as softmax_reference

FWD_BWD_FACTOR = 3.5      # backward = 5 of the forward's 2 matmul passes again (dq, dk, dv, recomputed w)
DENSE_LIMIT_BYTES = 12e9  # the padded baseline is skipped where one f32 B x H x N x N array exceeds this


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  max_len: int
  heads: int
  head_dim: int
  lengths: str  # "full": every row max_len long; "heavy": log-normal, median max_len / 10

  @property
  def name(self) -> str:
    return f"B{self.batch}_N{self.max_len}_H{self.heads}_D{self.head_dim}_{self.lengths}"


def lengths_for(shape: Shape, rng) -> np.ndarray:
  if shape.lengths == "full":
    return np.full(shape.batch, shape.max_len)
  # Heavy tail: log-normal with sigma 1 and median max_len / 10 (mean ~ max_len / 6), capped at max_len.
  n = rng.lognormal(np.log(shape.max_len / 10), 1.0, shape.batch).astype(np.int64)
  return np.clip(n, 1, shape.max_len)


def quick_grid() -> list[Shape]:
  """CPU-sized shapes (experiments/bench_kernels.py --quick)."""
  return [Shape(16, 256, 2, 64, "full"), Shape(32, 512, 2, 64, "heavy"), Shape(64, 256, 2, 32, "heavy")]


def full_grid() -> list[Shape]:
  shapes = []
  for n in (256, 1024, 4096, 8192):
    for lengths in ("full", "heavy"):
      for h, d in ((2, 64), (4, 128)):
        shapes.append(Shape(max(4, 16384 // n), n, h, d, lengths))
  return shapes


def gpu_check_grid() -> list[Shape]:
  """GEM-like shapes, most informative first (the GPU check truncates the list at its time limit): bf16,
  D = 64 and 128, N = 1024 .. 4096, heavy-tailed rows (~43k tokens a batch) and full rows (32k tokens)."""
  shapes = []
  for n in (1024, 2048, 4096):
    for d in (64, 128):
      shapes.append(Shape(8 * (32768 // n), n, 4, d, "heavy"))
      shapes.append(Shape(32768 // n, n, 4, d, "full"))
  return shapes


def rehearsal_grid() -> list[Shape]:
  return [Shape(6, 32, 2, 16, "heavy")]


def _cudnn_baseline(q, k, v, lengths_B, shape: Shape):
  """(fn(q, k, v) on the padded layout, impl name): jax.nn.dot_product_attention, cuDNN on GPU."""
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  offsets = np.concatenate([[0], np.cumsum(lengths_B)])
  b, n = shape.batch, shape.max_len
  # Token t of row r goes to slot (r, t - offsets[r]) of B x N.
  row_T = np.repeat(np.arange(b), lengths_B)
  pos_T = np.arange(offsets[-1]) - offsets[row_T]
  pad = lambda x: jnp.zeros((b, n) + x.shape[1:], x.dtype).at[row_T, pos_T].set(x[:offsets[-1]])
  qp, kp, vp = pad(q), pad(k), pad(v)
  seq = jnp.asarray(lengths_B, jnp.int32)

  def fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=seq,
                                        key_value_seq_lengths=seq, implementation=impl)

  return fn, (qp, kp, vp), impl or "xla"


def bench_shape(shape: Shape, *, impls: dict, reps: int, peak: float, dtype=jnp.float32, rng,
                deadline: float | None = None, dense_limit_bytes: float = DENSE_LIMIT_BYTES) -> list[dict]:
  """Records of every (kernel, impl, pass) on one shape; `impls` maps kernel -> {impl name: fn or a reason
  it is skipped (a string)}; kernels "hstu_attention" and "jagged_softmax_attention". A timing that starts
  after `deadline` (time.time()) is recorded as skipped."""
  lengths = lengths_for(shape, rng)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  t = int(offsets[-1])
  h, d, n = shape.heads, shape.head_dim, shape.max_len
  q, k, v = (jnp.asarray(rng.normal(size=(t, h, d)), dtype) for _ in range(3))
  flops_fwd = float(np.sum(lengths * (lengths + 1) // 2)) * h * 4 * d  # q.k and w.v per causal pair
  records = []

  timed = []   # (record, (fn, args)): timed together once every record is in (interleaved_medians)

  def add(kernel, impl, pass_, measure, err=None):
    """measure: (fn, args) to time, or a string: why this one is skipped."""
    rec = {"kernel": kernel, "impl": impl, "shape": shape.name, "pass": pass_, "dtype": jnp.dtype(dtype).name,
           "batch": shape.batch, "max_len": n, "heads": h, "head_dim": d, "lengths": shape.lengths,
           "tokens": t, "mean_length": float(lengths.mean()), "median_ms": None, "real_tflops": None,
           "pct_of_peak": None, "max_rel_err": err, "skipped": None, "error": None}
    if isinstance(measure, str):
      rec["skipped"] = measure
    else:
      timed.append((rec, measure))
    records.append(rec)

  def both_passes(kernel, name, fn, ref_out, kw, bwd=True):
    if isinstance(fn, str):
      add(kernel, name, "fwd", fn)
      add(kernel, name, "fwd+bwd", fn)
      return
    fwd = jax.jit(lambda q, k, v: fn(q, k, v, offsets, **kw))
    try:
      err = max_rel_err(fwd(q, k, v), ref_out)
    except Exception as e:
      add(kernel, name, "fwd", f"failed: {type(e).__name__}: {str(e)[:300]}")
      add(kernel, name, "fwd+bwd", "the forward failed")
      return
    add(kernel, name, "fwd", (fwd, (q, k, v)), err)
    if bwd is not True:
      add(kernel, name, "fwd+bwd", bwd)
      return
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, offsets, **kw).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    add(kernel, name, "fwd+bwd", (grad, (q, k, v)))

  with jax.default_matmul_precision("highest"):  # the references in true f32
    hkw = dict(max_seq_len=n, alpha=1.0 / d, causal=True)
    skw = dict(max_seq_len=n, scale=d ** -0.5, causal=True)
    f32 = lambda x: x.astype(jnp.float32)
    dense_bytes = 4.0 * shape.batch * h * n * n
    hstu_ref = softmax_ref = None
    if dense_bytes <= dense_limit_bytes:
      hstu_ref = jax.jit(lambda q, k, v: hstu_reference.hstu_attention(q, k, v, offsets, **hkw))(f32(q), f32(k), f32(v))
      softmax_ref = jax.jit(lambda q, k, v: softmax_reference.jagged_softmax_attention(
          q, k, v, offsets, **skw))(f32(q), f32(k), f32(v))
  if hstu_ref is None:  # too large for the dense reference: compare against the tiled XLA path instead
    hstu_ref = jax.jit(lambda q, k, v: ops.hstu_attention(q, k, v, offsets, impl="xla", **hkw))(f32(q), f32(k), f32(v))
    softmax_ref = jax.jit(lambda q, k, v: ops.jagged_softmax_attention(
        q, k, v, offsets, impl="xla", **skw))(f32(q), f32(k), f32(v))

  for name, fn in impls.get("hstu_attention", {}).items():
    both_passes("hstu_attention", name, fn, hstu_ref, hkw,
                bwd="its backward is the dense reference's" if name == "triton" else True)
  for name, fn in impls.get("jagged_softmax_attention", {}).items():
    both_passes("jagged_softmax_attention", name, fn, softmax_ref, skw)
  padded = (softmax_reference.jagged_softmax_attention if dense_bytes <= dense_limit_bytes else
            f"one f32 B x H x N x N array would take {dense_bytes / 1e9:.1f} GB")
  both_passes("padded_softmax_baseline", "dense", padded, softmax_ref, skw)
  if impls.get("hstu_attention"):
    padded = (hstu_reference.hstu_attention if dense_bytes <= dense_limit_bytes else
              f"one f32 B x H x N x N array would take {dense_bytes / 1e9:.1f} GB")
    both_passes("padded_hstu_baseline", "dense", padded, hstu_ref, hkw)

  fn, padded_qkv, impl = _cudnn_baseline(q, k, v, lengths, shape)
  cudnn = jax.jit(fn)
  try:
    out_BxNxHxD = cudnn(*padded_qkv)
    row_T = np.repeat(np.arange(shape.batch), lengths)
    pos_T = np.arange(t) - np.asarray(offsets)[row_T]
    err = max_rel_err(out_BxNxHxD[row_T, pos_T], softmax_ref[:t])
    add("dot_product_attention", impl, "fwd", (cudnn, padded_qkv), err)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    add("dot_product_attention", impl, "fwd+bwd", (grad, padded_qkv))
  except Exception as e:
    reason = f"failed: {type(e).__name__}: {str(e)[:300]}"
    add("dot_product_attention", impl, "fwd", reason)
    add("dot_product_attention", impl, "fwd+bwd", reason)
  # Every impl and baseline of the shape timed together, reps interleaved: drift cannot favour one of them.
  for (rec, _), got in zip(timed, interleaved_medians([m for _, m in timed], reps=reps, deadline=deadline)):
    if got is None:
      rec["skipped"] = "the section's time limit was reached"
    elif isinstance(got, Exception):   # a kernel that does not lower or run here is reported, not fatal
      rec["error"] = f"{type(got).__name__}: {str(got)[:300]}"
    else:
      flops = flops_fwd * (1.0 if rec["pass"] == "fwd" else FWD_BWD_FACTOR)
      rec.update(median_ms=got, real_tflops=flops / (got / 1e3) / 1e12, pct_of_peak=100 * flops / (got / 1e3) / peak)
  return records


BASELINES = ("padded_softmax_baseline", "padded_hstu_baseline", "dot_product_attention")
SAME_OP = {"hstu_attention": "padded_hstu_baseline", "jagged_softmax_attention": "padded_softmax_baseline"}


def speedups(records: list[dict]) -> list[dict]:
  """Per shape and pass, each impl's speed against the baselines (their time / its time: x faster):
  vs_padded the padded softmax baseline (for every kernel, as since the first runs of this benchmark),
  vs_padded_same_op the padded baseline of the impl's own operation (HSTU or softmax), vs_cudnn
  jax.nn.dot_product_attention's. None where that baseline was not timed."""
  out = []
  timed = [r for r in records if r["median_ms"]]
  for r in timed:
    if r["kernel"] in BASELINES:
      continue
    base = {b["kernel"]: b["median_ms"] for b in timed if b["shape"] == r["shape"] and b["pass"] == r["pass"]
            and b["kernel"] in BASELINES}
    ratio = lambda kernel: base[kernel] / r["median_ms"] if kernel in base else None
    out.append({"shape": r["shape"], "kernel": r["kernel"], "impl": r["impl"], "pass": r["pass"],
                "vs_padded": ratio("padded_softmax_baseline"), "vs_padded_same_op": ratio(SAME_OP.get(r["kernel"])),
                "vs_cudnn": ratio("dot_product_attention")})
  return out


def registered_impls(*, on_gpu: bool, pallas: bool = True,
                     kernels: tuple[str, ...] = ("hstu_attention", "jagged_softmax_attention"),
                     exclude: tuple[str, ...] = ("reference",)) -> dict:
  """{kernel: {impl: fn, or why it is skipped}} for every impl registered in gem_jax.ops, less `exclude`
  (the references are the padded baseline's job). pallas=False: Pallas runs in interpret mode here, an
  emulator not worth timing."""
  families = {"hstu_attention": (ops.hstu_impls, ops.hstu_impl),
              "jagged_softmax_attention": (ops.softmax_impls, ops.softmax_impl)}
  out = {}
  for kernel in kernels:
    names, get = families[kernel]
    out[kernel] = {}
    for name in names():
      if name in exclude:
        continue
      if name == "triton" and not on_gpu:
        out[kernel][name] = "the Triton kernel runs only on GPU (jax-triton)"
      elif name == "cpp" and on_gpu:
        out[kernel][name] = "the C++ kernel runs only on CPU"
      elif name == "pallas" and not pallas:
        out[kernel][name] = "Pallas interpret mode is an emulator: timed only on the smallest shape"
      else:
        out[kernel][name] = get(name)
  return out
