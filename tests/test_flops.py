"""Model FLOPs derived from traces agree with XLA's cost analysis on unpadded batches and with a direct trace at
every length; pair and tile counts are exact."""

import jax
import numpy as np
import pytest

from gem_jax import configs
from gem_jax.config import apply_overrides
from gem_jax.data.batch import Batch
from gem_jax.jagged import Jagged
from gem_jax.observe import flops
from gem_jax.run.build import build
from pallas_kernels.hstu_attention.reference import attention_mask


def unpadded_batch(spec, batch_size: int, length: int, seed: int = 0) -> Batch:
  """Every row has exactly `length` history tokens and the capacity holds exactly the real tokens."""
  rng = np.random.default_rng(seed)
  ids = lambda table, shape: rng.integers(0, spec.table(table).vocab_size, shape).astype(np.int32)
  b = batch_size
  hist = np.stack([ids(f.table, (b * length,)) for f in spec.sequence.fields], axis=1)
  multi = {f.name: Jagged(ids(f.table, (b * f.max_ids,)), (np.arange(b + 1) * f.max_ids).astype(np.int32))
           for f in spec.multi_hot}
  k = len(spec.tasks)
  return Batch({f.name: ids(f.table, (b,)) for f in spec.single_hot}, multi,
               rng.normal(size=(b, spec.dense_dim)).astype(np.float32),
               Jagged(hist, (np.arange(b + 1) * length).astype(np.int32)),
               rng.integers(0, len(spec.domains), b).astype(np.int32), np.zeros((b, k), np.float32),
               np.ones((b, k), np.float32), np.ones((b,), np.float32), np.zeros((b, k), np.float32))


def xla_forward_flops(run, batch) -> float:
  # The dense reference attention: XLA's cost analysis counts a while loop's body once, so the tiled
  # path's adaptive work is invisible to it (the kernel benchmark counts that path's pairs instead).
  fwd = jax.jit(lambda params, batch: run.model(params)(batch))
  cost = fwd.lower(run.state.params, batch).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


# Unpadded means every layer's rows fill its static max length: length >= every keep_last value. The
# match holds where matmuls dominate (the shipped CPU default and wider); at the tiny config's 16-wide
# heads XLA's pointwise ops (mask, bucketing, SiLU) add ~20% on top of the matmuls.
@pytest.mark.parametrize("name,length", [("small", 64)])
def test_derived_flops_match_xla_on_unpadded_batch(name, length):
  run = build(apply_overrides(configs.get(name), ["model.hstu.attn_impl=reference"]))
  batch = unpadded_batch(run.cfg.data.spec, 16, length)
  derived = flops.FlopModel(run).forward(np.full(16, length))
  executed = xla_forward_flops(run, batch)
  assert abs(executed / derived - 1) < 0.10, (executed, derived)


@pytest.fixture(scope="module")
def tiny_model():
  """The tiny config on the tiled attention loop (`xla`), whose executed work the model counts per tile."""
  run = build(apply_overrides(configs.get("tiny"), ["model.hstu.attn_impl=xla"]), abstract=True)
  return run, flops.FlopModel(run)


def test_flops_grow_with_real_tokens_only(tiny_model):
  _, model = tiny_model
  assert model.forward([0, 5, 32]) == model.forward([5, 32, 0])
  assert model.forward([6]) > model.forward([5])
  with pytest.raises(ValueError, match="lengths must be in"):
    model.forward([33])  # longer than the spec's max history


def test_the_piecewise_model_is_the_traced_count_at_every_length(tiny_model):
  """f(n) is rebuilt from a few traces per piece between the model's truncation points (keep_last 32 and
  16 on tiny); every length gives what a trace of that length counts, and the tiled kernel's rows too."""
  run, model = tiny_model
  assert [(p.lo, p.hi) for p in model.pieces] == [(0, 16), (16, 32)]
  for n in (0, 1, 7, 16, 17, 25, 31, 32):
    traced, calls, _ = flops.trace_row(run, n)
    assert model.forward([n]) == pytest.approx(traced, rel=1e-9), n
    piece = model.pieces[int(np.searchsorted([p.hi for p in model.pieces], n))]
    assert [round(s * n + b) for _, s, b in piece.calls] == [c.length for c in calls], n
  assert model.tiled and model.tiled_train([0, 16, 32]) > model.tiled_train([0, 16])


@pytest.mark.parametrize("n,c,t", [(1, 0, 0), (7, 0, 0), (7, 2, 1), (3, 2, 1), (9, 3, 1), (2, 2, 0)])
def test_exact_pair_count_matches_the_mask(n, c, t):
  mask, _ = attention_mask(np.array([n]), max(n, 1), causal=True,
                           num_targets_B=np.array([t]) if t else None, contextual_seq_len=c)
  assert flops.hstu_pairs([n], num_contextual=c, num_targets=t, exact_mask=True) == int(np.asarray(mask).sum())
  assert flops.hstu_pairs([n]) == n * n


