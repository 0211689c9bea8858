"""The tiled (tile list + dynamic loop) HSTU attention against the jnp reference: forward, d q/k/v and
d rel_bias on jagged rows with empty and single-token rows, lengths off the block grid, targets,
windows, contextual tokens and non-causal rows; the tile list covers every masked pair, fits its static
capacity, and on a heavy-tailed batch executes at most 1.5x the jagged causal pairs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hstu_attention import reference
from pallas_kernels.hstu_attention import tiled
from tests.kernel_helpers import HSTU_CASES, HSTU_TAIL, hstu_inputs, hstu_value_and_grads
from tests.kernel_helpers import max_rel_err as _max_rel_err

BLOCK = 8


def tiled_fn(*args, **kwargs):
  return tiled.hstu_attention(*args, block=BLOCK, **kwargs)


@pytest.mark.parametrize("case", sorted(HSTU_CASES))
def test_f32_forward_and_grads_match_reference(case):
  args, offsets_Bp1, cot, kwargs = hstu_inputs(case, jnp.float32)
  want_out, want_grads = hstu_value_and_grads(reference.hstu_attention, args, offsets_Bp1, cot, kwargs)
  got_out, got_grads = hstu_value_and_grads(tiled_fn, args, offsets_Bp1, cot, kwargs)
  assert float(jnp.max(jnp.abs(want_out))) > 0
  assert got_out.shape == want_out.shape and got_out.dtype == want_out.dtype
  assert _max_rel_err(got_out, want_out) <= 1e-5
  np.testing.assert_array_equal(np.asarray(got_out[-HSTU_TAIL:]), 0.0)
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert _max_rel_err(got, want) <= 1e-5, name


@pytest.mark.parametrize("tiles", tiled.CANDIDATES, ids=lambda t: f"b{t.block}_g{t.group}")
def test_every_candidate_tile_config_matches_the_reference(tiles):
  """Each (tile edge, tiles per step) a caller can pick: forward and every gradient at the f32 tolerance, on
  causal rows of 0-30 tokens with a bias and neither targets nor contextual tokens (the bias read per tile
  offset), so the tile count is rarely a multiple of the group and the last step runs padding tiles. The
  other bias paths are held to the reference by the tests around it, with 8-token tiles."""
  args, offsets_Bp1, cot, kwargs = hstu_inputs("causal_bias", jnp.float32)
  want_out, want_grads = hstu_value_and_grads(reference.hstu_attention, args, offsets_Bp1, cot, kwargs)
  fn = functools.partial(tiled.hstu_attention, block=tiles.block, group=tiles.group)
  got_out, got_grads = hstu_value_and_grads(fn, args, offsets_Bp1, cot, kwargs)
  assert _max_rel_err(got_out, want_out) <= 1e-5
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert _max_rel_err(got, want) <= 1e-5, name


@pytest.mark.parametrize("group", [1, 16])
@pytest.mark.parametrize("lengths,targets", [([17, 6, 30, 3, 9, 24], [1, 1, 0, 1, 1, 0]),
                                             ([17, 1, 30, 3, 9, 24], [1, 0, 2, 1, 3, 1])],
                         ids=["on_diagonal", "shared_target_positions"])
def test_bias_with_contextual_tokens_and_targets_matches_the_reference(lengths, targets, group):
  """The bias read per tile offset with the contextual rows and columns fixed per pair, and the loop steps
  that go per pair whole: rows with two or more targets (they share max_pos) or too short for their
  contextual and target tokens. One tile per step puts such rows' steps between steps that go per offset."""
  rng = np.random.default_rng(3)
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  capacity, heads = int(offsets_Bp1[-1]) + 2, 2
  q, k, v, cot = (jnp.asarray(rng.normal(size=(capacity, heads, 8)), jnp.float32) for _ in range(4))
  bias = jnp.asarray(rng.normal(size=(heads, 12)), jnp.float32)
  kwargs = dict(max_seq_len=32, alpha=0.7, num_targets=jnp.asarray(targets, jnp.int32), contextual_seq_len=4)
  want_out, want_grads = hstu_value_and_grads(reference.hstu_attention, (q, k, v, bias), offsets_Bp1, cot, kwargs)
  fn = functools.partial(tiled.hstu_attention, block=BLOCK, group=group)
  got_out, got_grads = hstu_value_and_grads(fn, (q, k, v, bias), offsets_Bp1, cot, kwargs)
  assert _max_rel_err(got_out, want_out) <= 1e-5
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert _max_rel_err(got, want) <= 1e-5, name


@pytest.mark.parametrize("case", ["targets_window_bias", "contextual_targets_bias"])
def test_bf16_forward_and_grads_match_f32_reference(case):
  args, offsets_Bp1, cot, kwargs = hstu_inputs(case, jnp.bfloat16)
  # The f32 reference on the same (bf16-rounded) inputs is the target the bf16 path approximates.
  args_f32 = tuple(None if x is None else x.astype(jnp.float32) for x in args)
  want_out, want_grads = hstu_value_and_grads(reference.hstu_attention, args_f32, offsets_Bp1, cot, kwargs)
  got_out, got_grads = hstu_value_and_grads(tiled_fn, args, offsets_Bp1, cot, kwargs)
  assert got_out.dtype == jnp.bfloat16
  assert _max_rel_err(got_out, want_out) <= 2e-2
  for name, got, want in zip("qkvb", got_grads, want_grads):
    assert got.dtype == args["qkvb".index(name)].dtype, name
    assert _max_rel_err(got, want) <= 2e-2, name


