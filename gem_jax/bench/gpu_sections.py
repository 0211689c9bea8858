"""The sections of the GPU check (gem_jax/bench/gpu_check.py runs each as `python -m` this module).

  environment     versions, the device, what will be skipped and why, a measured bf16 GEMM
  correctness     the kernel conformance cases (pallas_kernels/conformance.py) on the device, forward and
                  gradients against the reference in f32 and bf16; FP8 GEMMs against the emulation
  kernel_speed    jagged attention at GEM-like shapes next to padded softmax and cuDNN (bench/attention.py)
  fp8_speed       bf16 vs FP8 GEMM TFLOP/s at M = 16k, K = N = 512 .. 4096 (bench/fp8.py)
  train_step      the `base` config's train step under the bf16, row-wise FP8 and default FP8 policies,
                  through the trainer, with its efficiency report (step time, MFU/HFU, memory)
  sparse_scaling  the sparse-embedding benchmark's table-size scaling (not built yet: skipped)

A rehearsal (--rehearse) runs every section with tiny shapes, interpret-mode Pallas and the CPU backend,
writing the same keys. A section appends records through `Context.record`, which rewrites
<work>/<section>.json at once, so a section killed at its time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "jax-triton", "flax", "optax",
            "orbax-checkpoint", "chex", "grain", "numpy", "pyarrow", "torch")


class Context:
  def __init__(self, name: str, work: str, deadline: float, rehearse: bool):
    self.name, self.rehearse, self.deadline = name, rehearse, deadline
    self.path = os.path.join(work, f"{name}.json")
    self.data = {"notes": [], "result": {}, "records": [], "finished": False, "error": None}
    self.flush()

  def left(self) -> float:
    return self.deadline - time.time()

  def record(self, rec: dict) -> None:
    self.data["records"].append(rec)
    self.flush()

  def note(self, text: str) -> None:
    self.data["notes"].append(text)
    self.flush()

  def set(self, **values) -> None:
    self.data["result"].update(values)
    self.flush()

  def flush(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, default=float)
    os.replace(tmp, self.path)


def _version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _importable(module: str) -> str | None:
  """None when `module` imports, else the error."""
  try:
    __import__(module)
    return None
  except Exception as e:  # jax_triton raises ImportError without a GPU jaxlib, others may raise anything
    return f"{type(e).__name__}: {str(e)[:200]}"


def environment(ctx: Context) -> None:
  import jax
  import jax.numpy as jnp

  from gem_jax.bench import timing
  from gem_jax.observe import report
  from gem_jax.precision import fp8

  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  smi = None
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  on_gpu = jax.default_backend() == "gpu"
  n = 8192 if on_gpu else 256
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  ctx.set(python=platform.python_version(), packages={p: _version(p) for p in PACKAGES},
          backend=jax.default_backend(), device_kind=dev.device_kind, device_count=jax.device_count(),
          compute_capability=getattr(dev, "compute_capability", None),
          memory_bytes=(stats or {}).get("bytes_limit"), nvidia_smi=smi,
          install=json.loads(os.environ.get("GEM_JAX_GPU_CHECK_INSTALL", "null")),
          datasheet_peak_flops={"bf16": timing.datasheet_peak("bf16"), "fp8": timing.datasheet_peak("fp8")})
  ctx.set(measured_gemm={"dtype": jnp.dtype(dtype).name, "n": n, "flops": report.measure_gemm_peak(dtype, n)})
  skips = []
  triton_error = _importable("jax_triton")
  if not on_gpu:
    skips.append({"what": "Triton kernels (HSTU forward, FP8 GEMMs)",
                  "why": "they run only on GPU; tests/test_*_triton.py check their math in Triton's interpreter"})
  elif triton_error:
    skips.append({"what": "Triton kernels (HSTU forward, FP8 GEMMs)", "why": f"jax_triton: {triton_error}"})
  if not fp8._has_native_mx():
    skips.append({"what": "native MX GEMM (impl xla for mxfp8)",
                  "why": "MX tensor cores need compute capability >= 10 (Blackwell); MX runs as Pallas/Triton"})
  grain_error = _importable("grain")
  if grain_error:
    skips.append({"what": "train_step", "why": f"grain: {grain_error}"})
  skips.append({"what": "sparse_scaling", "why": "the sparse-embedding benchmark does not exist yet"})
  ctx.set(expected_skips=skips, jax_triton_import_error=triton_error)


def _attention_variants(family: str, on_gpu: bool, rehearse: bool) -> dict:
  """{impl label: fn or why skipped} for the conformance run: every registered impl but the reference;
  Pallas with 16-wide tiles on GPU (8 in interpret mode), so the short cases cross tile boundaries."""
  import functools

  from gem_jax import ops
  from pallas_kernels.hstu_attention import api as hstu_api
  from pallas_kernels.hstu_attention.config import CPU_TEST_BLOCKS, HSTUBlockConfig
  from pallas_kernels.jagged_softmax_attention import pallas as softmax_pallas

  names, get = (ops.hstu_impls, ops.hstu_impl) if family == "hstu" else (ops.softmax_impls, ops.softmax_impl)
  out = {}
  block = HSTUBlockConfig(16, 16) if on_gpu else CPU_TEST_BLOCKS
  pallas = hstu_api.hstu_attention if family == "hstu" else softmax_pallas.jagged_softmax_attention
  for name in names():
    if name == "reference" or (name == "blocked" and (on_gpu or rehearse)):
      continue  # blocked is a CPU variant of the tiled loop, covered by the CPU tests
    if name == "pallas":
      out[f"pallas_b{block.block_q}"] = functools.partial(pallas, block=block, interpret=not on_gpu)
    elif name == "triton" and not on_gpu:
      out[name] = "runs only on GPU (Triton's interpreter checks it in tests/test_hstu_triton.py)"
    elif name == "cpp" and on_gpu:
      out[name] = "runs only on CPU (tests/test_hstu_cpu.py checks it)"
    else:
      out[name] = get(name)
  return out


def correctness(ctx: Context) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from gem_jax.bench import fp8 as fp8_bench
  from pallas_kernels import conformance
  from pallas_kernels.hstu_attention import reference as hstu_reference
  from pallas_kernels.jagged_softmax_attention import reference as softmax_reference

  on_gpu = jax.default_backend() == "gpu"
  # The FP8 GEMM checks first: a few seconds, where the attention cases compile about 60 programs on a GPU.
  rows = ([("rowwise", "xla"), ("rowwise", "pallas"), ("mxfp8", "pallas")] if not on_gpu else
          [("rowwise", "xla"), ("rowwise", "pallas"), ("rowwise", "triton"), ("mxfp8", "pallas"),
           ("mxfp8", "triton")] + ([("mxfp8", "xla")] if fp8_bench.fp8._has_native_mx() else []))
  shapes = [(40, 96, 48)] if ctx.rehearse else [(72, 96, 40), (33, 136, 65), (1024, 1024, 1024)]
  for m, k, n in shapes:
    for recipe, impl in rows:
      if ctx.left() < 0:
        ctx.note(f"fp8 {m}x{k}x{n} {recipe}/{impl}: not run, the section's time limit was reached")
        continue
      ctx.record(fp8_bench.check_gemm(m, k, n, recipe, impl, np.random.default_rng(0)))
  references = {"hstu": hstu_reference.hstu_attention, "softmax": softmax_reference.jagged_softmax_attention}
  for family in ("hstu", "softmax"):
    cases = [(c, "float32") for c in conformance.CASES[family]] + \
            [(c, "bfloat16") for c in conformance.BF16_CASES[family]]
    if ctx.rehearse:  # every impl in f32, HSTU's Pallas kernels in bf16 too
      cases = [("plain_d32", "float32"), ("plain_d32", "bfloat16")]
    wants = {}
    for impl, fn in _attention_variants(family, on_gpu, ctx.rehearse).items():
      for case, dtype in cases:
        if ctx.rehearse and dtype == "bfloat16" and not (impl.startswith("pallas") and family == "hstu"):
          continue
        rec = {"check": "attention", "family": family, "impl": impl, "case": case, "dtype": dtype,
               "tolerance": conformance.TOLERANCE[dtype], "errors": None, "tail_zero": None, "passed": False,
               "skipped": None, "error": None}
        if isinstance(fn, str) or ctx.left() < 0:
          rec["skipped"] = fn if isinstance(fn, str) else "the section's time limit was reached"
          ctx.record(rec)
          continue
        args, offsets, cot, kwargs = conformance.inputs(family, case, jnp.dtype(dtype))
        if (case, dtype) not in wants:  # the f32 reference on the same (rounded) inputs
          ref_args = tuple(None if x is None else x.astype(jnp.float32) for x in args)
          with jax.default_matmul_precision("highest"):
            wants[case, dtype] = conformance.value_and_grads(references[family], ref_args, offsets, cot, kwargs)
        want_out, want_grads = wants[case, dtype]
        try:
          got_out, got_grads = conformance.value_and_grads(fn, args, offsets, cot, kwargs)
        except Exception as e:
          rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          ctx.record(rec)
          continue
        errors = {"out": conformance.max_rel_err(got_out, want_out)}
        errors.update({f"d{n}": conformance.max_rel_err(g, w) for n, g, w in zip("qkvb", got_grads, want_grads)})
        rec.update(errors=errors, tail_zero=bool(np.all(np.asarray(got_out[-conformance.TAIL:]) == 0)))
        rec["passed"] = rec["tail_zero"] and all(e <= rec["tolerance"] for e in errors.values())
        ctx.record(rec)

  if not on_gpu:
    ctx.note("FP8 Triton GEMMs run only on GPU (Triton's interpreter checks them in tests/test_fp8_gemm_triton.py)")
  failed = [r for r in ctx.data["records"] if not r["passed"] and not r.get("skipped")]
  ctx.set(checked=sum(1 for r in ctx.data["records"] if not r.get("skipped")), failed=len(failed))


def kernel_speed(ctx: Context) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from gem_jax.bench import attention, timing
  from gem_jax.observe import report

  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  peak = timing.datasheet_peak("bf16") if on_gpu else None
  source = "datasheet bf16"
  if peak is None:
    peak, source = report.measure_gemm_peak(dtype, 8192 if on_gpu else 256), "measured GEMM"
  ctx.set(peak_flops=peak, peak_source=source, dtype=jnp.dtype(dtype).name)
  rng = np.random.default_rng(0)
  shapes = attention.gpu_check_grid() if not ctx.rehearse else attention.rehearsal_grid()
  # On GPU the softmax XLA loop and the blocked variant are CPU paths; the cuDNN and padded rows stand
  # in for what an XLA user would run there.
  exclude = ("reference", "blocked") + (("xla",) if on_gpu else ())
  for i, shape in enumerate(shapes):
    if ctx.left() < 0:
      ctx.note(f"not run (the section's time limit): {[s.name for s in shapes[i:]]}")
      break
    impls = attention.registered_impls(on_gpu=on_gpu, exclude=("reference", "blocked"))
    if on_gpu:
      impls["jagged_softmax_attention"] = {k: v for k, v in impls["jagged_softmax_attention"].items()
                                           if k not in exclude}
    reps = 5 if on_gpu else 1
    for rec in attention.bench_shape(shape, impls=impls, reps=reps, peak=peak, dtype=dtype, rng=rng,
                                     deadline=ctx.deadline):
      ctx.record(rec)
  ctx.set(speedups=attention.speedups(ctx.data["records"]))


def fp8_speed(ctx: Context) -> None:
  import jax
  import numpy as np

  from gem_jax.bench import fp8 as fp8_bench
  from gem_jax.bench import timing

  on_gpu = jax.default_backend() == "gpu"
  rows = [("bf16", "xla"), ("rowwise", "xla")]
  if on_gpu:
    rows += [("rowwise", "pallas"), ("rowwise", "triton"), ("mxfp8", "pallas"), ("mxfp8", "triton")]
  else:
    rows += [("rowwise", "emulate"), ("mxfp8", "emulate")]
  peaks = {"bf16": timing.datasheet_peak("bf16"), "fp8": timing.datasheet_peak("fp8")}
  ctx.set(peaks=peaks, rows=[list(r) for r in rows])
  shapes = [(16384, d, d) for d in (512, 1024, 2048, 4096)] if not ctx.rehearse else [(256, 64, 64)]
  rng = np.random.default_rng(0)
  for m, k, n in shapes:
    if ctx.left() < 0:
      ctx.note(f"{m}x{k}x{n}: not run, the section's time limit was reached")
      continue
    for rec in fp8_bench.with_ratios(fp8_bench.bench_gemm(m, k, n, reps=10 if on_gpu else 2, rows=rows, rng=rng,
                                                          peaks=peaks)):
      rec.setdefault("speedup_vs_bf16", None)
      ctx.record(rec)


def base_train_step(ctx: Context) -> None:
  import jax

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.run.build import build
  from gem_jax.train import hooks as hooks_lib, trainer
  from gem_jax.train.jobs import standard_hooks

  on_gpu = jax.default_backend() == "gpu"
  name = "base" if on_gpu else "tiny"
  mesh = "meshes/h200_1.yaml" if on_gpu else "meshes/cpu_1.yaml"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  steps = 12 if on_gpu else 9   # the efficiency report's profiler window needs > 7 steps
  batch = configs.get(name).data.pipeline.batch_size
  ctx.set(config=name, mesh=mesh, steps=steps, batch_size=batch)
  first_s = None
  # The rehearsal trains one policy (a CPU compile of the step costs 15-30 s; the other policies run the
  # same code with another name) to stay under 3 minutes on CI's 2 cores.
  for policy in ("bf16",) if ctx.rehearse else ("bf16", "rowwise", "fp8"):
    rec = {"config": name, "policy": policy, "attn_impl": "auto", "steps": steps, "step_time_s": None,
           "examples_per_s": None, "mfu": None, "hfu": None, "padding_waste": None, "peak_memory_bytes": None,
           "compile_s": None, "host_data_s": None, "eval_ne": None, "notes": [], "skipped": None, "error": None}
    # A later policy reuses the first one's eager compiles and data: about half its time.
    if first_s is not None and ctx.left() < 0.5 * first_s:
      rec["skipped"] = f"{ctx.left():.0f} s left; the first policy took {first_s:.0f} s"
      ctx.record(rec)
      continue
    t = time.time()
    for attn_impl in ("auto", "xla") if on_gpu else ("auto",):
      # The rehearsal's tiny model has one layer: the step's CPU compile dominates the section.
      small = ["model.num_layers=1", "model.hstu.keep_last=[32]"] if ctx.rehearse else []
      cfg = apply_overrides(configs.get(name), small + [
          f"mesh={os.path.join(root, mesh)}", f"model.precision.policy={policy}", f"model.hstu.attn_impl={attn_impl}",
          f"train.steps={steps}", f"train.warmup_steps=2", "train.eval_every=100000", "train.log_every=1",
          f"train.eval_examples={2 * batch}", "train.checkpoint_every=100000", "train.keep_checkpoints=1"])
      out = os.path.join(os.path.dirname(ctx.path), f"train_{name}_{policy}_{attn_impl}")
      shutil.rmtree(out, ignore_errors=True)
      try:
        # No checkpoint hook: the last step's checkpoint of base's state (about 8 GB with the tables'
        # optimizer state) would cost each policy seconds of the section and the disk its space.
        run = build(cfg)
        summary = trainer.train(run, out, [h for h in standard_hooks(run, progress=False, report=True)
                                           if not isinstance(h, hooks_lib.Checkpoint)])
      except Exception as e:
        rec["error"] = f"attn_impl={attn_impl}: {type(e).__name__}: {str(e)[:400]}"
        continue
      with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
      shutil.rmtree(os.path.join(out, "profile"), ignore_errors=True)   # the trace; report.json stays
      mem = rep.get("memory_bytes_per_device") or {}
      rec.update(attn_impl=attn_impl, step_time_s=rep.get("step_time_s"), examples_per_s=rep.get("examples_per_s"),
                 mfu=rep.get("mfu"), hfu=rep.get("hfu"), padding_waste=rep.get("padding_waste"),
                 peak_memory_bytes=max(mem.get("peak_estimate") or 0, mem.get("peak_reported") or 0) or None,
                 compile_s=rep.get("compile_s"),
                 host_data_s=(rep.get("step_breakdown") or {}).get("host_data_s"),
                 eval_ne={t: v["eval_ne"] for t, v in summary["tasks"].items()}, notes=rep.get("notes", [])[:6])
      break
    first_s = first_s or time.time() - t
    ctx.record(rec)


def sparse_scaling(ctx: Context) -> None:
  ctx.set(table_params=[], step_ms=[])
  ctx.note("skipped: the sparse-embedding benchmark (table-size scaling of the train step) does not exist "
           "yet; this section runs it once it does")


SECTIONS = {"environment": environment, "correctness": correctness, "kernel_speed": kernel_speed,
            "fp8_speed": fp8_speed, "train_step": base_train_step, "sparse_scaling": sparse_scaling}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="One section of the GPU check (run by gem_jax/bench/gpu_check.py).")
  p.add_argument("section", choices=sorted(SECTIONS))
  p.add_argument("--work", required=True)
  p.add_argument("--deadline", type=float, required=True, help="time.time() by which to stop adding records")
  p.add_argument("--rehearse", action="store_true")
  args = p.parse_args(argv)
  ctx = Context(args.section, args.work, args.deadline, args.rehearse)
  try:
    SECTIONS[args.section](ctx)
  except Exception:
    ctx.data["error"] = traceback.format_exc()[-3000:]
    print(ctx.data["error"], file=sys.stderr)
  ctx.data["finished"] = True
  ctx.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
