"""The input pipeline: host `Examples` blocks -> validated, statically shaped `Batch`es, through grain.

  source.block(index, size) -> Examples --validate_examples--> pack --> Batch (numpy)

A source is any object with `.spec` (a FeatureSpec) and `.block(index: int, size: int) -> Examples` that
is deterministic in (index, size); SyntheticAdsStream is one. Record i of the training stream is block
`start_index + i`, so the stream position is one integer and grain's iterator state (JSON) is all a
checkpoint needs to resume exactly where it stopped.

Static shapes: every batch has exactly `batch_size` rows (a short block is padded with example_mask 0
rows); the history capacity T is the smallest configured bucket that holds the batch's tokens,
so jit compiles once per bucket; a multi-hot feature always has capacity batch_size * max_ids.

Letters: B batch size, T history token capacity, F history fields, G dense width, K tasks.

This module never clips, truncates or drops data: input that breaks the spec raises
BatchValidationError, and a batch that does not fit its capacity raises too.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
from typing import Iterable, Protocol, Sequence

import grain
import numpy as np

from gem_jax.data.batch import Batch, Examples
from gem_jax.data.spec import FeatureSpec, SparseFeature
from gem_jax.data.validate import BatchValidationError, validate_examples
from gem_jax.jagged import Jagged, validate_offsets

_INT32_MAX = np.iinfo(np.int32).max


class BlockSource(Protocol):
  """What the pipeline reads: deterministic blocks of examples."""
  spec: FeatureSpec

  def block(self, index: int, size: int) -> Examples:
    ...


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How blocks become batches.

  History buckets: bucket i holds ceil(history_bucket_fractions[i] * B * max_len) tokens, rounded up to a
  multiple of `bucket_multiple` (kernel tiles like multiples of 128). The last fraction is 1, so the last
  bucket holds the fullest possible batch and every batch fits. The default fractions are geometric
  (quarter octaves from 1/32 to 1), so a batch wastes at most ~16% of its capacity (plus rounding)
  whatever the mean history length; since a batch's token count concentrates around B * mean length,
  only one or two buckets (one compile each) are hit in practice.
  """
  batch_size: int
  history_bucket_fractions: tuple[float, ...] = tuple(2.0**(-k / 4) for k in range(20, -1, -1))
  bucket_multiple: int = 128
  read_threads: int = 4  # grain worker threads that read and pack blocks
  prefetch_buffer_size: int = 8  # packed batches grain keeps ready ahead of the consumer

  def __post_init__(self):
    # Sizes are ints: a float batch size or bucket multiple fails only inside numpy's shapes, far from here.
    for name, low in (("batch_size", 1), ("bucket_multiple", 1), ("read_threads", 0), ("prefetch_buffer_size", 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"data.pipeline.{name} must be an integer >= {low}, got {value!r}")
    fr = self.history_bucket_fractions
    is_number = lambda f: not isinstance(f, bool) and isinstance(f, (int, float, np.number))
    if (not fr or not all(map(is_number, fr)) or any(not 0 < f <= 1 for f in fr) or list(fr) != sorted(fr)
        or fr[-1] != 1.0):
      raise ValueError(f"data.pipeline.history_bucket_fractions must increase within (0, 1] and end at 1.0, "
                       f"got {fr!r}")

  def history_buckets(self, spec: FeatureSpec) -> tuple[int, ...]:
    """The allowed history capacities T, increasing; the last one holds B * max_len tokens."""
    full = self.batch_size * spec.sequence.max_len
    m = self.bucket_multiple
    caps = {max(m, _round_up(math.ceil(f * full), m)) for f in self.history_bucket_fractions}
    return tuple(sorted(caps))

  def multi_hot_capacity(self, feature: SparseFeature) -> int:
    return self.batch_size * feature.max_ids


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pick_bucket(num_tokens: int, buckets: Sequence[int]) -> int:
  """The smallest bucket holding num_tokens."""
  for cap in buckets:
    if num_tokens <= cap:
      return cap
  raise BatchValidationError(f"history: {num_tokens} tokens exceed the largest bucket {buckets[-1]}")


def pack(ex: Examples, spec: FeatureSpec, cfg: PipelineConfig) -> Batch:
  """Validates n <= batch_size examples and lays them out as one static-shape numpy Batch."""
  n, B = len(ex), cfg.batch_size
  if n > B:
    raise BatchValidationError(f"a block of {n} examples does not fit batch_size {B}")
  too_big = [t.name for t in spec.tables if t.vocab_size > _INT32_MAX]
  if too_big:
    raise BatchValidationError(f"tables {too_big} have more rows than int32 ids can address")
  validate_examples(ex, spec)

  def rows(x: np.ndarray, dtype, fill=0) -> np.ndarray:
    """x (n, ...) -> (B, ...) in dtype; rows n..B-1 are `fill`."""
    out = np.full((B,) + x.shape[1:], fill, dtype)
    out[:n] = x
    return out

  def jagged(values: np.ndarray, lengths: np.ndarray, capacity: int, name: str) -> Jagged:
    values_T = np.zeros((capacity,) + values.shape[1:], np.int32)
    values_T[:values.shape[0]] = values
    offsets_Bp1 = np.zeros((B + 1,), np.int32)
    np.cumsum(lengths, out=offsets_Bp1[1:n + 1])
    offsets_Bp1[n + 1:] = offsets_Bp1[n]
    try:
      validate_offsets(offsets_Bp1, capacity, name)
    except ValueError as e:
      raise BatchValidationError(str(e)) from e
    return Jagged(values_T, offsets_Bp1)

  hist_values, hist_lengths = ex.history
  T = pick_bucket(int(hist_values.shape[0]), cfg.history_buckets(spec))
  example_mask_B = np.zeros((B,), np.float32)
  example_mask_B[:n] = 1.0
  return Batch(
      sparse={f.name: rows(ex.sparse[f.name], np.int32) for f in spec.single_hot},
      multi_hot={f.name: jagged(*ex.multi_hot[f.name], cfg.multi_hot_capacity(f), f.name)
                 for f in spec.multi_hot},
      dense_BxG=rows(ex.dense_nxG, np.float32),
      history=jagged(hist_values, hist_lengths, T, "history"),
      domain_B=rows(ex.domain_n, np.int32),
      labels_BxK=rows(ex.labels_nxK, np.float32),
      label_mask_BxK=rows(ex.label_mask_nxK, np.float32),
      example_mask_B=example_mask_B,
      # Padding rows have no ground truth; NaN says "unknown" as it does for real data.
      planted_logits_BxK=rows(ex.planted_logits_nxK, np.float32, fill=np.nan))


# ---- grain datasets -----------------------------------------------------------------------------------

# Training streams are endless; grain's range dataset needs a stop, so use the largest index it can hold.
_STREAM_END = sys.maxsize


class _PackBlock:
  """grain map: block index -> packed Batch."""

  def __init__(self, source: BlockSource, spec: FeatureSpec, cfg: PipelineConfig, size: int | None = None):
    self.source, self.spec, self.cfg = source, spec, cfg
    self.size = cfg.batch_size if size is None else size

  def __call__(self, index: int) -> Batch:
    return pack(self.source.block(int(index), self.size), self.spec, self.cfg)


def _check_source(source: BlockSource, spec: FeatureSpec) -> None:
  src_spec = getattr(source, "spec", spec)
  if src_spec != spec:
    raise ValueError("the source's FeatureSpec differs from the pipeline's spec")


def _read_options(cfg: PipelineConfig) -> grain.ReadOptions:
  return grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch_buffer_size)


