"""Sequential recommendation on public data: parsers (and their errors), the leave-one-out split, batches,
full-ranking metrics against brute force, the sampled-softmax loss, and a quick real-data run.

Tests that read ../shared/data (or $GEM_JAX_DATA_DIR) skip with a message naming the missing file."""

import json
import math
import os
import shutil
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from gem_jax import configs, metrics
from gem_jax.bench import seqrec_step
from gem_jax.check import ConfigError
from gem_jax.config import apply_overrides
from gem_jax.data import seqrec as data
from gem_jax.data import seqrec_source
from gem_jax.data.seqrec_source import SeqRecDataConfig
from gem_jax.jagged import Jagged
from gem_jax.model.seqrec import SeqRecModel, SeqRecModelConfig
from gem_jax.run import next_item
from gem_jax.run.build import build
from gem_jax.run.next_item import NextItemConfig
from gem_jax.train import jobs
from tests.data_helpers import fixed_batch_losses, toy_u_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA_DIR = os.environ.get("GEM_JAX_DATA_DIR", os.path.normpath(os.path.join(ROOT, "..", "shared", "data")))


def needs_data(name: str):
  """Skips (with the paths it looked for) unless dataset `name` is under DATA_DIR."""
  if data.dataset_path(name, DATA_DIR) is None:
    looked = " or ".join(os.path.join(DATA_DIR, rel) for rel, _ in data.DATASETS[name].paths)
    pytest.skip(f"{name} data absent: looked for {looked} (set GEM_JAX_DATA_DIR to the shared data root)")


def write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


# ---- parsers -------------------------------------------------------------------------------------------
def test_ratings_sorted_by_time_ties_in_file_order_ids_remapped(tmp_path):
  path = write(tmp_path, "ratings.dat", "\n".join([
      "7::30::5::300", "7::10::3::100", "7::20::4::100",   # tie at t=100: file order 10, 20
      "2::20::1::5", "2::40::2::1", "2::30::5::9", ""]))
  ds = data.load_ratings(path)
  assert ds.user_ids.tolist() == [2, 7]
  assert ds.item_ids.tolist() == [10, 20, 30, 40]   # item i = rank of the original id
  assert [ds.item_ids[s - 1].tolist() for s in ds.sequences] == [[40, 20, 30], [10, 20, 30]]
  assert ds.num_items == 4 and ds.num_interactions == 6


def test_u_data_and_sequences_formats(tmp_path):
  ds = data.load_u_data(write(tmp_path, "u.data", "1\t5\t3\t20\n1\t6\t3\t10\n1\t7\t1\t30\n"))
  assert ds.item_ids[ds.sequences[0] - 1].tolist() == [6, 5, 7]
  ds = data.load_sequences(write(tmp_path, "seq.txt", "3 9 4 9 8\n1 4 5 6\n"))
  assert ds.user_ids.tolist() == [3, 1]
  assert ds.item_ids.tolist() == [4, 5, 6, 8, 9]
  assert ds.sequences[0].tolist() == [5, 1, 5, 4]   # a repeated item stays repeated


