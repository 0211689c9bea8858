"""The next-item comparison towers and losses: SASRec and eSASRec blocks against a per-row dense computation,
per-token sampled softmax and BCE against numpy, every tower training through the spine, the test split read
only after training, and the seed summary of experiments/seqrec.py --seeds."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import configs, ops
from gem_jax.config import apply_overrides
from gem_jax.data import seqrec_source
from gem_jax.jagged import Jagged
from gem_jax.model.seqrec import SeqRecModel, SeqRecModelConfig
from gem_jax.run import next_item
from gem_jax.run.build import build
from gem_jax.run.next_item import NextItemConfig
from gem_jax.train import jobs, seqrec_results
from tests.data_helpers import fixed_batch_losses, toy_u_data


# ---- the blocks against a dense computation, one row at a time ------------------------------------------
def _ln(x, norm):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-5) * np.asarray(norm.scale[...]) + np.asarray(norm.bias[...])


def _dense(x, layer):
  y = x @ np.asarray(layer.kernel[...])
  return y if layer.bias is None else y + np.asarray(layer.bias[...])


def _mha(q_in, kv_in, block, heads):
  n, d = q_in.shape
  q = _dense(q_in, block.q).reshape(n, heads, d // heads)
  k, v = np.split(_dense(kv_in, block.kv), 2, axis=-1)
  k, v = k.reshape(n, heads, d // heads), v.reshape(n, heads, d // heads)
  logits = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d // heads)
  logits = np.where(np.tril(np.ones((n, n), bool))[None], logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return _dense(np.einsum("hij,jhd->ihd", w, v).reshape(n, d), block.attn_out)


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _dense_row(model, ids, heads):
  """One row through the model in numpy, straight from the formulas of gem_jax/model/sasrec.py."""
  cfg = model.cfg
  x = np.asarray(model.item_emb_IxD[...])[ids] * (cfg.dim ** 0.5 if cfg.embed_scale else 1.0)
  pos = np.arange(len(ids))
  x = x + np.asarray(model.pos_emb_NxD[...])[pos[::-1] if cfg.positions == "from_end" else pos]
  for b in model.layers:
    if cfg.arch == "sasrec":
      q = _ln(x, b.norm_attn)
      x = q + _mha(q, x, b, heads)
      z = _ln(x, b.norm_ffn)
      x = z + _dense(np.maximum(_dense(z, b.ffn_in), 0), b.ffn_out)
    else:
      h = _ln(x, b.norm_attn)
      x = x + _sigmoid(_dense(x, b.gate_attn)) * _mha(h, h, b, heads)
      a, g = np.split(_dense(_ln(x, b.norm_ffn), b.ffn_in), 2, axis=-1)
      x = x + _sigmoid(_dense(x, b.gate_ffn)) * _dense(a * _sigmoid(a) * g, b.ffn_out)
  if cfg.arch == "sasrec":
    x = _ln(x, model.final_norm)
  return x / np.linalg.norm(x, axis=-1, keepdims=True) if cfg.normalize else x


@pytest.mark.parametrize("arch,normalize,positions,block", [("sasrec", False, "from_end", 0),
                                                             ("esasrec", True, "from_start", 4)])
def test_softmax_blocks_match_a_dense_computation_row_by_row(arch, normalize, positions, block):
  """block 4: tiles of the xla loop that straddle rows (lengths 3, 6, 1)."""
  cfg = SeqRecModelConfig(dim=8, num_layers=2, num_heads=2, max_len=6, dropout_rate=0.3, attn_impl="xla", arch=arch,
                          ffn_multiplier=2, normalize=normalize, embed_scale=False, positions=positions,
                          attn_block=block)
  model = SeqRecModel(cfg, num_items=11, rngs=nnx.Rngs(3))
  # Non-trivial norms and gate biases, so a swapped or missing term shows.
  rng = np.random.default_rng(0)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param) and var[...].ndim == 1:
      var[...] = jnp.asarray(rng.normal(size=var[...].shape), jnp.float32)
  rows = [np.array([3, 4, 5], np.int32), np.array([7, 1, 2, 9, 10, 11], np.int32), np.array([6], np.int32)]
  values = np.concatenate(rows + [np.zeros(6, np.int32)])
  offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
  got = np.asarray(model.encode(Jagged(values, offsets)))
  for r, start in zip(rows, offsets):
    np.testing.assert_allclose(got[start:start + len(r)], _dense_row(model, r, heads=2), rtol=2e-4, atol=2e-5)
  dropped = np.asarray(model.encode(Jagged(values, offsets), dropout_rng=jax.random.key(0)))
  assert not np.allclose(dropped[:offsets[-1]], got[:offsets[-1]])
  # The output table: dropout only with table_dropout and a key.
  table = np.asarray(model.item_table())
  np.testing.assert_array_equal(np.asarray(model.item_table(jax.random.key(0))), table)
  model.cfg = dataclasses.replace(cfg, table_dropout=True)
  np.testing.assert_array_equal(np.asarray(model.item_table()), table)
  zeroed = np.asarray(model.item_table(jax.random.key(0))) == 0
  assert 0.1 < zeroed.mean() < 0.5


def test_tower_settings_are_checked(monkeypatch):
  with pytest.raises(ValueError, match="arch must be one of"):
    SeqRecModelConfig(arch="bert4rec")
  with pytest.raises(ValueError, match="positions must be 'from_start' or 'from_end'"):
    SeqRecModelConfig(positions="relative")
  with pytest.raises(ValueError, match="ffn_multiplier must be >= 1"):
    SeqRecModelConfig(arch="sasrec", ffn_multiplier=0)
  with pytest.raises(ValueError, match="heads do not divide the width 10"):
    SeqRecModel(SeqRecModelConfig(dim=10, num_heads=3, arch="sasrec"), num_items=4, rngs=nnx.Rngs(0))
  amazon = configs.seqrec("toys")
  assert (amazon.model.dim, amazon.model.head_dim, amazon.task.temperature) == (128, 128, 0.1)
  ss, bce = configs.seqrec("beauty", tower="sasrec-ss"), configs.seqrec("ml-1m", tower="sasrec-bce")
  assert (ss.model.arch, ss.model.dim, ss.model.num_layers, ss.model.normalize) == ("sasrec", 64, 1, False)
  assert (ss.task.loss, ss.task.negatives, ss.task.num_negatives) == ("sampled_softmax", "per_token", 256)
  assert (bce.task.loss, bce.task.num_negatives, bce.model.num_layers, bce.model.max_len) == ("bce", 1, 2, 200)
  with pytest.raises(ValueError, match="unknown tower 'bert4rec'"):
    configs.seqrec("beauty", tower="bert4rec")
  with pytest.raises(ValueError, match="task.negatives: must be one of"):
    NextItemConfig(negatives="in_batch")
  no_bias = SeqRecModel(SeqRecModelConfig(dim=8, head_dim=4, value_dim=4, rel_bias=False), 5, rngs=nnx.Rngs(0))
  assert all(layer.rel_bias_HxR is None for layer in no_bias.layers)
  assert no_bias.layers[0].qk_scale == pytest.approx(0.5)   # 1 / sqrt(head_dim 4)
  raw = SeqRecModel(SeqRecModelConfig(dim=8, head_dim=4, value_dim=4, qk_scale=1.0), 5, rngs=nnx.Rngs(0))
  assert raw.layers[0].qk_scale == 1.0
  with pytest.raises(ValueError, match="qk_scale must be >= 0"):
    SeqRecModelConfig(qk_scale=-1.0).hstu_model_config()
  for field in ("attn_block", "attn_group"):
    with pytest.raises(ValueError, match="attn_block and attn_group must be >= 0"):
      SeqRecModelConfig(**{field: -1})
  with pytest.raises(ValueError, match="block=32, group=4 is a setting of the 'xla' impl, not of 'reference'"):
    ops.jagged_softmax_attention(*(jnp.zeros((4, 1, 2)),) * 3, jnp.array([0, 4]), max_seq_len=4, scale=1.0,
                                 impl="reference", block=32, group=4)
  # On a GPU "auto" resolves to pallas, which has no such block: a preset's block is dropped, not refused.
  seen = {}
  monkeypatch.setitem(ops._SOFTMAX_IMPLS, "pallas", lambda *a, **kw: seen.update(kw) or a[2])
  monkeypatch.setattr(ops.runtime, "platform", lambda: "gpu")
  ops.jagged_softmax_attention(*(jnp.zeros((4, 1, 2)),) * 3, jnp.array([0, 4]), max_seq_len=4, scale=1.0, block=32,
                               group=4)
  assert seen and "block" not in seen and "group" not in seen
  monkeypatch.undo()
  tiled = SeqRecModel(SeqRecModelConfig(dim=8, head_dim=4, value_dim=4, attn_tiles="64x8"), 5, rngs=nnx.Rngs(0))
  assert tiled.layers[0].attn_tiles == ops.TileConfig(64, 8)
  with pytest.raises(ValueError, match="attn_tiles must be 'default', 'auto'"):
    SeqRecModelConfig(attn_tiles="64").hstu_model_config()
  blocked = SeqRecModel(SeqRecModelConfig(dim=8, arch="sasrec", attn_block=32, attn_group=4), 5, rngs=nnx.Rngs(0))
  assert (blocked.layers[0].attn_block, blocked.layers[0].attn_group) == (32, 4)
  assert configs.seqrec("ml-1m", tower="sasrec-ss").model.attn_block == 32
  assert configs.seqrec("beauty", tower="sasrec-ss").model.attn_block == 0


# ---- per-token losses --------------------------------------------------------------------------------------
def test_per_token_sampled_softmax_and_bce_match_numpy():
  rng = np.random.default_rng(2)
  T, D, I, K = 6, 4, 9, 5
  user = rng.normal(size=(T, D)).astype(np.float32)
  table = rng.normal(size=(I + 1, D)).astype(np.float32)
  targets = np.array([1, 2, 3, 4, 0, 6], np.int32)
  negatives = rng.integers(1, I + 1, (T, K)).astype(np.int32)
  negatives[0, 2] = 1  # an accidental hit
  zeros = np.zeros(T, np.float32)
  got_ss = float(next_item.mean_loss(next_item.sampled_softmax_loss_sums, user, table, targets, negatives, 0.0,
                                     zeros, 0.5))
  got_bce = float(next_item.mean_loss(next_item.bce_loss_sums, user, table, targets, negatives, 0.0, zeros, 0.5))
  softplus = lambda x: np.log1p(np.exp(x))
  want_ss, want_bce = [], []
  for t in (0, 1, 2, 3, 5):
    pos = user[t] @ table[targets[t]] / 0.5
    neg = [user[t] @ table[n] / 0.5 for n in negatives[t] if n != targets[t]]
    want_ss.append(np.log(np.exp(pos) + np.sum(np.exp(neg))) - pos)
    want_bce.append(softplus(-pos) + sum(softplus(x) for x in neg))
  assert got_ss == pytest.approx(np.mean(want_ss), rel=1e-5)
  assert got_bce == pytest.approx(np.mean(want_bce), rel=1e-5)


def _toy_cfg(tmp_path, *sets):
  return apply_overrides(configs.seqrec("ml-100k", quick=True), [
      f"data.data_dir={toy_u_data(tmp_path)}", "data.batch_size=8", "data.uniform_negatives=6",
      "data.batch_negatives=2", "data.token_multiple=64", *sets])


@pytest.mark.parametrize("arch", ["hstu", "esasrec"])
def test_every_dense_site_of_the_next_item_model_is_its_module_path(arch):
  from gem_jax.model.layers import Dense, dense_sites
  model = nnx.eval_shape(lambda: SeqRecModel(SeqRecModelConfig(dim=8, head_dim=4, value_dim=4, num_layers=2, arch=arch,
                                                               hstu_ffn=arch == "hstu", max_len=6), 9,
                                             rngs=nnx.Rngs(0)))
  paths = {".".join(str(p) for p in path): m for path, m in nnx.iter_modules(model) if isinstance(m, Dense)}
  sites = dict(dense_sites(model))
  assert sites.keys() == paths.keys() and all(sites[k] is paths[k] for k in paths), (sorted(sites), sorted(paths))


def test_hstu_ffn_follows_each_hstu_layer_with_the_gated_feed_forward():
  """hstu_ffn: layer i's output goes through FFN i (eSASRec's formula, in numpy here) before layer i + 1; the
  HSTU layers' own parameters are created as without it."""
  cfg = SeqRecModelConfig(dim=8, head_dim=4, value_dim=4, num_layers=2, hstu_ffn=True, ffn_multiplier=2, max_len=6)
  model = SeqRecModel(cfg, 9, rngs=nnx.Rngs(0))
  plain = SeqRecModel(dataclasses.replace(cfg, hstu_ffn=False), 9, rngs=nnx.Rngs(0))
  assert plain.ffns is None and len(model.ffns) == 2 and model.ffns[1].ffn_in.kernel.shape == (8, 32)
  mine, theirs = (jax.tree.leaves(nnx.state(m.layers, nnx.Param)) for m in (model, plain))
  assert len(mine) == len(theirs) > 0
  for a, b in zip(mine, theirs):
    np.testing.assert_array_equal(a, b)
  ids = jnp.array([3, 1, 4, 1, 5, 2, 6], jnp.int32)
  items = Jagged(ids, jnp.array([0, 4, 7], jnp.int32))
  x = Jagged(cfg.dim ** 0.5 * model.item_emb_IxD[...][ids] + model.pos_emb_NxD[...][items.positions()], items.offsets)
  for layer, ffn in zip(model.layers, model.ffns):
    h = np.asarray(layer(x).values)
    a, g = np.split(_dense(_ln(h, ffn.norm_ffn), ffn.ffn_in), 2, axis=-1)
    h = h + _sigmoid(_dense(h, ffn.gate_ffn)) * _dense(a * _sigmoid(a) * g, ffn.ffn_out)
    x = x.replace_values(jnp.asarray(h, jnp.float32))
  want = np.asarray(x.values) / np.linalg.norm(np.asarray(x.values), axis=-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(model.encode(items)), want, rtol=2e-5, atol=2e-6)
  assert not np.allclose(np.asarray(plain.encode(items)), want, atol=1e-3)
  with pytest.raises(ValueError, match="hstu_ffn adds a feed-forward to HSTU layers; arch 'sasrec'"):
    SeqRecModelConfig(arch="sasrec", hstu_ffn=True)


