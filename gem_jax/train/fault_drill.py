"""Fault drill: SIGKILL the trainer at random points, resume it each time, compare with an unbroken run
(experiments/fault_drill.py is its command line; the trainer processes run this module with --worker).

The drill trains a small config (default `tiny`, with HSTU dropout on so that the checkpointed RNG
matters) twice, each in fresh processes on one CPU device:
  reference  one process, start to finish
  drilled    started, killed with SIGKILL at the i-th planned point, restarted with resume, K times, then
             left to finish
Kill points are drawn (seeded by --seed) from three kinds of moment, each used once when K >= 3:
  step          right after step N is dispatched (its compute, or the next batch's, is under way)
  save_begin    just before checkpoint N is handed to orbax (the device-to-host copy)
  save_started  just after that hand-off returns, while the asynchronous write is in flight
Every trainer process shares one persistent compilation cache (in the work folder), so only the reference
run pays for compiling.

Multi-process mode (`processes` > 1, with a mesh file whose devices the processes split): each drilled start
is a group of processes on one coordinator (a fresh port each start), and each kill takes one process of the
group, the i-th kill process i mod `processes` (so the coordinator dies too). The others are left `grace_s`
seconds to notice (a peer's death fails their next collective or heartbeat) and are then killed, as a
cluster scheduler ends a job step whose task died; then the whole group is restarted with resume. The
comparison restores both runs' last checkpoints on one device (resharded), so it checks the checkpoint a
multi-process run wrote as well as the training. The reference is a group like the drilled run's
(`reference="group"`, the default) or one process holding all of the mesh's devices (`reference="one"`): a
group start costs every process a compile of its own (a multi-process CPU run keeps no persistent cache,
gem_jax/parallel/distributed.py), where one process compiles once and writes the cache. "one" also claims
that the group trains exactly what one process trains, which holds where each cross-process reduction adds
its terms in the order one process would (on cpu_2 with host tables, 2026-12-05: every loss, all 231 state
leaves and the evaluation equal to the bit); on a mesh where it does not, `identical` is false for a reason
that is not the resume.

The trainer announces these moments on stdout (`train(on_event=...)`); the drill kills the moment it reads
the line, so the process dies a few milliseconds later, wherever it got to.

Written to --out (JSON): `identical` (every per-step loss, the final train state -- params, optimizer
state, step, rng -- and the final evaluation metrics bit for bit equal), the kill points (kind, step,
whether the checkpoint being written got committed, the step the next process resumed from), the steps
lost per kill (steps dispatched before the kill that the restart ran again), and wall times. The exit
status is 0 only when `identical` is true.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from gem_jax.parallel import distributed

MARK = "@@drill"
KINDS = ("step", "save_begin", "save_started")   # the order the trainer passes them within one step


@dataclasses.dataclass(frozen=True)
class Drill:
  """What a drill runs: K kills over a `steps`-step run of `config` with a checkpoint every
  `checkpoint_every` steps (`sets`: more config overrides)."""
  kills: int = 5
  steps: int = 30
  checkpoint_every: int = 4
  seed: int = 0
  config: str = "tiny"
  sets: tuple[str, ...] = ()
  workdir: str | None = None
  keep_runs: bool = False
  timeout: float = 900.0
  processes: int = 1
  mesh: str | None = None      # mesh file; default one device (one per process)
  grace_s: float = 5.0         # multi-process: how long the others of a killed process may run on
  reference: str = "group"     # multi-process: the unbroken run as a group like the drilled one, or "one" process

  def __post_init__(self):
    if self.reference not in ("group", "one"):
      raise ValueError(f"a drill's reference is 'group' or 'one' (one process with all of the mesh's devices), "
                       f"got {self.reference!r}")
    if self.kills < 0 or self.steps < 2 or self.checkpoint_every < 1:
      raise ValueError("a drill needs kills >= 0, steps >= 2, checkpoint_every >= 1")
    if self.processes < 1 or self.grace_s < 0:
      raise ValueError(f"a drill needs --processes >= 1 and --grace >= 0, got {self.processes} and {self.grace_s}")
    fixed = {"train.steps", "train.checkpoint_every", "mesh"}   # the kill points are planned from these
    clash = sorted({kv.split("=", 1)[0] for kv in self.sets} & fixed)
    if clash:
      raise ValueError(f"a drill plans its kill points from --steps, --checkpoint-every and --mesh: set those, not "
                       f"--set {' '.join(clash)}")
    devices = self.mesh_devices()
    if devices % self.processes:
      raise ValueError(f"mesh {self.mesh} has {devices} devices, which {self.processes} processes cannot split evenly")

  def mesh_devices(self) -> int:
    if self.mesh is None:
      return self.processes
    from gem_jax.parallel import mesh as mesh_lib
    return mesh_lib.load(self.mesh).num_devices

  def devices_per_process(self) -> int:
    return self.mesh_devices() // self.processes


def _overrides(args) -> list[str]:
  return [f"train.steps={args.steps}", f"train.checkpoint_every={args.checkpoint_every}", "train.log_every=1",
          f"train.eval_every={args.steps}", "train.eval_examples=256", "train.keep_checkpoints=3",
          "train.warmup_steps=2", "model.hstu.dropout_rate=0.1", *([f"mesh={args.mesh}"] if args.mesh else []),
          *args.sets]


def _config(args):
  from gem_jax import configs
  from gem_jax.config import apply_overrides
  return apply_overrides(configs.get(args.config), _overrides(args))


# ---- the trainer process ----------------------------------------------------------------------------


def worker(args: Drill, run_dir: str, process_id: int = 0, coordinator: str | None = None) -> int:
  """The trainer process of a drill: resumes run_dir and announces each moment on stdout. In a
  multi-process drill, process `process_id` of the group on `coordinator` (host:port)."""
  if args.processes > 1:
    distributed.setup(distributed.ProcessSetup(coordinator, args.processes, process_id))
  from gem_jax.train.jobs import train_config

  def emit(name: str, step: int) -> None:
    print(f"{MARK} {name} {step}", flush=True)

  train_config(_config(args), run_dir, resume=True, progress=False, report=False, on_event=emit)
  emit("exit", 0)
  return 0


def _worker_cmd(args: Drill, run_dir: str, process_id: int, coordinator: str | None) -> list[str]:
  return [sys.executable, "-m", "gem_jax.train.fault_drill", run_dir, json.dumps(dataclasses.asdict(args)),
          str(process_id), coordinator or ""]


def _intra_op_threads(args: Drill) -> int:
  """The intra-op thread count every trainer process of the drill compiles for. XLA:CPU splits a large
  loop fusion into as many parallel tasks as its client's thread pool has threads, and that pool has
  max(schedulable cores, the process's CPU devices) threads (PJRT_NPROC, if set, stands for the cores). A
  split loop can round an element differently, so a one-process reference holding two devices on one core
  (two threads) and group processes holding one each (one thread) trained 1 ulp apart (2026-12-06, pinned
  to one core: Adam's nu, one element of 128). One count for all of them keeps the programs the same."""
  cores = os.environ.get("PJRT_NPROC")
  if not cores:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  return max(int(cores), args.mesh_devices())


def _env(args: Drill, cache_dir: str) -> dict:
  """Each process's share of the mesh's CPU devices, one intra-op thread count for all of them
  (_intra_op_threads), and a persistent compilation cache shared by every trainer process of the drill (as
  restarts on a cluster share one): the reference run compiles, the restarts load the same executables."""
  flags = distributed.cpu_device_flags(os.environ.get("XLA_FLAGS"), args.devices_per_process())
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PJRT_NPROC=str(_intra_op_threads(args)),
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


def _free_port() -> int:
  import socket
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def _run(args: Drill, run_dir: str, log, kill_at: tuple[str, int] | None, victim: int = 0) -> dict:
  """One start of the trainer: its processes (one, or a multi-process group on a fresh coordinator port).
  The drill reads process `victim`'s announcements (the others write to the log) and, kill_at (kind,
  step) given, SIGKILLs that process when it announces that moment, then the others after args.grace_s."""
  t0 = time.perf_counter()
  coordinator = f"localhost:{_free_port()}" if args.processes > 1 else None
  env = _env(args, os.path.join(os.path.dirname(run_dir), "compile_cache"))
  procs = [subprocess.Popen(_worker_cmd(args, run_dir, i, coordinator), stdout=subprocess.PIPE if i == victim else log,
                            stderr=log, text=True, env=env) for i in range(args.processes)]
  # A hung process (a collective whose peer died, a deadlock) ends the start instead of the drill's caller.
  fired = threading.Event()
  timer = threading.Timer(args.timeout, lambda: (fired.set(), [p.kill() for p in procs]))
  timer.start()
  seen = {"start": None, "last_step": None, "killed": False, "process": victim}
  try:
    for line in procs[victim].stdout:
      if not line.startswith(MARK):
        continue
      _, name, value = line.split()
      step = int(value)
      if name == "start":
        seen["start"] = step
      elif name == "step":
        seen["last_step"] = step
      if kill_at is not None and (name, step) == kill_at:
        os.kill(procs[victim].pid, signal.SIGKILL)
        seen["killed"] = True
        break
    if seen["killed"] or procs[victim].wait() != 0:
      # Killed, or dead on its own: the others would wait in a collective until the timeout.
      seen["others"] = _end_others(procs, victim, args.grace_s)
  finally:
    codes = [p.wait() for p in procs]
    timer.cancel()
  seen.update(returncode=codes[victim], wall_s=round(time.perf_counter() - t0, 2))
  if fired.is_set():
    raise TimeoutError(f"trainer processes ran past {args.timeout:.0f} s; their stderr is in {log.name}")
  if kill_at is None and any(codes):
    raise RuntimeError(f"trainer process failed (exit codes {codes}); their stderr is in {log.name}")
  if kill_at is not None and not seen["killed"]:
    raise RuntimeError(f"trainer process {victim} ended (exit {codes[victim]}) before reaching the kill point "
                       f"{kill_at}; its stderr is in {log.name}")
  return seen


def _end_others(procs: list, victim: int, grace_s: float) -> dict[int, str]:
  """The processes of a group other than the killed one: each either exits within grace_s of the kill
  (how, by exit status) or is killed then."""
  deadline = time.monotonic() + grace_s
  ended = {}
  for i, p in enumerate(procs):
    if i == victim:
      continue
    try:
      ended[i] = f"exited {p.wait(timeout=max(0.0, deadline - time.monotonic()))}"
    except subprocess.TimeoutExpired:
      p.kill()
      ended[i] = f"killed after {grace_s:g} s"
  return ended


# ---- the drill ---------------------------------------------------------------------------------------


def plan_kills(kills: int, steps: int, every: int, seed: int) -> list[tuple[str, int]]:
  """K distinct kill points, in the order a run passes them; each kind at least once when K >= 3."""
  saves = list(range(every, steps, every))
  candidates = {"step": [("step", s) for s in range(1, steps)],
                "save_begin": [("save_begin", s) for s in saves], "save_started": [("save_started", s) for s in saves]}
  pool = sorted(set(p for c in candidates.values() for p in c))
  if kills > len(pool):
    raise ValueError(f"--kills {kills}: a {steps}-step run with a checkpoint every {every} steps has only "
                     f"{len(pool)} distinct kill points")
  rng = random.Random(seed)
  chosen = set()
  for kind in KINDS[:min(kills, 3)]:
    if candidates[kind]:
      chosen.add(rng.choice(candidates[kind]))
  while len(chosen) < kills:
    chosen.add(rng.choice(pool))
  return sorted(chosen, key=lambda p: (p[1], KINDS.index(p[0])))


def identical(a, b) -> bool:
  """Exact equality of two JSON values, where a NaN equals a NaN in the same place (a metric with no
  examples, e.g. conversion AUC on an eval set without a conversion) and every other float must match to
  the bit; `==` on dicts holding NaN is never true."""
  if isinstance(a, dict) or isinstance(b, dict):
    return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
        identical(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
    return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(identical(x, y) for x, y in zip(a, b)))
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  return type(a) is type(b) and a == b


def _losses(run_dir: str) -> dict[int, float]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def _compare(args, ref_dir: str, drill_dir: str) -> dict:
  """Bitwise comparison of the two runs: per-step losses, the final train state, the final evaluation."""
  os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS=distributed.cpu_device_flags(os.environ.get("XLA_FLAGS"), 1))
  import jax
  import numpy as np

  # jax read JAX_PLATFORMS when gem_jax imported it (gem_jax/malloc_env.py); its backends start only now.
  jax.config.update("jax_platforms", "cpu")

  from gem_jax.run.build import build
  from gem_jax.train.checkpoint import Checkpointer

  ref_losses, drill_losses = _losses(ref_dir), _losses(drill_dir)
  loss_diffs = [s for s in sorted(set(ref_losses) | set(drill_losses))
                if s not in ref_losses or s not in drill_losses
                or np.float64(ref_losses[s]).tobytes() != np.float64(drill_losses[s]).tobytes()]
  # On one device whatever mesh the runs had (the restore reshards), and host tables as device tables:
  # checkpoints hold them whole. Shapes and shardings only, nothing compiled.
  cfg = _config(args)
  cfg = dataclasses.replace(cfg, mesh=None, train=dataclasses.replace(cfg.train, host_tables=()))
  abstract = build(cfg, abstract=True).abstract_state()
  states = []
  for d in (ref_dir, drill_dir):
    with Checkpointer(os.path.join(d, "checkpoints"), keep=3, save_every=args.checkpoint_every) as ckpt:
      states.append(ckpt.restore(args.steps, abstract_state=abstract)[1])
  leaf_diffs = []
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(states[0])[0], jax.tree_util.tree_leaves(states[1])):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
      leaf_diffs.append(jax.tree_util.keystr(path))
  evals = []
  for d in (ref_dir, drill_dir):
    with open(os.path.join(d, "summary.json")) as f:
      evals.append(json.load(f)["tasks"])
  return {"losses_identical": not loss_diffs and len(ref_losses) == args.steps,
          "state_identical": not leaf_diffs, "eval_identical": identical(evals[0], evals[1]),
          "steps_compared": len(ref_losses), "leaves_compared": len(jax.tree_util.tree_leaves(states[0])),
          "loss_differences_at": loss_diffs[:20], "state_differences_in": leaf_diffs[:20],
          "final_loss": ref_losses.get(args.steps), "final_eval": evals[0]}


