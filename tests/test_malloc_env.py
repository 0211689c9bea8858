"""gem_jax/malloc_env.py: a large buffer freed and allocated again (what an XLA:CPU step does with its
temporaries) is not faulted in again page by page once gem_jax has set the allocator; with GEM_JAX_MALLOC=0
it is, which is what the settings are for."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import ctypes, resource
import gem_jax

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = 96 << 20

def churn(n):
  for _ in range(n):
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)

churn(2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(10)
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(gem_jax.MALLOC_ENV, (after - before) / 10 / (SIZE // 4096))
"""


def _probe(**env):
  # Without the huge-page tunable (this process's import of gem_jax exported it): 4 KiB pages, one fault each.
  base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  out = subprocess.run([sys.executable, "-c", PROBE], env=dict(base, JAX_PLATFORMS="cpu", **env),
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  state, faults_per_page = out.stdout.split()
  return state, float(faults_per_page)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator settings are glibc's (Linux)")
def test_a_freed_large_buffer_is_reused_without_page_faults():
  state, faults = _probe()
  if state == "unavailable":
    pytest.skip("this C library has no mallopt")
  assert state == "set" and faults < 0.05, (state, faults)
  state, faults = _probe(GEM_JAX_MALLOC="0")
  assert state == "off" and faults > 0.5, (state, faults)   # glibc's defaults: every page, every time



RELAUNCH = r"""
import os, sys
from gem_jax import malloc_env
print("start", malloc_env.started_with_huge_pages(), sys.argv[1:], flush=True)
malloc_env.relaunch_with_huge_pages()
print("run", malloc_env.started_with_huge_pages(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator settings are glibc's (Linux)")
def test_a_script_started_without_the_huge_page_tunable_runs_again_with_it(tmp_path):
  """glibc reads GLIBC_TUNABLES only at a process's start: the script starts over once, with the tunable added
  to what was there and its arguments kept; with the settings off it runs as it was started."""
  script = tmp_path / "script.py"
  script.write_text(RELAUNCH)
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  run = lambda **extra: subprocess.run([sys.executable, "-u", str(script), "a b", "--x"],
                                       env=dict(env, **extra), capture_output=True, text=True, cwd=ROOT, timeout=120)
  out = run(GLIBC_TUNABLES="glibc.malloc.check=0")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == [
      "start False ['a b', '--x']", "start True ['a b', '--x']",
      "run True glibc.malloc.check=0:glibc.malloc.hugetlb=1 ['a b', '--x']"], out.stdout
  out = run(GEM_JAX_MALLOC="0")
  assert out.stdout.splitlines() == ["start False ['a b', '--x']", "run False None ['a b', '--x']"], out.stdout
