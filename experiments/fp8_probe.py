"""FP8 sensitivity probe: SNR of every matmul site under every FP8 recipe, and a proposed policy.

  python experiments/fp8_probe.py --out probe.json                      # small config at init, CPU ~2 min
  python experiments/fp8_probe.py --run runs/default --out probe.json   # the trained model of a run
  python experiments/fp8_probe.py --config tiny --batches 1 --threshold 24 --sites '*hstu*' 

Prints one row per Dense site (rows M, widths K x N, bf16's SNR against float32, each recipe's worst SNR
over y / dx / dw against bf16, and "e2e": the whole-model gradient SNR with only that site in FP8) and
two proposals:
  per site     the first recipe of gem_jax.precision.probe.PREFERENCE whose worst local SNR clears
               --threshold, else bf16;
  end to end   the set of sites in --end-to-end's recipe with the most Dense FLOPs whose combined noise
               keeps the whole-model gradient above --target-db (checked by a second measurement).
The JSON holds the rows, both proposals and the `--set` flags that train with them.
"""

import argparse
import dataclasses
import fnmatch
import json
import os
import sys
import time

import jax
from flax import nnx

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data import pipeline
from gem_jax.data.synthetic import SyntheticAdsStream
from gem_jax.model.gem import GEM
from gem_jax.precision import policy, probe
from gem_jax.train.checkpoint import Checkpointer
from gem_jax.train.optim import make_optimizer
from gem_jax.train.step import init_state


def build_model(cfg, run_dir: str | None):
  """The config's model at init, or with the parameters of run_dir's latest checkpoint."""
  model = GEM(cfg.data.spec, cfg.model, rngs=nnx.Rngs(cfg.train.seed))
  if run_dir is None:
    return model, None
  optimizer = make_optimizer(cfg.train, nnx.state(model, nnx.Param))
  graphdef, rest, state = init_state(model, optimizer)
  ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=1, save_every=1, async_save=False)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"--run {run_dir}: no checkpoints under {run_dir}/checkpoints")
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  step, state, _ = ckpt.restore(abstract_state=abstract)
  ckpt.close()
  return nnx.merge(graphdef, state.params, rest), step


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="small", choices=sorted(configs.CONFIGS))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--run", default=None, help="probe the parameters of this run folder's last checkpoint")
  p.add_argument("--batches", type=int, default=2, help="training-stream batches to probe on")
  p.add_argument("--threshold", type=float, default=25.0, help="min SNR (dB) of y, dx and dw to allow a recipe")
  p.add_argument("--sites", default="*",
                 help="fnmatch pattern: probe only the matching sites (the end-to-end 'every site' row still "
                      "switches all of them)")
  p.add_argument("--end-to-end", default="mxfp8_rceil", metavar="RECIPE",
                 help="recipe of the whole-model gradient probe ('none' to skip)")
  p.add_argument("--target-db", type=float, default=20.0,
                 help="whole-model gradient SNR the end-to-end proposal must keep")
  p.add_argument("--out", default=None, help="JSON output path")
  args = p.parse_args(argv)
  if args.batches < 1:
    p.error(f"--batches must be >= 1, got {args.batches}")
  cfg = apply_overrides(configs.get(args.config), args.set)
  spec = cfg.data.spec
  t0 = time.perf_counter()
  model, step = build_model(cfg, args.run)
  stream = SyntheticAdsStream(spec, cfg.data.synthetic)
  batches = pipeline.eval_batches(stream, spec, cfg.data.pipeline,
                                  num_examples=args.batches * cfg.data.pipeline.batch_size, start_index=0)
  captures = {s: c for s, c in probe.capture(model, batches, spec).items() if fnmatch.fnmatchcase(s, args.sites)}
  if not captures:
    p.error(f"--sites {args.sites!r} matches no Dense site of {cfg.name}")
  rows = probe.measure(captures)
  chosen = probe.propose(rows, args.threshold)
  e2e = None
  if args.end_to_end != "none":
    e2e = end_to_end_section(model, batches, cfg, captures, args.end_to_end, args.target_db)
  print(probe.table(rows, chosen, e2e))
  rules = probe.as_rules(chosen)
  flag = f"--set model.precision.policy=bf16 --set 'model.precision.rules={json.dumps(list(rules))}'"
  counts = {r: sum(1 for v in chosen.values() if v == r) for r in sorted(set(chosen.values()))}
  print(f"\nper-site proposal (every site's y, dx, dw >= {args.threshold} dB): {counts}\ntrain with: {flag}")
  if e2e:
    print(e2e["summary"])
  print(f"probe took {time.perf_counter() - t0:.0f} s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"config": cfg.name, "checkpoint_step": step, "batches": args.batches,
                 "threshold_db": args.threshold, "sites": rows, "proposed": chosen, "rules": list(rules),
                 "set_flag": flag, "end_to_end": e2e}, f, indent=2, default=str)
  return 0


def end_to_end_section(model, batches, cfg, captures, recipe: str, target_db: float) -> dict:
  """Whole-model gradient SNR per site, a FLOPs-greedy proposal under target_db, and the measured SNR of
  that proposal and of the config's `fp8` policy."""
  spec = cfg.data.spec
  flops = {s: c.xs_MxK[0].shape[0] * c.w_KxN.shape[0] * c.w_KxN.shape[1] for s, c in captures.items()}
  e2e = probe.end_to_end(model, batches, spec, recipe, singles=list(captures))
  proposed = probe.propose_end_to_end(e2e, flops, target_db)
  fp8_policy = [s for s, d in policy.dense_sites(model)
                if policy.resolve(s, d.in_features, d.out_features,
                                  dataclasses.replace(cfg.model.precision, policy="fp8")) not in (None, "bf16")]
  check = probe.end_to_end(model, batches, spec, recipe, sets={"proposed": proposed, "fp8_policy": fp8_policy},
                           singles=False)
  share = lambda chosen: sum(flops.get(s, 0) for s in chosen) / max(sum(flops.values()), 1)
  e2e["proposed"] = {"sites": proposed, "flop_share": share(proposed), **check["sets"]["proposed"]}
  e2e["fp8_policy"] = {"sites": fp8_policy, "flop_share": share(fp8_policy), **check["sets"]["fp8_policy"]}
  rules = [f"{s}={recipe}" for s in sorted(proposed)]
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


if __name__ == "__main__":
  sys.exit(main())
