"""Predicts what one train step of a config costs on a mesh file, without compiling or running it: comm bytes
by collective and mesh axes, step time and MFU, memory per device against HBM (gem_jax/observe/simulate.py).

  python experiments/simulate_cluster.py --config large --mesh meshes/h200_1024_5d.yaml --out sim.json
  python experiments/simulate_cluster.py --config tiny --mesh meshes/cpu_8.yaml --out sim.json --batch-size 256

CPU mesh files give no peak FLOP/s or bandwidths: bytes and memory only, no times.
"""

import argparse
import json
import time

def _unit(largest: float) -> tuple[str, float]:
  """GB, or MB when everything is under a GB (tiny configs on CPU meshes)."""
  return ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)


def _ms(s: float) -> str:
  return f"{s * 1e3:10.3f}"


def summary(sim: dict, mesh_spec, config: str) -> list[str]:
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
    hidden = max(0.0, t["step_s"] - t["compute_s"] - t["exposed_comm_s"])
    lines.append(f"step {t['step_s'] * 1e3:.3f} ms = compute {t['compute_s'] * 1e3:.3f} + exposed comm (lookups, "
                 f"tensor/context sums) {t['exposed_comm_s'] * 1e3:.3f} + parameter comm not hidden {hidden * 1e3:.3f}"
                 f" (of {t['params_comm_s'] * 1e3:.3f}); MFU {100 * sim['mfu']:.2f}% of "
                 f"{hw.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16")
  m = sim["memory"]
  unit, scale = _unit(max(m["total"], m["hbm_bytes"] or 0.0))
  kinds = ("params", "optimizer", "gradients", "gathered_params", "activations")
  mem = ", ".join(f"{k} {m[k] / scale:.2f}" for k in kinds)
  if m["hbm_bytes"] is None:
    lines.append(f"memory per device ({unit}): {mem} = {m['total'] / scale:.2f} (no HBM size in the mesh file)")
  else:
    lines.append(f"memory per device ({unit}): {mem} = {m['total'] / scale:.2f} of {m['hbm_bytes'] / scale:.0f} HBM: "
                 + ("fits" if m["fits"] else "DOES NOT FIT"))
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
      line += f" {_ms(t['comm_s_by_axis'][k])}  {t['bandwidth_by_axis'][k]}"
    lines.append(line)
  lines.append(f"  {'total':<{width}} {comm['total'] / scale:10.4f}"
               + ("" if t is None else f" {_ms(sum(t['comm_s_by_axis'].values()))}"))
  for note in comm["placement_notes"]:
    lines.append(f"note: {note}")
  return lines


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="named config (gem_jax/configs.py)")
  p.add_argument("--mesh", required=True, help="mesh file (meshes/*.yaml)")
  p.add_argument("--out", required=True, help="write the simulation here (JSON)")
  p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the config's)")
  p.add_argument("--mean-history", type=float, default=None, help="one history length for every row")
  p.add_argument("--overlap", type=float, default=0.9, help="share of compute parameter traffic hides behind")
  p.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOP/s the compute reaches")
  args = p.parse_args(argv)

  from gem_jax import configs
  from gem_jax.observe.simulate import simulate
  from gem_jax.parallel import mesh as mesh_lib

  t0 = time.perf_counter()
  cfg = configs.get(args.config)
  mesh_spec = mesh_lib.load(args.mesh)
  sim = simulate(cfg, mesh_spec, batch_size=args.batch_size, mean_history=args.mean_history,
                 overlap=args.overlap, efficiency=args.efficiency)
  sim = {"config": cfg.name, "mesh_file": args.mesh, "overlap": args.overlap, "efficiency": args.efficiency, **sim}
  with open(args.out, "w") as f:
    json.dump(sim, f, indent=1)
  print("\n".join(summary(sim, mesh_spec, cfg.name)))
  print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
  return sim


if __name__ == "__main__":
  main()
