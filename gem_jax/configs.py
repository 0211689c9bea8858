"""Named configs, from `tiny` (tests) through `small` (the CPU default) to `base` / `large` / `xl` (GPUs),
and the next-item recipes of the public datasets (`seqrec(dataset)`, "seqrec_<dataset>" in CONFIGS).

Each function's docstring gives the command, the hardware it is sized for, the parameter counts (sparse
embedding rows x width apart from dense) and the model FLOPs per example of the forward pass at the
stream's mean history length (gem_jax/observe/flops.py; a train step costs ~3x). tests/test_configs.py
recomputes every one of these numbers, so they cannot drift from the code.

Model FLOPs count matmuls over real (unpadded) tokens; attention counts every (query, key) pair of a
sequence once (dense convention), so a causal kernel that skips masked pairs does about half of it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from gem_jax.config import Config, TrainConfig
from gem_jax.data.pipeline import PipelineConfig
from gem_jax.data.seqrec import DATASETS
from gem_jax.data.seqrec_source import SeqRecDataConfig
from gem_jax.data.sources import DataConfig
from gem_jax.data.spec import ads_feature_spec
from gem_jax.data.synthetic import SyntheticConfig
from gem_jax.model.config import HSTUConfig, ModelConfig, WukongConfig
from gem_jax.model.seqrec import SeqRecModelConfig
from gem_jax.run.next_item import NextItemConfig
from gem_jax.run.tasks import AdsMultiTaskConfig

CONFIGS: dict[str, Callable[[], Config]] = {}


def register(fn: Callable[[], Config]) -> Callable[[], Config]:
  CONFIGS[fn.__name__] = fn
  return fn


def get(name: str) -> Config:
  if name not in CONFIGS:
    raise KeyError(f"unknown config {name!r}; known: {sorted(CONFIGS)}")
  return CONFIGS[name]()


@register
def tiny() -> Config:
  """Unit tests and smoke runs: `python experiments/train.py --config tiny --out runs/tiny` (CPU).

  params: 55.1K sparse, 59.9K dense; forward FLOPs/example at 16 history tokens: 6.78e+05
  """
  spec = ads_feature_spec(users=1_000, ads=2_000, advertisers=100, categories=20, embed_dim=16,
                          max_history=32, max_interests=4, num_domains=2)
  model = ModelConfig(embed_dim=16, model_dim=32, num_layers=2,
                      hstu=HSTUConfig(num_heads=2, head_dim=16, value_dim=16, keep_last=(32, 16),
                                      num_contextual=2, rel_pos_buckets=16),
                      wukong=WukongConfig(fm_outputs=4, lcb_outputs=4, fm_rank=4, mlp_hidden=64),
                      num_recent=2, tower_hidden=32)
  data = DataConfig(spec, SyntheticConfig(seed=0, history_mu=2.5, history_sigma=0.8, calibration_examples=8192),
                    # One history bucket: tests compile each step function once.
                    PipelineConfig(batch_size=32, history_bucket_fractions=(1.0,), read_threads=1,
                                   prefetch_buffer_size=2))
  # A one-step profiler window: tiny's runs are tests and smoke runs, mostly on 1-8 virtual CPU devices, where
  # stopping the trace of one cpu_8 step (13k XLA op events) takes ~1.3 s, against ~0.1 s for the step.
  train = TrainConfig(steps=20, warmup_steps=2, eval_every=10, eval_examples=256, checkpoint_every=10,
                      log_every=5, profile_steps=1)
  return Config("tiny", model, data, train, AdsMultiTaskConfig())


@register
def small() -> Config:
  """The CPU default: `python experiments/train.py` (2 CPU cores, under 5 minutes; see README for the
  NE it reaches against the planted model).

  params: 4.98M sparse, 516K dense; forward FLOPs/example at 32 history tokens: 5.12e+06
  """
  spec = ads_feature_spec(users=100_000, ads=50_000, advertisers=5_000, categories=200, embed_dim=32,
                          max_history=64, max_interests=8, num_domains=3)
  model = ModelConfig(embed_dim=32, model_dim=64, num_layers=2,
                      hstu=HSTUConfig(num_heads=2, head_dim=32, value_dim=32, keep_last=(64, 32),
                                      num_contextual=2, rel_pos_buckets=32),
                      wukong=WukongConfig(fm_outputs=8, lcb_outputs=8, fm_rank=8, mlp_hidden=256),
                      num_recent=2, tower_hidden=128)
  # A batch of 256 holds ~8k history tokens (49% of 256 x 64): one bucket at 56% covers it (3.6 sigma),
  # so the run compiles its step once.
  data = DataConfig(spec, SyntheticConfig(seed=0),
                    PipelineConfig(batch_size=256, history_bucket_fractions=(0.5625, 1.0), read_threads=1,
                                   prefetch_buffer_size=4))
  # Row-wise Adagrad at 0.2 on the tables: at 0.05 the same run closed 53% of the click NE gap, at 0.1
  # 63%, at 0.2 67% (dense AdamW at 3e-3).
  train = TrainConfig(steps=900, learning_rate=3e-3, embedding_learning_rate=0.2, warmup_steps=50,
                      eval_every=10_000, eval_examples=65536, checkpoint_every=300, log_every=20)
  return Config("small", model, data, train, AdsMultiTaskConfig())


# GPU configs size the id tables (users, ads, advertisers) to a multiple of this many rows, so that row
# sharding over any power-of-two number of shards up to 8192 divides (placement.of keeps a table whose rows
# do not divide whole, i.e. replicated: 500M user rows = 2^8 x 5^9 would split at most 256 ways and could
# not fit at 1024 GPUs). Categories are a count of interest topics, not ids, and stay as given (the
# table is at most 51 MB, replicated when it does not divide).
TABLE_ROW_MULTIPLE = 8192


def _rows(n: int) -> int:
  return -(-n // TABLE_ROW_MULTIPLE) * TABLE_ROW_MULTIPLE


def _gpu_config(name: str, *, users, ads, advertisers, categories, embed_dim, max_history, model_dim,
                layers, heads, head_dim, keep_last, fm_outputs, lcb_outputs, fm_rank, mlp_hidden,
                tower_hidden, batch_size, steps) -> Config:
  users, ads, advertisers = map(_rows, (users, ads, advertisers))
  spec = ads_feature_spec(users=users, ads=ads, advertisers=advertisers, categories=categories,
                          embed_dim=embed_dim, max_history=max_history, max_interests=32, num_domains=5)
  model = ModelConfig(embed_dim=embed_dim, model_dim=model_dim, num_layers=layers,
                      hstu=HSTUConfig(num_heads=heads, head_dim=head_dim, value_dim=head_dim,
                                      keep_last=keep_last, num_contextual=4, rel_pos_buckets=64),
                      wukong=WukongConfig(fm_outputs=fm_outputs, lcb_outputs=lcb_outputs, fm_rank=fm_rank,
                                          mlp_hidden=mlp_hidden),
                      num_recent=4, tower_hidden=tower_hidden, compute_dtype="bfloat16")
  # A calibration sample of 16384 requests, not the default 65536: at these history lengths (mean ~245
  # tokens) the default's sample takes 7-12 s to draw in every process that builds the config (a simulator
  # or planner run, a compile for a GPU), and the fitted click bias moves by ~0.02 (base: -5.404 against
  # -5.384), well inside the noise of any measured rate.
  data = DataConfig(spec, SyntheticConfig(seed=0, history_mu=5.0, history_sigma=1.0, calibration_examples=16384),
                    PipelineConfig(batch_size=batch_size))
  train = TrainConfig(steps=steps, warmup_steps=min(1000, steps // 10), eval_every=1000, eval_examples=262144,
                      checkpoint_every=1000, log_every=50)
  return Config(name, model, data, train, AdsMultiTaskConfig())


@register
def base() -> Config:
  """One GPU node (8 x H200): `python experiments/train.py --config base --mesh meshes/h200_8.yaml`; compiled for
  it without a GPU: `python experiments/compile_for.py --config base --mesh meshes/h200_8.yaml` (README).

  params: 1.95B sparse, 30.3M dense; forward FLOPs/example at 256 history tokens: 9.65e+08
  """
  return _gpu_config("base", users=10_000_000, ads=5_000_000, advertisers=200_000, categories=2_000,
                     embed_dim=128, max_history=1024, model_dim=256, layers=4, heads=4, head_dim=64,
                     keep_last=(1024, 512, 256, 128), fm_outputs=16, lcb_outputs=16, fm_rank=16,
                     mlp_hidden=1024, tower_hidden=512, batch_size=2048, steps=100_000)


@register
def large() -> Config:
  """128 nodes x 8 H200 (meshes/h200_1024_5d.yaml; meshes/plan_large_1024.yaml is the planner's layout).

  params: 154B sparse, 615M dense; forward FLOPs/example at 256 history tokens: 8.16e+09
  """
  return _gpu_config("large", users=500_000_000, ads=100_000_000, advertisers=2_000_000, categories=20_000,
                     embed_dim=256, max_history=2048, model_dim=512, layers=8, heads=8, head_dim=64,
                     keep_last=(2048, 2048, 1024, 1024, 512, 512, 256, 256), fm_outputs=32,
                     lcb_outputs=32, fm_rank=32, mlp_hidden=4096, tower_hidden=1024, batch_size=65536,
                     steps=500_000)


@register
def xl() -> Config:
  """Thousands of H200s, the GEM-scale target: 2,048 on meshes/plan_xl_2048.yaml (the planner's layout).

  params: 771B sparse, 4.06B dense; forward FLOPs/example at 256 history tokens: 4.51e+10
  """
  return _gpu_config("xl", users=2_000_000_000, ads=1_000_000_000, advertisers=10_000_000, categories=50_000,
                     embed_dim=256, max_history=4096, model_dim=1024, layers=12, heads=16, head_dim=64,
                     keep_last=(4096, 4096, 4096, 2048, 2048, 2048, 1024, 1024, 1024, 512, 512, 512),
                     fm_outputs=64, lcb_outputs=64, fm_rank=64, mlp_hidden=8192, tower_hidden=2048,
                     batch_size=131072, steps=1_000_000)


# ---- next-item recommendation on public data (gem_jax/run/next_item.py) ------------------------------------

AMAZON = ("beauty", "sports", "toys")


TOWERS = ("hstu", "sasrec-ss", "sasrec-bce")


def _sasrec_tower(cfg: Config, dataset: str, tower: str) -> Config:
  """The SASRec comparison recipes on the same code (gem_jax/model/sasrec.py).

  sasrec-ss   eSASRec's SASRec+SS (Tikhonovich et al., RecSys 2025; their repository blondered/
              transformer_benchmark, README and configs/paper/loo): width 64 as their README says (the S3
              config, configs/paper/loo/s3_vanilla.yaml, sets 256: README), 1 block on Amazon and 2 on ML-1M,
              1 head, dropout 0.2 (ML-1M 0.1), raw dot-product scores, learned positions counted from the
              newest item, dropout on the output table too, sampled softmax over 256 uniform negatives drawn
              per token, Adam lr 1e-3, betas (0.9, 0.98), batch 128. ML-1M's rows of up to 200 items run
              the softmax loop in 32-token tiles (1.27x the step's tokens/s of the default 16, same loss)
  sasrec-bce  the same model trained as the original SASRec (Kang & McAuley 2018): binary cross-entropy
              against one uniform negative per token, the setting of the SASRec rows of the TIGER table
  """
  ml = dataset.startswith("ml-")
  model = dataclasses.replace(cfg.model, arch="sasrec", dim=64, num_layers=2 if ml else 1, num_heads=1,
                              dropout_rate=0.1 if ml else 0.2, normalize=False, embed_scale=False,
                              positions="from_end", table_dropout=True, ffn_multiplier=1, attn_block=32 if ml else 0,
                              hstu_ffn=False)
  negatives = 256 if tower == "sasrec-ss" else 1
  task = dataclasses.replace(cfg.task, loss="sampled_softmax" if tower == "sasrec-ss" else "bce",
                             negatives="per_token", num_negatives=negatives, temperature=1.0)
  return dataclasses.replace(cfg, name=f"{cfg.name}_{tower.replace('-', '_')}", model=model, task=task)


def seqrec(dataset: str, quick: bool = False, tower: str = "hstu") -> Config:
  """The next-item recipe of a public dataset: `python experiments/seqrec.py --dataset NAME` (2 CPU cores:
  ~85 min ML-1M alone, 1.16 s a step, 2.3 h pinned to one core next to another run; Beauty 22-41 min next
  to other runs; README, public benchmarks).

  HSTU's MovieLens-1M settings (Zhai et al. 2024), where the presets start: item embeddings of width 50
  shared between input and output, 2 HSTU layers, 1 head, dropout 0.2, L2-normalized embeddings,
  temperature 0.05, AdamW (lr 1e-3, betas 0.9 / 0.98, no decay), batch 128 users, max length 200 (ML-1M) or
  50 (Amazon, dropout 0.5), K = 10, 50, 200 (Amazon adds 5, 20); validation every 5 epochs, the best NDCG@10
  kept, stop after 4 without a better one. Amazon: width 128 (q/k/v too) and temperature 0.1, chosen on
  Beauty's validation split. `tower`: "hstu", or a SASRec comparison recipe (_sasrec_tower) on the same data,
  training and evaluation. Sports uses eSASRec's layers instead of HSTU's (chosen on its validation split). ML-1M uses
  every item as a negative (full softmax, chunked: 1.21x the step time of 1,024 shared
  sampled ones on CPU, better validation NDCG@10 at every epoch measured), and width 128 in 4 layers of 2
  heads of 64 at temperature 0.1, each row a random window of a user's items, evaluated and kept as a moving
  average of the dense parameters (train.ema_decay; all chosen on its validation split). `quick`: a few epochs
  of a small model on MovieLens-100K for tests (a learning check, not a result).
  """
  if dataset not in DATASETS:
    raise ValueError(f"unknown dataset {dataset!r}; known: {sorted(DATASETS)}")
  if tower not in TOWERS:
    raise ValueError(f"unknown tower {tower!r}; known: {TOWERS}")
  if tower != "hstu":
    return _sasrec_tower(seqrec(dataset, quick), dataset, tower)
  train = TrainConfig(steps=1, learning_rate=1e-3, warmup_steps=0, end_lr_fraction=1.0, weight_decay=0.0, b2=0.98,
                      grad_clip_norm=float("inf"), eval_every_epochs=5, select_metric="NDCG@10", patience=4,
                      checkpoint_every=1000, log_every=50, epochs=100)
  if quick:
    if dataset != "ml-100k":
      raise ValueError(f"--quick runs on ml-100k only (got {dataset!r}): it is sized for a CI test")
    model = SeqRecModelConfig(max_len=50, dim=32, head_dim=32, value_dim=32)
    data = SeqRecDataConfig(dataset, max_len=50, batch_size=32, token_multiple=512)
    train = dataclasses.replace(train, epochs=20, patience=0, checkpoint_every=100, log_every=10)
    return Config(f"seqrec_{dataset}_quick", model, data, train, NextItemConfig())
  if dataset in AMAZON:
    # Width 128 and temperature 0.1, chosen on Beauty's validation split (README, ablations): validation
    # NDCG@10 .0656 at width 50 and temperature 0.05, .0682 at width 128, .0716 with both.
    # Sports takes eSASRec's layers (softmax attention and a gated feed-forward, gem_jax/model/sasrec.py) on
    # the same loss: validation NDCG@10 .0439 against .0423 and .0423 for two seeds of the HSTU layers
    # (one seed so far; results/seqrec/ablations-sports.json, curves-sports-esasrec.json).
    model = SeqRecModelConfig(max_len=50, dropout_rate=0.5, dim=128, head_dim=128, value_dim=128,
                              arch="esasrec" if dataset == "sports" else "hstu")
    # Sports (the most items, 18,357) takes 2,048 shared negatives: 1,536 uniform + 512 from the batch, where
    # Beauty and Toys keep 512 + 512. On Sports' validation it led 1,024 up to epoch 95 and tied at the end
    # (NDCG@10 .0423 on two seeds vs .0425 on one; README, results/seqrec/curves-sports.json).
    data = SeqRecDataConfig(dataset, max_len=50, token_multiple=512,
                            uniform_negatives=1536 if dataset == "sports" else 512)
    return Config(f"seqrec_{dataset}", model, data,
                  dataclasses.replace(train, epochs=200), NextItemConfig(ks=(5, 10, 20, 50, 200), temperature=0.1))
  if dataset == "ml-1m":
    # Width 128, 4 layers of 2 heads of 64, temperature 0.1, chosen on ML-1M's validation split (README,
    # results/seqrec/curves-ml-1m.json): validation NDCG@10 .1844 at epoch 70, against .1742 for 2 layers of
    # one 128-wide head and .1682 for HSTU's shape (width 50, 2 layers) at temperature 0.1. Random training
    # windows (the last ones never show 34% of ML-1M's training items): .1846 at epoch 90, one seed each.
    # Parameter averaging (ema_decay 0.998; over ML-1M's 4,800 steps the warm-up rate, spanning about the last
    # t / 9 steps, stays below the decay until step 4,491): validation HR@10 / NDCG@10 .3344 / .1854 over
    # 3 seeds against .3328 / .1846 without it (the rule fixed before a test split was read).
    # eSASRec's gated feed-forward after each layer (multiplier 2): validation HR@10 / NDCG@10 .3402 / .1885 over 3 seeds
    # against .3344 / .1854 for the layers alone (the bar fixed before its seeds ran; README), at 1.6x the step.
    model = SeqRecModelConfig(dim=128, num_layers=4, num_heads=2, head_dim=64, value_dim=64, hstu_ffn=True,
                              ffn_multiplier=2)
    return Config(f"seqrec_{dataset}", model, SeqRecDataConfig(dataset, train_window="random"),
                  dataclasses.replace(train, ema_decay=0.998), NextItemConfig(loss="full_softmax", temperature=0.1))
  return Config(f"seqrec_{dataset}", SeqRecModelConfig(), SeqRecDataConfig(dataset), train, NextItemConfig())


@register
def movielens() -> Config:
  """MovieLens-100K as two engagement tasks (like: rating >= 4; love: rating 5 given like) through the full
  GEM model, on 2 CPU cores in a few minutes:
    python experiments/prepare_movielens.py --data-dir ../shared/data --out runs/movielens-100k
    python experiments/train.py --config movielens --data runs/movielens-100k --out runs/movielens
  The spec is gem_jax/data/specs/movielens_100k.yaml; the rows and the time split, gem_jax/data/movielens.py.

  params: 44.3K sparse, 145K dense; forward FLOPs/example at 38 history tokens: 1.53e+06
  """
  from gem_jax.data import movielens as ml
  from gem_jax.data.parquet_source import ParquetDataConfig
  model = ModelConfig(embed_dim=16, model_dim=32, num_layers=2,
                      hstu=HSTUConfig(num_heads=2, head_dim=16, value_dim=16, keep_last=(50, 25),
                                      num_contextual=2, rel_pos_buckets=32),
                      wukong=WukongConfig(fm_outputs=8, lcb_outputs=8, fm_rank=8, mlp_hidden=128),
                      num_recent=2, tower_hidden=64)
  # A batch of 256 holds ~9.8k history tokens of 12.8k (mean 38 of at most 50); evaluation, later in time,
  # has fuller histories.
  data = ParquetDataConfig("runs/movielens-100k", PipelineConfig(batch_size=256, history_bucket_fractions=(0.875, 1.0),
                                                                  read_threads=1, prefetch_buffer_size=4),
                           spec_file=ml.SPEC, shuffle_window=16384, seed=0)
  # One epoch (313 batches of 256): a second and third overfit (like AUC 0.740 after one, 0.726 after three).
  train = TrainConfig(steps=313, learning_rate=3e-3, embedding_learning_rate=0.1, warmup_steps=30,
                      eval_every=100_000, checkpoint_every=300, log_every=20)
  return Config("movielens", model, data, train, AdsMultiTaskConfig())


def with_steps(cfg: Config, steps: int) -> Config:
  """A shorter run of the same config (tests)."""
  train = dataclasses.replace(cfg.train, steps=steps, warmup_steps=min(cfg.train.warmup_steps, steps - 1))
  return dataclasses.replace(cfg, train=train)


for _name in DATASETS:
  CONFIGS[f"seqrec_{_name}"] = (lambda name: lambda: seqrec(name))(_name)
