"""Test helpers shared by the data tests: random valid Examples of a spec."""

import numpy as np

from gem_jax.data.batch import Examples


def make_examples(spec, rng, n, hist_lengths=None):
  """n valid random examples of `spec` (histories of hist_lengths tokens if given)."""
  vocab = lambda table: spec.table(table).vocab_size
  if hist_lengths is None:
    hist_lengths = rng.integers(0, spec.sequence.max_len + 1, n)
  hist_lengths = np.asarray(hist_lengths, np.int64)
  tokens = int(hist_lengths.sum())
  hist = np.stack([rng.integers(0, vocab(f.table), tokens) for f in spec.sequence.fields], axis=1)
  multi = {}
  for f in spec.multi_hot:
    lengths = rng.integers(0, f.max_ids + 1, n)
    multi[f.name] = (rng.integers(0, vocab(f.table), int(lengths.sum())), lengths)
  K = len(spec.tasks)
  labels, mask = np.zeros((n, K), np.float32), np.zeros((n, K), np.float32)
  for k, t in enumerate(spec.tasks):
    p = spec.task_names.index(t.parent) if t.parent else None
    mask[:, k] = 1.0 if p is None else labels[:, p] * mask[:, p]
    labels[:, k] = rng.integers(0, 2, n) * mask[:, k]
  return Examples(
      sparse={f.name: rng.integers(0, vocab(f.table), n) for f in spec.single_hot},
      multi_hot=multi,
      dense_nxG=rng.normal(size=(n, spec.dense_dim)).astype(np.float32),
      history=(hist, hist_lengths),
      domain_n=rng.integers(0, len(spec.domains), n),
      labels_nxK=labels,
      label_mask_nxK=mask,
      planted_logits_nxK=rng.normal(size=(n, K)).astype(np.float32))


def shared_data_root() -> str:
  """The shared public datasets: $GEM_JAX_DATA_DIR, or ../shared/data beside the repository."""
  import os
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return os.environ.get("GEM_JAX_DATA_DIR", os.path.normpath(os.path.join(here, "..", "shared", "data")))


def toy_u_data(root, users: int = 24, seed: int = 0) -> str:
  """A small MovieLens-100K-format file (root/ml-100k/u.data) of `users` users with 5-14 interactions over
  30 items, so the next-item source and task run without the shared data."""
  rng = np.random.default_rng(seed)
  lines = [f"{u}\t{i}\t4\t{t}" for u in range(1, users + 1)
           for t, i in enumerate(rng.choice(np.arange(1, 31), rng.integers(5, 15), replace=False))]
  (root / "ml-100k").mkdir(parents=True, exist_ok=True)
  (root / "ml-100k" / "u.data").write_text("\n".join(lines) + "\n")
  return str(root)


def fixed_batch_losses(run, steps: int):
  """Trains `run` on its source's first batch `steps` times -> (the final state, the loss of each step)."""
  batch = run.device_batch(run.source.first_batch())
  state, losses = run.state, []
  for _ in range(steps):
    state, m = run.train_step(state, batch)
    losses.append(float(m["loss"]))
  return state, losses
