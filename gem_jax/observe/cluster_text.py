"""What the planner and the cluster simulator print and write, and the two commands over them
(experiments/plan_mesh.py, experiments/simulate_cluster.py).

  plan_mesh(cfg, devices, preset, ...)        plan (gem_jax/observe/plan.py), print the ranked table and the
                                              explanation, write the best layout as a mesh file and the JSON
  simulate_cluster(cfg, mesh_spec, out, ...)  simulate (gem_jax/observe/simulate.py), print, write the JSON
  table(plan, top) / explain(plan) -> lines   the planner's markdown table and its reasons
  to_yaml(plan, scored, name, command) -> str a mesh file (meshes/README.md schema) with comments
  to_json(plan, top) -> dict
  simulation_lines(sim, mesh_spec, config)    the readable lines of one simulation

Nothing here compiles or touches a device: every number is the simulator's.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time

from gem_jax.observe import plan as plan_lib
from gem_jax.observe import simulate as sim_lib
from gem_jax.observe.plan import GB, Plan, Scored
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.rules import MESH_AXES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANNED = "# Planned by experiments/plan_mesh.py"  # the first line of a mesh file plan_mesh wrote


# ---- the planner ---------------------------------------------------------------------------------------

def _ms(s: float | None) -> str:
  if s is None:
    return "-"
  ms = s * 1e3
  return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3g}"


def whole_tables(p: Plan, s: Scored) -> list[str]:
  """Row-sharded tables whose rows do not divide over the layout's table shards: they stay whole."""
  return [name for name, (rows, _) in p.tables.items() if rows % s.table_shards]


def _tables_text(p: Plan, s: Scored) -> str:
  whole = whole_tables(p, s)
  what = "table row sync (sparse engine)" if s.sparse_engine else "table-gradient all-reduce"
  text = f"{what} {s.table_sync_bytes / GB:.2f} GB"
  if whole:
    text += f" ({', '.join(whole)} kept whole: rows do not divide over {s.table_shards} shards)"
  return text


def row(s: Scored) -> dict:
  """One table row (also the JSON of a layout)."""
  big = s.biggest_axis()
  return {"axes": s.layout.axes_label, "intra_node": s.layout.intra_label, "table_rows": s.layout.rows_label,
          "step_ms": None if s.step_s is None else s.step_s * 1e3, "mfu": s.mfu,
          "memory_gb": s.memory_bytes / GB, "fits": s.fits,
          "compiled_peak_gb": None if s.compiled_peak is None else s.compiled_peak / GB,
          "exposed_comm_ms": None if s.exposed_s is None else s.exposed_s * 1e3,
          "biggest_comm": None if big is None else {"axes": big[0], "ms": big[1] * 1e3, "link": big[2]},
          "sizes": dict(zip(MESH_AXES, s.layout.sizes)), "intra": dict(zip(MESH_AXES, s.layout.intra))}


def _cells(label: str, s: Scored) -> list[str]:
  r = row(s)
  big = r["biggest_comm"]
  return [label, r["axes"], r["intra_node"], r["table_rows"], f"{s.step_s * 1e3:.3f}",
          "-" if s.mfu is None else f"{100 * s.mfu:.1f}%", f"{r['memory_gb']:.1f}",
          {True: "yes", False: "NO", None: "-"}[s.fits], "-" if s.exposed_s is None else f"{s.exposed_s * 1e3:.3f}",
          "-" if big is None else f"{big['axes']} {big['ms']:.2f} ms ({big['link']})"]


def table(p: Plan, top: int = 10) -> list[str]:
  """Markdown table: the `top` ranked layouts, then the baselines."""
  head = ["rank", "axes (size > 1)", "inside a node", "table rows over (shards)", "step ms", "MFU",
          "GB/device", "fits", "exposed comm ms", "biggest comm (axes, time, link)"]
  body = [_cells(str(i + 1), s) for i, s in enumerate(p.ranked[:top])]
  body += [_cells(f"naive: {name}", s) for name, s in p.baselines.items()]
  widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
  fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in body]


