"""Compile a config's train and eval steps for a GPU cluster without a GPU, and say what XLA:GPU made of them.

  report = compile_for(cfg)                   # cfg.mesh names a mesh file whose `target` is a GPU
  print(table(report)); json.dump(report, f)  # experiments/compile_for.py writes compile.json

The run is built for compile-only devices of the mesh file's target in its topology (gem_jax/run/build.py
`build(cfg, target=...)`, gem_jax/parallel/target.py): the lookup capacities come from the source's first
training batch, as in a real run, and the steps are lowered on ShapeDtypeStructs and compiled by the GPU
compiler of the installed CUDA plugin. Per program it reports whether it compiled (or the compiler's
error), the compile seconds and the per-device memory of XLA's buffer assignment; for the train step also
the collectives (gem_jax/observe/hlo.py: kind, mesh axes, bytes, whether the schedule overlaps them with
compute), the kernels and FP8 GEMMs (gem_jax/observe/compiled.py) and how the scatter fusions add floats
(from the PTX of XLA's dump). Next to them: the mesh file's HBM and the cluster simulator's prediction of
the same config on the same mesh (gem_jax/observe/simulate.py), with their ratios.

Memory per device: peak = argument + output + temp - alias (XLA's buffer assignment: the parameters and
optimizer state, the batch, the outputs not donated into inputs, and one temp allocation for every
intermediate at its largest). Compiled is not run: no timings, and a kernel that compiles may still be
slow or wrong on the device; `experiments/gpu_check.py` measures that when a GPU is lent.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any

import jax
from flax import nnx

from gem_jax.observe import compiled as compiled_lib
from gem_jax.observe import hlo
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import target as target_lib

GB = 1e9
PROGRAMS = ("train", "eval")


def _compile(lowered_fn, dump_dir: str | None, options: dict) -> tuple[Any, str | None, float, float]:
  """(compiled or None, the error, lower seconds, compile seconds)."""
  t0 = time.perf_counter()
  try:
    lowered = lowered_fn()
  except Exception as e:  # noqa: BLE001 - a program that does not lower is a result, with its error
    return None, f"lowering failed: {type(e).__name__}: {e}", time.perf_counter() - t0, 0.0
  t1 = time.perf_counter()
  try:
    options = {**options, **({"xla_dump_to": dump_dir} if dump_dir else {})}
    return lowered.compile(compiler_options=options or None), None, t1 - t0, time.perf_counter() - t1
  except Exception as e:  # noqa: BLE001
    return None, f"{type(e).__name__}: {e}", t1 - t0, time.perf_counter() - t1


def fp8_sites(run) -> list[str]:
  """The model's Dense sites whose recipe is an FP8 one (bf16 and the compute dtype are not)."""
  from gem_jax.model.layers import dense_sites
  from gem_jax.precision import fp8
  model = nnx.merge(run.graphdef, run.state.params, run.rest)
  return [site for site, dense in dense_sites(model)
          if dense.recipe is not None and fp8.get_recipe(dense.recipe).kind != "bf16"]


def default_out(config: str, mesh: str, target: str | None = None, sets=()) -> str:
  """experiments/compile_for.py's folder when --out is not given: runs/compile_<config>_<mesh file's stem>,
  then _<target> with --target and a digest of the --set overrides with any, so that compiles of one config
  for other targets or settings do not overwrite each other's compile.json."""
  import hashlib
  name = f"compile_{config}_{os.path.splitext(os.path.basename(mesh))[0]}"
  if target:
    name += f"_{target}"
  if sets:
    name += "_" + hashlib.sha1("\n".join(sets).encode()).hexdigest()[:8]
  return os.path.join("runs", name)


def _memory(compiled) -> dict:
  m = hlo.memory(compiled)
  return {"argument": m["argument"], "output": m["output"], "temp": m["temp"], "alias": m["alias"],
          "peak": m["peak_estimate"]} if m else {}


def _collectives(text: str, mesh) -> tuple[list[dict], dict]:
  colls = hlo.collectives(text, mesh)
  rows = [{"kind": c.kind, "axis": ",".join(c.axes), "bytes": c.moved_bytes * c.count, "count": c.count,
           "async": c.overlap is not None and c.overlap > 0, "overlap": c.overlap, "conditional": c.conditional,
           "op_name": c.op_name} for c in colls if c.axes]
  return rows, hlo.summarize(colls)


def _ratio(a, b):
  return None if a is None or not b else a / b


