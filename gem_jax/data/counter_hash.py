"""Counter-based randomness for the synthetic stream: every hidden attribute of an id is a pure function of
(seed, attribute name, id), so a table of 10^9 rows costs nothing and any block can be regenerated alone.

  hash_key(seed, salt)    a uint64 key per (seed, attribute)
  hash_ids(key, *ids)     splitmix64 of (key, ids...), broadcasting the id arrays
  uniform(h), normal(h)   floats from a hash: U[0, 1) from its top 53 bits, N(0, 1) by Box-Muller
  zipf_rank(u, n, s)      a bounded Zipf(s) rank in [0, n) from a uniform
  Scramble.make(n, key)   an affine bijection of [0, n) and its inverse
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_U64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(z: np.ndarray) -> np.ndarray:
  """The splitmix64 finalizer: a bijection of uint64 whose output bits all depend on every input bit."""
  z = z ^ (z >> np.uint64(30))
  z *= _M1
  z ^= z >> np.uint64(27)
  z *= _M2
  return z ^ (z >> np.uint64(31))


def hash_key(seed: int, salt: str) -> np.uint64:
  """A per-(seed, attribute) hash key, in Python ints so that numpy scalars never warn on wrap-around."""
  z = 0
  raw = salt.encode()
  for v in [seed] + [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]:
    z = (z ^ v) + 0x9E3779B97F4A7C15 & _U64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _U64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _U64
    z ^= z >> 31
  return np.uint64(z)


def hash_ids(key: np.uint64, *ids) -> np.ndarray:
  """uint64 hash of (key, ids...), broadcasting the id arrays."""
  h = np.asarray(key, np.uint64)
  for a in ids:
    h = mix(np.asarray(a).astype(np.uint64) * _GOLDEN + h)
  return h


def uniform(h: np.ndarray) -> np.ndarray:
  return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def normal(h: np.ndarray) -> np.ndarray:
  """Box-Muller on the two 32-bit halves of one hash."""
  u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
  u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * 2.0**-32
  return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def zipf_rank(u: np.ndarray, n, s: float) -> np.ndarray:
  """Bounded Zipf(s) rank in [0, n) by inverting the continuous CDF of x^-s on [1, n + 1)."""
  n = np.asarray(n, np.float64)
  if abs(s - 1.0) < 1e-9:
    x = np.exp(u * np.log1p(n))
  else:
    t = 1.0 - s
    x = (1.0 + u * ((n + 1.0)**t - 1.0))**(1.0 / t)
  # floor(x) - 1 <= n - 1 except where float rounding lands exactly on n + 1.
  return np.minimum(x.astype(np.int64) - 1, n.astype(np.int64) - 1)


@dataclasses.dataclass(frozen=True)
class Scramble:
  """An affine bijection of [0, n): spreads popular ranks over the id space without a table."""
  n: int
  a: int
  b: int
  a_inv: int

  @staticmethod
  def make(n: int, key: np.uint64) -> "Scramble":
    a = int(key) % n | 1
    while math.gcd(a, n) != 1:
      a += 2
    a %= n
    return Scramble(n, a, (int(key) >> 32) % n, pow(a, -1, n) if n > 1 else 0)

  def __call__(self, x: np.ndarray) -> np.ndarray:  # products stay < 2**62 since n < 2**31
    y = (x.astype(np.uint64) * np.uint64(self.a) + np.uint64(self.b)) % np.uint64(self.n)
    return y.astype(np.int64)

  def inverse(self, y: np.ndarray) -> np.ndarray:
    d = (y.astype(np.uint64) + np.uint64(self.n - self.b)) % np.uint64(self.n)
    return (d * np.uint64(self.a_inv) % np.uint64(self.n)).astype(np.int64)
