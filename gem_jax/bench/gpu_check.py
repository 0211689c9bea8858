"""The prepared GPU check: every GPU-only claim of gem-jax measured by one command in a few minutes.

    PYTHONPATH=$PWD python3 experiments/gpu_check.py --wheels .whl --out DIR        # on the GPU machine
    python experiments/gpu_check.py --rehearse --out DIR                             # CPU rehearsal (CI)

Each section (gpu_sections.SECTIONS: environment, correctness, kernel_speed, fp8_speed, train_step,
sparse_scaling) runs in its own subprocess with a time limit, so a kernel that hangs, crashes the process
or poisons the CUDA context costs that section only. A section writes its records to the work folder as it
goes; after every section this runner merges what exists into DIR/gpu_check.json and DIR/gpu_check.md, so
a run stopped at any point leaves every finished section (and the records of the one cut short). A section
is skipped, with a note, when less of the total budget is left than it needs to say anything.

The rehearsal runs the same sections and code with tiny shapes, interpret-mode Pallas and the CPU backend,
and writes the same keys (tests/test_gpu_check.py).

Wheels (--wheels DIR): what the GPU image lacks is installed offline from DIR with pip --no-index --no-deps
into the work folder: every wheel except jax_triton into one target, and each jax_triton wheel into a target
of its own, probed in a subprocess (import plus a one-line Triton kernel); the first that works is used.
DIR is made here by `--prepare-wheels DIR` (pip download for CPython 3.12 / manylinux x86_64).

This module never imports jax: a broken accelerator stack must not take the runner down with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import os
import subprocess
import sys
import time

from gem_jax.bench import gpu_report
from gem_jax.parallel import distributed

# What the GPU image lacks (the device tool's package list, 2026-11-17): grain (+ array-record,
# portpicker) and jax-triton. jax-triton 0.4.x wants triton >= 3.7 and 0.3.1 a GPU jaxlib at import; the
# image has triton 3.6, so both are carried and probed there.
WHEELS = ("grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0")
JAX_TRITON_WHEELS = ("jax-triton==0.4.1", "jax-triton==0.3.1")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")
GPU_BUDGET_S = 480.0   # the sections' limits (470 s) and the wheels' install; run it with timeout_s=560
REHEARSAL_BUDGET_S = 175.0

_PROBE = """
import json
import jax
import jax_triton as jt
if jax.default_backend() != "gpu":
  print(json.dumps({"ran_kernel": False}))
  raise SystemExit(0)
import jax.numpy as jnp
import triton
import triton.language as tl
@triton.jit
def add_one(x_ptr, out_ptr, N: tl.constexpr):
  i = tl.arange(0, N)
  tl.store(out_ptr + i, tl.load(x_ptr + i) + 1.0)