@pytest.mark.parametrize("loader,text,message", [
    (data.load_ratings, "1::2::3::4\n1::2::3\n", r"ratings.dat:2: expected 4 fields UserID::MovieID"),
    (data.load_ratings, "1::2::3::4\n1::x::3::4\n", r"ratings.dat:2: item id 'x' is not an integer"),
    (data.load_ratings, "1::0::3::4\n", r"ratings.dat:1: item id 0 must be a positive integer"),
    (data.load_ratings, "-1::2::3::4\n", r"ratings.dat:1: user id -1 must be a positive"),
    (data.load_ratings, "1::2::3::4.5\n", r"ratings.dat:1: timestamp '4.5' is not an integer"),
    (data.load_ratings, "1::2::3::4\n1::3::3::5\n", r"ratings.dat:1: user 1 has 2 interactions"),
    (data.load_ratings, "\n\n", r"ratings.dat: no interactions"),
    (data.load_u_data, "1 2 3 4\n", r"ratings.dat:1: expected 4 fields user<TAB>item"),
    (data.load_sequences, "1 2 3 4\n1 5 6 7\n", r"ratings.dat:2: user 1 already has a line \(line 1\)"),
    (data.load_sequences, "1 2 3 4\n2\n", r"ratings.dat:2: user 2 has no items"),
    (data.load_sequences, "1 2 3 4\n2 3 99999999999999999999x 4\n", r"ratings.dat:2: item id '99999999999999999999x'"),
    (data.load_sequences, "1 2 3\n", r"ratings.dat:1: user 1 has 2 interactions"),
    (data.load_sequences, "", r"ratings.dat: no user lines"),
    # Found by tests/test_fuzz.py: ids past int64 raised OverflowError from numpy; int() took " 2", "+2",
    # "1_0"; str.split() split on \x0b and \xa0; a lone \r was read as a line break.
    (data.load_sequences, "1 2 3 4\n2 3 100000000000000000000000000000 4\n",
     r"ratings.dat:2: item id 100000000000000000000000000000 does not fit in int64"),
    (data.load_ratings, "9223372036854775808::2::3::4\n", r"ratings.dat:1: user id 9223372036854775808 does not fit"),
    (data.load_u_data, "1\t2\t3\t-9223372036854775809\n", r"ratings.dat:1: timestamp -9223372036854775809 does not"),
    (data.load_ratings, "1::+2::3::4\n", r"ratings.dat:1: item id '\+2' is not an integer"),
    (data.load_ratings, "1::1_0::3::4\n", r"ratings.dat:1: item id '1_0' is not an integer"),
    (data.load_ratings, "1:: 2::3::4\n", r"ratings.dat:1: item id ' 2' is not an integer"),
    (data.load_sequences, "1\x0b2 3 4\n", r"ratings.dat:1: user id '1\\x0b2' is not an integer"),
    (data.load_ratings, "1::2::3::4\r1::3::3::5\n1::4::3::6\n", r"ratings.dat:1: expected 4 fields"),
])
def test_malformed_files_name_the_line_and_reason(tmp_path, loader, text, message):
  with pytest.raises(data.SeqRecDataError, match=message):
    loader(write(tmp_path, "ratings.dat", text))


def test_files_accept_crlf_blanks_leading_zeros_and_int64(tmp_path):
  """The reading policy of the module docstring: blanks and CRs around a line, blank lines (still counted in
  error line numbers), no final newline, leading zeros, ids up to the int64 max, any int64 timestamp."""
  big = 2**63 - 1
  text = f"\r\n 1::{big}::5::-9223372036854775808\t\r\n\n1::007::1::0\r\n1::7::1::{big}"
  ds = data.load_ratings(write(tmp_path, "ratings.dat", text))
  assert ds.user_ids.tolist() == [1] and ds.item_ids[ds.sequences[0] - 1].tolist() == [big, 7, 7]
  with pytest.raises(data.SeqRecDataError, match=r"ratings.dat:4: item id 'x' is not an integer"):
    data.load_ratings(write(tmp_path, "ratings.dat", "\n1::2::3::4\r\n \n1::x::3::4\n"))
  ds = data.load_sequences(write(tmp_path, "seq.txt", "5\t1  2 \t3\r\n"))
  assert ds.item_ids[ds.sequences[0] - 1].tolist() == [1, 2, 3]


def test_missing_dataset_names_the_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"ml-1m/ratings.dat or .*ml-1m_sequences_orig_ids.txt"):
    data.load("ml-1m", str(tmp_path))
  with pytest.raises(ValueError, match="unknown dataset 'netflix'"):
    data.load("netflix", str(tmp_path))


# ---- split and batches ---------------------------------------------------------------------------------
def _toy() -> data.SeqDataset:
  seqs = [np.array([1, 2, 3, 4, 5], np.int32), np.array([3, 1, 2], np.int32), np.arange(1, 9, dtype=np.int32)]
  return data.SeqDataset("toy", seqs, np.array([10, 11, 12]), np.arange(1, 9))


def test_leave_one_out():
  split = data.leave_one_out(_toy())
  assert split.train[0].tolist() == [1, 2, 3] and split.train[1].tolist() == [3]
  assert split.valid.targets.tolist() == [4, 1, 7] and split.test.targets.tolist() == [5, 2, 8]
  assert split.valid.prefixes[1].tolist() == [3] and split.test.prefixes[1].tolist() == [3, 1]
  through = data.leave_one_out(_toy(), through_valid=True)  # HSTU's protocol: the validation item is trained on
  assert [t.tolist() for t in through.train] == [[1, 2, 3, 4], [3, 1], list(range(1, 8))]
  assert through.valid.targets.tolist() == [4, 1, 7] and through.test.targets.tolist() == [5, 2, 8]
  assert [p.tolist() for p in through.test.prefixes] == [t.tolist() for t in through.train]


