"""Multi-process training: 2 processes x 4 CPU devices train exactly what 1 process x 8 devices trains.

The two processes read Parquet files, each only its own rows (data.readers defaults to one reader per
process: gem_jax/data/parquet_source.py), agreeing on each step's history capacity and label counts over the
coordination service (gem_jax/parallel/host_exchange.py). The files hold the one-process run's synthetic
stream laid out for two readers (export_synthetic(readers=2)), so both runs see the same examples in every
step and only the order of floating-point additions may differ. The evaluation set is read whole by every
process and placed as a global batch, the synthetic stream's way.

The one-process run also writes the efficiency report, which is checked like a user's cpu_8 run.

The two processes are experiments/train.py subprocesses on meshes/cpu_8.yaml (fsdp spans them), with their
environment set explicitly: the 8-device XLA_FLAGS of conftest.py would give every process 8. The
one-process reference is the session's tiny_cpu8_run (conftest.py), trained in a test process with 8 CPU
devices; the resharding-restore test reads the same run's checkpoint.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gem_jax.data import export
from gem_jax.parallel import distributed
from gem_jax.parallel.distributed import ProcessSetup
from tests.run_helpers import CPU8_SETS, check_run_report, child_env

REPO = Path(__file__).resolve().parents[1]
SETS = CPU8_SETS
STEPS = SETS["train.steps"]
TIMEOUT_S = 600  # all processes together; a hung collective fails the test instead of hanging CI


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(out: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
  env = {k: v for k, v in child_env().items()
         if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  cmd = [sys.executable, "experiments/train.py", "--config", "tiny", "--mesh", "meshes/cpu_8.yaml",
         "--out", str(out), "--no-progress", *flags]
  for k, v in SETS.items():
    cmd += ["--set", f"{k}={v}"]
  # Output to files, not pipes: a full pipe buffer would block a process inside a collective.
  with open(log, "w") as f:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT), log


def _wait_all(procs: list[tuple[subprocess.Popen, Path]]) -> None:
  """Waits for every process; the first failure (or the deadline) kills the others: a process whose peer
  died would otherwise sit in a collective until JAX's heartbeat timeout."""
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while True:
      codes = [p.poll() for p, _ in procs]
      failed = [f"{log.name} exited with {c}" for (_, log), c in zip(procs, codes) if c not in (None, 0)]
      if not failed and all(c == 0 for c in codes):
        return
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.5)
  finally:
    for p, _ in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  why = "; ".join(failed) or f"still running after {TIMEOUT_S} s"
  tails = "\n".join(f"---- {log.name} (last lines) ----\n{log.read_text()[-3000:]}" for _, log in procs)
  pytest.fail(f"{why}\n{tails}")


