"""Runs one config on several mesh files and reports, per mesh, what the compiled step moves and holds.

Every mesh trains the same model from the same seed on the same batches, so the loss trajectories must
agree up to the order of floating-point additions; `max_rel_loss_diff` compares each one with the first
mesh. Per mesh (`sweep_one`):
  losses                 per step
  memory                 compiled memory analysis per device (gem_jax/observe/hlo.py)
  comm.by_kind/by_axis   bytes leaving one device per step, by collective kind and by mesh axes, parsed from
                         the compiled HLO (collectives in the lookup's fallback branch are listed apart and
                         counted only on the steps it ran)
  comm.dense             measured parameter traffic (everything but the lookups, the tensor-parallel
                         activation sums and scalars) next to the analytic HSDP volume of the placement
                         (gem_jax/parallel/placement.py analytic_comm)
  comm.tensor_parallel_bytes   the all-reduces of the tensor-parallel pairs (forward and backward)
  comm.context_parallel_bytes  the gathers of keys, values and outputs of context-parallel HSTU layers
  embedding              all-to-all bytes of the lookups (forward, and backward), the ideal bytes (distinct
                         remote ids out + their rows back, per device, from the step's own counts) and
                         embedding_comm_ratio = forward bytes / ideal; with the sparse engine
                         (train.embedding_update=sparse) table_sync_bytes, the collectives of its update
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np

from gem_jax import scopes
from gem_jax.config import apply_overrides
from gem_jax.observe import embedding_update, hlo
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import placement
from gem_jax.parallel import lookups, sparse
from gem_jax.parallel.rules import DATA_AXES
from gem_jax.run import table_update
from gem_jax.run.build import build


def _is_scalar_collective(c) -> bool:
  return c.operand_bytes <= 64  # losses, counts, norms: a few floats


def sweep_one(path: str, cfg, batches, *, capacity_slack: float = 1.05, capacity_multiple: int = 1) -> dict:
  """One mesh file's record of the sweep (module docstring): cfg built on it (its first devices), trained on
  `batches` from the same seed, its compiled program read."""
  mesh_spec = mesh_lib.load(path)
  run = build(dataclasses.replace(cfg, mesh=path), devices=jax.devices()[:mesh_spec.num_devices],
              first_batch=batches[0], capacity_slack=capacity_slack, capacity_multiple=capacity_multiple)
  spec, mesh, params_host = cfg.data.spec, run.mesh, run.state.params
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

  lookup = hlo.select(colls, op_name_contains=scopes.EMBEDDING_LOOKUP)
  fwd = [c for c in lookup if "transpose(" not in c.op_name and not c.conditional]
  bwd = [c for c in lookup if "transpose(" in c.op_name and not c.conditional]
  tensor_parallel = hlo.select(colls, op_name_contains=scopes.TENSOR_PARALLEL)
  context_parallel = hlo.select(colls, op_name_contains=scopes.CONTEXT_PARALLEL)
  # The sparse engine's row-gradient sync (gem_jax/run/table_update.py): apart from parameter traffic.
  table_sync = hlo.select(colls, op_name_contains=scopes.EMBEDDING_UPDATE)
  other = [c for c in colls if c not in lookup and c not in tensor_parallel and c not in context_parallel
           and c not in table_sync]
  params_like = [c for c in other if not _is_scalar_collective(c)]
  # Lookup calls ("table/N"), each with its table's row width.
  calls = {c: spec.table(lookups.table_of(c)).dim for c in run.capacities}
  moved = lambda cs: sum(c.moved_bytes * c.count for c in cs)
  forward = lambda cs: [c for c in cs if "transpose(" not in c.op_name]
  rounds = (scopes.SPILL, scopes.SECOND, scopes.LAST_RESORT)
  fallback = {r: [c for c in lookup if c.conditional and scopes.in_round(c.op_name, r)] for r in rounds}
  ran = {c: {r: sum(1 for s in stats if s.get(f"emb/{c}/{r}", 0) > 0) / max(len(stats), 1) for r in rounds}
         for c in calls}
  # Fallback rounds are charged, per call, on the fraction of steps they ran.
  fallback_fwd = {r: sum(ran[c][r] * moved([x for x in forward(fallback[r]) if scopes.in_table(x.op_name, c)])
                         for c in calls) for r in rounds}
  overflow_steps = sum(1 for s in stats if any(s.get(f"emb/{c}/overflow", 0) > 0 for c in calls))
  ideal = float(np.mean([sum(sparse.ideal_bytes(s.get(f"emb/{c}/remote_unique", 0.0), e) for c, e in calls.items())
                         for s in stats])) if calls else 0.0
  fwd_bytes = moved(fwd) + sum(fallback_fwd.values())
  analytic = placement.analytic_comm(run.plan, params_host)
  measured_params = moved(params_like)
  sparse_engine = cfg.train.embedding_update == "sparse"
  engine = (embedding_update.account(colls, stats, table_update.row_bytes(params_host, run.optimizer,
                                                                            run.state.opt_state))
            if sparse_engine else None)
  # The sparse engine never all-reduces a table: its parameter traffic is the dense HSDP volume alone.
  expected_params = analytic["dense_total"] + (0.0 if sparse_engine else analytic["table_grad_sync"])
  return {
      "mesh": mesh_spec.name,
      "axes": dict(mesh_spec.axes),
      "devices": mesh_spec.num_devices,
      "losses": losses,
      "step_time_s_median": float(np.median(times[1:] if len(times) > 1 else times)),
      "compile_s": compile_s,
      "memory": hlo.memory(compiled),
      "placement_notes": list(run.plan.notes),
      # Per table, the largest single array its update's all-reduces / all-gathers over a data axis carry in
      # every step (a block's gradient on the dense path; touched rows' slots with the sparse engine).
      "largest_sync_array_bytes": {
          t: max([c.array_bytes for c in colls if c.kind in ("all-reduce", "all-gather") and not c.conditional
                  and set(c.axes) & set(DATA_AXES) and scopes.in_table(c.op_name, t)], default=0)
          for t in run.plan.table_axes},
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
          # The sparse engine's update: row gradients summed over copies, sent to their owners and gathered
          # across the table's copies, against the touched rows' ideal (observe/embedding_update.py).
          "table_sync_bytes": engine["sync_bytes"] if engine else None,
          "table_sync_ideal_bytes": engine["sync_ideal_bytes"] if engine else None,
          "table_sync_ratio": engine["sync_ratio"] if engine else None,
          "table_sync_fallback_rate": engine["fallback_rate"] if engine else None,
          "table_sync_fallback_rates": ({t: r["fallback_rates"] for t, r in engine["tables"].items()}
                                        if engine else None),
          "table_sync_by_kind": engine["sync_by_kind"] if engine else None,
          "table_axes": {t: list(a) for t, a in run.plan.table_axes.items()},
      },
  }


def sweep(cfg, meshes, *, steps: int, batch_size: int, capacity_slack: float = 1.05,
          capacity_multiple: int = 1) -> dict:
  """Every mesh file of `meshes` on the same `steps` batches of `batch_size` rows (module docstring)."""
  cfg = apply_overrides(cfg, [f"data.pipeline.batch_size={batch_size}"])
  source = build(cfg, abstract=True).source
  batches = [source.sample(batch_size, index=i) for i in range(steps)]
  results = []
  for path in meshes:
    print(f"--- {path}", flush=True)
    results.append(sweep_one(path, cfg, batches, capacity_slack=capacity_slack, capacity_multiple=capacity_multiple))
  base = np.asarray(results[0]["losses"])
  for r in results:
    r["max_rel_loss_diff"] = float(np.max(np.abs(np.asarray(r["losses"]) / base - 1.0)))
  return {"config": cfg.name, "batch_size": batch_size, "steps": steps, "meshes": results}


def table(result: dict) -> str:
  """The sweep as a console table, then the bytes by mesh axes of every mesh."""
  lines = [f"{'mesh':12s} {'dev':>4s} {'loss[-1]':>9s} {'max rel':>9s} {'step s':>7s} {'peak MB':>8s} "
           f"{'dense MB':>9s} {'analytic':>9s} {'ratio':>6s} {'emb fwd KB':>10s} {'ideal KB':>9s} {'emb ratio':>9s}"]
  fmt = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}s}"
  for r in result["meshes"]:
    d, e = r["comm"]["dense"], r["embedding"]
    peak = r["memory"].get("peak_estimate", float("nan")) / 1e6
    lines.append(f"{r['mesh']:12s} {r['devices']:4d} {r['losses'][-1]:9.5f} {r['max_rel_loss_diff']:9.2e} "
                 f"{r['step_time_s_median']:7.3f} {peak:8.2f} {d['measured_bytes'] / 1e6:9.3f} "
                 f"{d['analytic_bytes'] / 1e6:9.3f} {fmt(d['ratio'], 6, 3)} {e['forward_all_to_all_bytes'] / 1e3:10.1f} "
                 f"{e['ideal_bytes'] / 1e3:9.1f} {fmt(e['embedding_comm_ratio'], 9, 3)}")
  for r in result["meshes"]:
    e = r["embedding"]
    if e.get("table_sync_bytes") is not None:
      lines.append(f"{r['mesh']}: table sync {e['table_sync_bytes'] / 1e3:.1f} KB per device and step, ideal "
                   f"{e['table_sync_ideal_bytes'] / 1e3:.1f} KB (ratio {fmt(e['table_sync_ratio'], 5, 3).strip()}), "
                   f"second rounds on {e['table_sync_fallback_rate']:.0%} of steps")
  for r in result["meshes"]:
    lines.append(f"{r['mesh']}: bytes by axis {json.dumps({k: round(v) for k, v in r['comm']['by_axis'].items()})}")
  return "\n".join(lines)