def _costs(s: Scored, n: int = 3) -> str:
  parts = []
  for sec, part, key, moved, link in s.comm()[:n]:
    parts.append(f"{part} over {key} {moved / GB:.2f} GB = {sec * 1e3:.1f} ms ({link})")
  return "; ".join(parts)


def explain(p: Plan) -> list[str]:
  """How the best plan compares with the baselines and why, from the simulated numbers."""
  best = p.best
  hw = p.preset.hardware
  flops = best.sim["flops"]["model_flops_per_step"]
  lines = [f"Every layout computes for {_ms(best.time['compute_s'])} ms/step ({flops:.3g} model FLOPs over "
           f"{p.devices} devices at {p.options['efficiency']:.0%} of "
           f"{hw.peak_bf16_flops / 1e12:.0f} TFLOP/s); they differ in communication, of which only parameter "
           f"collectives may hide behind compute (up to {p.options['overlap']:.0%} of it). Links: "
           f"{hw.intra_node_bandwidth / GB:.0f} GB/s inside a node, {hw.inter_node_bandwidth / GB:.0f} GB/s across."]
  lines.append(f"Plan 1 ({best.layout.axes_label}; inside a node {best.layout.intra_label}; rows over "
               f"{best.layout.rows_label}): {_ms(best.step_s)} ms, {best.memory_bytes / GB:.1f} GB/device, "
               f"{_tables_text(p, best)}. Largest costs: {_costs(best)}.")
  for name, s in p.baselines.items():
    fits = "fits" if s.fits else f"does NOT fit ({hw.hbm_bytes / GB:.0f} GB HBM)"
    same = " - the same layout as plan 1" if s.layout == best.layout else ""
    lines.append(f"{name} ({s.layout.axes_label}; inside a node {s.layout.intra_label}; rows over "
                 f"{s.layout.rows_label}){same}: {_ms(s.step_s)} ms, {s.memory_bytes / GB:.1f} GB/device, {fits}; "
                 f"{_tables_text(p, s)}. Largest costs: {_costs(s)}.")
  total = sum(w for _, w in p.tables.values())
  for name, why in p.baseline_errors.items():
    lines.append(f"{name}: cannot run this config: {why}.")
  capped = {name: math.gcd(rows, p.devices) for name, (rows, w) in p.tables.items()
            if math.gcd(rows, p.devices) < p.devices and w >= 0.01 * total}  # the tables that weigh
  if capped:
    lines.append("Row sharding is capped by divisibility (a dim that does not divide over its axes stays whole, "
                 "placement.of): " + ", ".join(f"{name} ({p.tables[name][0]:,} rows) over at most {n} of the "
                                            f"{p.devices} devices" for name, n in capped.items())
                 + "; no layout can give every device its own rows of those.")
  base = p.best_baseline()
  if base is None:
    lines.append("No naive layout fits in HBM, so there is no fitting baseline to compare the plan with.")
  else:
    lines.append(f"Speedup of plan 1 over the best naive layout that fits ({base[0]}, {_ms(base[1].step_s)} ms): "
                 f"{base[1].step_s / best.step_s:.2f}x.")
  return lines


def _yaml_float(x: float | None) -> str:
  if x is None:
    return "null"
  text = f"{x:.6g}"
  if "e" in text and "." not in text.split("e")[0]:
    mant, exp = text.split("e")
    text = f"{mant}.0e{exp}"  # YAML 1.1 reads a float only with a dot in it
  return text


