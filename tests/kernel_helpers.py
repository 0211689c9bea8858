"""Helpers shared by the kernel tests."""

import numpy as np


def max_rel_err(got, want) -> float:
  """max|got - want| / max|want| in f32: the error measure of every kernel acceptance bound."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