@pytest.mark.parametrize("sets", [
    ("model.arch=sasrec", "model.normalize=false", "task.temperature=1.0", "task.negatives=per_token",
     "task.num_negatives=8"),
    ("model.arch=esasrec", "model.ffn_multiplier=2", "task.loss=bce", "task.negatives=per_token",
     "task.num_negatives=1", "task.temperature=1.0", "model.normalize=false"),
    ("model.rel_bias=false", "model.embed_scale=false"),
    ("model.hstu_ffn=true", "model.ffn_multiplier=2"),
], ids=["sasrec-ss", "esasrec-bce", "hstu-no-bias", "hstu-ffn"])
def test_every_tower_and_loss_trains_through_the_spine(tmp_path, sets):
  cfg = _toy_cfg(tmp_path, "model.dropout_rate=0.0", "train.learning_rate=0.01", *sets)
  run = build(cfg)
  _, losses = fixed_batch_losses(run, 25)
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses  # per-token negatives: a new draw every step


# ---- the protocol: test read once, after training -------------------------------------------------------
def test_the_test_split_is_read_only_after_the_last_training_step(tmp_path, monkeypatch):
  events = []
  real_next, real_eval = seqrec_source._Epochs.__next__, seqrec_source.SeqRecSource.eval_batches

  def train_next(self):
    events.append("train")
    return real_next(self)

  def eval_batches(self, split):
    events.append(split)
    return real_eval(self, split)

  monkeypatch.setattr(seqrec_source._Epochs, "__next__", train_next)
  monkeypatch.setattr(seqrec_source.SeqRecSource, "eval_batches", eval_batches)
  cfg = _toy_cfg(tmp_path, "train.epochs=6", "train.eval_every_epochs=2", "train.patience=0")
  summary = jobs.train_config(cfg, str(tmp_path / "run"), progress=False, report=False)
  first_test = events.index("test")
  assert "train" in events[:first_test] and "train" not in events[first_test:], events
  assert events[:first_test].count("valid") >= 3, events  # the periodic evaluations read validation only
  assert set(summary["test"]) == cfg.task.metric_names()
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert not any(key.startswith("test/") for row in logged for key in row)