def test_train_batches_pairs_next_items_and_truncate():
  split = data.leave_one_out(_toy())
  batches = list(data.train_batches(split.train, batch_size=2, max_len=4, multiple=8,
                                    rng=np.random.default_rng(0)))
  rows = {}
  for b in batches:
    off = b.items.offsets
    assert b.items.capacity % 8 == 0 and off.shape == (3,) and np.all(np.diff(off) <= 4)
    for r, u in enumerate(b.row_user_B):
      if u >= 0:
        rows[int(u)] = (b.items.values[off[r]:off[r + 1]].tolist(), b.targets_T[off[r]:off[r + 1]].tolist())
    assert np.all(b.targets_T[off[-1]:] == 0)
  # user 1 has one training item: no pair; user 2's 6 training items keep the last 5 (4 inputs)
  assert rows == {0: ([1, 2], [2, 3]), 2: ([2, 3, 4, 5], [3, 4, 5, 6])}


def test_random_windows_are_whole_consecutive_runs_and_reach_every_pair():
  """train_window="random": each row is max_len + 1 consecutive training items of its user (inputs, next
  items), a short user's are all kept, and over epochs every training pair of a long user is trained on."""
  split = data.leave_one_out(_toy())  # training items: user 0 [1, 2, 3], user 2 [1..6]
  rng = np.random.default_rng(0)
  windows, pairs = {0: set(), 2: set()}, set()
  for _ in range(12):
    for b in data.train_batches(split.train, batch_size=2, max_len=3, multiple=8, rng=rng, random_windows=True):
      off = b.items.offsets
      for r, u in enumerate(b.row_user_B):
        if u < 0:
          continue
        x, y = b.items.values[off[r]:off[r + 1]].tolist(), b.targets_T[off[r]:off[r + 1]].tolist()
        seq = split.train[u].tolist()
        start = seq.index(x[0])
        assert x == seq[start:start + len(x)] and y == seq[start + 1:start + len(x) + 1]
        windows[int(u)].add(tuple(x))
        pairs |= {(int(u), a, c) for a, c in zip(x, y)}
  assert windows[0] == {(1, 2)}
  assert windows[2] == {(1, 2, 3), (2, 3, 4), (3, 4, 5)}  # every end a whole window of 4 can have
  assert {(u, a, c) for u, a, c in pairs if u == 2} == {(2, a, a + 1) for a in range(1, 6)}


def test_random_window_stream_resumes_at_the_exact_batch(tmp_path):
  """The windows come from the source's one generator: a stream restored from its JSON state replays the
  same batches, and the random windows differ from the last ones for users longer than a window."""
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=4", "data.token_multiple=32",
      "data.max_len=4", "data.train_window=random"])
  source = seqrec_source.SeqRecSource(cfg)
  stream = source.train_iterator()
  for _ in range(9):  # past the first epoch's end (24 users, 4 a batch)
    next(stream)
  state = json.loads(json.dumps(stream.get_state()))
  ahead = [next(stream) for _ in range(4)]
  restored = source.train_iterator()
  restored.set_state(state)
  for a, b in zip(ahead, [next(restored) for _ in range(4)]):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  last = seqrec_source.SeqRecSource(apply_overrides(cfg, ["data.train_window=last"])).train_iterator()
  random_rows, last_rows = [], []
  for stream_, rows in ((source.train_iterator(), random_rows), (last, last_rows)):
    for _ in range(6):
      b = next(stream_)
      off = np.asarray(b.items.offsets)
      rows += [np.asarray(b.items.values)[off[r]:off[r + 1]].tolist() for r in range(len(off) - 1)]
  assert random_rows != last_rows
  with pytest.raises(ValueError, match="data.train_window: 'all' is not 'last' or 'random'"):
    apply_overrides(cfg, ["data.train_window=all"])


def test_eval_batches_cover_every_user_once():
  split = data.leave_one_out(_toy())
  seen = []
  for b in data.eval_batches(split.test, batch_size=2, max_len=3, multiple=4):
    off = b.items.offsets
    for r, u in enumerate(b.row_user_B):
      if u >= 0:
        seen.append(int(u))
        assert b.items.values[off[r]:off[r + 1]].tolist() == split.test.prefixes[u][-3:].tolist()
  assert seen == [0, 1, 2]


