"""Test setup: 8 virtual CPU devices (set before jax is imported), loud numerics, shared fixtures."""

import os

# Compile fast, run slower: the suite compiles thousands of programs and runs most of them a few times, so
# compiling is most of its time. Backend optimization level 0 skips LLVM's optimization passes; without
# XLA:CPU's fusion emitters (its MLIR code generator for fusions) a compile takes well under half as long
# again. `python experiments/compile_flags.py` (tiny's train step, fresh processes): 15.2 s to compile at
# XLA's defaults, 11.1 s at level 0, 4.3 s at level 0 without fusion emitters, for steps 3.4x and 5x slower
# than the defaults' and the same loss to 2e-7 after 10 steps. Every subprocess a test starts keeps these flags (run_helpers.child_env, and
# the library's launchers through parallel/distributed.cpu_device_flags), so runs a test compares are
# compiled alike; a test of an execution-bound user command may run it with XLA's defaults instead.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Python's collector runs far less often in this process and in every process it starts (gem_jax/gc_env.py:
# the suite takes about 15% less CPU).
os.environ.setdefault("GEM_JAX_GC_THRESHOLDS", "100000,50,1000")

import jax  # noqa: E402
import gem_jax  # noqa: E402,F401  (applies GEM_JAX_GC_THRESHOLDS now, before the first test)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _shared_fixtures(item) -> list[str]:
  """The module- and session-scoped fixtures of this suite (not pytest's own) that `item` uses, as keys
  that name one instance: a module fixture per module, a session fixture once."""
  info = getattr(item, "_fixtureinfo", None)
  out = []
  for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
    d = defs[-1]
    if d.scope not in ("module", "session") or name == "compile_cache":
      continue
    if not str(getattr(d.func, "__module__", "")).startswith("tests"):
      continue
    out.append(f"{item.module.__name__.rsplit('.', 1)[-1]}.{name}" if d.scope == "module" else name)
  return out


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks (--dist loadgroup, pyproject.toml)
def pytest_collection_modifyitems(config, items):
  """Work units for `-n 2` on a 2-core machine, where a fixture built twice or a long test started last
  costs wall time: tests that share an expensive fixture (module- or session-scoped, e.g. test_spmd's
  cpu_8 setup, the session's tiny_cpu8_run) form one xdist group, so one worker builds it once and no
  worker waits on the other's lock; and units holding a slow test go out first, grouped units next, so
  the longest work starts early and short tests fill the end. Without -n the order is the same and each
  group's tests stay contiguous, so a module fixture is still built once."""
  parent: dict[str, str] = {}

  def find(k: str) -> str:
    while parent.setdefault(k, k) != k:
      parent[k] = parent[parent[k]]
      k = parent[k]
    return k

  keys = [_shared_fixtures(item) for item in items]
  for ks in keys:
    for k in ks[1:]:
      parent[find(k)] = find(ks[0])
  unit = [find(ks[0]) if ks else item.nodeid for item, ks in zip(items, keys)]
  first, slow = {}, set()
  for i, (item, u) in enumerate(zip(items, unit)):
    first.setdefault(u, i)
    if item.get_closest_marker("slow"):
      slow.add(u)
  grouped = {u for item, u, ks in zip(items, unit, keys) if ks}
  for item, u in zip(items, unit):
    if u in grouped:
      item.add_marker(pytest.mark.xdist_group(u))
  rank = lambda iu: (0 if iu[1][1] in slow else 1 if iu[1][1] in grouped else 2, first[iu[1][1]], iu[0])
  order = sorted(enumerate(zip(items, unit)), key=rank)
  items[:] = [item for _, (item, _) in order]


def pytest_configure(config):
  """Stops a `--dist loadgroup` run that cannot group. xdist's workers tag a grouped test by rewriting
  `item._nodeid` to "<id>@<group>", and the scheduler groups by that suffix; a pytest whose Node.nodeid reads
  another attribute (9.2, with xdist 3.8) silently splits every group, so each worker rebuilds the shared
  fixtures (minutes of CI) with nothing saying why."""
  if getattr(config.option, "dist", "no") != "loadgroup":
    return
  import types
  probe = types.SimpleNamespace(_nodeid="t.py::t@group", _id="t.py::t")
  try:
    tagged = pytest.Item.nodeid.fget(probe) == probe._nodeid
  except Exception:
    tagged = False
  if not tagged:
    raise pytest.UsageError(f"pytest {pytest.__version__} does not keep the test ids pytest-xdist rewrites, so "
                            f"--dist loadgroup would split every group: install the pytest that pyproject.toml's "
                            f"test extra pins (pip install -e '.[test]')")


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
  """One persistent compilation cache for the whole test session (unless one is set already): a program
  compiled again (a new jit of the same computation in any test, on any xdist worker) is loaded instead of
  compiled. The folder is shared by the session's workers (the parent of each worker's base temp dir) and
  starts empty each session. Every program is stored, however fast its compile; subprocesses a test
  starts get the same cache through the JAX_* environment variables."""
  from jax.experimental.compilation_cache import compilation_cache
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  folder = root / "jax_compile_cache"
  folder.mkdir(exist_ok=True)
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", str(folder))
  # Every program, however small: most of a tiny run's compiles are eager ops of well under a second each,
  # and the same ones recur in most tests.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=str(folder), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  try:
    yield
  finally:
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
      os.environ.pop(name, None)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def tiny_cpu8_run(tmp_path_factory):
  """(config, run folder, console log) of run_helpers.tiny_cpu8_config() trained once per session, with its
  efficiency report. The first xdist worker that asks trains it under a file lock in the session's shared
  folder; a worker that asks later (or meanwhile) waits for the lock and reads the same folder. The run
  folder's count_only_traces.json lists the batch shape of every count-only trace of the task (what
  tests/test_sparse_engine.py checks), recorded by a wrapper that changes nothing else."""
  import contextlib
  import fcntl
  import io
  import json

  import jax

  from gem_jax import runtime
  from gem_jax.run import tasks
  from gem_jax.train import jobs
  from tests import run_helpers
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  cfg = run_helpers.tiny_cpu8_config()
  out, log_path, done = root / "tiny_cpu8_run", root / "tiny_cpu8_run.log", root / "tiny_cpu8_run.done"
  with open(root / "tiny_cpu8_run.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      log, seen, original = io.StringIO(), [], tasks.AdsMultiTask.sums

      def sums(self, model, batch, rng):
        if runtime.current().count_only:
          seen.append([[list(x.shape), str(x.dtype)] for x in jax.tree_util.tree_leaves(batch)])
        return original(self, model, batch, rng)

      with contextlib.redirect_stdout(log), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks.AdsMultiTask, "sums", sums)
        jobs.train_config(cfg, str(out), progress=False)
      log_path.write_text(log.getvalue())
      (out / "count_only_traces.json").write_text(json.dumps(seen))
      done.touch()
  return cfg, out, log_path


@pytest.fixture(scope="session")
def movielens_prepared(tmp_path_factory):
  """The folder experiments/prepare_movielens.py writes, prepared once per session from the shared data
  (skips, naming the path it looked at, where ml-100k is absent)."""
  import fcntl

  from gem_jax.data import movielens
  from tests.data_helpers import shared_data_root
  source = os.path.join(shared_data_root(), "ml-100k", "u.data")
  if not os.path.exists(source):
    pytest.skip(f"MovieLens-100K absent: looked for {source} (set GEM_JAX_DATA_DIR to the shared data root)")
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  out = root / "movielens-100k"
  with open(root / "movielens.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "prepare.json").exists():
      movielens.prepare(shared_data_root(), str(out))
  return str(out)