def test_training_through_validation_reads_the_test_split_once_after_fixed_epochs(tmp_path, monkeypatch):
  """HSTU's protocol (data.train_through_valid): the validation item is a training target, nothing is
  evaluated during training, nothing selects, and the test split is read after the last step."""
  with pytest.raises(ValueError, match=r"train.epochs=20, train.select_metric='NDCG@10', train.eval_every_epochs=5"):
    seqrec_source.SeqRecSource(_toy_cfg(tmp_path, "data.train_through_valid=true"))
  with pytest.raises(ValueError, match=r"\(got train.epochs=4, train.max_train_minutes=30.0\)"):
    seqrec_source.SeqRecSource(_toy_cfg(tmp_path, "data.train_through_valid=true", "train.epochs=4",
                                        "train.select_metric=", "train.eval_every_epochs=0",
                                        "train.max_train_minutes=30"))
  events = []
  real_next, real_eval = seqrec_source._Epochs.__next__, seqrec_source.SeqRecSource.eval_batches

  def train_next(self):
    batch = real_next(self)
    events.append(("train", batch))
    return batch

  def eval_batches(self, split):
    events.append((split, None))
    return real_eval(self, split)

  monkeypatch.setattr(seqrec_source._Epochs, "__next__", train_next)
  monkeypatch.setattr(seqrec_source.SeqRecSource, "eval_batches", eval_batches)
  cfg = _toy_cfg(tmp_path, "data.train_through_valid=true", "train.epochs=4", "train.select_metric=",
                 "train.eval_every_epochs=0", "train.eval_every=1")
  source = seqrec_source.SeqRecSource(cfg)
  assert source.eval_splits == ("test",) and source.monitor_split is None
  # Every user's validation item is the next item of its last training token.
  held_out = dict(zip(range(len(source.split.valid.targets)), source.split.valid.targets.tolist()))
  batch = next(iter(source.train_iterator()))
  items, targets = np.asarray(batch.items.values), np.asarray(batch.targets_T)
  ends = np.asarray(batch.items.offsets)[1:] - 1
  trained = {int(items[e]) for e in ends if e >= 0} | set(targets[targets > 0].tolist())
  assert len(set(held_out.values()) & trained) > 0
  for user, seq in enumerate(source.dataset.sequences):
    assert source.split.train[user].tolist() == seq[:-1].tolist()
  events.clear()
  run_dir = tmp_path / "run"
  results = jobs.train_next_item(cfg, str(run_dir), report=False, log=lambda s: None)
  names = [e for e, _ in events]
  first_test = names.index("test")
  assert "train" not in names[first_test:] and names[:first_test].count("train") >= results["steps"], names
  assert results["valid"] is None and results["best_step"] is None and set(results["test"]) == cfg.task.metric_names()
  logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert not any(key.startswith(("test/", "valid/")) for row in logged for key in row)  # eval_every=1 is moot
  summary = seqrec_results.seed_summary([{"seed": 0, "valid": None, "test": results["test"]}])
  assert "valid" not in summary and summary["test"]["mean"]["hr@10"] == results["test"]["HR@10"]
  row, = seqrec_results.ablation_rows([str(run_dir)])
  assert row["valid"] is None and row["epochs"] == row["kept_epoch"] == 4
  assert row["changes"]["data.train_through_valid"] is True
  assert "| - | - | 4 (4) |" in seqrec_results.markdown([row])


