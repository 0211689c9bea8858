"""HSTU layer stacks, one training step each (forward, backward, AdamW; float32) over heavy-tailed jagged rows:
how fast the sequence arch computes on this machine, apart from the rest of GEM (experiments/bench_hstu_stack.py
is the command).

Stacks (row lengths lognormal with sigma 1 around the mean, from a fixed seed, clipped to [1, N]):
  S: D=64,  H=2, Dh=Dv=32, 2 layers, B=64, N=200, mean length 50
  M: D=256, H=4, Dh=Dv=64, 4 layers, B=32, N=512, mean length 100
Each layer is gem_jax.model.hstu.HSTULayer with no contextual tokens and no targets, so the causal mask is the
whole mask; the loss is the mean squared output over real tokens. `impl` is the attention kernel
(gem_jax.ops.hstu_attention): `xla` the tiled jagged loop, `cpp` the C++ kernel, `reference` the dense padded
B x N x N spec, `dense` the same padded work one row per loop step with its own backward, `auto` whatever the
measured tree's default is (to compare a tree's default path with an older one's).

Per (stack, impl, tree): the median step time over `reps` timed steps (after a compile step), tokens/s (real
tokens per second), model FLOP/s and its share of a float32 GEMM peak measured in the same process (the best
of GEMM_SIZES). Model FLOPs count real tokens and the causal pairs of each row (n(n+1)/2), forward and
backward (3x the forward); padding and masked pairs are not model FLOPs. compare() runs each (stack, impl)
`rounds` times per source tree in fresh processes, alternating which tree goes first, so a machine that
drifts taxes both alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "bench_hstu_stack.py")

STACKS = {
    "S": {"model_dim": 64, "heads": 2, "head_dim": 32, "value_dim": 32, "layers": 2, "batch": 64, "max_len": 200,
          "mean_len": 50},
    "M": {"model_dim": 256, "heads": 4, "head_dim": 64, "value_dim": 64, "layers": 4, "batch": 32, "max_len": 512,
          "mean_len": 100},
}
IMPLS = ("auto", "xla", "cpp", "dense", "reference")
DEFAULT_IMPLS = ("xla", "cpp", "dense", "reference")
GEMM_SIZES = (512, 1024, 2048)


def gemm_peak() -> tuple[float, int]:
  """(FLOP/s, n): the fastest float32 n x n x n GEMM over GEMM_SIZES, in this process. Through
  observe/report.measure_gemm_peak, which older trees measured with --baseline have too (this file runs over
  their gem_jax)."""
  import jax.numpy as jnp

  from gem_jax.observe.report import measure_gemm_peak
  return max((measure_gemm_peak(jnp.float32, n), n) for n in GEMM_SIZES)


def lengths(stack: dict, seed: int):
  """Row lengths of a stack's batch: lognormal (sigma 1) with the stack's mean, clipped to [1, N]."""
  import numpy as np
  sigma = 1.0
  mu = np.log(stack["mean_len"]) - sigma ** 2 / 2
  n = np.random.default_rng(seed).lognormal(mu, sigma, stack["batch"])
  return np.clip(np.round(n), 1, stack["max_len"]).astype(np.int64)


def model_flops(stack: dict, lengths_B) -> float:
  """Forward + backward FLOPs of the stack on rows of `lengths_B` (module docstring)."""
  n = [int(x) for x in lengths_B]
  tokens, pairs = sum(n), sum(x * (x + 1) // 2 for x in n)
  d, h, dh, dv = stack["model_dim"], stack["heads"], stack["head_dim"], stack["value_dim"]
  per_layer = 2 * tokens * d * (2 * h * dv + 2 * h * dh) + 2 * tokens * h * dv * d + 2 * pairs * h * (dh + dv)
  return 3.0 * stack["layers"] * per_layer


def build_step(stack_name: str, impl: str, seed: int, rel_bias: bool = True):
  """(jitted step(params, opt_state, x) -> (params, opt_state, loss), (params, opt_state, x), lengths): one
  stack's training step and its inputs (child() times it; experiments/profile_step.py --stack profiles it)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from gem_jax.jagged import Jagged
  from gem_jax.model.config import HSTUConfig, ModelConfig
  from gem_jax.model.hstu import HSTULayer

  stack = STACKS[stack_name]
  hstu = dataclasses.replace(HSTUConfig(), num_heads=stack["heads"], head_dim=stack["head_dim"],
                             value_dim=stack["value_dim"], keep_last=(stack["max_len"],) * stack["layers"],
                             num_contextual=0, attn_impl=impl,
                             **({} if rel_bias else {"rel_pos_buckets": 0}))
  cfg = dataclasses.replace(ModelConfig(), model_dim=stack["model_dim"], num_layers=stack["layers"], hstu=hstu)

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([HSTULayer(cfg, stack["max_len"], site=f"layers.{i}", rngs=rngs)
                              for i in range(stack["layers"])])

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x)
      return x

  lens = lengths(stack, seed)
  tokens = int(lens.sum())
  capacity = -(-tokens // 128) * 128
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  values = np.asarray(jax.random.normal(jax.random.key(seed), (capacity, stack["model_dim"]), jnp.float32))
  x = Jagged(jnp.asarray(values), jnp.asarray(offsets))
  valid_T = jnp.arange(capacity) < tokens

  model = Stack(nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)

  def loss_fn(p, x):
    y = nnx.merge(graphdef, p)(x).values
    return jnp.sum(jnp.where(valid_T[:, None], y * y, 0.0)) / tokens

  @jax.jit
  def step(p, s, x):
    loss, g = jax.value_and_grad(loss_fn)(p, x)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  return step, (params, opt_state, x), lens


def child(stack_name: str, impl: str, reps: int, seed: int, rel_bias: bool = True) -> dict:
  """One (stack, impl) in this process with the gem_jax first on sys.path: build, compile, time. rel_bias=False:
  layers without the relative position bias (model.hstu.rel_pos_buckets=0; a tree older than that setting
  refuses it)."""
  import jax
  import jax.numpy as jnp

  import gem_jax

  stack = STACKS[stack_name]
  step, (params, opt_state, x), lens = build_step(stack_name, impl, seed, rel_bias)
  tokens = int(lens.sum())
  capacity = x.capacity
  t0 = time.perf_counter()
  compiled = step.lower(params, opt_state, x).compile()
  compile_s = time.perf_counter() - t0
  p, s, loss = compiled(params, opt_state, x)
  jax.block_until_ready(loss)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    p, s, loss = compiled(p, s, x)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  flops = model_flops(stack, lens)
  peak, peak_n = gemm_peak()
  return {"stack": stack_name, "impl": impl, "rel_bias": rel_bias,
          "gem_jax": os.path.dirname(os.path.dirname(gem_jax.__file__)), "tokens": tokens,
          "capacity": capacity, "padded_tokens": stack["batch"] * stack["max_len"],
          "compile_s": compile_s, "step_s": step_s, "step_s_all": times, "tokens_per_s": tokens / step_s,
          "model_flops": flops, "model_flops_per_s": flops / step_s, "gemm_peak_flops_per_s": peak,
          "gemm_peak_n": peak_n,
          "pct_of_gemm_peak": 100.0 * flops / step_s / peak, "loss": float(loss), "backend": jax.default_backend()}


def tile_configs(stack_name: str, *, reps: int, seed: int, rel_bias: bool = True, candidates=None) -> list[dict]:
  """The stack's attention alone (one layer's shapes: forward + backward of sum(out * cotangent), float32) with the
  `xla` impl at each TileConfig of `candidates` (default pallas_kernels/hstu_attention/tiled.py's CANDIDATES), in
  this process: the median time over `reps` calls after a compile call, and its ratio to the default config's."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.hstu_attention import tiled, tune

  stack = STACKS[stack_name]
  lens = lengths(stack, seed)
  tokens = int(lens.sum())
  capacity = -(-tokens // 128) * 128
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
  keys = jax.random.split(jax.random.key(seed), 5)
  h, dh, dv = stack["heads"], stack["head_dim"], stack["value_dim"]
  q, k = (jax.random.normal(key, (capacity, h, dh), jnp.float32) for key in keys[:2])
  v, cot = (jax.random.normal(key, (capacity, h, dv), jnp.float32) for key in keys[2:4])
  bias = 0.1 * jax.random.normal(keys[4], (h, 32), jnp.float32) if rel_bias else None
  candidates = list(candidates or tiled.CANDIDATES)
  if tiled.DEFAULT_TILES not in candidates:
    candidates.append(tiled.DEFAULT_TILES)
  times = tune.time_configs_on(q, k, v, cot, offsets, candidates, reps=reps, max_seq_len=stack["max_len"],
                               alpha=dh ** -0.5, rel_bias_HxR=bias)
  rows = [{"stack": stack_name, "block": tc.block, "group": tc.group, "rel_bias": rel_bias, "fwd_bwd_s": times[tc],
           "executed_pairs": tiled.executed_pairs(offsets, stack["max_len"], tc.block),
           "default": tc == tiled.DEFAULT_TILES} for tc in candidates]
  base = next(r["fwd_bwd_s"] for r in rows if r["default"])
  for r in rows:
    r["vs_default"] = r["fwd_bwd_s"] / base
  return rows


# The batched dots of one layer of the dense padded attention (impl "reference"), by operand form: each form
# runs twice a layer (forward q.k^T and backward dO.v^T; forward w.v and backward dS.k; backward w^T.dO and dS^T.q).
DENSE_DOT_FORMS = (("q.k^T: N x N out (fwd logits, bwd dW)", "bhid,bhjd->bhij", "qk"),
                   ("w.v: N x D out, over keys (fwd out, bwd dq)", "bhij,bhjd->bhid", "wv"),
                   ("w^T.x: N x D out, over queries (bwd dv, dk)", "bhij,bhid->bhjd", "wv"))


def dense_dots(stack_name: str, *, reps: int, seed: int = 0) -> dict:
  """What the dense padded attention's dots alone cost on this backend at a stack's B x H x N x N: each operand
  form timed on its own (jitted, float32, median of `reps`), the stack's total for them (2 calls of each form a
  layer, every layer), and a float32 GEMM measured in the same process. A floor for the `reference` impl's step:
  its elementwise work and the rest of the layer come on top."""
  import jax
  import jax.numpy as jnp

  from gem_jax.bench import timing

  stack = STACKS[stack_name]
  b, h, n, d = stack["batch"], stack["heads"], stack["max_len"], stack["head_dim"]
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (b, h, n, d), jnp.float32)
  operands = {"qk": (x, jax.random.normal(keys[1], (b, h, n, d), jnp.float32)),
              "wv": (jax.random.normal(keys[2], (b, h, n, n), jnp.float32), x)}
  flops = 2.0 * b * h * n * n * d
  forms = []
  for name, spec, which in DENSE_DOT_FORMS:
    ms = timing.median_ms(jax.jit(lambda p, q, spec=spec: jnp.einsum(spec, p, q)), *operands[which], reps=reps)
    forms.append({"form": name, "einsum": spec, "ms": ms, "flops_per_s": flops / (ms / 1e3)})
  per_step_s = 2 * stack["layers"] * sum(f["ms"] for f in forms) / 1e3
  return {"stack": stack_name, "shape": {"B": b, "H": h, "N": n, "D": d}, "forms": forms,
          "dots_per_step_s": per_step_s, "gemm_peak_flops_per_s": gemm_peak()[0]}


def dense_dots_table(result: dict) -> str:
  lines = [f"stack {result['stack']} ({', '.join(f'{k}={v}' for k, v in result['shape'].items())}):"]
  for f in result["forms"]:
    lines.append(f"  {f['form']:46} {f['ms']:8.1f} ms {f['flops_per_s'] / 1e9:6.0f} GFLOP/s")
  lines.append(f"  the dense attention's dots per step (x2 a layer, x{STACKS[result['stack']]['layers']} layers): "
               f"{1e3 * result['dots_per_step_s']:.0f} ms; a 2048^3 GEMM here: "
               f"{result['gemm_peak_flops_per_s'] / 1e9:.0f} GFLOP/s")
  return "\n".join(lines)


def tiles_table(rows: list[dict]) -> str:
  lines = [f"{'stack':5} {'block':>5} {'group':>5} {'fwd+bwd ms':>10} {'vs default':>10} {'pairs':>10}"]
  for r in rows:
    lines.append(f"{r['stack']:5} {r['block']:5d} {r['group']:5d} {1e3 * r['fwd_bwd_s']:10.2f} "
                 f"{r['vs_default']:9.2f}x {r['executed_pairs']:10,d}{'  (default)' if r['default'] else ''}")
  return "\n".join(lines)


def run_child(tree: str, stack: str, impl: str, reps: int, seed: int, rel_bias: bool = True,
              xla_flags: str | None = None) -> dict:
  """child() in a fresh process with `tree`'s gem_jax first on the path (and XLA_FLAGS=`xla_flags` if given)."""
  from gem_jax import malloc_env   # here, not at the top: a child loads this file over an older tree's gem_jax
  # Without the huge-page tunable: the child asks for it itself when the measured tree has gem_jax/malloc_env.py.
  env = dict(malloc_env.without_huge_pages(), GEM_JAX_TREE=os.path.abspath(tree),
             JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  cmd = [sys.executable, SCRIPT, "--child", stack, impl, "--reps", str(reps), "--seed", str(seed),
         *([] if rel_bias else ["--no-rel-bias"])]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{tree}: stack {stack} impl {impl} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(trees: dict[str, str], stacks, impls, *, reps: int, rounds: int, seed: int, rel_bias: bool = True,
            flag_sets: dict[str, str] | None = None, log=print) -> dict:
  """Every (stack, impl) in every tree, `rounds` fresh processes each, alternating the trees' order.
  flag_sets: {name: XLA_FLAGS} (gem_jax/bench/xla_flags.py) to compare instead of trees: one tree, each set
  a column of its own (named by the set)."""
  if flag_sets:
    if len(trees) != 1:
      raise ValueError("compare: flag sets are compared within one tree; got trees " + ", ".join(trees))
    tree = next(iter(trees.values()))
    columns = {name: (tree, flags) for name, flags in flag_sets.items()}
  else:
    columns = {name: (path, None) for name, path in trees.items()}
  runs: dict[str, list[dict]] = {}
  for stack in stacks:
    for impl in impls:
      for r in range(rounds):
        for name in (list(columns) if r % 2 == 0 else list(columns)[::-1]):
          path, flags = columns[name]
          rec = {"tree": name, "round": r, **run_child(path, stack, impl, reps, seed, rel_bias, flags)}
          runs.setdefault(f"{stack}/{impl}", []).append(rec)
          log(f"{stack}/{impl} {name} round {r}: {1e3 * rec['step_s']:.1f} ms, {rec['tokens_per_s']:,.0f} tokens/s, "
              f"{rec['pct_of_gemm_peak']:.1f}% of a {rec['gemm_peak_flops_per_s'] / 1e9:.0f} GFLOP/s GEMM")
  medians = {key: {name: {k: statistics.median(r[k] for r in rs if r["tree"] == name)
                          for k in ("step_s", "tokens_per_s", "model_flops_per_s", "pct_of_gemm_peak", "compile_s")}
                   for name in columns} for key, rs in runs.items()}
  return {"trees": {name: path for name, (path, _) in columns.items()}, "flag_sets": flag_sets or {},
          "stacks": {s: STACKS[s] for s in stacks}, "reps": reps, "rounds": rounds, "seed": seed,
          "rel_bias": rel_bias, "runs": runs, "medians": medians}


def flags_table(result: dict) -> str:
  """A compare() over flag sets: one line per (stack, impl, set), its step time against the first set's."""
  sets = list(result["trees"])
  lines = [f"{'stack':5} {'impl':9} {'flags':18} {'step ms':>9} {'tok/s':>10} {'%GEMM':>6} {'vs ' + sets[0]:>12}"]
  for key, per_set in result["medians"].items():
    stack, impl = key.split("/")
    base = per_set[sets[0]]["step_s"]
    for name in sets:
      m = per_set[name]
      lines.append(f"{stack:5} {impl:9} {name:18} {1e3 * m['step_s']:9.1f} {m['tokens_per_s']:10,.0f} "
                   f"{m['pct_of_gemm_peak']:6.1f} {base / m['step_s']:11.2f}x")
  return "\n".join(lines)


def table(result: dict) -> str:
  if result.get("flag_sets"):
    return flags_table(result)
  trees = list(result["trees"])
  head = f"{'stack':5} {'impl':9} " + " ".join(f"{t + ' step ms':>16} {t + ' tok/s':>14} {'%GEMM':>6}" for t in trees)
  if len(trees) > 1:
    head += f" {'tok/s ' + trees[0] + '/' + trees[1]:>18}"
  lines = [head]
  for key, per_tree in result["medians"].items():
    stack, impl = key.split("/")
    row = f"{stack:5} {impl:9} " + " ".join(
        f"{1e3 * per_tree[t]['step_s']:16.1f} {per_tree[t]['tokens_per_s']:14,.0f} "
        f"{per_tree[t]['pct_of_gemm_peak']:6.1f}" for t in trees)
    if len(trees) > 1:
      row += f" {per_tree[trees[0]]['tokens_per_s'] / per_tree[trees[1]]['tokens_per_s']:18.2f}x"
    lines.append(row)
  return "\n".join(lines)