# ---- metrics -------------------------------------------------------------------------------------------
def _brute_rank(scores, target, excluded):
  """1-based position of the target after sorting candidates by score, ties put before the target."""
  better = [i for i in range(len(scores)) if i != target and i not in excluded and scores[i] >= scores[target]]
  return 1 + len(better)


@pytest.mark.parametrize("seed", range(5))
def test_full_ranking_ranks_match_brute_force_with_ties_and_history(seed):
  rng = np.random.default_rng(seed)
  B, I = 12, 15
  scores = rng.integers(0, 4, (B, I)).astype(np.float32)   # few values: many ties
  targets = rng.integers(0, I, B)
  exclude = rng.random((B, I)) < 0.3
  exclude[:, 0] = True
  exclude[0, targets[0]] = True          # the target repeated in the history is still ranked
  ranks = np.asarray(jax.jit(metrics.full_ranking_ranks)(scores, targets, exclude))
  brute = [_brute_rank(scores[b], targets[b], set(np.flatnonzero(exclude[b]))) for b in range(B)]
  assert ranks.tolist() == brute
  got = metrics.hit_rate_ndcg(ranks, (1, 3, 10))
  for k in (1, 3, 10):
    assert got[f"HR@{k}"] == pytest.approx(np.mean([r <= k for r in brute]))
    assert got[f"NDCG@{k}"] == pytest.approx(np.mean([1 / math.log2(r + 1) if r <= k else 0 for r in brute]))


def test_constant_scores_rank_last_and_nan_target_misses():
  scores = np.zeros((3, 6), np.float32)
  scores[1, 2] = np.nan
  scores[2] = [0.0, 1.0, np.nan, np.nan, 0.5, -1.0]   # NaN rivals count against the target, like ties
  exclude = np.zeros((3, 6), bool)
  exclude[2, 0] = True
  ranks = np.asarray(metrics.full_ranking_ranks(scores, np.array([3, 2, 1]), exclude))
  assert ranks.tolist() == [6, 7, 3]
  assert metrics.hit_rate_ndcg(ranks[:2], (5,)) == {"HR@5": 0.0, "NDCG@5": 0.0}
  with pytest.raises(ValueError, match="ranks must be >= 1; got 0 at index 1"):
    metrics.hit_rate_ndcg([3, 0], (10,))


# ---- loss and model ------------------------------------------------------------------------------------
def test_sampled_softmax_loss_matches_numpy_with_accidental_hits_and_logq():
  rng = np.random.default_rng(0)
  T, D, I = 7, 4, 9
  user = rng.normal(size=(T, D)).astype(np.float32)
  table = rng.normal(size=(I + 1, D)).astype(np.float32)
  targets = np.array([1, 2, 3, 3, 5, 0, 0], np.int32)
  negatives, logq_neg, logq_pos = seqrec_source.sample_negatives(rng, targets, I, uniform=5, in_batch=4)
  assert negatives.shape == (9,) and np.all(np.isin(negatives[5:], targets[targets > 0]))
  # expected count: 5 / I uniform + 4 * (share of the item among the 5 targets)
  assert logq_pos[2] == pytest.approx(np.log(5 / I + 4 * 2 / 5)) and logq_pos[5] == 0
  got = float(next_item.mean_loss(next_item.sampled_softmax_loss_sums, user, table, targets, negatives, logq_neg,
                                  logq_pos, 0.5))
  want = []
  for t in range(5):
    logits = [user[t] @ table[targets[t]] / 0.5 - logq_pos[t]]
    logits += [user[t] @ table[n] / 0.5 - lq for n, lq in zip(negatives, logq_neg) if n != targets[t]]
    want.append(np.log(np.sum(np.exp(logits))) - logits[0])
  assert got == pytest.approx(np.mean(want), rel=1e-5)


