"""gem_jax/malloc_env.py: a large buffer freed and allocated again (what an XLA:CPU step does with its
temporaries) is not faulted in again page by page once gem_jax has set the allocator, whatever its size and
in a jitted program too; with GEM_JAX_MALLOC=0 it is, which is what the settings are for."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import ctypes, os, resource
import gem_jax

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
SIZE = int(os.environ["PROBE_MIB"]) << 20

def churn(n):
  for _ in range(n):
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)

churn(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(3)
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(gem_jax.MALLOC_ENV, (after - before) / 3 / (SIZE // 4096))
"""

# A jitted program whose output (32,768 x 1,024 float32, 128 MiB) is larger than a worker thread's heap.
JITTED = r"""
import resource, statistics
import gem_jax
import jax, jax.numpy as jnp

f = jax.jit(lambda a, b: jnp.tanh(a @ b))
a, b = jnp.ones((32768, 64)), jnp.ones((64, 1024))
f(a, b).block_until_ready()
faults = []
for _ in range(5):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(a, b).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The median call: the heap still grows on a call or two (when a freed output has not been given back yet).
print(gem_jax.MALLOC_ENV, statistics.median(faults) / (128 << 20 >> 12))
"""


def _probe(program=PROBE, **env):
  """(apply()'s state, page faults per 4 KiB page of the buffer per round) from a fresh process: without the
  huge-page tunable (this process's import of gem_jax exported it), so 4 KiB pages, one fault each, and
  without an explicit dispatch setting."""
  base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GEM_JAX_ASYNC_DISPATCH")}
  out = subprocess.run([sys.executable, "-c", program], env=dict(base, JAX_PLATFORMS="cpu", **env),
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  state, faults_per_page = out.stdout.split()
  return state, float(faults_per_page)


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator settings are glibc's")


def _huge_pages_always() -> bool:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return "[always]" in f.read()
  except OSError:
    return False


# The probes count one fault per 4 KiB page of a fresh mapping; a kernel that gives every mapping 2 MiB pages
# faults 512 times less and the counts no longer tell the settings apart.
small_pages = pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages are 'always' on this kernel")


@linux_only
@small_pages
@pytest.mark.parametrize("mib", [96, 1280])   # under and over the 1 GiB trim threshold the settings once had
def test_a_freed_large_buffer_is_reused_without_page_faults(mib):
  state, faults = _probe(PROBE_MIB=str(mib))
  if state == "unavailable":
    pytest.skip("this C library has no mallopt")
  assert state == "set" and faults < 0.05, (state, faults)
  if mib < 1024:   # (glibc's defaults map the larger one on its own as well)
    state, faults = _probe(PROBE_MIB=str(mib), GEM_JAX_MALLOC="0")
    assert state == "off" and faults > 0.5, (state, faults)   # glibc's defaults: every page, every time


@linux_only
@small_pages
def test_a_jitted_programs_large_buffers_are_reused_without_page_faults():
  """The program runs on the calling thread (no async dispatch), whose heap keeps its buffers; on jax's worker
  thread a buffer over 64 MiB is a mapping of its own, faulted in every call."""
  state, faults = _probe(JITTED)
  if state == "unavailable":
    pytest.skip("this C library has no mallopt")
  assert state == "set" and faults < 0.05, (state, faults)
  state, faults = _probe(JITTED, GEM_JAX_ASYNC_DISPATCH="1")   # the heap settings alone
  assert state == "set" and faults > 0.5, (state, faults)



RELAUNCH = r"""
import os, sys
from gem_jax import malloc_env
print("start", malloc_env.started_with_huge_pages(), sys.argv[1:], flush=True)
malloc_env.relaunch_with_huge_pages()
print("run", malloc_env.started_with_huge_pages(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:])
"""


@linux_only
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
