"""Runs one config on several mesh files and reports, per mesh, what the compiled step moves and holds.

  python experiments/mesh_sweep.py --meshes meshes/cpu_*.yaml --out sweep.json
  python experiments/mesh_sweep.py --meshes meshes/cpu_1.yaml meshes/cpu_16_5d.yaml --steps 5 --batch-size 64

CPU meshes run on virtual devices (as many as the largest mesh needs, set before jax starts). Every mesh
trains the same model from the same seed on the same batches, so the loss trajectories must agree up to
the order of floating-point additions; `max_rel_loss_diff` compares each one with the first mesh.

Per mesh, sweep.json holds:
  losses                 per step
  memory                 compiled memory analysis per device (gem_jax/observe/hlo.py)
  comm.by_kind/by_axis   bytes leaving one device per step, by collective kind and by mesh axes, parsed from
                         the compiled HLO (collectives in the lookup's fallback branch are listed apart and
                         counted only on the steps it ran)
  comm.dense             measured parameter traffic (everything but the lookups, the tensor-parallel
                         activation sums and scalars) next to the analytic HSDP volume of the placement
                         (gem_jax/parallel/spmd.py analytic_comm)
  comm.tensor_parallel_bytes   the all-reduces of the tensor-parallel pairs (forward and backward)
  comm.context_parallel_bytes  the gathers of keys, values and outputs of context-parallel HSTU layers
  embedding              all-to-all bytes of the lookups (forward, and backward), the ideal bytes (distinct
                         remote ids out + their rows back, per device, from the step's own counts) and
                         embedding_comm_ratio = forward bytes / ideal
"""

import argparse
import glob
import json
import math
import sys
import time


def _mesh_devices(path: str) -> int:
  import yaml
  with open(path) as f:
    axes = (yaml.safe_load(f) or {}).get("axes") or {}
  return math.prod(int(v) for v in axes.values()) if isinstance(axes, dict) and axes else 1


def _is_scalar_collective(c) -> bool:
  return c.operand_bytes <= 64  # losses, counts, norms: a few floats


