"""FP8 sensitivity probe of a run: SNR of every matmul site under every FP8 recipe, and proposed policies
(experiments/fp8_probe.py; the measurements are gem_jax/precision/probe.py).

  per site     the first recipe of probe.PREFERENCE whose worst local SNR (y, dx, dw against bf16) clears
               `threshold`, else bf16
  end to end   the set of sites in `recipe` with the most Dense FLOPs whose combined noise keeps the
               whole-model gradient above `target_db` (checked by a second measurement), next to the
               config's own `fp8` policy
The probe runs on the model at init or, with run_dir, on the parameters of that run's latest checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time

from gem_jax.config import apply_overrides
from gem_jax.model.layers import dense_sites
from gem_jax.precision import policy, probe
from gem_jax.run.build import build
from gem_jax.train.checkpoint import Checkpointer


def model_of(cfg, run_dir: str | None):
  """(run, model, checkpoint step): the config's model at init, or with run_dir's latest parameters."""
  run = build(cfg)
  if run_dir is None:
    return run, run.model(), None
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=1, save_every=1, async_save=False)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"--run {run_dir}: no checkpoints under {run_dir}/checkpoints")
  step, state, _ = ckpt.restore(abstract_state=run.abstract_state())
  ckpt.close()
  return run, run.model(state.params), step


def probe_run(cfg, *, run_dir: str | None = None, batches: int = 2, threshold: float = 25.0, sites: str = "*",
              recipe: str | None = "mxfp8_rceil", target_db: float = 20.0, log=print) -> dict:
  """The probe's JSON: per-site rows, the per-site proposal and its --set flag, the end-to-end section."""
  t0 = time.perf_counter()
  run, model, step = model_of(cfg, run_dir)
  source = run.source
  data = [source.sample(source.batch_size, index=i) for i in range(batches)]
  loss_fn = lambda model, batch: run.task.loss(run.task.sums(model, batch, None))[0]
  all_sites = dense_sites(model)
  captures = {s: c for s, c in probe.capture(model, all_sites, data, loss_fn).items() if fnmatch.fnmatchcase(s, sites)}
  if not captures:
    raise ValueError(f"--sites {sites!r} matches no Dense site of {cfg.name}")
  rows = probe.measure(captures)
  chosen = probe.propose(rows, threshold)
  e2e = None
  if recipe is not None:
    e2e = end_to_end_section(run, model, all_sites, data, loss_fn, captures, recipe, target_db)
  log(probe.table(rows, chosen, e2e))
  rules = probe.as_rules(chosen)
  flag = f"--set model.precision.policy=bf16 --set 'model.precision.rules={json.dumps(list(rules))}'"
  counts = {r: sum(1 for v in chosen.values() if v == r) for r in sorted(set(chosen.values()))}
  log(f"\nper-site proposal (every site's y, dx, dw >= {threshold} dB): {counts}\ntrain with: {flag}")
  if e2e:
    log(e2e["summary"])
  log(f"probe took {time.perf_counter() - t0:.0f} s")
  return {"config": cfg.name, "checkpoint_step": step, "batches": batches, "threshold_db": threshold, "sites": rows,
          "proposed": chosen, "rules": list(rules), "set_flag": flag, "end_to_end": e2e}


def end_to_end_section(run, model, sites, batches, loss_fn, captures, recipe: str, target_db: float) -> dict:
  """Whole-model gradient SNR per site, a FLOPs-greedy proposal under target_db, and the measured SNR of
  that proposal and of the config's `fp8` policy."""
  flops = {s: c.xs_MxK[0].shape[0] * c.w_KxN.shape[0] * c.w_KxN.shape[1] for s, c in captures.items()}
  e2e = probe.end_to_end(model, sites, batches, loss_fn, recipe, singles=list(captures))
  proposed = probe.propose_end_to_end(e2e, flops, target_db)
  fp8_cfg = apply_overrides(run.cfg, ["model.precision.policy=fp8"]).model.precision
  fp8_policy = [s for s, d in sites if policy.resolve(s, d.in_features, d.out_features, fp8_cfg) not in (None, "bf16")]
  check = probe.end_to_end(model, sites, batches, loss_fn, recipe,
                           sets={"proposed": proposed, "fp8_policy": fp8_policy}, singles=False)
  share = lambda chosen: sum(flops.get(s, 0) for s in chosen) / max(sum(flops.values()), 1)
  e2e["proposed"] = {"sites": proposed, "flop_share": share(proposed), **check["sets"]["proposed"]}
  e2e["fp8_policy"] = {"sites": fp8_policy, "flop_share": share(fp8_policy), **check["sets"]["fp8_policy"]}
  rules = [f"{s}={recipe}" for s in sorted(proposed)]
  e2e["rules"] = rules  # fp8_parity.py --probe trains with these
  e2e["set_flag"] = f"--set model.precision.policy=bf16 --set 'model.precision.rules={json.dumps(rules)}'"
  e2e["summary"] = "\n".join([
      f"whole-model gradient SNR vs all-bf16 ({recipe}): every site {e2e['all']['grad_snr_db']:.1f} dB, "
      f"the fp8 policy {e2e['fp8_policy']['grad_snr_db']:.1f} dB ({100 * e2e['fp8_policy']['flop_share']:.0f}% of "
      f"Dense FLOPs)" + (f"; SGD's own batch-to-batch noise {e2e['sgd_noise_snr_db']:.1f} dB"
                          if "sgd_noise_snr_db" in e2e else ""),
      f"end-to-end proposal (>= {target_db} dB): {len(proposed)} sites, "
      f"{100 * e2e['proposed']['flop_share']:.0f}% of Dense FLOPs, measured {e2e['proposed']['grad_snr_db']:.1f} dB",
      f"train with: {e2e['set_flag']}"])
  return e2e