def compile_for(cfg, *, target: str | target_lib.Target | None = None, programs=PROGRAMS,
                simulate: bool = True, keep_dump: str | None = None, compiler_options: dict | None = None) -> dict:
  """The compile report of `cfg` on its mesh file's GPU target (module docstring). target: another target
  than the mesh file's (a name, file or Target). keep_dump: a folder to keep XLA's dump of the train step in
  (default: a temporary one, removed). compiler_options: XLA debug options for both programs (e.g.
  {"xla_gpu_enable_triton_gemm": False}), recorded in the report."""
  from gem_jax.run.build import build
  if cfg.mesh is None:
    raise ValueError("compile_for: the config names no mesh file (--mesh meshes/h200_8.yaml, or cfg.mesh)")
  spec = mesh_lib.load(cfg.mesh)
  target = target or spec.target
  if target is None:
    raise ValueError(f"compile_for: mesh file {cfg.mesh} names no target; add `target: h200` (one of "
                     f"{list(target_lib.names())}) or pass one")
  unknown = set(programs) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"compile_for: unknown programs {sorted(unknown)}; known: {PROGRAMS}")
  t0 = time.perf_counter()
  run = build(cfg, target=target)
  tgt = target_lib.of(run.mesh, run.mesh_spec)
  build_s = time.perf_counter() - t0
  first = run.source.first_batch()
  batch = run.batch_struct(first)
  eval_example = run.task.eval_example(first)
  eval_batch = batch if eval_example is first else run.batch_struct(eval_example)
  state = run.abstract_state()
  sites = fp8_sites(run)
  report: dict = {
      "config": cfg.name, "mesh": spec.name, "mesh_file": str(cfg.mesh), "target": tgt.name, "device": tgt.device,
      "topology": target_lib.topology(spec), "devices": spec.num_devices, "jax": jax.__version__,
      "hbm_bytes": spec.hardware.hbm_bytes, "device_memory_bytes": tgt.device_memory_bytes,
      # A next-item model (SeqRecModelConfig) has its attention impl at the top and no precision policy.
      "attn_impl": getattr(cfg.model, "hstu", cfg.model).attn_impl,
      "precision_policy": getattr(getattr(cfg.model, "precision", None), "policy", None),
      "embedding_update": cfg.train.embedding_update, "compiler_options": dict(compiler_options or {}),
      "build_s": build_s, "programs": {}, "kernels": [],
      "fp8": {"sites": len(sites), "site_names": sites, "gemms": None, "by_program": {}, "by_site": {},
              "sites_with_fp8_forward": None, "sites_without": []},
      "collectives": [], "collective_bytes_by_axis": {}, "scatter_atomics": None, "scatter_fusions": [],
  }
  lowerers = {"train": lambda: run.train_step.lower(state, batch),
              "eval": lambda: run.eval_step.lower(state.params, eval_batch)}
  for name in programs:
    dump = None
    if name == "train":
      dump = keep_dump or tempfile.mkdtemp(prefix="gem_jax_dump_")
      os.makedirs(dump, exist_ok=True)
    try:
      compiled, error, lower_s, compile_s = _compile(lowerers[name], dump, dict(compiler_options or {}))
      entry = {"compiled": compiled is not None, "error": error, "lower_s": lower_s, "compile_s": compile_s,
               "memory": {}}
      report["programs"][name] = entry
      if compiled is None:
        continue
      text = compiled.as_text()
      entry["memory"] = _memory(compiled)
      kernels = compiled_lib.kernels(text)
      report["kernels"] += [{**k, "program": name} for k in kernels]
      gemms = compiled_lib.fp8_gemms(text)
      report["fp8"]["by_program"][name] = {"gemms": compiled_lib.count(gemms), "detail": gemms}
      for site, passes in compiled_lib.fp8_by_site(gemms).items():
        report["fp8"]["by_site"].setdefault(site, {}).update({f"{name}_{p}": n for p, n in passes.items()})
      if name == "train":
        report["fp8"]["gemms"] = compiled_lib.count(gemms)
        report["collectives"], summary = _collectives(text, run.mesh)
        report["collective_bytes_by_axis"] = summary["by_axis"]
        atomics = compiled_lib.scatter_atomics(text, dump)
        report["scatter_atomics"], report["scatter_fusions"] = atomics["verdict"], atomics["fusions"]
    finally:
      if dump and not keep_dump:
        shutil.rmtree(dump, ignore_errors=True)
  fp8 = report["fp8"]
  with_forward = [s for s in sites if all(fp8["by_site"].get(s, {}).get(f"{p}_forward", 0) > 0
                                          for p in report["programs"] if report["programs"][p]["compiled"])]
  fp8["sites_with_fp8_forward"], fp8["sites_without"] = len(with_forward), sorted(set(sites) - set(with_forward))
  if simulate:
    report["simulator"] = _simulated(cfg, spec)
  _compare(report)
  return report