def test_sampled_softmax_gradients_match_logsumexp_of_the_concatenated_logits():
  """The loss adds the positive to the negatives' exp-sum without concatenating them: same value and
  gradients as logsumexp over [pos, neg], and finite when every negative of a token is its own target."""
  rng = np.random.default_rng(3)
  T, D, I = 6, 5, 8
  user = jax.numpy.asarray(rng.normal(size=(T, D)).astype(np.float32))
  table = jax.numpy.asarray(rng.normal(size=(I + 1, D)).astype(np.float32))
  targets = np.array([1, 4, 4, 6, 0, 2], np.int32)
  negatives = np.array([[4, 4], [4, 4], [4, 4], [1, 2], [3, 5], [7, 2]], np.int32)   # tokens 1, 2: all masked
  logq_neg, logq_pos = rng.normal(size=(T, 2)).astype(np.float32), rng.normal(size=T).astype(np.float32)

  def concatenated(u, t):
    pos = jax.numpy.sum(u * t[targets], -1) / 0.3 - logq_pos
    neg = jax.numpy.einsum("td,tkd->tk", u, t[negatives]) / 0.3 - logq_neg
    neg = jax.numpy.where(negatives == targets[:, None], -jax.numpy.inf, neg)
    lse = jax.nn.logsumexp(jax.numpy.concatenate([pos[:, None], neg], 1), 1)
    return jax.numpy.sum(jax.numpy.where(targets > 0, lse - pos, 0.0))

  def ours(u, t):
    return next_item.sampled_softmax_loss_sums(u, t, targets, negatives, logq_neg, logq_pos, 0.3)[0]

  want = jax.value_and_grad(concatenated, argnums=(0, 1))(user, table)
  got = jax.value_and_grad(ours, argnums=(0, 1))(user, table)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1]):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert float(np.abs(got[1][0][1]).max()) == 0.0   # a token with only masked negatives: loss 0, no gradient


def test_shared_negatives_read_normalized_rows_like_the_normalized_table(tmp_path):
  """With shared negatives the task normalizes only the rows it gathers (NormalizedRows): the same loss and
  gradients as normalizing the whole table first."""
  from gem_jax.model.seqrec import NormalizedRows, l2_normalize
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.uniform_negatives=6",
      "data.batch_negatives=2", "data.token_multiple=64"])
  run = build(cfg, abstract=True)   # its source and task
  batch = run.source.first_batch()
  model = SeqRecModel(cfg.model, run.source.num_items, rngs=nnx.Rngs(0))
  raw = model.item_emb_IxD[...]
  np.testing.assert_array_equal(np.asarray(NormalizedRows(raw)[batch.negatives_K]),
                                np.asarray(l2_normalize(raw)[batch.negatives_K]))
  key = jax.random.key(4)

  def loss(m, whole):
    if whole:   # the task's sums with the whole normalized table handed to the loss
      m.item_table = lambda rng=None, rows_only=False: SeqRecModel.item_table(m, rng)
    sums = run.task.sums(m, batch, key)
    return sums["loss_sum"] / sums["tokens"]

  graphdef, params = nnx.split(model)
  grad = lambda whole: jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), whole))(params)
  (got, g_got), (want, g_want) = grad(False), grad(True)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(g_got), jax.tree_util.tree_leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_full_softmax_loss_matches_numpy():
  rng = np.random.default_rng(1)
  user = rng.normal(size=(4, 3)).astype(np.float32)
  table = rng.normal(size=(6, 3)).astype(np.float32)
  targets = np.array([1, 5, 0, 2], np.int32)
  got = float(next_item.mean_loss(next_item.full_softmax_loss_sums, user, table, targets, None, None, None, 0.7))
  want = []
  for t in (0, 1, 3):
    logits = user[t] @ table[1:].T / 0.7    # item 0 is padding, never a class
    want.append(np.log(np.sum(np.exp(logits))) - logits[targets[t] - 1])
  assert got == pytest.approx(np.mean(want), rel=1e-5)
  with pytest.raises(ValueError, match="unknown loss 'bpr'"):
    NextItemConfig(loss="bpr")


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_chunked_full_softmax_matches_the_unchunked_loss_and_its_gradients(chunk):
  """Chunks that divide T, that do not (the last one padded), and one larger than T; padding tokens
  (target 0) inside and at the end; a cotangent other than 1 (mean_loss divides by the token count)."""
  rng = np.random.default_rng(2)
  T, I, D = 13, 9, 5
  user = jax.numpy.asarray(rng.normal(size=(T, D)).astype(np.float32))
  table = jax.numpy.asarray(rng.normal(size=(I, D)).astype(np.float32))
  targets = np.array([1, 8, 0, 2, 2, 7, 3, 0, 4, 5, 6, 0, 0], np.int32)
  chunked = lambda *a: next_item.chunked_full_softmax_loss_sums(*a, chunk=chunk)

  def loss(sums, u, t):
    return next_item.mean_loss(sums, u, t, targets, None, None, None, 0.7)

  want = jax.value_and_grad(lambda u, t: loss(next_item.full_softmax_loss_sums, u, t), argnums=(0, 1))(user, table)
  got = jax.jit(jax.value_and_grad(lambda u, t: loss(chunked, u, t), argnums=(0, 1)))(user, table)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert float(loss(chunked, user, table)) == pytest.approx(float(want[0]), rel=1e-6)   # undifferentiated
  assert not np.any(got[1][0][targets == 0])    # padding tokens get no gradient