def test_param_counts_split_sparse_and_dense(tiny_model):
  run, _ = tiny_model
  counts = flops.param_counts(run)
  assert counts["sparse"] == sum(t.vocab_size * t.dim for t in run.cfg.data.spec.tables)
  assert counts["sparse"] + counts["dense"] == sum(x.size for x in jax.tree_util.tree_leaves(run.state.params))


def test_tiled_attention_tiles_match_the_kernels_own_count():
  from pallas_kernels.hstu_attention import tiled
  rng = np.random.default_rng(0)
  for c, block in ((0, 32), (3, 32), (20, 32), (3, 64), (20, 16)):
    n = rng.integers(0, 120, size=17) + c + 1
    offsets = np.concatenate([[0], np.cumsum(n)])
    want = tiled.executed_pairs(offsets, c + 100, block, num_targets=np.ones(17, np.int32), contextual_seq_len=c)
    assert flops.tiled_attention_tiles(n, max_seq_len=c + 100, num_contextual=c, block=block) * block ** 2 == want


def test_a_chunked_full_softmax_counts_each_rows_own_tokens(tmp_path):
  """The chunked loss pads a batch's tokens to a multiple of task.loss_chunk; a row's model FLOPs are its own
  tokens' logits, as the whole-batch loss counts them, less the padding item it also scores."""
  from tests.data_helpers import toy_u_data
  base = apply_overrides(configs.seqrec("ml-100k", quick=True), [f"data.data_dir={toy_u_data(tmp_path)}",
                                                                  "task.loss=full_softmax"])
  counts = [flops.FlopModel(build(apply_overrides(base, [f"task.loss_chunk={c}"]), abstract=True)).forward([1, 7, 30])
            for c in (0, 512)]
  assert counts[0] - counts[1] == pytest.approx(2 * base.model.dim * 38, rel=1e-9)   # the padding item, per token


def test_executed_tiled_flops_follow_the_configured_tile_edge(tiny_model):
  """An explicit model.hstu.attn_tiles counts the tiles its loops walk at its own edge, not the default's;
  the count-only trace records the edge with each attention call, and "auto" (picked per batch) says so."""
  _, model32 = tiny_model
  model = lambda tiles: flops.FlopModel(build(apply_overrides(configs.get("tiny"), [f"model.hstu.attn_tiles={tiles}"]),
                                              abstract=True))   # tiles pick the xla impl under "auto"
  model64, auto = model("64x8"), model("auto")
  assert {c.block for p in model64.pieces for c, _, _ in p.calls} == {64} and not model64.notes
  lengths = np.array([3, 17, 32])   # rows of at most 35 tokens: one 64-token tile each, 1-2 x 32 x 32 pairs
  assert model64.tiled_train(lengths) > 1.3 * model32.tiled_train(lengths)
  assert any("attn_tiles=auto" in note for note in auto.notes)


def test_the_cpp_kernels_executed_pairs_are_its_blocks():
  """cpu.executed_pairs follows the kernel's loops: a 100-token causal row is forward query blocks [0, 64) x keys
  [0, 64) and [64, 100) x [0, 112), backward key blocks [0, 64) x queries [0, 112) and [64, 100) x [64, 112);
  the contextual tokens' queries join every key block; a non-causal row is every block pair."""
  from pallas_kernels.hstu_attention import cpu
  assert cpu.executed_pairs([100], 200) == (64 * 64 + 36 * 112, 64 * 112 + 36 * 48)
  assert cpu.executed_pairs([100], 200, contextual_seq_len=20) == (64 * 112 + 36 * 112, 64 * 112 + 36 * (48 + 32))
  assert cpu.executed_pairs([100], 200, causal=False) == (100 * 112, 100 * 112)
  assert cpu.executed_pairs([100, 0, 300], 200) == tuple(a + b for a, b in zip(cpu.executed_pairs([100], 200),
                                                                               cpu.executed_pairs([200], 200)))
  rng = np.random.default_rng(0)
  for n in rng.integers(1, 400, size=20):
    fwd, bwd = cpu.executed_pairs([n], 512)
    causal = n * (n + 1) // 2
    assert causal <= fwd <= causal + 64 * n and causal <= bwd <= causal + 80 * n, (n, fwd, bwd)


def test_the_cpp_kernel_is_counted_where_xla_cannot_see_it():
  """With the C++ kernel (the CPU default of impl auto) the FLOP model says so and counts its executed work,
  heads and widths included, from each call's row lengths."""
  from pallas_kernels.hstu_attention import cpu
  run = build(apply_overrides(configs.get("tiny"), ["model.hstu.attn_impl=cpp"]), abstract=True)
  model = flops.FlopModel(run)
  assert model.native and not model.tiled
  assert model.native_train([0, 16, 32]) > model.native_train([0, 16]) > 0
  _, calls, _ = flops.trace_row(run, 20)
  want = 0.0
  for c in calls:
    fwd, bwd = cpu.executed_pairs([c.length], c.max_seq_len, contextual_seq_len=c.num_contextual)
    want += c.heads * (fwd * (2 * (c.dh + c.dv) + 8) + bwd * (2 * (3 * c.dh + 2 * c.dv) + 16))
  assert model.native_train([20]) == pytest.approx(want, rel=1e-12)
