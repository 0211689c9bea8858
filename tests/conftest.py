"""Test setup: 8 virtual CPU devices (set before jax is imported), loud numerics, shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """JAX's persistent compilation cache while a module that asks for it runs (unless one is set already):
  a program compiled again (a new jit of the same computation, in this module or another one using this
  fixture on the same worker, which uses the same folder) is loaded instead of compiled. The folder lives
  in this session's pytest temp dir, so every session starts empty. Only programs that took >= 1 s to compile
  are stored (jax_persistent_cache_min_compile_time_secs)."""
  from jax.experimental.compilation_cache import compilation_cache
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  compilation_cache.reset_cache()
  folder = tmp_path_factory.getbasetemp() / "jax_compile_cache"  # per xdist worker
  folder.mkdir(exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  try:
    yield
  finally:
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