# ---- seeds --------------------------------------------------------------------------------------------------
def test_seed_summary_is_the_mean_and_sample_std_of_the_runs():
  runs = [{"seed": s, "valid": {"HR@10": v, "NDCG@10": v / 2}, "test": {"HR@10": t, "NDCG@10": t / 4}}
          for s, v, t in ((0, .1, .2), (1, .3, .4), (2, .2, .9))]
  out = seqrec_results.seed_summary(runs)
  assert out["test"]["mean"]["hr@10"] == pytest.approx(0.5) and out["test"]["std"]["hr@10"] == pytest.approx(
      np.std([.2, .4, .9], ddof=1))
  assert out["valid"]["mean"]["ndcg@10"] == pytest.approx(0.1)
  assert out["test"]["seeds"][1] == {"seed": 1, "hr@10": .4, "ndcg@10": .1}
  assert seqrec_results.seed_summary(runs[:1])["test"]["std"] == {"hr@10": 0.0, "ndcg@10": 0.0}


def test_curves_read_every_evaluation_of_finished_and_unfinished_runs(tmp_path):
  def run(name, evals):
    folder = tmp_path / name
    folder.mkdir()
    lines = [{"loss": 9.0, "step": 50}]   # training records carry no epoch: skipped
    lines += [{"eval_step": 10 * e, "epoch": e, "valid/HR@10": hr, "valid/NDCG@10": hr / 2, "valid/HR@50": 1.0}
              for e, hr in evals]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(folder)

  got = seqrec_results.curves({"preset": run("a", [(5, .10), (10, .20), (15, .25)]), "cut": run("b", [(5, .12)])})
  assert got == {"preset": {5: {"HR@10": .10, "NDCG@10": .05}, 10: {"HR@10": .20, "NDCG@10": .10},
                            15: {"HR@10": .25, "NDCG@10": .125}},
                 "cut": {5: {"HR@10": .12, "NDCG@10": .06}}}
  table = seqrec_results.curves_markdown(got, "HR@10").splitlines()
  assert table[0] == "| epoch | preset | cut |"
  assert table[2] == "| 5 | 0.1000 | 0.1200 |" and table[3] == "| 10 | 0.2000 |  |"
  with pytest.raises(ValueError, match="no validation records"):
    seqrec_results.curves({"x": run("c", [])})
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    seqrec_results.curves({"x": str(tmp_path / "missing")})