def to_yaml(p: Plan, s: Scored, name: str, command: str = "") -> str:
  """The mesh file of layout `s`, with comments that say where it comes from and why each axis lies where
  it does (collectives by mesh axes, from the simulation)."""
  hw, per = p.preset.hardware, p.preset.devices_per_node
  rank = next((i + 1 for i, r in enumerate(p.ranked) if r is s), None)
  lay = s.layout
  out = [f"{PLANNED} (gem_jax/observe/plan.py)" + (":" if command else ".")]
  out += [f"#   {command}"] if command else []
  out += [f"# Config {p.config}, global batch {p.batch_size}, {p.devices} x {hw.device} = {p.devices // per} nodes "
          f"of {per}. Predicted by the",
          f"# cluster simulator (gem_jax/observe/simulate.py, overlap {p.options['overlap']}, efficiency "
          f"{p.options['efficiency']}), not measured: step {_ms(s.step_s)} ms",
          f"# (compute {_ms(s.time['compute_s'])} ms), MFU {100 * s.mfu:.1f}%, {s.memory_bytes / GB:.1f} GB of "
          f"{hw.hbm_bytes / GB:.0f} GB HBM per device"
          + (f"; rank {rank} of {len(p.ranked)} fitting layouts ({p.counts['layouts_timed']} timed)." if rank else "."),
          f"# Inside a node ({hw.intra_node_bandwidth / GB:.0f} GB/s per device): {lay.intra_label}. Across nodes "
          f"({hw.inter_node_bandwidth / GB:.0f} GB/s): "
          + (" ".join(f"{a}{n // i}" for a, n, i in zip(MESH_AXES, lay.sizes, lay.intra) if n // i > 1) or "-") + ".",
          "# Per device and step, by the mesh axes a collective runs over:"]
  by_key: dict[str, list] = {}
  for sec, part, key, moved, link in s.comm():
    entry = by_key.setdefault(key, [0.0, 0.0, link, []])
    entry[0] += sec
    entry[1] += moved
    entry[3].append(part)
  for key, (sec, moved, link, parts) in sorted(by_key.items(), key=lambda kv: -kv[1][0]):
    out.append(f"#   {key:<28} {link:<5} {moved / GB:8.3f} GB {sec * 1e3:8.2f} ms  {', '.join(parts)}")
  rows = " x ".join(lay.table_rows) or "nothing"
  shape = s.mesh_spec.shape
  copies = [a for a in MESH_AXES if a not in lay.table_rows and shape[a] > 1]
  if s.sparse_engine:
    out.append(f"# Table rows over {rows} = {s.table_shards} shards; the sparse engine sends each touched row's "
               f"gradient to its owner and across the block's copies ({', '.join(copies) or 'none'}):")
    out.append(f"# {s.table_sync_bytes / GB:.3f} GB per device and step.")
  elif s.table_sync_bytes <= 1e-3 * GB:
    out.append(f"# Table rows over {rows} = {s.table_shards} shards: every device owns its own rows, so no row "
               "block's gradient is all-reduced.")
  else:
    out.append(f"# Table rows over {rows} = {s.table_shards} shards; each block is copied over "
               f"{', '.join(copies) or 'no axis'}, whose devices")
    out.append(f"# all-reduce its gradient: {s.table_sync_bytes / GB:.2f} GB per device and step.")
  whole = whole_tables(p, s)
  if whole:
    out.append(f"# {', '.join(whole)}: rows do not divide over {s.table_shards} shards, kept whole.")
  data = lay.mesh_data(name, "", p.preset)
  axes = ", ".join(f"{a}: {n}" for a, n in data["axes"].items())
  intra = ", ".join(f"{a}: {n}" for a, n in data["intra_node"].items())
  description = (f"planned for {p.config} on {p.devices} {hw.device} ({p.devices // per} nodes of {per}), "
                 f"predicted {_ms(s.step_s)} ms/step")
  out += [f"name: {name}", f"description: {json.dumps(description)}",  # a JSON string is a YAML string
          f"axes: {{{axes}}}", f"devices_per_node: {per}", f"intra_node: {{{intra}}}", "hardware:",
          f"  device: {json.dumps(hw.device)}"]
  out += [f"  {k}: {_yaml_float(getattr(hw, k))}" for k in mesh_lib.HARDWARE_KEYS[1:]]
  if "rules" in data:
    out.append(f"rules: {{table_rows: [{', '.join(lay.table_rows)}]}}")
  if "target" in data:
    out.append(f"target: {data['target']}")
  return "\n".join(out) + "\n"


def to_json(p: Plan, top: int = 10) -> dict:
  return {"config": p.config, "devices": p.devices, "hardware": p.preset.name, "batch_size": p.batch_size,
          "options": p.options, "counts": p.counts, "seconds": p.seconds,
          "ranked": [row(s) for s in p.ranked[:top]],
          "baselines": {name: row(s) for name, s in p.baselines.items()}, "baseline_errors": p.baseline_errors,
          "best_baseline": None if p.best_baseline() is None else p.best_baseline()[0],
          "speedup_over_best_fitting_baseline": (None if not p.ranked or p.best_baseline() is None
                                                 else p.best_baseline()[1].step_s / p.best.step_s),
          "explanation": explain(p) if p.ranked else []}


def matching_meshes(devices: int, device_name: str) -> list[str]:
  """Hand-written mesh files (meshes/*.yaml, not ones plan_mesh wrote) for this many devices of this type."""
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, "meshes", "*.yaml"))):
    with open(path) as f:
      if f.readline().startswith(PLANNED):
        continue
    spec = mesh_lib.load(path)
    if spec.num_devices == devices and spec.hardware.device == device_name:
      out.append(path)
  return out