def test_other_rows_and_tail_never_change_outputs():
  (q, k, v, bias), offsets_Bp1, _, kwargs = hstu_inputs("targets_window_bias", jnp.float32, seed=1)
  attend = jax.jit(lambda q, k, v: tiled_fn(q, k, v, offsets_Bp1, rel_bias_HxR=bias, **kwargs))
  base = np.asarray(attend(q, k, v))
  # Row 0 is tokens [0, 11): huge (even inf) values everywhere else must leave it bit for bit alone.
  outside = jnp.arange(q.shape[0]) >= 11
  poison = lambda x: jnp.where(outside[:, None, None], jnp.inf, x)
  got = np.asarray(attend(poison(q), poison(k), poison(v)))
  np.testing.assert_array_equal(got[:11], base[:11])


def _coverage(offsets_Bp1, n, kwargs):
  """(covered_BxNxN bool from the tile list, n_tiles, tile capacity, unclamped tile count)."""
  num_rows = offsets_Bp1.shape[0] - 1
  targets = kwargs.get("num_targets")
  s = tiled.Static(n, 1.0, kwargs.get("causal", True), targets is not None, kwargs.get("max_attn_len", 0),
                    kwargs.get("contextual_seq_len", 0), BLOCK, False)
  cap = tiled.tile_capacity(int(offsets_Bp1[-1]), num_rows, s)
  targets_B = tiled._targets(targets, num_rows)
  tiles_Cx3, n_tiles = tiled._tiles(offsets_Bp1, targets_B, cap, s)
  _, unclamped = tiled._tiles(offsets_Bp1, targets_B, cap * 4 + 64, s)
  covered = np.zeros((num_rows, n + BLOCK, n + BLOCK), bool)
  for b, q0, k0 in np.asarray(tiles_Cx3)[:int(n_tiles)]:
    assert not covered[b, q0, k0], "tile listed twice"
    covered[b, q0:q0 + BLOCK, k0:k0 + BLOCK] = True
  return covered[:, :n, :n], int(n_tiles), cap, int(unclamped)


@pytest.mark.parametrize("case", sorted(HSTU_CASES))
def test_tile_list_covers_mask_and_fits_capacity(case):
  _, offsets_Bp1, _, kwargs = hstu_inputs(case, jnp.float32)
  n = kwargs["max_seq_len"]
  covered, n_tiles, cap, unclamped = _coverage(offsets_Bp1, n, kwargs)
  mask, _ = reference.attention_mask(
      np.diff(np.asarray(offsets_Bp1)), n, causal=kwargs.get("causal", True),
      num_targets_B=kwargs.get("num_targets"), max_attn_len=kwargs.get("max_attn_len", 0),
      contextual_seq_len=kwargs.get("contextual_seq_len", 0))
  assert not np.any(np.asarray(mask) & ~covered)
  assert unclamped == n_tiles <= cap
  assert n_tiles * BLOCK * BLOCK == tiled.executed_pairs(offsets_Bp1, n, BLOCK, **{
      key: val for key, val in kwargs.items() if key not in ("max_seq_len", "alpha")})


@pytest.mark.parametrize("kwargs", [{}, {"causal": False}, {"contextual_seq_len": 11}])
def test_tile_capacity_bounds_worst_case_offsets(kwargs):
  n, capacity = 32, 100  # full rows then a remainder: the packing the bound is tight for
  for lengths in ([32, 32, 32, 4, 0], [1] * 5, [32, 32, 9, 9, 9], [0, 0, 0, 0, 100]):
    lengths = np.minimum(lengths, n)
    offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    s = tiled.Static(n, 1.0, kwargs.get("causal", True), False, 0, kwargs.get("contextual_seq_len", 0),
                      BLOCK, False)
    cap = tiled.tile_capacity(capacity, len(lengths), s)
    _, count = tiled._tiles(offsets_Bp1, jnp.zeros(len(lengths), jnp.int32), cap * 4, s)
    assert int(count) <= cap, lengths


def test_heavy_tailed_batch_executes_at_most_1p5x_jagged_pairs():
  n, rows, block = 256, 64, 16
  rng = np.random.default_rng(0)
  lengths = np.clip(np.round(rng.lognormal(np.log(60.0) - 0.5, 1.0, rows)), 0, n).astype(np.int32)
  assert lengths.mean() <= n / 4 and lengths.max() > 3 * lengths.mean()  # heavy tail, as meant
  offsets_Bp1 = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  mask, _ = reference.attention_mask(jnp.asarray(lengths), n)
  jagged_pairs = int(np.asarray(mask).sum())
  executed = tiled.executed_pairs(offsets_Bp1, n, block)
  assert jagged_pairs <= executed <= 1.5 * jagged_pairs, (executed, jagged_pairs)
  assert executed < 0.5 * rows * n * n / 2  # far below the padded dense causal work


def test_empty_batch_and_bad_arguments():
  (q, k, v, _), offsets_Bp1, _, _ = hstu_inputs("plain", jnp.float32)
  out = tiled.hstu_attention(q, k, v, jnp.zeros((1,), jnp.int32), max_seq_len=24, alpha=1.0)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  with pytest.raises(ValueError, match="rel_bias"):
    tiled.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=24, alpha=1.0, rel_bias_HxR=jnp.zeros((3, 4)))
  with pytest.raises(ValueError, match="num_targets"):
    tiled.hstu_attention(q, k, v, offsets_Bp1, max_seq_len=24, alpha=1.0, num_targets=jnp.zeros((2,)))
  with pytest.raises(ValueError, match="disagree"):
    tiled.hstu_attention(q, k[:-1], v, offsets_Bp1, max_seq_len=24, alpha=1.0)