@pytest.mark.slow
def test_seeds_train_apart_and_a_finished_seed_is_read_not_retrained(tmp_path):
  cfg = _toy_cfg(tmp_path, "train.epochs=2", "train.eval_every_epochs=1", "train.patience=0")
  out = tmp_path / "seeds"
  first = jobs.train_next_item_seeds(cfg, str(out), [0, 1], report=False, command="cmd", log=lambda s: None)
  per_seed = [json.loads((out / f"seed-{s}" / "results.json").read_text()) for s in (0, 1)]
  assert [r["config"]["train"]["seed"] for r in per_seed] == [0, 1]
  assert [r["config"]["data"]["seed"] for r in per_seed] == [0, 1]
  assert per_seed[0]["test"] != per_seed[1]["test"]
  assert first["test"]["mean"]["ndcg@10"] == pytest.approx(np.mean([r["test"]["NDCG@10"] for r in per_seed]))
  assert json.loads((out / "seeds.json").read_text())["command"] == "cmd"
  lines = []
  again = jobs.train_next_item_seeds(cfg, str(out), [0, 1], report=False, log=lines.append)
  assert again["test"] == first["test"] and lines[:2] == [f"seed {s}: read {out}/seed-{s}/results.json" for s in (0, 1)]
  with pytest.raises(ValueError, match=r"seed-0/results.json was trained with another config .*'train.epochs': 2"):
    jobs.train_next_item_seeds(apply_overrides(cfg, ["train.epochs=3"]), str(out), [0], report=False)
  # A results.json written before a field existed counts with that field's default: a run from before
  # train.ema_decay is a seed of a config without averaging, not of one that averages.
  stored = json.loads((out / "seed-0" / "results.json").read_text())
  del stored["config"]["train"]["ema_decay"]
  (out / "seed-0" / "results.json").write_text(json.dumps(stored))
  assert jobs.train_next_item_seeds(cfg, str(out), [0], report=False, log=lambda s: None)["test"]["seeds"] == \
      first["test"]["seeds"][:1]
  with pytest.raises(ValueError, match=r"another config .*'train.ema_decay': 0.0"):
    jobs.train_next_item_seeds(apply_overrides(cfg, ["train.ema_decay=0.5"]), str(out), [0], report=False)
  # The kept parameters (best/) evaluate to the run's own numbers; without history exclusion, to others.
  seeded = apply_overrides(cfg, ["train.seed=1", "data.seed=1"])
  kept = jobs.evaluate_checkpoint(seeded, str(out / "seed-1"), folder="best")
  assert kept["step"] == per_seed[1]["best_step"] and kept["evaluation"]["test"] == per_seed[1]["test"]
  unfiltered = jobs.evaluate_checkpoint(apply_overrides(seeded, ["data.exclude_history=false"]), str(out / "seed-1"),
                                        folder="best")
  assert unfiltered["evaluation"]["test"] != per_seed[1]["test"]
  rows = seqrec_results.ablation_rows([str(out / "seed-1")])
  assert rows[0]["changes"]["train.seed"] == 1 and rows[0]["changes"]["data.batch_size"] == 8
  assert "data.data_dir" not in rows[0]["changes"] and "model.arch" not in rows[0]["changes"]
  assert rows[0]["valid"]["NDCG@10"] == per_seed[1]["valid"]["NDCG@10"] and rows[0]["epochs"] == 2
  assert "| seed-1 | " in seqrec_results.markdown(rows)
  with pytest.raises(FileNotFoundError, match="no results.json"):
    seqrec_results.ablation_rows([str(tmp_path)])
  # A run stopped off an epoch boundary (a time limit): the kept epoch is its evaluation's own, 20, where
  # steps / last epoch (1234 / 25) would give 960 / 49.4 = 19.
  stopped = json.loads((out / "seed-1" / "results.json").read_text())
  stopped.update(steps=1234, best_step=960, history=[{**stopped["history"][-1], "eval_step": 960, "epoch": 20},
                                                     {**stopped["history"][-1], "eval_step": 1234, "epoch": 25}])
  (tmp_path / "stopped").mkdir()
  (tmp_path / "stopped" / "results.json").write_text(json.dumps(stopped))
  row, = seqrec_results.ablation_rows([str(tmp_path / "stopped")])
  assert (row["epochs"], row["kept_epoch"]) == (25, 20)
  # Each seed records the file it read; a finished seed of another file (here one line more) is refused.
  assert per_seed[0]["stats"]["file"] == os.path.join("ml-100k", "u.data") and len(per_seed[0]["stats"]["sha256"]) == 64
  u_data = tmp_path / "ml-100k" / "u.data"
  u_data.write_text(u_data.read_text() + "1\t30\t4\t999\n")
  with pytest.raises(ValueError, match=r"seed-0/results.json was trained on ml-100k/u.data \(sha256 \w{12}\), but "
                                       r"this run would read ml-100k/u.data \(sha256 \w{12}\)"):
    jobs.train_next_item_seeds(cfg, str(out), [0], report=False)