def test_full_softmax_loss_chunk_setting():
  with pytest.raises(ValueError, match="loss_chunk must be >= 0"):
    NextItemConfig(loss="full_softmax", loss_chunk=-1)


def _model(dropout=0.3):
  cfg = SeqRecModelConfig(dim=8, num_layers=2, head_dim=4, value_dim=4, num_heads=2, max_len=6,
                          dropout_rate=dropout, attn_impl="xla")
  return SeqRecModel(cfg, num_items=11, rngs=nnx.Rngs(0))


def test_encode_rows_are_isolated_and_dropout_only_with_a_key():
  model = _model()
  a, b = np.array([3, 4, 5], np.int32), np.array([7, 1, 2, 9, 10], np.int32)
  both = Jagged(np.concatenate([a, b, np.zeros(4, np.int32)]), np.array([0, 3, 8], np.int32))
  only_b = Jagged(np.concatenate([b, np.zeros(3, np.int32)]), np.array([0, 5], np.int32))
  out_both = np.asarray(model.encode(both))
  np.testing.assert_allclose(out_both[3:8], np.asarray(model.encode(only_b))[:5], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(out_both[:8], axis=-1), 1.0, rtol=1e-5)
  # causal: appending items does not change earlier outputs
  np.testing.assert_allclose(out_both[:2], np.asarray(model.encode(
      Jagged(np.array([3, 4, 0, 0], np.int32), np.array([0, 2], np.int32))))[:2], rtol=1e-5, atol=1e-6)
  key = jax.random.key(1)
  dropped = np.asarray(model.encode(both, dropout_rng=key))
  assert not np.allclose(dropped[:8], out_both[:8])
  np.testing.assert_array_equal(dropped, np.asarray(model.encode(both, dropout_rng=key)))


def test_train_step_lowers_loss_on_a_fixed_batch_and_ranks_every_user(tmp_path):
  """The next-item task through the one spine (build, the mesh step) on a toy dataset."""
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.uniform_negatives=6",
      "data.batch_negatives=2", "data.token_multiple=64", "model.dropout_rate=0.0", "train.learning_rate=0.01"])
  run = build(cfg)
  state, losses = fixed_batch_losses(run, 30)
  assert losses[-1] < 0.5 * losses[0], losses
  ranks = [np.asarray(run.eval_step(state.params, run.place(b))) for b in run.eval_batches("test")]
  result = run.task.evaluate(ranks, run.eval_batches("test"))
  assert set(result) == cfg.task.metric_names() and 0 < result["HR@50"] <= 1
  assert sum(int(np.asarray(b.row_mask_B).sum()) for b in run.eval_batches("test")) == 24


def test_step_bench_times_variants_of_one_preset_on_the_same_batches(tmp_path):
  """gem_jax/bench/seqrec_step.py: the chunked and unchunked full softmax through the real step start from
  the same loss (same parameters, same batch), and every rate is measured."""
  base = [f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.token_multiple=16",
          "task.loss=full_softmax"]
  result = seqrec_step.compare("ml-100k", {"unchunked": base + ["task.loss_chunk=0"],
                                           "chunk16": base + ["task.loss_chunk=16"]},
                               steps=4, rounds=1, eval_batches=1, quick=True, log=lambda line: None)
  rows = result["variants"]
  assert rows["chunk16"]["first_loss"] == pytest.approx(rows["unchunked"]["first_loss"], rel=1e-6)
  assert rows["unchunked"]["speedup"] == 1.0
  for row in rows.values():
    assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["eval_users_per_s"] > 0
    assert 0 < row["tokens_per_batch"] <= 80
    # Batches of several token capacities: each shape compiled before the timed round, none during it.
    assert row["batch_shapes"] >= 2 and row["compiled_while_timed"] == 0, row
  assert "chunk16" in seqrec_step.table(result)