def sweep_one(path: str, cfg, batches, args) -> dict:
  import jax
  import numpy as np
  from flax import nnx

  from gem_jax.model.gem import GEM
  from gem_jax.observe import hlo
  from gem_jax.parallel import mesh as mesh_lib
  from gem_jax.parallel import sparse, spmd
  from gem_jax.train.optim import make_optimizer
  from gem_jax.train.step import init_state

  spec = cfg.data.spec
  mesh_spec = mesh_lib.load(path)
  mesh = mesh_lib.build_mesh(mesh_spec, jax.devices()[:mesh_spec.num_devices])
  model = GEM(spec, cfg.model, rngs=nnx.Rngs(cfg.train.seed))
  optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer)
  params_host = state.params
  run = spmd.MeshRun.create(mesh_spec, mesh, graphdef, rest, optimizer, state, spec, cfg.data.pipeline,
                            cfg.model.hstu.keep_last[0], batches[0], args.capacity_slack, args.capacity_multiple)
  device_batches = [run.device_batch(b) for b in batches]
  t0 = time.perf_counter()
  compiled = run.train_step.lower(run.state, device_batches[0]).compile()
  compile_s = time.perf_counter() - t0
  colls = hlo.collectives(compiled.as_text(), mesh)

  state = run.state
  losses, times, stats = [], [], []
  for b in device_batches:
    t = time.perf_counter()
    state, metrics = compiled(state, b)
    metrics = jax.device_get(metrics)
    times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
    stats.append({k: float(v) for k, v in metrics.items() if k.startswith("emb/")})

  lookup = hlo.select(colls, op_name_contains="embedding_lookup")
  fwd = [c for c in lookup if "transpose(" not in c.op_name and not c.conditional]
  bwd = [c for c in lookup if "transpose(" in c.op_name and not c.conditional]
  tensor_parallel = hlo.select(colls, op_name_contains="tensor_parallel")
  context_parallel = hlo.select(colls, op_name_contains="context_parallel")
  other = [c for c in colls if c not in lookup and c not in tensor_parallel and c not in context_parallel]
  params_like = [c for c in other if not _is_scalar_collective(c)]
  # Lookup calls ("table/N"), each with its table's row width.
  calls = {c: spec.table(c.rsplit("/", 1)[0]).dim for c in run.capacities}
  moved = lambda cs: sum(c.moved_bytes * c.count for c in cs)
  forward = lambda cs: [c for c in cs if "transpose(" not in c.op_name]
  rounds = ("spill", "second", "last_resort")
  fallback = {r: [c for c in lookup if c.conditional and f"/{r}/" in c.op_name] for r in rounds}
  ran = {c: {r: sum(1 for s in stats if s.get(f"emb/{c}/{r}", 0) > 0) / max(len(stats), 1) for r in rounds}
         for c in calls}
  # Fallback rounds are charged, per call, on the fraction of steps they ran.
  fallback_fwd = {r: sum(ran[c][r] * moved([x for x in forward(fallback[r]) if f"table={c}/" in x.op_name])
                         for c in calls) for r in rounds}
  overflow_steps = sum(1 for s in stats if any(s.get(f"emb/{c}/overflow", 0) > 0 for c in calls))
  ideal = float(np.mean([sum(sparse.ideal_bytes(s.get(f"emb/{c}/remote_unique", 0.0), e) for c, e in calls.items())
                         for s in stats])) if calls else 0.0
  fwd_bytes = moved(fwd) + sum(fallback_fwd.values())
  analytic = spmd.analytic_comm(run.plan, params_host)
  measured_params = moved(params_like)
  expected_params = analytic["dense_total"] + analytic["table_grad_sync"]
  return {
      "mesh": mesh_spec.name,
      "axes": dict(mesh_spec.axes),
      "devices": mesh_spec.num_devices,
      "losses": losses,
      "step_time_s_median": float(np.median(times[1:] if len(times) > 1 else times)),
      "compile_s": compile_s,
      "memory": hlo.memory(compiled),
      "placement_notes": list(run.plan.notes),
      "capacities": run.capacities,
      "comm": {
          **hlo.summarize(colls),
          "fallback_bytes_if_run": {r: moved(fallback[r]) for r in rounds},
          "dense": {"measured_bytes": measured_params, "analytic_bytes": expected_params,
                    "ratio": measured_params / expected_params if expected_params else None,
                    "analytic": analytic,
                    "measured_by_kind": hlo.summarize(params_like)["by_kind"]},
          # Activations of the tensor-parallel pairs (forward partial sums and their backward).
          "tensor_parallel_bytes": moved(tensor_parallel),
          # Keys, values and outputs of the context-parallel HSTU layers (forward gathers and their
          # backward reduce-scatters).
          "context_parallel_bytes": moved(context_parallel),
      },
      "embedding": {
          "forward_all_to_all_bytes": fwd_bytes,
          "backward_all_to_all_bytes": moved(bwd),
          "ideal_bytes": ideal,
          "embedding_comm_ratio": fwd_bytes / ideal if ideal else None,
          "fallback_steps": overflow_steps,
          "round1_bytes": moved(fwd),
          "fallback_bytes": fallback_fwd,
          "fallback_rates": ran,
          "all_gathers_in_lookup": sum(1 for c in lookup if c.kind == "all-gather"),
          "table_axes": {t: list(a) for t, a in run.plan.table_axes.items()},
      },
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--meshes", nargs="+", default=sorted(glob.glob("meshes/cpu_*.yaml")))
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch-size", type=int, default=256,
                 help="global batch (must divide over every mesh's data shards); larger batches make the "
                      "per-shard id counts, and so the all-to-all capacity, less noisy")
  p.add_argument("--capacity-slack", type=float, default=1.05,
                 help="all-to-all slots per destination = slack x the first batch's largest need")
  p.add_argument("--capacity-multiple", type=int, default=1, help="round capacities up to this")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--out", default="sweep.json")
  args = p.parse_args(argv)

  from gem_jax.parallel import distributed
  distributed.setup(distributed.ProcessSetup(cpu_devices=max(_mesh_devices(m) for m in args.meshes)))

  import numpy as np

  from gem_jax import configs
  from gem_jax.config import apply_overrides
  from gem_jax.data import pipeline
  from gem_jax.data.synthetic import SyntheticAdsStream

  cfg = apply_overrides(configs.get(args.config), [f"data.pipeline.batch_size={args.batch_size}"] + args.set)
  spec = cfg.data.spec
  stream = SyntheticAdsStream(spec, cfg.data.synthetic)
  batches = [pipeline.pack(stream.block(i, args.batch_size), spec, cfg.data.pipeline) for i in range(args.steps)]

  results = []
  for path in args.meshes:
    print(f"--- {path}", flush=True)
    results.append(sweep_one(path, cfg, batches, args))
  base = np.asarray(results[0]["losses"])
  for r in results:
    r["max_rel_loss_diff"] = float(np.max(np.abs(np.asarray(r["losses"]) / base - 1.0)))
  with open(args.out, "w") as f:
    json.dump({"config": args.config, "batch_size": args.batch_size, "steps": args.steps, "meshes": results},
              f, indent=2)

  print(f"\n{'mesh':12s} {'dev':>4s} {'loss[-1]':>9s} {'max rel':>9s} {'step s':>7s} {'peak MB':>8s} "
        f"{'dense MB':>9s} {'analytic':>9s} {'ratio':>6s} {'emb fwd KB':>10s} {'ideal KB':>9s} {'emb ratio':>9s}")
  for r in results:
    d, e = r["comm"]["dense"], r["embedding"]
    peak = r["memory"].get("peak_estimate", float("nan")) / 1e6
    fmt = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}s}"
    print(f"{r['mesh']:12s} {r['devices']:4d} {r['losses'][-1]:9.5f} {r['max_rel_loss_diff']:9.2e} "
          f"{r['step_time_s_median']:7.3f} {peak:8.2f} {d['measured_bytes'] / 1e6:9.3f} "
          f"{d['analytic_bytes'] / 1e6:9.3f} {fmt(d['ratio'], 6, 3)} {e['forward_all_to_all_bytes'] / 1e3:10.1f} "
          f"{e['ideal_bytes'] / 1e3:9.1f} {fmt(e['embedding_comm_ratio'], 9, 3)}")
  for r in results:
    print(f"{r['mesh']}: bytes by axis {json.dumps({k: round(v) for k, v in r['comm']['by_axis'].items()})}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