def train_dataset(source: BlockSource, spec: FeatureSpec, cfg: PipelineConfig, *,
                  start_index: int = 0) -> grain.IterDataset:
  """Endless dataset whose record i is pack(source.block(start_index + i, batch_size)).

  Blocks are read and packed by `cfg.read_threads` grain threads, `cfg.prefetch_buffer_size` ahead.
  """
  _check_source(source, spec)
  if start_index < 0:
    raise ValueError(f"start_index must be >= 0, got {start_index}")
  return _indexed(_PackBlock(source, spec, cfg), cfg, start_index)


def _indexed(fn, cfg: PipelineConfig, start_index: int = 0) -> grain.IterDataset:
  return grain.MapDataset.range(start_index, _STREAM_END).map(fn).to_iter_dataset(_read_options(cfg))


def indexed_iterator(fn, cfg: PipelineConfig) -> grain.DatasetIterator:
  """An endless iterator whose record i is fn(i), read by cfg's grain threads with its prefetch; its state
  (JSON) is a batch counter, as make_iterator's."""
  return iter(_indexed(fn, cfg))


def make_iterator(source: BlockSource, spec: FeatureSpec, cfg: PipelineConfig, *, start_index: int = 0,
                  state: dict | None = None) -> grain.DatasetIterator:
  """An iterator over train_dataset; `it.get_state()` is a JSON-serializable dict and
  `make_iterator(..., state=saved)` (or `it.set_state(saved)`) resumes at the same batch.

  The state counts batches from start_index, so restore with the same source, spec, cfg and start_index.
  """
  it = iter(train_dataset(source, spec, cfg, start_index=start_index))
  if state is not None:
    it.set_state(state)
  return it