def _simulated(cfg, spec) -> dict:
  from gem_jax.observe import simulate as simulate_lib
  sim = simulate_lib.simulate(dataclasses.replace(cfg, mesh=None), spec)
  return {"peak_bytes": sim["memory"]["total"], "memory": {k: v for k, v in sim["memory"].items()
                                                           if isinstance(v, float)},
          "collective_bytes_by_axis": sim["comm"]["by_axis"],
          "parts": {k: v["by_axis"] for k, v in sim["comm"]["parts"].items() if v["by_axis"]}}


def _compare(report: dict) -> None:
  """Ratios compiled / simulated and compiled / HBM, and the headroom under the mesh file's HBM."""
  train = report["programs"].get("train", {})
  peak = train.get("memory", {}).get("peak")
  hbm = report["hbm_bytes"]
  sim = report.get("simulator") or {}
  by_axis = {}
  for axis in sorted(set(report["collective_bytes_by_axis"]) | set(sim.get("collective_bytes_by_axis", {}))):
    got, want = report["collective_bytes_by_axis"].get(axis), sim.get("collective_bytes_by_axis", {}).get(axis)
    by_axis[axis] = {"compiled": got, "simulated": want, "ratio": _ratio(got, want)}
  report["comparison"] = {
      "peak_vs_simulated": _ratio(peak, sim.get("peak_bytes")),
      "peak_vs_hbm": _ratio(peak, hbm), "fits": None if peak is None or hbm is None else peak <= hbm,
      "headroom": None if peak is None or hbm is None else 1.0 - peak / hbm,
      "collectives_by_axis": by_axis,
  }


def _gb(x) -> str:
  return "-" if x is None else f"{x / GB:.2f}"


def _x(r) -> str:
  return "-" if r is None else f"{r:.2f}x"


def table(report: dict) -> str:
  """A short text summary of a compile report."""
  lines = [f"compile_for: {report['config']} on {report['mesh']} ({report['devices']} x {report['device']}, topology "
           f"{report['topology']}), jax {report['jax']}, attn_impl {report['attn_impl']}, precision "
           f"{report['precision_policy']}, embedding_update {report['embedding_update']}",
           f"{'program':8} {'compiled':8} {'lower s':>8} {'compile s':>9} {'arg GB':>8} {'temp GB':>8} "
           f"{'peak GB':>8} {'of HBM':>7}"]
  hbm = report["hbm_bytes"]
  for name, p in report["programs"].items():
    m = p["memory"]
    lines.append(f"{name:8} {'yes' if p['compiled'] else 'NO':8} {p['lower_s']:8.1f} {p['compile_s']:9.1f} "
                 f"{_gb(m.get('argument')):>8} {_gb(m.get('temp')):>8} {_gb(m.get('peak')):>8} "
                 f"{_x(_ratio(m.get('peak'), hbm)):>7}")
    if p["error"]:
      lines.append(f"  error: {p['error'][:400]}")
  cmp_ = report.get("comparison", {})
  sim = report.get("simulator")
  if sim:
    room = cmp_.get("headroom")
    room = "-" if room is None else f"{100 * room:.0f}%"
    lines.append(f"memory: train peak {_gb(report['programs'].get('train', {}).get('memory', {}).get('peak'))} GB, "
                 f"simulator {_gb(sim['peak_bytes'])} GB ({_x(cmp_.get('peak_vs_simulated'))}); HBM "
                 f"{_gb(hbm)} GB, headroom {room}")
  for axis, c in cmp_.get("collectives_by_axis", {}).items():
    lines.append(f"collectives over {axis or '(none)'}: compiled {_gb(c['compiled'])} GB, simulator "
                 f"{_gb(c['simulated'])} GB ({_x(c['ratio'])})")
  colls = report["collectives"]
  if colls:
    lines.append(f"collectives: {len(colls)} in the train step, {sum(c['async'] for c in colls)} async with compute "
                 "scheduled between start and done")
  kernels = [f"{k['name']} ({k['kind']}, {k['program']} x{k['count']})" for k in report["kernels"]
             if k["kind"] != "xla"]
  lines.append("Pallas kernels: " + (", ".join(kernels) or "none"))
  xla = sorted({k["name"] for k in report["kernels"] if k["kind"] == "xla"})
  lines.append("XLA kernels: " + (", ".join(xla) or "none"))
  fp8 = report["fp8"]
  by = ", ".join(f"{p} {v['gemms']}" for p, v in fp8["by_program"].items())
  lines.append(f"FP8 GEMMs: {by or '-'}; policy FP8 sites {fp8['sites']}, with an FP8 forward GEMM in every "
               f"program {fp8['sites_with_fp8_forward']}" + (f" (not: {', '.join(fp8['sites_without'])})"
                                                               if fp8["sites_without"] else ""))
  lines.append(f"scatter atomics: {report['scatter_atomics']}")
  return "\n".join(lines)