def drill(args: Drill) -> dict:
  """Runs the drill (module docstring); the result's `identical` says whether it passed."""
  t0 = time.perf_counter()
  work = args.workdir or tempfile.mkdtemp(prefix="fault_drill_")
  ref_dir, drill_dir = os.path.join(work, "reference"), os.path.join(work, "drilled")
  for d in (ref_dir, drill_dir):
    if os.path.exists(d):
      shutil.rmtree(d)
    os.makedirs(d)
  plan = plan_kills(args.kills, args.steps, args.checkpoint_every, args.seed)
  print(f"fault drill: {args.steps} steps of {args.config}, a checkpoint every {args.checkpoint_every}; kill points "
        f"{plan}; runs in {work}", flush=True)
  with open(os.path.join(work, "reference.log"), "w") as log:
    ref = _run(dataclasses.replace(args, processes=1) if args.reference == "one" else args, ref_dir, log, None)
  print(f"  reference run ({'one process' if args.reference == 'one' else f'{args.processes} processes'}): "
        f"{ref['wall_s']} s", flush=True)
  kills = []
  with open(os.path.join(work, "drilled.log"), "w") as log:
    for i, (kind, step) in enumerate(plan):
      seen = _run(args, drill_dir, log, (kind, step), victim=i % args.processes)
      committed = sorted(int(n) for n in os.listdir(os.path.join(drill_dir, "checkpoints")) if n.isdigit())
      kills.append({"kind": kind, "step": step, "process": seen["process"], "process_started_at": seen["start"],
                    "last_step_dispatched": seen["last_step"], "process_wall_s": seen["wall_s"],
                    "checkpoints_on_disk": committed,
                    **({"save_committed": step in committed} if kind != "step" else {}),
                    **({"other_processes": seen["others"]} if args.processes > 1 else {})})
      print(f"  killed process {seen['process']} at {kind} {step} (last step dispatched {seen['last_step']}, checkpoints on disk "
            f"{committed})", flush=True)
    final = _run(args, drill_dir, log, None)
  restarts = [k["process_started_at"] for k in kills[1:]] + [final["start"]]
  for k, resumed in zip(kills, restarts):
    k["resumed_from"] = resumed
    k["steps_lost"] = (k["last_step_dispatched"] or 0) - resumed
  result = {"identical": None, **_compare(args, ref_dir, drill_dir)}
  result["identical"] = result["losses_identical"] and result["state_identical"] and result["eval_identical"]
  result.update(
      kills=kills, steps_lost=[k["steps_lost"] for k in kills], total_steps_lost=sum(k["steps_lost"] for k in kills),
      config=args.config, steps=args.steps, checkpoint_every=args.checkpoint_every, seed=args.seed,
      processes=args.processes, mesh=args.mesh, overrides=_overrides(args),
      reference_processes=1 if args.reference == "one" else args.processes, reference_wall_s=ref["wall_s"],
      drilled_wall_s=round(sum(k["process_wall_s"] for k in kills) + final["wall_s"], 2),
      wall_s=round(time.perf_counter() - t0, 2), workdir=work)
  if not args.keep_runs and args.workdir is None and result["identical"]:
    shutil.rmtree(work)
    result["workdir"] = None
  return result


if __name__ == "__main__":  # a trainer process: python -m gem_jax.train.fault_drill RUN_DIR DRILL_JSON PROCESS_ID COORDINATOR
  spec = Drill(**{k: tuple(v) if k == "sets" else v for k, v in json.loads(sys.argv[2]).items()})
  sys.exit(worker(spec, sys.argv[1], int(sys.argv[3]), sys.argv[4] or None))