def eval_batches(source: BlockSource, spec: FeatureSpec, cfg: PipelineConfig, *, num_examples: int,
                 start_index: int) -> list[Batch]:
  """num_examples examples from blocks start_index, start_index + 1, ... as a finite list of batches.

  Every block has batch_size examples but the last, which has the remainder (padded with example_mask 0
  rows). Pick start_index past every block the training stream will read, so the two are disjoint.
  """
  _check_source(source, spec)
  if num_examples <= 0 or start_index < 0:
    raise ValueError(f"need num_examples > 0 and start_index >= 0, got {num_examples}, {start_index}")
  B = cfg.batch_size
  full, rest = divmod(num_examples, B)
  ds = grain.MapDataset.range(start_index, start_index + full).map(_PackBlock(source, spec, cfg))
  batches = list(ds.to_iter_dataset(_read_options(cfg)))
  if rest:
    batches.append(_PackBlock(source, spec, cfg, size=rest)(start_index + full))
  return batches


# ---- padding accounting ---------------------------------------------------------------------------------


def padding_stats(batch: Batch) -> dict[str, float]:
  """Token and row padding of one batch: what fraction of each static capacity is filler."""
  def waste(tokens: int, capacity: int) -> float:
    return 1.0 - tokens / capacity if capacity else 0.0
  offsets = np.asarray(batch.history.offsets)
  stats = {
      "history_tokens": float(offsets[-1]),
      "history_capacity": float(batch.history.capacity),
      "history_padding": waste(int(offsets[-1]), batch.history.capacity),
      "row_padding": 1.0 - float(np.mean(np.asarray(batch.example_mask_B))),
  }
  for name, jag in batch.multi_hot.items():
    stats[f"{name}_padding"] = waste(int(np.asarray(jag.offsets)[-1]), jag.capacity)
  return stats


def bucket_counts(batches: Iterable[Batch]) -> dict[str, object]:
  """How often each history bucket was used and the token-weighted history padding over `batches`."""
  counts: collections.Counter[int] = collections.Counter()
  tokens = capacity = 0
  for b in batches:
    counts[b.history.capacity] += 1
    tokens += int(np.asarray(b.history.offsets)[-1])
    capacity += b.history.capacity
  return {"bucket_counts": dict(sorted(counts.items())),
          "history_padding": 1.0 - tokens / capacity if capacity else 0.0}
