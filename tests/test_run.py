"""The spine's extension points, used the way a newcomer would: a data source and a task written in this
file and registered here (nothing else in the library changes), trained through build(cfg) and the
standard trainer; and a model with an added layer pair and an added lookup, which the derived FLOPs,
tensor-parallel parts and widths and lookup capacities all see without being told.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import check, metrics
from gem_jax.data import pipeline, sources
from gem_jax.data.pipeline import PipelineConfig
from gem_jax.data.spec import FeatureSpec
from gem_jax.data.synthetic import SyntheticAdsStream, SyntheticConfig
from gem_jax.model.gem import GEM
from gem_jax.model.layers import Dense
from gem_jax.observe import flops, plan
from gem_jax.parallel import placement
from gem_jax.run import tasks
from gem_jax.run.build import build
from gem_jax.train import trainer
from gem_jax.train.jobs import standard_hooks, train_config
from tests.run_helpers import ONE_LAYER, tiny


# ---- a data source in one class: a fixed in-memory set of examples, read in shuffled epochs -------------

@dataclasses.dataclass(frozen=True)
class FixedSetConfig:
  spec: FeatureSpec
  pipeline: PipelineConfig
  train_examples: int = 96
  eval_examples: int = 64
  seed: int = 7


class _EpochIterator:
  """Epochs over the rows in an order drawn from (seed, epoch); the state is (epoch, next batch)."""

  def __init__(self, src):
    self.src, self.epoch, self.index = src, 0, 0

  def __iter__(self):
    return self

  def __next__(self):
    order = np.random.default_rng([self.src.cfg.data.seed, self.epoch]).permutation(len(self.src.train))
    b = self.src.batch_size
    rows = np.sort(order[self.index * b:(self.index + 1) * b])
    self.index += 1
    if self.index == self.src.steps_per_epoch():
      self.epoch, self.index = self.epoch + 1, 0
    return self.src.pack(_take(self.src.train, rows))

  def get_state(self):
    return {"epoch": self.epoch, "index": self.index}

  def set_state(self, state):
    self.epoch, self.index = state["epoch"], state["index"]


def _take(examples, rows):
  return type(examples).concat([examples.slice(int(r), int(r) + 1) for r in rows])


@sources.register(FixedSetConfig)
class FixedSetSource:
  name = "fixed_set"
  eval_splits = ("holdout",)

  def __init__(self, cfg):
    self.cfg, self.spec, self.pipe = cfg, cfg.data.spec, cfg.data.pipeline
    self.batch_size = self.pipe.batch_size
    # The rows could come from anywhere; here they are drawn once from the synthetic world.
    world = SyntheticAdsStream(self.spec, SyntheticConfig(seed=cfg.data.seed))
    self.train = world.block(0, cfg.data.train_examples)
    self.holdout = world.block(1, cfg.data.eval_examples)

  def pack(self, examples, rows=None):
    return pipeline.pack(examples, self.spec, dataclasses.replace(self.pipe, batch_size=rows or self.batch_size))

  def train_iterator(self):
    return _EpochIterator(self)

  def eval_batches(self, split="holdout"):
    b = self.batch_size
    return [self.pack(self.holdout.slice(i, min(i + b, len(self.holdout)))) for i in range(0, len(self.holdout), b)]

  def first_batch(self):
    return self.pack(self.train.slice(0, self.batch_size))

  def sample(self, rows, index=0):
    return self.pack(self.train.slice(0, rows), rows)

  def shard(self, batch, num_shards):
    return sources.SyntheticSource.shard(self, batch, num_shards)

  def lengths(self, batch, real=True):
    return sources.SyntheticSource.lengths(self, batch, real)

  def max_length(self):
    return self.spec.sequence.max_len

  def row_batch(self, n):
    return sources.SyntheticSource.row_batch(_RowBatch(self), n)

  def steps_per_epoch(self):
    return len(self.train) // self.batch_size

  def stats(self, num_examples=0):
    return {"lengths": np.asarray(self.train.history[1]), "examples": len(self.train)}


@dataclasses.dataclass
class _RowBatch:  # what SyntheticSource.row_batch reads: a stream with block(), the spec and the pipeline
  src: FixedSetSource

  def __getattr__(self, name):
    return {"stream": self, "spec": self.src.spec, "pipe": self.src.pipe}[name]

  def block(self, index, size):
    return self.src.train.slice(0, size)


# ---- a task in one class: GEM's logits scored by squared error (the Brier score) -----------------------

@dataclasses.dataclass(frozen=True)
class BrierConfig:
  """Squared error of the predicted probability, per counted label."""


@tasks.register(BrierConfig)
class Brier(tasks.Task):
  name = "brier"

  def build_model(self, cfg, source, rngs):
    return GEM(source.spec, cfg.model, rngs=rngs)

  def sums(self, model, batch, dropout_rng):
    p_BxK = jax.nn.sigmoid(model(batch, dropout_rng=dropout_rng))
    mask_BxK = batch.label_mask_BxK * batch.example_mask_B[:, None]
    return {"se": jnp.sum(mask_BxK * (p_BxK - batch.labels_BxK) ** 2), "n": jnp.sum(mask_BxK)}

  def loss(self, totals):
    loss = totals["se"] / jnp.maximum(totals["n"], 1.0)
    return loss, {"brier": loss}

  def predict(self, model, batch):
    return jax.nn.sigmoid(model(batch))

  def evaluate(self, predictions, batches):
    k = len(self.source.spec.tasks)
    se = n = 0.0
    for p, b in zip(predictions, batches):
      mask = np.asarray(b.label_mask_BxK).reshape(-1, k) * np.asarray(b.example_mask_B).reshape(-1, 1)
      se += float((mask * (np.asarray(p).reshape(-1, k) - np.asarray(b.labels_BxK).reshape(-1, k)) ** 2).sum())
      n += float(mask.sum())
    return {"brier": se / n, "count": n}

  def selectable(self):
    return {"brier": -1}


def _fixed_set_cfg(*sets, **named):
  """tiny on an in-test source and task; one GEM layer (the tests are of the trainer's wiring, not the model)."""
  cfg = tiny(*ONE_LAYER, *sets, **named)
  return dataclasses.replace(cfg, data=FixedSetConfig(cfg.data.spec, cfg.data.pipeline), task=BrierConfig())


def test_registered_source_and_task_are_found_by_name():
  assert "fixed_set" in sources.names() and "brier" in tasks.names()
  run = build(_fixed_set_cfg(), abstract=True)
  assert isinstance(run.source, FixedSetSource) and isinstance(run.task, Brier)
  with pytest.raises(check.ConfigError, match="'brier'"):
    build(_fixed_set_cfg(**{"train.select_metric": "click/auc"}), abstract=True)


@pytest.mark.slow
def test_an_in_test_source_and_task_train_resume_and_select_through_the_trainer(tmp_path):
  """Two epochs of 3 steps with model selection on the task's own metric; the run folder has what any run
  has, and a run stopped after 4 steps and resumed ends with the same parameters and evaluations."""
  cfg = _fixed_set_cfg(**{"train.epochs": 2, "train.eval_every_epochs": 1, "train.select_metric": "brier",
                          "train.learning_rate": 0.01, "train.checkpoint_every": 2})
  run = build(cfg)
  before = trainer.evaluate(run, run.state.params, "holdout")
  whole = trainer.train(run, str(tmp_path / "whole"), standard_hooks(run, progress=False, report=False))
  assert whole["steps"] == 6 and whole["selected"]["step"] in (3, 6)
  final = whole["eval"]["holdout"]
  assert final["count"] == before["count"] > 0
  assert final["brier"] < 0.5 * before["brier"], (before, final)  # from sigmoid(~0) toward the base rates
  records = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
  assert [r["epoch"] for r in records if "eval_step" in r] == [1, 2]
  assert all(np.isfinite(r["brier"]) for r in records if "step" in r and "brier" in r)
  assert os.path.isdir(tmp_path / "whole" / "checkpoints") and os.path.isdir(tmp_path / "whole" / "best")

  part = str(tmp_path / "part")
  train_config(cfg, part, progress=False, report=False, stop_after=4)
  resumed = train_config(cfg, part, resume=True, progress=False, report=False)
  assert resumed["steps_this_run"] == 2
  assert resumed["eval"] == whole["eval"] and resumed["selected"] == whole["selected"]
  # Step 4 (a checkpoint, no evaluation) counts in the next evaluation's mean train loss after the resume too.
  evals = lambda folder: [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "eval_step" in r]
  assert evals(part) == evals(tmp_path / "whole")


# ---- derived, not mirrored: an added layer pair and an added lookup are seen everywhere -------------------

@dataclasses.dataclass(frozen=True)
class WiderConfig:
  width: int = 24  # the added tensor-parallel pair's inner width


class _Wider(nnx.Module):
  """GEM plus one more lookup (the candidate ad's row again, read as a call of 2B ids) feeding a column /
  row parallel Dense pair whose output is added to the logits."""

  def __init__(self, spec, cfg, width, *, rngs):
    self.gem = GEM(spec, cfg, rngs=rngs)
    e, k = spec.table("ad_id").dim, len(spec.tasks)
    self.up = Dense(e, width, ("embed", "mlp"), cfg, site="extra.up", rngs=rngs)
    self.down = Dense(width, k, ("mlp", None), cfg, site="extra.down", rngs=rngs)

  def __call__(self, batch, *, dropout_rng=None):
    ids_B = batch.sparse["ad_id"]
    rows_2BxE = self.gem.embeddings.lookup("ad_id", jnp.concatenate([ids_B, ids_B]))
    b = ids_B.shape[0]
    extra_BxK = self.down(jax.nn.relu(self.up(rows_2BxE[:b] + rows_2BxE[b:])))
    return self.gem(batch, dropout_rng=dropout_rng) + extra_BxK.astype(jnp.float32)


@tasks.register(WiderConfig)
class WiderAds(tasks.AdsMultiTask):
  name = "wider_ads"

  def build_model(self, cfg, source, rngs):
    return _Wider(self.spec, cfg.model, self.config.width, rngs=rngs)


def _wider(cfg, width=24):
  return dataclasses.replace(cfg, task=WiderConfig(width))


def test_flops_count_an_added_layer_pair_without_a_formula():
  base, wider = build(tiny(), abstract=True), build(_wider(tiny()), abstract=True)
  spec = base.source.spec
  e, k, w = spec.table("ad_id").dim, len(spec.tasks), 24
  added = 2 * e * w + 2 * w * k  # one row: its up and down matmuls
  for n in (0, 5, spec.sequence.max_len):
    assert flops.FlopModel(wider).forward([n]) - flops.FlopModel(base).forward([n]) == pytest.approx(added, rel=1e-9)


def _params(cfg):
  run = build(cfg, abstract=True)
  return run, nnx.state(nnx.eval_shape(lambda: run.task.build_model(cfg, run.source, nnx.Rngs(0))), nnx.Param)


def test_tensor_parallel_parts_widths_and_placement_see_an_added_pair(tmp_path):
  mesh = tmp_path / "tp2.yaml"
  text = open("meshes/cpu_8.yaml").read()
  mesh.write_text(text.replace("name: cpu_8", "name: tp2").replace("fsdp: 2, sparse: 2", "fsdp: 1, sparse: 1")
                  .replace("devices_per_node: 4", "devices_per_node: 2").replace("{sparse: 2, tensor: 2}", "{tensor: 2}"))
  for width, slices in ((24, 2), (25, 1)):  # 25 does not split over tensor=2: the pair stays whole
    run, params = _params(dataclasses.replace(_wider(tiny(), width), mesh=str(mesh)))
    parts = {p.path: p for p in placement.tensor_parallel_parts(params)}
    # Both layers of the pair belong to the module that holds them (the model's root here).
    assert (parts["up.kernel"].dim, parts["up.kernel"].size, parts["up.kernel"].group) == (1, width, "")
    assert (parts["down.kernel"].dim, parts["up.bias"].size, parts["down.kernel"].group) == (0, width, "")
    assert width in plan.tensor_widths(params)
    assert {placement.tensor_slices(parts[k], run.mesh_spec) for k in ("up.kernel", "up.bias", "down.kernel")} == {slices}
    up = run.state.params["up"]["kernel"]
    assert up.sharding.spec == (jax.sharding.PartitionSpec(None, "tensor") if slices > 1
                                else jax.sharding.PartitionSpec(None, None)), up.sharding.spec


def test_lookup_capacities_and_stats_see_an_added_lookup():
  cfg = _wider(tiny("mesh=meshes/cpu_8.yaml"))
  run = build(cfg, devices=jax.devices()[:8])
  per_shard = cfg.data.pipeline.batch_size // run.data_shards
  assert run.plan.table_axes["ad_id"], run.plan.table_axes  # row sharded: the lookup needs capacities
  assert {f"ad_id/{per_shard}", f"ad_id/{2 * per_shard}"} <= set(run.capacities), run.capacities
  # The step's per-call statistics name it too (traced, not compiled).
  _, metrics_out = jax.eval_shape(run.train_step, run.state, run.device_batch(run.source.first_batch()))
  assert {f"emb/ad_id/{2 * per_shard}/unique", f"emb/ad_id/{2 * per_shard}/overflow"} <= set(metrics_out)


def test_the_one_device_step_runs_no_collective():
  """One device is the 1x1x1x1x1 mesh, and a collective over one device computes nothing; XLA:CPU would still
  run it (an all-reduce of every gradient when the parameters were typed varying over the size-1 axes)."""
  run = build(tiny())
  batch = run.device_batch(run.source.first_batch())
  text = run.train_step.lower(run.state, batch).as_text()
  found = sorted({op for op in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "collective_permute")
                  if f"stablehlo.{op}" in text})
  assert found == [], found


def test_a_batch_not_split_into_the_runs_data_shards_is_refused_when_the_step_is_traced():
  run = build(tiny())
  two_shards = jax.tree_util.tree_map(jnp.asarray, run.source.shard(run.source.first_batch(), 2))
  with pytest.raises(AssertionError, match="assert_tree_shape_prefix"):
    run.train_step(run.state, two_shards)
  with pytest.raises(AssertionError, match="assert_tree_shape_prefix"):
    run.eval_step(run.state.params, two_shards)