def test_a_dataset_with_no_training_pair_is_refused_when_the_source_is_built(tmp_path):
  """Every user with 3 interactions: leave-one-out leaves each one training item, no (input, next item) pair,
  so an epoch would be empty (and a run would train on nothing, or fail elsewhere with another reason)."""
  root = tmp_path / "three"
  (root / "ml-100k").mkdir(parents=True)
  (root / "ml-100k" / "u.data").write_text("".join(f"{u}\t{u + t}\t4\t{t}\n" for u in range(1, 9) for t in range(3)))
  with pytest.raises(ValueError, match="no user of 'ml-100k' has two training items.*at least 4 interactions"):
    seqrec_source.SeqRecSource(_toy_cfg(tmp_path, f"data.data_dir={root}"))


def test_history_exclusion_can_be_switched_off_to_measure_it(tmp_path):
  on = seqrec_source.SeqRecSource(_toy_cfg(tmp_path))
  off = seqrec_source.SeqRecSource(_toy_cfg(tmp_path, "data.exclude_history=false"))
  for split in ("valid", "test"):
    for a, b in zip(on.eval_batches(split), off.eval_batches(split)):
      real = np.asarray(a.row_mask_B) > 0
      assert np.all(np.asarray(b.exclude_BxI)[:, 0]) and not np.asarray(b.exclude_BxI)[:, 1:].any()
      assert np.all(np.asarray(a.exclude_BxI)[real, 1:].sum(axis=1) >= 1)  # every real row has a history
  assert off.popularity_baseline("test", (10,))["HR@10"] <= on.popularity_baseline("test", (10,))["HR@10"]
