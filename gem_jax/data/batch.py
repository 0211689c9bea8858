"""The two data layouts between a data source and the model.

`Examples` (host, numpy) is what sources produce: n examples, struct-of-arrays, variable-length parts as
flat values + per-example lengths, so blocks can be sliced and concatenated cheaply.
`Batch` (a pytree; numpy on the host, jax arrays on device) is what the model eats: static shapes,
jagged parts as `Jagged` with a capacity taken from a small set of buckets.

Letters: B examples in a batch, T jagged token capacity, F history token fields (spec.sequence.fields),
K tasks (spec.tasks), G dense feature width (spec.dense_dim).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from gem_jax.jagged import Jagged


@dataclasses.dataclass
class Examples:
  """n host-side examples laid out by a FeatureSpec.

  sparse:            single-hot ids, name -> (n,) int
  multi_hot:         name -> (values (sum of lengths,) int, lengths (n,) int)
  dense_nxG:         float32
  history:           (values (sum of lengths, F) int, lengths (n,) int), chronological, most recent last
  domain_n:          int
  labels_nxK:        float32 in {0, 1}
  label_mask_nxK:    float32, 1 where the label is defined (conversion only on clicks)
  planted_logits_nxK: the ground-truth logits of a synthetic source (NaN when unknown, e.g. real data)
  """
  sparse: dict[str, np.ndarray]
  multi_hot: dict[str, tuple[np.ndarray, np.ndarray]]
  dense_nxG: np.ndarray
  history: tuple[np.ndarray, np.ndarray]
  domain_n: np.ndarray
  labels_nxK: np.ndarray
  label_mask_nxK: np.ndarray
  planted_logits_nxK: np.ndarray

  def __len__(self) -> int:
    return int(self.domain_n.shape[0])

  def slice(self, start: int, stop: int) -> "Examples":
    """Examples [start, stop)."""
    def cut(values, lengths):
      ends = np.cumsum(lengths)
      lo = int(ends[start - 1]) if start > 0 else 0
      hi = int(ends[stop - 1]) if stop > 0 else 0
      return values[lo:hi], lengths[start:stop]
    return Examples(
        sparse={k: v[start:stop] for k, v in self.sparse.items()},
        multi_hot={k: cut(*v) for k, v in self.multi_hot.items()},
        dense_nxG=self.dense_nxG[start:stop],
        history=cut(*self.history),
        domain_n=self.domain_n[start:stop],
        labels_nxK=self.labels_nxK[start:stop],
        label_mask_nxK=self.label_mask_nxK[start:stop],
        planted_logits_nxK=self.planted_logits_nxK[start:stop])

  @staticmethod
  def concat(parts: list["Examples"]) -> "Examples":
    if len(parts) == 1:
      return parts[0]
    first = parts[0]
    cat = lambda xs: np.concatenate(xs, axis=0)
    return Examples(
        sparse={k: cat([p.sparse[k] for p in parts]) for k in first.sparse},
        multi_hot={k: (cat([p.multi_hot[k][0] for p in parts]), cat([p.multi_hot[k][1] for p in parts]))
                   for k in first.multi_hot},
        dense_nxG=cat([p.dense_nxG for p in parts]),
        history=(cat([p.history[0] for p in parts]), cat([p.history[1] for p in parts])),
        domain_n=cat([p.domain_n for p in parts]),
        labels_nxK=cat([p.labels_nxK for p in parts]),
        label_mask_nxK=cat([p.label_mask_nxK for p in parts]),
        planted_logits_nxK=cat([p.planted_logits_nxK for p in parts]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
  """A model batch with static shapes (see the module docstring for the letters)."""
  sparse: dict[str, Any]          # name -> ids_B int32 (single-hot features)
  multi_hot: dict[str, Jagged]    # name -> Jagged(ids_T int32, offsets_Bp1)
  dense_BxG: Any                  # float32
  history: Jagged                 # Jagged(ids_TxF int32, offsets_Bp1)
  domain_B: Any                   # int32
  labels_BxK: Any                 # float32
  label_mask_BxK: Any             # float32
  example_mask_B: Any             # float32, 0 on rows that only pad the batch to its static size
  planted_logits_BxK: Any         # float32, NaN when unknown

  @property
  def batch_size(self) -> int:
    return int(self.domain_B.shape[0])