def _records(out: Path) -> list[dict]:
  # json.loads fails on a line that two writers interleaved.
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(tmp_path, tiny_cpu8_run):
  cfg, one, one_log = tiny_cpu8_run  # the reference, with the efficiency report as a user's run has it
  files = tmp_path / "files"
  rows = export.export_synthetic(cfg, str(files), STEPS * cfg.data.pipeline.batch_size, readers=2)
  assert rows == {"train": STEPS * cfg.data.pipeline.batch_size, "eval": SETS["train.eval_examples"]}
  two = tmp_path / "two"
  port = _free_port()
  # Nothing here reads the two-process run's step breakdown: no profiled steps.
  multi = ["--coordinator", f"localhost:{port}", "--num-processes", "2", "--local-devices", "4",
           "--data", str(files), "--set", "train.profile_steps=0"]
  _wait_all([_launch(two, tmp_path / f"two_p{i}.log", *multi, "--process-id", str(i)) for i in (0, 1)])
  check_run_report(one, num_devices=8, log=one_log)
  assert json.loads((one / "report.json").read_text())["embedding_update"]["tables"]  # CPU8_SETS: sparse engine
  # Process 0's report counts the whole step's rows (each process reads its own half): the same model FLOPs
  # and sequence lengths as one process reading them all, over the same 8 devices' peak.
  r_two, r_one = (json.loads((d / "report.json").read_text()) for d in (two, one))
  assert r_two["model_tflops_per_step"] == pytest.approx(r_one["model_tflops_per_step"], rel=1e-9)
  # Each process's reader balances its own rows over its own 4 data shards; one process's one reader all 8.
  assert (r_two["rank_imbalance"]["readers"], r_one["rank_imbalance"]["readers"]) == (2, 1)
  assert 1.0 <= r_two["rank_imbalance"]["balanced"] <= r_two["rank_imbalance"]["random"]
  s_two, s_one = (json.loads((d / "summary.json").read_text()) for d in (two, one))
  for key in ("mean_sequence_length", "forward_flops_per_example"):
    assert s_two[key] == pytest.approx(s_one[key], rel=1e-9), key

  got, want = _records(two), _records(one)
  loss = lambda records: {r["step"]: r["loss"] for r in records if "loss" in r}
  # One writer: every step exactly once, as in the single-process folder.
  assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
  assert len(got) == len(want)
  np.testing.assert_allclose([loss(got)[s] for s in range(1, STEPS + 1)],
                             [loss(want)[s] for s in range(1, STEPS + 1)], rtol=1e-5)
  evals = lambda records: [(r["eval_step"], r["click/ne"]) for r in records if "eval_step" in r]
  assert [s for s, _ in evals(got)] == [4]
  np.testing.assert_allclose([ne for _, ne in evals(got)], [ne for _, ne in evals(want)], rtol=1e-5)

  s_got = json.loads((two / "summary.json").read_text())
  s_want = json.loads((one / "summary.json").read_text())
  assert s_got["steps"] == STEPS
  for task in s_want["tasks"]:
    np.testing.assert_allclose(s_got["tasks"][task]["eval_ne"], s_want["tasks"][task]["eval_ne"],
                               rtol=1e-5, equal_nan=True)
  assert np.isfinite(s_got["tasks"]["click"]["eval_ne"])
  # The label counts behind the summary (base rates) are the whole step's: each process counted its own rows.
  for task, numbers in s_want["tasks"].items():
    for key, value in numbers.items():
      if isinstance(value, (int, float)):
        np.testing.assert_allclose(s_got["tasks"][task][key], value, rtol=1e-5, equal_nan=True, err_msg=f"{task}.{key}")

  # Both processes took part in every save (orbax commits a step only once all of them have written).
  assert sorted(os.listdir(two / "checkpoints")) == ["4", "8"]


@pytest.mark.parametrize("setup, match", [
    (ProcessSetup(coordinator="localhost:1234"), "needs the number of processes"),
    (ProcessSetup(coordinator="localhost:1234", num_processes=2), "process_id=None"),
    (ProcessSetup(num_processes=2, process_id=0), "without a coordinator"),
    (ProcessSetup(coordinator="localhost", num_processes=2, process_id=0), "host:port"),
    (ProcessSetup(coordinator="localhost:1234", num_processes=2, process_id=2), r"in \[0, 2\)"),
    (ProcessSetup(cpu_devices=0), "cpu_devices must be >= 1"),
])
def test_setup_rejects_flags_that_do_not_describe_one_run(monkeypatch, setup, match):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(ValueError, match=match):
    distributed.setup(setup)


def test_setup_names_the_missing_environment_variables(monkeypatch):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
    distributed.setup(ProcessSetup.from_env())


def test_setup_warns_when_xla_flags_override_the_device_count(monkeypatch):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  # Single-process and the count already forced: setup changes no jax setting here.
  with pytest.warns(UserWarning, match=r"8 CPU devices; cpu_devices=4 \(--local-devices\) is ignored"):
    distributed.setup(ProcessSetup(cpu_devices=4))


def test_child_flags_replace_only_the_device_count():
  flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_dump_to=/tmp/d"
  assert distributed.cpu_device_flags(flags, 1) == ("--xla_force_host_platform_device_count=1 "
                                                    "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/d")
  assert distributed.cpu_device_flags(flags) == "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/d"
  assert distributed.cpu_device_flags(None, 4) == "--xla_force_host_platform_device_count=4"
  assert distributed.cpu_device_flags("--xla_force_host_platform_device_count=16") == ""