def test_with_parameter_averaging_evaluations_and_the_kept_parameters_are_the_average(tmp_path):
  """train.ema_decay: best/ keeps the average of the train state it was taken from, not its parameters, and
  the final evaluation reads it, as does an evaluation of the training checkpoint."""
  from gem_jax.run.optim import Optimizer
  from gem_jax.train.checkpoint import Checkpointer
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.token_multiple=64",
      "train.epochs=2", "train.eval_every_epochs=2", "train.checkpoint_every=3", "train.ema_decay=0.5"])
  out = tmp_path / "run"
  summary = jobs.train_config(cfg, str(out), progress=False, report=False)
  assert summary["selected"]["step"] == summary["steps"] == 6
  run = build(cfg)
  with Checkpointer(str(out / "checkpoints"), keep=3, save_every=3) as ckpt:
    _, state, _ = ckpt.restore(6, abstract_state=run.restore_target())
    _, state3, _ = ckpt.restore(3, abstract_state=run.restore_target())
  with Checkpointer(str(out / "best"), keep=1, save_every=1) as ckpt:
    _, kept, _ = ckpt.restore(6, abstract_state=run.restore_target().params)
  average = Optimizer.averaged(state.params, state.opt_state)
  leaves = lambda tree: jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))
  for (path, k), (_, a), (_, p) in zip(leaves(kept), leaves(average), leaves(state.params)):
    np.testing.assert_array_equal(k, a, err_msg=jax.tree_util.keystr(path))
    assert not np.array_equal(a, p), jax.tree_util.keystr(path)   # every parameter here is dense: averaged
  again = jobs.evaluate_checkpoint(cfg, str(out))   # a training checkpoint's evaluation reads the average too
  assert again["evaluation"]["test"] == summary["test"]
  # Checkpoint averaging after the fact: the mean of the two checkpoints' averages, and each one's own metrics.
  both = jobs.evaluate_average(cfg, str(out), [3, 6])
  assert both["each"][6]["test"] == summary["test"]
  mean = jax.tree.map(lambda a, b: ((np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2).astype(np.float32),
                      Optimizer.averaged(state3.params, state3.opt_state), average)
  from gem_jax.train import trainer
  want = trainer.jsonable_summary(trainer.evaluate(run, mean, "test"))
  assert both["evaluation"]["test"] == pytest.approx(want, abs=1e-6) and both["evaluation"]["test"] != summary["test"]
  with pytest.raises(ValueError, match="at least two"):
    jobs.evaluate_average(cfg, str(out), [6, 6])


def test_a_checkpoint_mean_averages_float_leaves_in_float32_and_refuses_integer_leaves_that_differ():
  a = {"w": np.array([1.0, 2.0], np.float16), "count": np.array([3], np.int32)}
  b = {"w": np.array([2.0, 4.0], np.float16), "count": np.array([3], np.int32)}
  got = jobs.mean_params([a, b], [4, 8])
  assert got["w"].dtype == np.float16 and np.array_equal(got["w"], np.array([1.5, 3.0], np.float16))
  assert np.array_equal(got["count"], a["count"])
  with pytest.raises(ValueError, match=r"\['count'\] \(int32\) differs between checkpoints 4 and 12"):
    jobs.mean_params([a, b, {**b, "count": np.array([4], np.int32)}], [4, 8, 12])


@pytest.mark.slow
def test_interrupted_next_item_run_resumes_to_the_same_metrics(tmp_path):
  """Killed after a selecting evaluation and before its next checkpoint, then resumed, a run ends on exactly
  the uninterrupted metrics: the source's epoch order, its negatives and the selection hook's best checkpoint
  all resume, and the best parameters the killed run saved past its checkpoint are replayed, not refused.
  With parameter averaging, which evaluations read: the average and its count resume with the optimizer."""
  cfg = apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.token_multiple=64",
      "train.epochs=6", "train.eval_every_epochs=2", "train.checkpoint_every=4", "train.ema_decay=0.5"])
  whole = jobs.train_config(cfg, str(tmp_path / "whole"), progress=False, report=False)
  cut = tmp_path / "cut"
  jobs.train_config(cfg, str(cut), progress=False, report=False, stop_after=7)
  # Steps are 3 an epoch: the evaluation at 6 saved best/6; the kill takes the checkpoint stop_after wrote at 7.
  assert sorted(os.listdir(cut / "best")) == ["6"]
  shutil.rmtree(cut / "checkpoints" / "7")
  resumed = jobs.train_config(cfg, str(cut), progress=False, report=False, resume=True)
  assert resumed["steps"] == whole["steps"] == 18 and resumed["steps_this_run"] == 18 - 4
  assert resumed["test"] == whole["test"] and resumed["valid"] == whole["valid"]
  assert resumed["selected"] == whole["selected"]
  with open(cut / "metrics.jsonl") as f:
    events = [r for r in map(json.loads, f) if r.get("event") == "best_replayed"]
  assert [(e["step"], e["dropped_steps"]) for e in events] == [(4, [6])]