def progress_printer(every_s: float = 5.0):
  """A plan() progress callback printing a line to stderr at most every `every_s` seconds, and at the end."""
  last = [-every_s]

  def show(p: dict) -> None:
    if p["seconds"] - last[0] < every_s and p["done"] < p["total"]:
      return
    last[0] = p["seconds"]
    c, best = p["counts"], p["best"]
    lead = (f"best so far {best.layout.axes_label} (rows over {best.layout.rows_label}, inside a node "
            f"{best.layout.intra_label}): {_ms(best.step_s)} ms, {best.memory_bytes / GB:.1f} GB" if best
            else "nothing fits yet")
    print(f"  [{p['seconds']:5.0f} s] {p['done']}/{p['total']} axis sizes x table rules, {c['simulated']} simulated, "
          f"{c['pruned_tables_exceed_hbm']} pruned, {c['layouts_timed']} layouts timed; {lead}",
          file=sys.stderr, flush=True)
  return show


def plan_mesh(cfg, devices: int, preset, *, baseline_paths: list[str] | None = None, out_mesh: str | None = None,
              json_path: str | None = None, top: int = 10, command: str = "", compile_top: int = 0,
              **options) -> dict:
  """Plans `cfg` on `devices` of `preset` (plan_lib.get_preset), prints the search counts, the ranked table
  and the explanation, writes the best layout to out_mesh (loaded back to check it) and the JSON to
  json_path; returns the JSON. baseline_paths: hand-written mesh files to compare with (default: those of
  the same device count and device). compile_top: compile the first K ranked layouts for the preset's GPU
  target and rank by the compiled memory (plan_lib.check_compiled). options: plan()'s keywords."""
  t0 = time.perf_counter()
  paths = baseline_paths if baseline_paths is not None else matching_meshes(devices, preset.hardware.device)
  print(f"planning {cfg.name} on {devices} x {preset.hardware.device}: reading the model and sample batches ...",
        file=sys.stderr, flush=True)
  result = plan_lib.plan(cfg, devices, preset, baseline_meshes=[mesh_lib.load(x) for x in paths],
                         progress=progress_printer(), **options)
  if compile_top:
    print(f"compiling the first {min(compile_top, len(result.ranked))} layouts' train steps for "
          f"{preset.target} (deviceless) ...", file=sys.stderr, flush=True)
    result = plan_lib.check_compiled(result, cfg, compile_top)
    for s in result.ranked[:compile_top] + result.rejected:
      if s.compiled_peak is not None:
        print(f"compiled {s.layout.axes_label} (rows over {s.layout.rows_label}, inside a node {s.layout.intra_label}): "
              f"peak {s.compiled_peak / GB:.1f} GB per device, simulated {s.memory_bytes / GB:.1f} GB "
              f"({s.compiled_peak / s.memory_bytes:.2f}x); " + ("fits" if s.fits else "DOES NOT FIT"))
  c = result.counts
  print(f"{cfg.name} on {devices} x {preset.hardware.device} ({devices // preset.devices_per_node} nodes "
        f"of {preset.devices_per_node}), global batch {result.batch_size}: {c['axis_sizes']} axis sizes x table "
        f"rules = {c['sizes_and_rules']}, {c['pruned_tables_exceed_hbm']} pruned (tables alone exceed HBM), "
        f"{c['simulated']} simulated, {c['layouts_timed']} layouts timed with their node placements, "
        f"{c['fitting']} fit.\n")
  print("\n".join(table(result, top)) + "\n")
  if result.ranked:
    print("\n".join(explain(result)))
  else:
    print(f"No layout fits in {preset.hardware.hbm_bytes / 1e9:.0f} GB per device.")
    for name, why in result.baseline_errors.items():
      print(f"{name}: cannot run this config: {why}.")
  if out_mesh and result.ranked:
    name = os.path.splitext(os.path.basename(out_mesh))[0]
    os.makedirs(os.path.dirname(os.path.abspath(out_mesh)), exist_ok=True)
    with open(out_mesh, "w") as f:
      f.write(to_yaml(result, result.best, name, command))
    mesh_lib.load(out_mesh)  # what we wrote must load
    print(f"\nwrote {out_mesh}")
  out = to_json(result, top)
  out["command"], out["wall_s"] = command, time.perf_counter() - t0
  if json_path:
    with open(json_path, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {json_path}")
  print(f"wall time {out['wall_s']:.1f} s")
  return out


# ---- the simulator -------------------------------------------------------------------------------------

def simulate_cluster(cfg, mesh_spec, out: str, *, mesh_file: str = "", **options) -> dict:
  """Simulates `cfg` on `mesh_spec`, writes the JSON to `out`, prints the readable lines; options:
  simulate()'s keywords (batch_size, mean_history, overlap, efficiency)."""
  t0 = time.perf_counter()
  sim = sim_lib.simulate(cfg, mesh_spec, **options)
  sim = {"config": cfg.name, "mesh_file": mesh_file, "overlap": options.get("overlap", 0.9),
         "efficiency": options.get("efficiency", 0.5), **sim}
  with open(out, "w") as f:
    json.dump(sim, f, indent=1)
  print("\n".join(simulation_lines(sim, mesh_spec, cfg.name)))
  print(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")
  return sim


def _unit(largest: float) -> tuple[str, float]:
  """GB, or MB when everything is under a GB (tiny configs on CPU meshes)."""
  return ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)


def _ms_column(s: float) -> str:
  """Milliseconds to a fixed width, for columns (the prose uses _ms)."""
  return f"{s * 1e3:10.3f}"


def _host_lines(host: dict, t: dict | None) -> list[str]:
  """Host tables: per table the device cache and the host store, and the step's traffic over the host link
  (a bound: simulate.host_tier)."""
  unit, scale = _unit(max([host["host_bytes_per_process"]] + [1.0]))
  lines = [f"host tables ({unit}; per step a bound: {host['bound']}):"]
  for name, h in host["tables"].items():
    lines.append(f"  {name}: {h['rows']:,} rows of {h['row_bytes']} B on the host ({h['host_store_bytes'] / scale:.3f}); "
                 f"{h['cache_rows_per_owner']:,} cached per owner shard ({h['device_cache_bytes'] / scale:.3f}); "
                 f"<= {h['misses_per_step_per_device']:,.0f} rows in and out per device per step")
  link = ("" if t is None or "host_link_s" not in t else
          f"; the host link takes {t['host_link_s'] * 1e3:.3f} ms, of which the step waits {t['host_wait_s'] * 1e3:.3f}")
  lines.append(f"  per device per step: {host['h2d_bytes_per_step'] / scale:.4f} in, {host['d2h_bytes_per_step'] / scale:.4f} "
               f"out{link}; host memory per process {host['host_bytes_per_process'] / scale:.3f}")
  return lines


def simulation_lines(sim: dict, mesh_spec, config: str) -> list[str]:
  """The readable lines printed after a simulation."""
  hw = mesh_spec.hardware
  lines = [f"{config} on {sim['mesh']}: {sim['devices']} devices ({mesh_spec.num_nodes} nodes of "
           f"{mesh_spec.devices_per_node}; " + " x ".join(f"{a} {n}" for a, n in mesh_spec.axes)
           + f"), global batch {sim['batch_size']} ({sim['rows_per_shard']} rows per data shard), mean history "
           f"{sim['mean_history']:.0f} tokens"]
  t = sim["time"]
  if t is None:
    lines.append("time: none - the mesh file gives no peak FLOP/s or bandwidths (a CPU file); bytes and memory only")
  else:
    wait = t.get("host_wait_s", 0.0)
    hidden = max(0.0, t["step_s"] - wait - t["compute_s"] - t["exposed_comm_s"])
    lines.append(f"step {t['step_s'] * 1e3:.3f} ms = compute {t['compute_s'] * 1e3:.3f} + exposed comm (lookups, "
                 f"tensor/context sums) {t['exposed_comm_s'] * 1e3:.3f} + parameter comm not hidden {hidden * 1e3:.3f}"
                 f" (of {t['params_comm_s'] * 1e3:.3f})" + (f" + host link wait {wait * 1e3:.3f}" if "host_wait_s" in t else "")
                 + f"; MFU {100 * sim['mfu']:.2f}% of "
                 f"{hw.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16")
  m = sim["memory"]
  unit, scale = _unit(max(m["total"], m["hbm_bytes"] or 0.0))
  kinds = ("params", "optimizer", "gradients", "gathered_params", "activations", "embedding_update")
  mem = ", ".join(f"{k} {m[k] / scale:.2f}" for k in kinds)
  mem += " (total: params + optimizer + gradients + the larger of gathered + activations and embedding_update)"
  if m["hbm_bytes"] is None:
    lines.append(f"memory per device ({unit}): {mem} = {m['total'] / scale:.2f} (no HBM size in the mesh file)")
  else:
    lines.append(f"memory per device ({unit}): {mem} = {m['total'] / scale:.2f} of {m['hbm_bytes'] / scale:.0f} HBM: "
                 + ("fits" if m["fits"] else "DOES NOT FIT"))
  if "host_tables" in sim:
    lines += _host_lines(sim["host_tables"], t)
  comm = sim["comm"]
  unit, scale = _unit(comm["total"])
  lines.append(f"comm per device per step ({unit}) by kind: "
               + ", ".join(f"{k} {v / scale:.4f}" for k, v in comm["by_kind"].items())
               + "; by part: " + ", ".join(f"{k} {v['total'] / scale:.4f}" for k, v in comm["parts"].items()))
  lines.append("by the mesh axes a collective runs over:")
  by_axis = comm["by_axis"]
  width = max([len(k) for k in by_axis] + [5])
  head = f"  {'axes':<{width}} {unit:>10}" + ("" if t is None else f" {'ms':>10}  link")
  lines.append(head)
  order = sorted(by_axis, key=lambda k: -(t["comm_s_by_axis"][k] if t else by_axis[k]))
  for k in order:
    line = f"  {k:<{width}} {by_axis[k] / scale:10.4f}"
    if t is not None:
      line += f" {_ms_column(t['comm_s_by_axis'][k])}  {t['bandwidth_by_axis'][k]}"
    lines.append(line)
  lines.append(f"  {'total':<{width}} {comm['total'] / scale:10.4f}"
               + ("" if t is None else f" {_ms_column(sum(t['comm_s_by_axis'].values()))}"))
  for note in comm["placement_notes"]:
    lines.append(f"note: {note}")
  return lines
