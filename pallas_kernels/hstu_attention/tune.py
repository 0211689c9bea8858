"""Picks the tiled HSTU loop's TileConfig (tiled.py) per shape bucket on the current backend.

For a bucket seen for the first time, every config of tiled.CANDIDATES runs the attention forward and backward
on synthetic rows of the bucket's shape, and the fastest median time wins. The pick is kept in memory and, when
the tuner has a file, in that JSON file, which later processes read instead of timing again: a run is
reproducible from the file, and a file copied to another machine of the same kind skips the timing there.

A bucket is what the loop's speed depends on and a trace knows: the backend and device kind, the jax version,
the token capacity and row count rounded up to powers of two, heads, q/k and value widths, N, the mask's static
settings, whether there is a bias, and the dtype. Its synthetic rows: B rows of lognormal lengths (sigma 1) with
a mean that fills 3/4 of the capacity, clipped to [1, N], from a fixed seed.

The tuner may be called while a step is being traced: it times its programs under jax.ensure_compile_time_eval,
so they run eagerly instead of being staged into the step.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.hstu_attention import tiled

ENV_FILE = "GEM_JAX_HSTU_TILES"   # a JSON file of picks to read and extend (none: picks live in this process)


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def bucket(q_TxHxD, v_TxHxDv, offsets_Bp1, *, max_seq_len: int, causal: bool, has_targets: bool,
           max_attn_len: int, contextual_seq_len: int, num_buckets: int) -> dict:
  """The bucket of one call (num_buckets 0: no relative bias); a flat dict of JSON scalars."""
  device = jax.devices()[0]
  return {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__,
          "capacity": _pow2(q_TxHxD.shape[0]), "rows": _pow2(offsets_Bp1.shape[0] - 1), "heads": q_TxHxD.shape[1],
          "dh": q_TxHxD.shape[2], "dv": v_TxHxDv.shape[2], "max_seq_len": max_seq_len, "causal": causal,
          "has_targets": has_targets, "max_attn_len": max_attn_len, "contextual_seq_len": contextual_seq_len,
          "num_buckets": num_buckets, "dtype": str(jnp.dtype(q_TxHxD.dtype))}


def key_of(b: dict) -> str:
  return json.dumps(b, sort_keys=True)


def synthetic_rows(b: dict, seed: int = 0):
  """(q, k, v, cotangent, offsets, num_targets or None, bias or None) for bucket `b`, from `seed`."""
  rng = np.random.default_rng(seed)
  rows, n, capacity = b["rows"], b["max_seq_len"], b["capacity"]
  mean = max(1.0, min(float(n), 0.75 * capacity / rows))
  lengths = np.clip(np.round(rng.lognormal(np.log(mean) - 0.5, 1.0, rows)), 1, n).astype(np.int64)
  while lengths.sum() > capacity:   # the rows must fit the capacity: trim the longest
    lengths[np.argmax(lengths)] -= 1
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  dtype = jnp.dtype(b["dtype"])
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, k = normal(capacity, b["heads"], b["dh"]), normal(capacity, b["heads"], b["dh"])
  v, cot = normal(capacity, b["heads"], b["dv"]), normal(capacity, b["heads"], b["dv"]).astype(jnp.float32)
  targets = jnp.asarray(np.minimum(lengths, 2), jnp.int32) if b["has_targets"] else None
  bias = 0.1 * normal(b["heads"], b["num_buckets"]).astype(jnp.float32) if b["num_buckets"] else None
  return q, k, v, cot, jnp.asarray(offsets), targets, bias


def time_configs_on(q_TxHxD, k_TxHxD, v_TxHxDv, cot_TxHxDv, offsets_Bp1, candidates, *, reps: int, max_seq_len: int,
                    alpha: float, causal: bool = True, num_targets=None, max_attn_len: int = 0,
                    contextual_seq_len: int = 0, rel_bias_HxR=None) -> dict[tiled.TileConfig, float]:
  """Median seconds of one forward + backward (of sum(out * cotangent)) per config on these inputs, run eagerly
  (also when called while a step is being traced)."""
  with jax.ensure_compile_time_eval():
    out = {}
    for tc in candidates:
      def loss(q, k, v, tc=tc):
        o = tiled.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=max_seq_len, alpha=alpha, causal=causal,
                                 num_targets=num_targets, max_attn_len=max_attn_len,
                                 contextual_seq_len=contextual_seq_len, rel_bias_HxR=rel_bias_HxR,
                                 block=tc.block, group=tc.group)
        return jnp.sum(o.astype(jnp.float32) * cot_TxHxDv)
      step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      jax.block_until_ready(step(q_TxHxD, k_TxHxD, v_TxHxDv))
      times = []
      for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(step(q_TxHxD, k_TxHxD, v_TxHxDv))
        times.append(time.perf_counter() - t)
      out[tc] = statistics.median(times)
    return out


def time_configs(b: dict, candidates, *, reps: int = 3, seed: int = 0) -> dict[tiled.TileConfig, float]:
  """time_configs_on bucket `b`'s synthetic rows."""
  with jax.ensure_compile_time_eval():
    q, k, v, cot, offsets, targets, bias = synthetic_rows(b, seed)
  return time_configs_on(q, k, v, cot, offsets, candidates, reps=reps, max_seq_len=b["max_seq_len"],
                         alpha=b["dh"] ** -0.5, causal=b["causal"], num_targets=targets,
                         max_attn_len=b["max_attn_len"], contextual_seq_len=b["contextual_seq_len"],
                         rel_bias_HxR=bias)