def test_batch_longer_than_max_len_is_refused():
  split = data.leave_one_out(_toy())
  batch = next(data.eval_batches(split.test, batch_size=3, max_len=7, multiple=8))
  with pytest.raises(ValueError, match="row of 7 items; the model's max_len is 6"):
    seqrec_source.check_rows(batch, 6)


def test_presets_build_and_bad_config_fails(tmp_path):
  for name in data.DATASETS:
    assert configs.seqrec(name).data.dataset == name
    assert configs.get(f"seqrec_{name}").data.dataset == name
  assert configs.seqrec("beauty").task.ks == (5, 10, 20, 50, 200) and configs.seqrec("ml-1m").model.max_len == 200
  with pytest.raises(ValueError, match="ml-100k only"):
    configs.seqrec("ml-1m", quick=True)
  quick = apply_overrides(configs.seqrec("ml-100k", quick=True),
                          [f"data.data_dir={toy_u_data(tmp_path)}", "train.select_metric=NDCG@5"])
  with pytest.raises(ConfigError, match="select_metric 'NDCG@5' is not one of the task's selectable"):
    build(quick, abstract=True)
  with pytest.raises(ValueError, match="at least one negative"):
    SeqRecDataConfig(dataset="ml-1m", uniform_negatives=0, batch_negatives=0)
  with pytest.raises(ValueError, match="model.max_len=40 differs from data.max_len=50"):
    build(apply_overrides(quick, ["train.select_metric=NDCG@10", "model.max_len=40"]), abstract=True)


# ---- real data -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,users,items,interactions", [
    ("ml-1m", 6040, 3706, 1000209), ("ml-100k", 943, 1682, 100000), ("beauty", 22363, 12101, 198502),
    ("sports", 35598, 18357, 296337), ("toys", 19412, 11924, 167597)])
def test_real_datasets_load_with_published_sizes(name, users, items, interactions):
  needs_data(name)
  ds = data.load(name, DATA_DIR)
  assert (ds.num_users, ds.num_items, ds.num_interactions) == (users, items, interactions)


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--evaluate", "runs/x", "--seeds", "2"], "--evaluate trains nothing, so --seeds would be ignored"),
    (["--evaluate", "runs/x", "--out", "runs/y"], "--evaluate trains nothing, so --out would be ignored"),
    (["--seeds", "3", "--set", "train.seed=4"], "--seeds sets train.seed and data.seed per run; drop --set train.seed"),
    (["--train-through-valid", "45", "--set", "train.epochs=50"], "--train-through-valid sets .*drop --set train.epochs"),
])
def test_the_seqrec_command_refuses_flags_it_would_ignore_or_override(flags, message):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "seqrec.py"), "--dataset", "ml-100k",
                         *flags], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr[-2000:]


def test_quick_ml100k_run_beats_most_popular(tmp_path):
  """The CI-sized end-to-end run (experiments/seqrec.py --quick, ~30 s on 2 cores): results.json has every
  metric on validation and test, and the model beats ranking by popularity on the test targets."""
  needs_data("ml-100k")
  out = tmp_path / "quick"
  # The command as a user types it, with XLA's default flags: this run is execution-bound (hundreds of steps
  # of a few programs), where the suite's compile-fast flags (conftest.py) make it twice as slow (103 s vs 48 s).
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "seqrec.py"), "--dataset", "ml-100k",
                         "--quick", "--data-dir", DATA_DIR, "--out", str(out)],
                        env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((out / "results.json").read_text())
  assert res["best_step"] is not None and (out / "report.json").exists() and (out / "checkpoints").is_dir()
  for part in ("valid", "test"):
    assert set(res[part]) == {f"{m}@{k}" for m in ("HR", "NDCG") for k in (10, 50, 200)}
  assert {k: res["stats"][k] for k in ("users", "items", "interactions")} == {"users": 943, "items": 1682,
                                                                           "interactions": 100000}
  assert res["stats"]["file"] == os.path.join("ml-100k", "u.data") and len(res["stats"]["sha256"]) == 64
  base = res["baseline_most_popular"]["test"]
  assert res["test"]["HR@10"] > base["HR@10"] and res["test"]["NDCG@10"] > base["NDCG@10"], (res["test"], base)
  assert res["wall_s"]["total"] < 180
