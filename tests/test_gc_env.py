"""GEM_JAX_GC_THRESHOLDS (gem_jax/gc_env.py): the collector's thresholds from the environment, or a clear error."""

import gc
import os
import subprocess
import sys

import pytest

from gem_jax import gc_env


@pytest.fixture
def thresholds(monkeypatch):
  """The collector's thresholds restored after the test; gc.freeze only counted (freezing this session's
  objects midway would keep them, and extension objects among them, alive to the end)."""
  saved = gc.get_threshold()
  freezes = []
  monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
  yield freezes
  gc.set_threshold(*saved)


def test_the_variable_sets_the_thresholds_and_unset_leaves_them(thresholds):
  gc.set_threshold(700, 10, 10)
  assert gc_env.apply({}) is None and gc_env.apply({gc_env.VAR: " "}) is None
  assert gc.get_threshold() == (700, 10, 10)
  assert not thresholds
  assert gc_env.apply({gc_env.VAR: "12345,6,78"}) == (12345, 6, 78)
  assert gc.get_threshold() == (12345, 6, 78) and thresholds == [1]
  assert gc_env.apply({gc_env.VAR: "5000"}) == (5000,) and gc.get_threshold() == (5000, 6, 78)


@pytest.mark.parametrize("text", ["fast", "1,2,3,4", "-1", "100,,5"])
def test_a_bad_value_is_refused_naming_the_variable(thresholds, text):
  before = gc.get_threshold()
  with pytest.raises(ValueError, match=f"GEM_JAX_GC_THRESHOLDS={text!r}: expected one to three"):
    gc_env.apply({gc_env.VAR: text})
  assert gc.get_threshold() == before


def test_a_process_the_suite_starts_gets_the_suite_s_thresholds():
  """conftest.py sets the variable for this session; a child that imports gem_jax runs with it."""
  assert os.environ[gc_env.VAR]
  out = subprocess.run([sys.executable, "-c", "import gem_jax, gc; print(gem_jax.GC_THRESHOLDS, gc.get_threshold())"],
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  want = tuple(int(v) for v in os.environ[gc_env.VAR].split(","))
  assert out.stdout.strip() == f"{want} {want}"
