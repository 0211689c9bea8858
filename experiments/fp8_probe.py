"""FP8 sensitivity probe: SNR of every matmul site under every FP8 recipe, and a proposed policy.

  python experiments/fp8_probe.py --out probe.json                      # small config at init, CPU ~2 min
  python experiments/fp8_probe.py --run runs/default --out probe.json   # the trained model of a run
  python experiments/fp8_probe.py --config tiny --batches 1 --threshold 24 --sites '*hstu*' 

Prints one row per Dense site (rows M, widths K x N, bf16's SNR against float32, each recipe's worst SNR
over y / dx / dw against bf16) and the proposed policy: per site the first recipe of
gem_jax.precision.probe.PREFERENCE whose worst SNR clears --threshold, else bf16. The JSON holds the
rows, the proposal and the `--set` flag that trains with it.
"""

import argparse
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
from gem_jax.precision import probe
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
  p.add_argument("--sites", default="*", help="fnmatch pattern: probe only the matching sites")
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
  print(probe.table(rows, chosen))
  rules = probe.as_rules(chosen)
  flag = f"--set model.precision.policy=bf16 --set 'model.precision.rules={json.dumps(list(rules))}'"
  counts = {r: sum(1 for v in chosen.values() if v == r) for r in sorted(set(chosen.values()))}
  print(f"\nproposed at >= {args.threshold} dB: {counts}\ntrain with: {flag}")
  print(f"probe took {time.perf_counter() - t0:.0f} s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"config": cfg.name, "checkpoint_step": step, "batches": args.batches,
                 "threshold_db": args.threshold, "sites": rows, "proposed": chosen, "rules": list(rules),
                 "set_flag": flag}, f, indent=2, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