class Tuner:
  """Picks per bucket, kept in memory and (path) in a JSON file {bucket key: {"block", "group", "timings_ms"}}."""

  def __init__(self, path: str | None = None, *, candidates=tiled.CANDIDATES, reps: int = 3):
    self.path, self.candidates, self.reps = path, tuple(candidates), reps
    self._picks: dict[str, dict] = {}
    self._used: dict[str, dict] = {}   # the buckets this process asked for (the run's report)
    self._timed: set[str] = set()      # the buckets this process timed (the others came from the file)
    self._lock = threading.Lock()
    if path and os.path.exists(path):
      self._picks = _read(path)

  def pick(self, b: dict) -> tiled.TileConfig:
    key = key_of(b)
    with self._lock:
      if key not in self._picks and jax.process_count() > 1:
        # Each process would time on its own and might pick another config, and so compile another program.
        raise RuntimeError(f"model.hstu.attn_tiles=auto in a {jax.process_count()}-process run: bucket {key} is "
                           f"not in {self.path or 'a tile file'}; run one process with ${ENV_FILE} set to fill it, "
                           "then give every process that file")
      if key not in self._picks:
        times = time_configs(b, self.candidates, reps=self.reps)
        best = min(times, key=times.get)
        self._picks[key] = {"block": best.block, "group": best.group,
                            "timings_ms": {f"{tc.block}x{tc.group}": 1e3 * t for tc, t in times.items()}}
        self._timed.add(key)
        self._save()
      entry = self._picks[key]
      self._used[key] = {"bucket": b, **entry, "source": "timed" if key in self._timed else "file"}
      return tiled.TileConfig(entry["block"], entry["group"])

  def _save(self) -> None:
    if not self.path:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    tmp = f"{self.path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(self._picks, f, indent=1, sort_keys=True)
    os.replace(tmp, self.path)

  def report(self) -> list[dict]:
    """The picks this process used: bucket, config, and the timings behind it (report.json's hstu_tiles)."""
    return [dict(v) for v in self._used.values()]


def _read(path: str) -> dict[str, dict]:
  """A tile file's picks, each checked (a bad file is named, not half-used)."""
  try:
    with open(path) as f:
      picks = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable JSON file of HSTU tile picks ({e})") from e
  if not isinstance(picks, dict):
    raise ValueError(f"{path}: expected an object of bucket -> pick, got {type(picks).__name__}")
  for key, entry in picks.items():
    ok = isinstance(entry, dict) and all(isinstance(entry.get(f), int) and entry[f] >= 1 for f in ("block", "group"))
    if not ok:
      raise ValueError(f"{path}: the pick of bucket {key} needs integer 'block' and 'group' >= 1, got {entry!r}")
  return picks


_DEFAULT: dict[str, Tuner] = {}


def default() -> Tuner:
  """This process's tuner, on the file named by $GEM_JAX_HSTU_TILES (or in memory only)."""
  path = os.environ.get(ENV_FILE) or None
  if path not in _DEFAULT:
    _DEFAULT[path] = Tuner(path)
  return _DEFAULT[path]


__all__ = ["ENV_FILE", "Tuner", "bucket", "default", "synthetic_rows", "time_configs", "time_configs_on"]