x = jnp.arange(16, dtype=jnp.float32)
out = jt.triton_call(x, kernel=add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), N=16)
assert bool(jnp.all(out == x + 1)), f"wrong result {out}"
print(json.dumps({"ran_kernel": True}))
"""


@dataclasses.dataclass(frozen=True)
class Section:
  name: str
  limit_s: float            # the subprocess is killed after this long (GPU run)
  min_s: float              # skipped when less of the budget is left
  rehearse_limit_s: float


# The train step (per-device memory and MFU of `base`) right after correctness: it needs the most time, and
# a slow install or jax-triton probe takes what is left from the speed sections instead.
SECTIONS = (
    Section("environment", 30, 10, 30),
    Section("correctness", 90, 30, 50),
    Section("train_step", 200, 60, 90),
    Section("kernel_speed", 100, 30, 30),
    Section("fp8_speed", 40, 15, 25),
    Section("sparse_scaling", 10, 3, 10),
)


def prepare_wheels(folder: str) -> list[str]:
  """Downloads the wheels the GPU image lacks (CPython 3.12, manylinux x86_64) into folder/."""
  os.makedirs(folder, exist_ok=True)
  plats = [a for p in PLATFORMS for a in ("--platform", p)]
  for req in WHEELS + JAX_TRITON_WHEELS:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plats, "-d", folder, req], check=True)
  return sorted(os.listdir(folder))


def _pip_target(wheels: list[str], target: str) -> None:
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                  "--no-cache-dir", "--upgrade", "--target", target, *wheels], check=True)


def _version_key(wheel: str) -> tuple:
  """(0, 4, 1) of ".../jax_triton-0.4.1-py3-none-any.whl" (numeric parts; others sort as -1)."""
  version = os.path.basename(wheel).split("-")[1]
  return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def install_wheels(folder: str, work: str, env: dict) -> dict:
  """Installs folder's wheels into work/site (and each jax_triton into its own target), probes the
  jax_triton candidates in order; -> {"site", "jax_triton": chosen target or None, "probes": [...]}."""
  wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
  common = [w for w in wheels if not os.path.basename(w).startswith("jax_triton-")]
  site = os.path.join(work, "site")
  info = {"wheels": [os.path.basename(w) for w in wheels], "site": site, "jax_triton": None, "probes": []}
  if common:
    _pip_target(common, site)
  candidates = sorted((w for w in wheels if os.path.basename(w).startswith("jax_triton-")), key=_version_key,
                      reverse=True)  # newest first
  for wheel in candidates:
    target = os.path.join(work, "site-" + os.path.basename(wheel).split("-py3")[0])
    _pip_target([wheel], target)
    probe_env = dict(env, PYTHONPATH=os.pathsep.join([target, site, env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=probe_env, capture_output=True, text=True,
                          timeout=120)
    probe = {"wheel": os.path.basename(wheel), "ok": proc.returncode == 0,
             "output": (proc.stdout + proc.stderr)[-600:]}
    info["probes"].append(probe)
    if probe["ok"]:
      info["jax_triton"] = target
      break
  return info


def section_env(rehearse: bool, pythonpath: list[str], work: str) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in pythonpath + [env.get("PYTHONPATH", "")] if p)
  env["PYTHONUNBUFFERED"] = "1"
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(work, "jax_cache"))
  if rehearse:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = distributed.cpu_device_flags(env.get("XLA_FLAGS"))  # one CPU device, for cpu_1
    env["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels decorate as interpreted
  return env


def run(out_dir: str, *, rehearse: bool = False, wheels: str | None = None, work: str | None = None,
        budget_s: float | None = None, sections: tuple[str, ...] | None = None) -> dict:
  """Runs the check; -> the gpu_check.json dict (also written to out_dir, with gpu_check.md)."""
  unknown = sorted(set(sections or ()) - {s.name for s in SECTIONS})
  if unknown:   # a typo would otherwise run nothing of it, on a GPU lent for minutes
    raise ValueError(f"gpu_check: unknown sections {unknown}; known: {[s.name for s in SECTIONS]}")
  t0 = time.time()
  budget = budget_s or (REHEARSAL_BUDGET_S if rehearse else GPU_BUDGET_S)
  os.makedirs(out_dir, exist_ok=True)
  work = work or os.path.join("/tmp", "gem_jax_gpu_check")  # fixed: a rerun reuses its compile cache
  os.makedirs(work, exist_ok=True)
  open(os.path.join(out_dir, "gpu_check.log"), "w").close()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  pythonpath = [root]
  result = {"schema_version": gpu_report.SCHEMA_VERSION, "mode": "rehearsal" if rehearse else "gpu",
            "command": " ".join(sys.argv), "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "budget_s": budget, "elapsed_s": None, "install": None, "sections": {}}
  if wheels:
    try:
      result["install"] = install_wheels(wheels, work, section_env(rehearse, pythonpath, work))
      pythonpath = [p for p in (result["install"]["jax_triton"], result["install"]["site"]) if p] + pythonpath
    except (subprocess.SubprocessError, OSError) as e:
      result["install"] = {"error": f"{type(e).__name__}: {e}"}
  env = section_env(rehearse, pythonpath, work)
  env["GEM_JAX_GPU_CHECK_INSTALL"] = json.dumps(result["install"])
  chosen = [s for s in SECTIONS if sections is None or s.name in sections]
  for s in chosen:
    left = budget - (time.time() - t0)
    limit = min(s.rehearse_limit_s if rehearse else s.limit_s, left)
    if left < s.min_s:
      result["sections"][s.name] = {"status": "skipped", "elapsed_s": 0.0, "limit_s": limit,
                                    "notes": [f"skipped: {left:.0f} s of the {budget:.0f} s budget left, the "
                                              f"section needs at least {s.min_s:.0f} s"],
                                    "result": {}, "records": [], "error": None}
      _write(out_dir, result, t0)
      continue
    result["sections"][s.name] = run_section(s.name, work, env, limit, rehearse,
                                                os.path.join(out_dir, "gpu_check.log"))
    _write(out_dir, result, t0)
  return _write(out_dir, result, t0)


def run_section(name: str, work: str, env: dict, limit: float, rehearse: bool, log_path: str,
                module: str = "gem_jax.bench.gpu_sections") -> dict:
  """Runs `python -m module name` under `limit` seconds; -> the section's entry of gpu_check.json (status ok,
  failed, crashed or timed_out, with whatever records it wrote)."""
  path = os.path.join(work, f"{name}.json")
  if os.path.exists(path):
    os.remove(path)
  cmd = [sys.executable, "-m", module, name, "--work", work,
         "--deadline", str(time.time() + limit * 0.85)] + (["--rehearse"] if rehearse else [])
  print(f"gpu_check: section {name} (limit {limit:.0f} s)", flush=True)
  t = time.time()
  status, error = "ok", None
  with open(log_path, "a") as log:
    log.write(f"==== {name} ({datetime.datetime.now().isoformat(timespec='seconds')}, limit {limit:.0f} s)\n")
    log.flush()
    start = log.tell()
    try:
      proc = subprocess.run(cmd, env=env, timeout=limit, stdout=log, stderr=subprocess.STDOUT)
      if proc.returncode != 0:
        status, error = "crashed", f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
      status, error = "timed_out", f"killed after its {limit:.0f} s limit"
  with open(log_path) as log:
    log.seek(start)
    output = log.read()
  if status == "crashed":
    error += ": " + output[-1500:]
  section = {"notes": [], "result": {}, "records": [], "finished": False}
  if os.path.exists(path):
    with open(path) as f:
      section.update(json.load(f))
  if status == "ok" and not section.get("finished"):
    status, error = "crashed", "the section exited without finishing its records: " + output[-1500:]
  section.pop("finished", None)
  if status == "ok" and section.get("error"):
    status, error = "failed", section["error"]
  section.pop("error", None)
  print(f"gpu_check: {name} {status} in {time.time() - t:.0f} s ({len(section['records'])} records)", flush=True)
  return {"status": status, "elapsed_s": time.time() - t, "limit_s": limit, **section, "error": error}


def _write(out_dir: str, result: dict, t0: float) -> dict:
  result["elapsed_s"] = time.time() - t0
  result["skipped"] = gpu_report.skipped(result)
  for name, text in (("gpu_check.json", json.dumps(result, indent=2, default=float)),
                     ("gpu_check.md", gpu_report.markdown(result))):
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out_dir, name))
  return result
