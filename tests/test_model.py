"""The GEM model on tiny shapes: row isolation, HSTU causality, FM algebra, jit fwd+bwd, bf16, sharding names.

Batches are built by hand here (no dependency on the data pipeline). One f32 model is built per module:
model construction compiles every initializer once, which dominates the run time on CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import ops
from gem_jax.data.batch import Batch
from gem_jax.data.spec import ads_feature_spec
from gem_jax.jagged import Jagged, concat_rows, dense_to_jagged
from gem_jax.model import interformer, layers, wukong
from gem_jax.model.config import HSTUConfig, ModelConfig, WukongConfig
from gem_jax.model.embeddings import TABLE_AXES, Table
from gem_jax.model.gem import GEM
from gem_jax.model.heads import multitask_loss
from gem_jax.model.hstu import HSTULayer
from gem_jax.parallel.rules import DEFAULT_RULES, logical_to_spec

SPEC = ads_feature_spec(users=50, ads=40, advertisers=10, categories=12, embed_dim=8, max_history=16)
CFG = ModelConfig(embed_dim=8, model_dim=16, num_layers=2, num_recent=2, tower_hidden=8,
                  hstu=HSTUConfig(num_heads=2, head_dim=4, value_dim=4, keep_last=(8, 4), num_contextual=1,
                                  rel_pos_buckets=8, attn_impl="xla"),
                  wukong=WukongConfig(fm_outputs=4, lcb_outputs=3, fm_rank=2, mlp_hidden=16))
LENGTHS = [0, 1, 6, 12]  # an empty history, a single token, and one longer than keep_last[0] = 8
GARBAGE_ID = 10**6       # written into jagged padding slots: must never be read


def _batch(seed=0, lengths=LENGTHS, domains=(0, 1, 1, 0)):
  rng = np.random.default_rng(seed)
  b, k = len(lengths), len(SPEC.tasks)
  vocab = lambda table: SPEC.table(table).vocab_size
  sparse = {f.name: rng.integers(0, vocab(f.table), b).astype(np.int32) for f in SPEC.single_hot}
  multi_hot = {}
  for f in SPEC.multi_hot:
    rows = [rng.integers(0, vocab(f.table), n).astype(np.int32) for n in (3, 0, 1, f.max_ids)]
    j = Jagged.from_rows(rows, capacity=sum(len(r) for r in rows) + 2, dtype=np.int32)
    j.values[j.offsets[-1]:] = GARBAGE_ID
    multi_hot[f.name] = j
  rows = [np.stack([rng.integers(0, vocab(t.table), n) for t in SPEC.sequence.fields], -1).astype(np.int32)
          for n in lengths]
  history = Jagged.from_rows(rows, capacity=sum(lengths) + 3, dtype=np.int32)
  history.values[history.offsets[-1]:] = GARBAGE_ID
  labels = rng.integers(0, 2, (b, k)).astype(np.float32)
  dense_BxG = rng.normal(size=(b, SPEC.dense_dim)).astype(np.float32)
  return Batch(sparse=sparse, multi_hot=multi_hot, dense_BxG=dense_BxG, history=history,
               domain_B=np.asarray(domains, np.int32), labels_BxK=labels,
               label_mask_BxK=np.ones((b, k), np.float32), example_mask_B=np.ones(b, np.float32),
               planted_logits_BxK=np.full((b, k), np.nan, np.float32))


@pytest.fixture(scope="module")
def model():
  return GEM(SPEC, CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def f32_step(model):
  """(params, jitted (params, batch) -> ((loss, logits), grads)) of the f32 model, compiled once."""
  return _loss_and_grad(model)


def _loss_and_grad(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params, batch):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(batch)
      return multitask_loss(logits, batch, SPEC)[0], logits
    return jax.value_and_grad(loss_fn, has_aux=True)(params)

  return params, run


def _finite(tree):
  # numpy, not jnp: an eager jnp op per leaf shape would compile dozens of tiny programs.
  return all(np.all(np.isfinite(np.asarray(x).astype(np.float32))) for x in jax.tree.leaves(tree))


# ---- algebra and building blocks -----------------------------------------------------------------
def test_fm_fast_form_equals_naive():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)
  fast, naive = wukong.fm_interaction(x, y), wukong.fm_interaction_naive(x, y)
  assert fast.shape == (3, 5, 2)
  np.testing.assert_allclose(np.asarray(fast), np.asarray(naive), rtol=1e-5, atol=1e-5)
  xn = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(naive), xn @ np.swapaxes(xn, 1, 2) @ np.asarray(y), rtol=1e-5, atol=1e-5)


def test_wukong_residual_projection_only_when_count_changes(model):
  same = nnx.eval_shape(lambda: wukong.WukongLayer(7, CFG, site="w", rngs=nnx.Rngs(0)))  # 7 == fm_outputs + lcb_outputs
  assert same.residual is None
  other = model.layers[0].wukong  # 8 sparse + 1 dense + 4 summary embeddings in
  assert other.num_inputs == 13 and other.residual is not None
  x = jnp.ones((2, 13, CFG.embed_dim), jnp.float32)
  assert jax.jit(lambda x: other(x))(x).shape == (2, 7, CFG.embed_dim)
  with pytest.raises(ValueError, match="expects 13"):
    other(x[:, :7])


def test_every_dense_site_is_its_module_path(model):
  """A Dense layer's site (what precision rules match and the probe reports) is its path in the module
  tree, so a rule written against a printed model reaches the layer it names."""
  from gem_jax.model.layers import Dense, dense_sites
  paths = {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(model) if isinstance(m, Dense)}
  sites = dict(dense_sites(model))
  assert sites.keys() == paths.keys() and all(sites[k] is paths[k] for k in paths)
  assert {"token_proj", "heads.trunk", "layers.0.hstu.uvqk", "layers.1.wukong.fm_mlp_in"} <= set(sites)


def test_a_domain_id_outside_the_towers_reads_nan_negative_ones_too(model):
  heads = model.heads
  r = heads.w1_RxGxG.shape[0]
  logits = np.asarray(heads(jnp.ones((4, heads.norm.scale.shape[0])), jnp.array([-1, 0, r, r - 1], jnp.int32)))
  assert np.isnan(logits[[0, 2]]).all() and np.isfinite(logits[[1, 3]]).all()


def test_embedding_lookups(model):
  emb = model.embeddings
  table = np.asarray(emb.tables["category"][...])
  ids = Jagged(jnp.array([1, 2, 5, 7, GARBAGE_ID], jnp.int32), jnp.array([0, 2, 2, 4], jnp.int32))
  pooled = np.asarray(emb.multi_hot("user_interests", ids))  # mean pooling
  np.testing.assert_allclose(pooled[0], (table[1] + table[2]) / 2, rtol=1e-6)
  np.testing.assert_array_equal(pooled[1], 0)  # empty row
  np.testing.assert_allclose(pooled[2], (table[5] + table[7]) / 2, rtol=1e-6)
  hist = Jagged(jnp.array([[3, 4, 1, 2], [GARBAGE_ID] * 4], jnp.int32), jnp.array([0, 1], jnp.int32))
  per_field = emb.history(hist)
  assert len(per_field) == len(SPEC.sequence.fields) and per_field[1].shape == (2, CFG.embed_dim)
  np.testing.assert_allclose(np.asarray(per_field[1][0]), table[4])  # item_category -> category table
  assert _finite(per_field), "a padding slot was looked up"
  bad = emb.single_hot("device", jnp.array([0, 8], jnp.int32))  # the device table has 8 rows
  assert np.all(np.isnan(np.asarray(bad[1]))) and np.all(np.isfinite(np.asarray(bad[0])))


def test_attention_pool_and_recent_tokens():
  x = Jagged(jnp.asarray(np.arange(12, dtype=np.float32).reshape(6, 2)), jnp.array([0, 3, 3, 4], jnp.int32))
  scores = jnp.array([0.5, 1.0, -1.0, 2.0, 1e30, 1e30], jnp.float32)  # huge scores in the 2 padding slots
  pool = jax.jit(lambda s: interformer.attention_pool(x.values, s, x))
  pooled = np.asarray(pool(scores))
  w = np.exp([0.5, 1.0, -1.0])
  np.testing.assert_allclose(pooled[0], (w / w.sum()) @ np.arange(6.0).reshape(3, 2), rtol=1e-5)
  np.testing.assert_array_equal(pooled[1], 0)
  np.testing.assert_allclose(pooled[2], [6.0, 7.0])
  grad = jax.jit(jax.grad(lambda s: pool(s).sum()))(scores)
  assert _finite(grad) and np.all(np.asarray(grad)[4:] == 0)
  recent = np.asarray(jax.jit(lambda x: interformer.recent_tokens(x, 2))(x))
  np.testing.assert_array_equal(recent[0], [[4, 5], [2, 3]])  # most recent first
  np.testing.assert_array_equal(recent[1], 0)
  np.testing.assert_array_equal(recent[2], [[6, 7], [0, 0]])


def test_multitask_loss_masks():
  batch = _batch()
  labels = np.array([[1, 1], [0, 1], [1, 0], [1, 1]], np.float32)  # row 1: conversion without a click
  batch = dataclasses.replace(batch, labels_BxK=labels, example_mask_B=np.array([1, 1, 1, 0], np.float32),
                              label_mask_BxK=np.array([[1, 1], [1, 1], [1, 1], [1, 1]], np.float32))
  logits = np.array([[0.3, -1.0], [2.0, 5.0], [-0.5, 1.5], [np.nan, np.nan]], np.float32)  # row 3 is padding
  loss, per_task = jax.jit(lambda z: multitask_loss(z, batch, SPEC))(jnp.asarray(logits))
  bce = lambda x, y: np.log1p(np.exp(-x)) if y else np.log1p(np.exp(x))
  click = np.mean([bce(0.3, 1), bce(2.0, 0), bce(-0.5, 1)])
  conversion = np.mean([bce(-1.0, 1), bce(1.5, 0)])  # only clicked, real rows 0 and 2
  np.testing.assert_allclose(float(per_task["loss/click"]), click, rtol=1e-5)
  np.testing.assert_allclose(float(per_task["loss/conversion"]), conversion, rtol=1e-5)
  # Every task is normalized by the 3 real examples: conversion's 2 labels weigh 2/3 of its mean.
  np.testing.assert_allclose(float(loss), (click + conversion * 2 / 3) / 2, rtol=1e-5)
  grad = jax.jit(jax.grad(lambda z: multitask_loss(z, batch, SPEC)[0]))(jnp.asarray(logits))
  assert _finite(grad) and np.all(np.asarray(grad)[3] == 0) and float(grad[1, 1]) == 0


# ---- HSTU layer ----------------------------------------------------------------------------------
def test_hstu_layer_is_causal_and_row_local(model):
  """d out_i / d x_j over a jagged [C contextual ++ history ++ target] layout with two rows."""
  c, d = CFG.hstu.num_contextual, CFG.model_dim
  layer = model.layers[0].hstu
  assert isinstance(layer, HSTULayer) and layer.max_seq_len >= c + 4 + 1
  hist_lengths = [4, 2]
  rng = np.random.default_rng(0)
  hist = Jagged.from_rows([rng.normal(size=(n, d)).astype(np.float32) for n in hist_lengths], capacity=7)
  ctx = dense_to_jagged(jnp.asarray(rng.normal(size=(2, c, d)), jnp.float32))
  tgt = dense_to_jagged(jnp.asarray(rng.normal(size=(2, 1, d)), jnp.float32))
  rows = concat_rows(concat_rows(ctx, Jagged(jnp.asarray(hist.values), jnp.asarray(hist.offsets))), tgt)
  offsets = np.asarray(rows.offsets)
  jac = jax.jit(jax.jacrev(lambda v: layer(rows.replace_values(v), jnp.ones((2,), jnp.int32)).values))(rows.values)
  dep = np.abs(np.asarray(jac)).sum(axis=(1, 3)) > 0  # T x T: does token i depend on token j
  for r in range(2):
    start, end = offsets[r], offsets[r + 1]
    ctx_pos, target = range(start, start + c), end - 1
    for i in range(start + c, end - 1):  # history tokens
      allowed = set(ctx_pos) | set(range(start + c, i + 1))
      for j in range(dep.shape[1]):
        assert dep[i, j] == (j in allowed), f"row {r}: token {i} vs {j}"
    assert all(dep[target, j] for j in range(start, end)), "the target sees its whole row"
    assert not dep[start, target] and all(dep[start, j] for j in range(start, end - 1))
    others = [j for j in range(dep.shape[1]) if not start <= j < end]
    assert not dep[start:end][:, others].any(), f"row {r} depends on another row or on padding"


# ---- the whole model -----------------------------------------------------------------------------
def test_params_carry_sharding_names(model):
  known = {name for name, _ in DEFAULT_RULES}
  seen_names, tables = set(), {}
  for path, var in nnx.iter_graph(model):
    if not isinstance(var, nnx.Param):
      continue
    names = var.get_metadata().get("out_sharding")
    assert isinstance(names, tuple) and len(names) == var[...].ndim, f"{path}: {names} for {var[...].shape}"
    assert all(n is None or n in known for n in names), f"{path}: unknown logical name in {names}"
    logical_to_spec(names)
    seen_names.update(n for n in names if n)
    if isinstance(var, Table):
      assert names == TABLE_AXES
      tables[path[-1]] = var[...].shape
  assert tables == {t.name: (t.vocab_size, t.dim) for t in SPEC.tables}
  assert {"embed", "mlp", "heads", "features", "table_rows"} <= seen_names


def test_jit_forward_backward_finite(f32_step):
  params, run = f32_step
  batch = jax.tree.map(jnp.asarray, _batch())
  (loss, logits), grads = run(params, batch)
  assert logits.shape == (4, len(SPEC.tasks)) and logits.dtype == jnp.float32
  assert _finite(logits) and np.isfinite(float(loss)) and _finite(grads)
  # Sparse gradients: only the user_id rows of the batch move; the absent domain's tower gets nothing.
  g_user = np.asarray(grads["embeddings"]["tables"]["user_id"][...])
  used = set(np.asarray(batch.sparse["user_id"]).tolist())
  assert all(np.abs(g_user[u]).sum() > 0 for u in used)
  assert np.all(np.delete(g_user, sorted(used), axis=0) == 0)
  g_w1 = np.asarray(grads["heads"]["w1_RxGxG"][...])
  assert np.all(g_w1[2] == 0) and np.abs(g_w1[0]).sum() > 0 and np.abs(g_w1[1]).sum() > 0
  # Every dense layer of both GEM layers is reached by the loss.
  for i in range(CFG.num_layers):
    layer = grads["layers"][i]
    for leaf in (layer["hstu"]["uvqk"]["kernel"], layer["hstu"]["rel_bias_HxR"], layer["wukong"]["fm_y_FxK"],
                 layer["summary"]["query_D"], layer["context"]["proj"]["kernel"]):
      assert np.abs(np.asarray(leaf[...])).sum() > 0


def test_no_dependence_across_examples(model, f32_step):
  graphdef, state = nnx.split(model)
  batch = jax.tree.map(jnp.asarray, _batch())

  @jax.jit
  def inputs_and_jacobians(state, batch):
    inputs = nnx.merge(graphdef, state).embed(batch)

    def logits(nonseq, tokens, target):
      moved = dataclasses.replace(inputs, nonseq_BxFxE=nonseq, history=inputs.history.replace_values(tokens),
                                  target_BxD=target)
      return nnx.merge(graphdef, state).forward(moved)

    return inputs, jax.jacrev(logits, argnums=(0, 1, 2))(inputs.nonseq_BxFxE, inputs.history.values,
                                                           inputs.target_BxD)

  inputs, (jac_nonseq, jac_tokens, jac_target) = inputs_and_jacobians(state, batch)
  b = batch.batch_size
  offsets = np.asarray(inputs.history.offsets)
  token_row = np.full(inputs.history.capacity, -1)
  for r in range(b):
    token_row[offsets[r]:offsets[r + 1]] = r
  dep_nonseq = np.abs(np.asarray(jac_nonseq)).sum(axis=(1, 3, 4)) > 0  # logit row x input row
  dep_target = np.abs(np.asarray(jac_target)).sum(axis=(1, 3)) > 0
  dep_tokens = np.abs(np.asarray(jac_tokens)).sum(axis=(1, 3)) > 0  # logit row x token
  np.testing.assert_array_equal(dep_nonseq, np.eye(b, dtype=bool))
  np.testing.assert_array_equal(dep_target, np.eye(b, dtype=bool))
  np.testing.assert_array_equal(dep_tokens, token_row[None, :] == np.arange(b)[:, None])

  # End to end through the ids: a new history for example 2 moves only example 2's logits.
  params, run = f32_step
  logits_fn = lambda batch: np.asarray(run(params, batch)[0][1])
  base = logits_fn(batch)
  hist = np.asarray(batch.history.values).copy()
  hist[offsets[2]:offsets[3], 0] = (hist[offsets[2]:offsets[3], 0] + 7) % SPEC.table("ad_id").vocab_size
  moved = logits_fn(dataclasses.replace(batch, history=Jagged(jnp.asarray(hist), batch.history.offsets)))
  np.testing.assert_allclose(np.delete(moved, 2, axis=0), np.delete(base, 2, axis=0), rtol=0, atol=1e-6)
  assert np.abs(moved[2] - base[2]).max() > 1e-6


def test_bf16_compute_and_params(model, f32_step):
  # One GEM layer: the per-layer code is the one the f32 tests run with two, and a bf16 compile on
  # CPU costs about twice an f32 one.
  cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", param_dtype="bfloat16", num_layers=1,
                            hstu=dataclasses.replace(CFG.hstu, keep_last=CFG.hstu.keep_last[:1]))
  bf16_model = nnx.eval_shape(lambda: GEM(SPEC, cfg, rngs=nnx.Rngs(0)))
  params = nnx.state(bf16_model, nnx.Param)
  assert {v.dtype for v in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}, "param_dtype is ignored"
  # Reuse (a cast of) the f32 model's weights instead of compiling every initializer again.
  weights = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  del weights["layers"][1]
  to_bf16 = lambda x: jnp.asarray(np.asarray(x).astype(jnp.bfloat16))  # numpy: no per-shape compile
  nnx.replace_by_pure_dict(params, jax.tree.map(to_bf16, weights))
  nnx.update(bf16_model, params)
  params, run = _loss_and_grad(bf16_model)
  batch = jax.tree.map(jnp.asarray, _batch())
  (loss, logits), grads = run(params, batch)
  assert logits.dtype == jnp.float32 and _finite(logits) and _finite(grads) and np.isfinite(float(loss))
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
  assert np.abs(np.asarray(grads["layers"][0]["hstu"]["uvqk"]["kernel"][...], np.float32)).sum() > 0


def test_no_relative_bias_has_no_parameter_and_equals_a_zero_bias():
  """rel_pos_buckets=0: the layer holds no bias and the attention adds none, which is exactly a layer whose
  bias is zero (its init); with a bias that is not zero the two differ."""
  def layer(buckets):
    cfg = dataclasses.replace(CFG, hstu=dataclasses.replace(CFG.hstu, rel_pos_buckets=buckets))
    return HSTULayer(cfg, 12, site="l", rngs=nnx.Rngs(0))

  with_bias, without = layer(8), layer(0)
  assert without.rel_bias_HxR is None and "rel_bias_HxR" not in nnx.state(without, nnx.Param)
  x = dense_to_jagged(jax.random.normal(jax.random.key(1), (3, 12, 16)), capacity=40)
  x = Jagged(x.values, jnp.array([0, 5, 5, 17], jnp.int32))
  a, b = with_bias(x).values[:17], without(x).values[:17]
  assert np.array_equal(np.asarray(a), np.asarray(b))
  with_bias.rel_bias_HxR[...] = jnp.full((2, 8), 0.5)
  assert not np.allclose(np.asarray(with_bias(x).values[:17]), np.asarray(b))
  with pytest.raises(ValueError, match="rel_pos_buckets must be an integer >= 0"):
    HSTUConfig(rel_pos_buckets=-1)


def test_stu_layer_form_is_generative_recommenders_production_layer():
  """layer_form="stu": SiLU on u only, and an output projection without bias over [u, attn, LN(attn) * u]
  of each head; computed here step by step from the layer's parameters with the reference attention."""
  cfg = dataclasses.replace(CFG, hstu=dataclasses.replace(CFG.hstu, layer_form="stu", rel_pos_buckets=8))
  layer = HSTULayer(cfg, 12, site="l", rngs=nnx.Rngs(0))
  layer.rel_bias_HxR[...] = jax.random.normal(jax.random.key(2), (2, 8))
  h, dh, dv = cfg.hstu.num_heads, cfg.hstu.head_dim, cfg.hstu.value_dim
  assert layer.out.bias is None and layer.out.kernel.shape == (3 * h * dv, cfg.model_dim)
  x = dense_to_jagged(jax.random.normal(jax.random.key(1), (3, 12, 16)), capacity=40)
  x = Jagged(x.values, jnp.array([0, 5, 5, 17], jnp.int32))

  def ln(v, norm):
    mean = v.mean(-1, keepdims=True)
    var = ((v - mean) ** 2).mean(-1, keepdims=True)
    return (v - mean) * jax.lax.rsqrt(var + 1e-5) * norm.scale[...][None] + norm.bias[...][None]

  t = x.values.shape[0]
  uvqk = (ln(x.values, layer.norm_in) @ layer.uvqk.kernel[...] + layer.uvqk.bias[...][None]).reshape(t, h, -1)
  u, v, q, k = jnp.split(uvqk, [dv, 2 * dv, 2 * dv + dh], axis=-1)
  attn = ops.hstu_attention(q, k, v, x.offsets, max_seq_len=12, alpha=dh ** -0.5, causal=True, contextual_seq_len=1,
                            rel_bias_HxR=layer.rel_bias_HxR[...], impl="reference")
  gated = ln(attn.reshape(t, h * dv), layer.norm_attn).reshape(t, h, dv) * jax.nn.silu(u)
  y = jnp.concatenate([jax.nn.silu(u), attn, gated], axis=-1).reshape(t, -1) @ layer.out.kernel[...]
  np.testing.assert_allclose(np.asarray(layer(x).values[:17]), np.asarray((x.values + y)[:17]), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="layer_form must be 'research' or 'stu'"):
    HSTUConfig(layer_form="sasrec")


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.9])
def test_dropout_keeps_its_rate_scales_to_the_expectation_and_draws_each_element_apart(rate):
  """layers.dropout on 1.6M elements with an odd last axis: the kept fraction is 1 - rate (within 5 standard
  errors), a kept element is x / k for the kept probability k, neighbours (one 32-bit draw's two halves) and
  the padded last column are kept independently, one key gives one mask and another key another."""
  x = jnp.full((1000, 1601), 3.0, jnp.float32)
  key = jax.random.key(7)
  out = np.asarray(layers.dropout(x, rate, key))
  kept = out != 0
  k = 1.0 - rate
  n = kept.size
  assert abs(kept.mean() - k) < 5 * np.sqrt(k * (1 - k) / n)
  np.testing.assert_allclose(out[kept], 3.0 * 65536 / round(k * 65536), rtol=1e-6)
  # Neighbours share a draw: P(both kept) must be k^2, not k (same half) or anything else.
  both = (kept[:, :-1:2] & kept[:, 1::2]).mean()
  assert abs(both - k * k) < 5 * np.sqrt(k * k * (1 - k * k) / (n // 2))
  assert abs(kept[:, -1].mean() - k) < 5 * np.sqrt(k * (1 - k) / kept.shape[0])
  np.testing.assert_array_equal(np.asarray(layers.dropout(x, rate, key)), out)
  assert (np.asarray(layers.dropout(x, rate, jax.random.key(8))) != out).any()
  assert layers.dropout(x, rate, None) is x and layers.dropout(x, 0.0, key) is x
