"""Config and mesh validation: every impossible setup fails before anything is built, with a message that
names the config key or mesh axis and the numbers; every shipped config and mesh file still passes.

Each bad case below was first shown, without gem_jax/check.py, to fail late (inside tracing or placement,
after the model and tables were built), to fail far from the config (inside numpy), or to run and compute
something else; here it must fail in build's checks on shapes alone (gem_jax/check.py), and a training job must raise the
same error before it builds or compiles anything.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import pytest
import yaml
from flax import nnx

from gem_jax import check, configs
from gem_jax.check import ConfigError
from gem_jax.config import TrainConfig, apply_overrides
from gem_jax.data.pipeline import PipelineConfig
from gem_jax.model.config import HSTUConfig, ModelConfig, WukongConfig
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.mesh import MeshFileError
from gem_jax.run import step as step_lib
from gem_jax.run import tasks
from gem_jax.run.build import build
from gem_jax.train import jobs

MESHES = pathlib.Path(__file__).resolve().parents[1] / "meshes"
NAN, INF = float("nan"), float("inf")


def sets(*assignments):
  return lambda cfg: apply_overrides(cfg, list(assignments))


def task_weights(*weights):
  def edit(cfg):
    spec = cfg.data.spec
    tasks = tuple(dataclasses.replace(t, weight=w) for t, w in zip(spec.tasks, weights))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, spec=dataclasses.replace(spec, tasks=tasks)))
  return edit


def mesh_data(stem: str, rules: dict | None) -> dict:
  data = yaml.safe_load((MESHES / f"{stem}.yaml").read_text())
  if rules is not None:
    data["rules"] = rules
  return data


# (id, edit of the tiny config, mesh (file stem, rules or None) or None, error, message pattern)
CASES = [
    ("devices", sets(), ("cpu_16_5d", None), MeshFileError,
     r"mesh 'cpu_16_5d' needs 16 devices \(replica=2 x fsdp=2 x sparse=2 x context=1 x tensor=2\), this run "
     r"has 8 \(cpu; 1 process\(es\), 8 in this one\)"),
    ("batch_over_data_axes", sets("data.pipeline.batch_size=18"), ("cpu_8", None), MeshFileError,
     r"batch size 18 does not divide .* = 4 shards\): set data\.pipeline\.batch_size to a multiple of 4"),
    ("heads_over_tensor", sets("model.hstu.num_heads=3"), ("cpu_8", None), ConfigError,
     r"layers\.0\.hstu: the parameters of its tensor-parallel pair would be cut differently over mesh axis "
     r"tensor=2 of mesh 'cpu_8' .*rel_bias_HxR dim 0 \(3\) whole.*uvqk\.kernel dim 1 \(192\) into 2.*"
     r"use widths divisible by tensor=2"),
    ("heads_rule_off_tensor", sets(), ("cpu_8", {"heads": None}), ConfigError,
     r"layers\.0\.hstu: .*rel_bias_HxR dim 0 \(2\) whole.*rules \(mlp: tensor, heads: None"),
    ("mlp_rule_off_tensor", sets(), ("cpu_8", {"mlp": None}), ConfigError,
     r"layers\.0\.hstu: .*rel_bias_HxR dim 0 \(2\) into 2.*uvqk\.kernel dim 1 \(128\) whole"),
    ("mlp_rule_fsdp_and_tensor", sets(), ("cpu_8", {"mlp": ["fsdp", "tensor"]}), ConfigError,
     r"heads: .*heads\.trunk\.bias dim 0 \(32\) whole; heads\.trunk\.kernel dim 1 \(32\) into 2"),
    ("embed_rule_takes_tensor", sets(), ("cpu_8", {"embed": ["fsdp", "tensor"]}), ConfigError,
     r"heads: .*heads\.trunk\.bias dim 0 \(32\) into 2; heads\.trunk\.kernel dim 1 \(32\) whole"),
    ("embed_rule_on_tensor", sets(), ("cpu_8", {"embed": "tensor"}), MeshFileError,
     r"rules put logical axis 'embed' on 'tensor' \(size 2\).*only \('mlp', 'heads'\)"),
    ("attn_impl", sets("model.hstu.attn_impl=bogus"), None, ConfigError,
     r"model\.hstu\.attn_impl='bogus' is not an HSTU attention impl; known: \[.*'xla'\]"),
    ("task_weights_sum_zero", task_weights(0.0, 0.0), None, ConfigError, r"data\.spec\.tasks: .* sum to 0"),
    ("task_weight_negative", task_weights(1.0, -1.0), None, ConfigError,
     r"data\.spec\.tasks: weights must be finite and >= 0, got \{'conversion': -1\.0\}"),
    ("task_weight_nan", task_weights(NAN, 1.0), None, ConfigError, r"weights must be finite.*'click': nan"),
    ("synthetic_nan_strength", sets("data.synthetic.affinity_strength=nan"), None, ConfigError,
     r"data\.synthetic\.affinity_strength must be finite, got nan"),
    ("synthetic_session_len", sets("data.synthetic.session_mean_len=0.5"), None, ConfigError,
     r"data\.synthetic\.session_mean_len must be >= 1, got 0\.5"),
]


def with_mesh(cfg, mesh, tmp_path):
  if mesh is None:
    return cfg
  path = tmp_path / f"{mesh[0]}.yaml"
  path.write_text(yaml.safe_dump(mesh_data(*mesh)))
  return dataclasses.replace(cfg, mesh=str(path))


@pytest.mark.parametrize("edit,mesh,error,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_setups_fail_before_anything_is_allocated(edit, mesh, error, pattern, tmp_path):
  """build(abstract=True) checks the config, the mesh against this process's devices and the model's
  tensor-parallel cuts on its shapes alone."""
  with pytest.raises(error, match=pattern):
    build(with_mesh(edit(configs.get("tiny")), mesh, tmp_path), abstract=True, devices=jax.devices())


@pytest.mark.parametrize("edit,mesh,error,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_train_fails_before_building_or_compiling(edit, mesh, error, pattern, tmp_path, monkeypatch):
  real_build_model = tasks.AdsMultiTask.build_model

  def abstract_only(self, *args, **kwargs):
    model = real_build_model(self, *args, **kwargs)
    if not all(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(nnx.state(model))):
      raise AssertionError("the model was built before validation")
    return model

  def compiled(*args, **kwargs):
    raise AssertionError("compiled before validation")

  monkeypatch.setattr(tasks.AdsMultiTask, "build_model", abstract_only)
  monkeypatch.setattr(step_lib, "make_train_step", compiled)
  with pytest.raises(error, match=pattern):
    jobs.train_config(with_mesh(edit(configs.get("tiny")), mesh, tmp_path), str(tmp_path / "run"), progress=False,
                      report=False)


@pytest.mark.parametrize("name", sorted(configs.CONFIGS))
@pytest.mark.parametrize("path", sorted(MESHES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_pass_on_every_shipped_mesh(name, path):
  """On its own device count every pair passes, except where the config's batch is smaller than the mesh's
  data shards (tiny on 1024 GPUs): that one must say so."""
  cfg, spec = configs.get(name), mesh_lib.load(path)
  check.check_config(cfg, None, 1)
  if check.train_batch_size(cfg) % spec.data_shards:
    with pytest.raises(MeshFileError, match="does not divide over the data axes"):
      check.check_config(cfg, spec, spec.num_devices)
  else:
    check.check_config(cfg, spec, spec.num_devices)


@pytest.mark.parametrize("edits", [
    ["model.wukong.mlp_hidden=63", "model.tower_hidden=33"],  # odd widths stay whole on tensor=2: valid
    ["data.pipeline.bucket_multiple=1", "data.pipeline.batch_size=28"],  # any history capacity splits on context
])
@pytest.mark.parametrize("stem", ["cpu_8", "cpu_8_cp"])
def test_setups_that_run_are_not_rejected(edits, stem):
  """Widths that do not divide the tensor axis are kept whole (and run: tried on cpu_8), and the context axis
  pads the token slots to its size (tried on cpu_8_cp): neither may be rejected."""
  check.check_config(apply_overrides(configs.get("tiny"), edits), mesh_lib.load(MESHES / f"{stem}.yaml"), 8)


def test_heads_need_not_divide_without_tensor_parallelism():
  three_heads = apply_overrides(configs.get("tiny"), ["model.hstu.num_heads=3"])
  check.check_config(three_heads, mesh_lib.load(MESHES / "h200_8.yaml"), 8)  # tensor=1
  check.check_config(three_heads, None, 8)


@pytest.mark.parametrize("build,pattern", [
    (lambda: ModelConfig(num_layers=0, hstu=HSTUConfig(keep_last=())), r"model\.num_layers must be an integer >= 1"),
    (lambda: ModelConfig(embed_dim=16.0), r"model\.embed_dim must be an integer >= 1, got 16\.0"),
    (lambda: WukongConfig(fm_outputs=0), r"model\.wukong\.fm_outputs must be an integer >= 1, got 0"),
    (lambda: WukongConfig(lcb_outputs=0), r"model\.wukong\.lcb_outputs must be an integer >= 1"),
    (lambda: WukongConfig(fm_outputs=-1, lcb_outputs=9), r"model\.wukong\.fm_outputs must be an integer >= 1"),
    (lambda: HSTUConfig(num_heads=0), r"model\.hstu\.num_heads must be an integer >= 1"),
    (lambda: HSTUConfig(keep_last=(1.5, 2)), r"model\.hstu\.keep_last must be a tuple of integers >= 1"),
    (lambda: HSTUConfig(dropout_rate=NAN), r"model\.hstu\.dropout_rate must be in \[0, 1\), got nan"),
    (lambda: TrainConfig(weight_decay=NAN), r"TrainConfig\.weight_decay must be a finite number, got nan"),
    (lambda: TrainConfig(learning_rate=INF), r"TrainConfig\.learning_rate must be a finite number, got inf"),
    (lambda: TrainConfig(learning_rate=NAN), r"TrainConfig\.learning_rate must be a finite number"),
    (lambda: TrainConfig(ema_warmup=1.0), r"TrainConfig\.ema_warmup must be > 1"),
    (lambda: TrainConfig(embedding_learning_rate=INF), r"TrainConfig\.embedding_learning_rate must be a finite"),
    (lambda: TrainConfig(adagrad_initial_accumulator=NAN), r"TrainConfig\.adagrad_initial_accumulator must be a"),
    (lambda: TrainConfig(adagrad_eps=INF), r"TrainConfig\.adagrad_eps must be a finite number"),
    (lambda: TrainConfig(steps=5.0), r"TrainConfig\.steps must be an integer, got 5\.0"),
    (lambda: PipelineConfig(batch_size=0), r"data\.pipeline\.batch_size must be an integer >= 1, got 0"),
    (lambda: PipelineConfig(batch_size=16.0), r"data\.pipeline\.batch_size must be an integer >= 1, got 16\.0"),
    (lambda: PipelineConfig(batch_size=8, bucket_multiple=0), r"data\.pipeline\.bucket_multiple must be"),
    (lambda: PipelineConfig(batch_size=8, history_bucket_fractions=("a", 1.0)), r"history_bucket_fractions must"),
    (lambda: PipelineConfig(batch_size=8, history_bucket_fractions=(NAN, 1.0)), r"history_bucket_fractions must"),
])
def test_impossible_values_fail_in_the_dataclass(build, pattern):
  with pytest.raises(ValueError, match=pattern):
    build()


def test_an_infinite_clip_norm_means_no_clipping():
  assert TrainConfig(grad_clip_norm=INF).grad_clip_norm == INF


@pytest.mark.parametrize("assignment,pattern", [
    ("model.hstu.num_headz=2", r"--set model\.hstu\.num_headz: unknown key 'num_headz' in HSTUConfig; known:"),
    ("train.steps.every=1", r"--set train\.steps\.every: train\.steps is not a config section"),
    ("data.pipeline.batch_size=1.5", r"--set data\.pipeline\.batch_size='1\.5': cannot parse as <class 'int'>"),
    ("model.hstu.keep_last=[1.5,2]", r"--set model\.hstu\.keep_last='\[1\.5,2\]': element 1\.5 is not of type int"),
    ("model.hstu.keep_last=true,2", r"element True is not of type int"),
    ("model.precision.rules=[1]", r"--set model\.precision\.rules='\[1\]': element 1 is not of type str"),
    ("model.hstu.keep_last=[8,", r"--set model\.hstu\.keep_last='\[8,': cannot parse as tuple\[int, \.\.\.\]"),
    ("data.spec.tables=[1]", r"--set data\.spec\.tables: fields of type .*TableSpec.* cannot be set"),
    ("model.hstu=2", r"--set model\.hstu: fields of type .*HSTUConfig.* cannot be set"),
    ("train.learning_rate=nan", r"--set train\.learning_rate=nan: TrainConfig\.learning_rate must be a finite"),
    ("model.num_layers=0", r"--set model\.num_layers=0: model\.num_layers must be an integer >= 1"),
])
def test_overrides_fail_naming_the_key(assignment, pattern):
  with pytest.raises(ValueError, match=pattern):
    apply_overrides(configs.get("tiny"), [assignment])


def test_tuple_overrides_take_the_element_type():
  cfg = apply_overrides(configs.get("tiny"), ["data.pipeline.history_bucket_fractions=[0.5,1]",
                                              "model.hstu.keep_last=16,8"])
  assert cfg.data.pipeline.history_bucket_fractions == (0.5, 1.0) and cfg.model.hstu.keep_last == (16, 8)
  assert all(type(f) is float for f in cfg.data.pipeline.history_bucket_fractions)
  # Names as a user types them (no JSON quotes), and as JSON.
  for value in ("user_id,ad_id", " user_id , ad_id", '["user_id", "ad_id"]'):
    assert apply_overrides(configs.get("tiny"), [f"train.host_tables={value}"]).train.host_tables == ("user_id", "ad_id")
  assert apply_overrides(configs.get("tiny"), ["train.host_tables="]).train.host_tables == ()


def test_overrides_that_need_each_other_apply_together():
  cfg = apply_overrides(configs.get("tiny"), ["model.num_layers=1", "model.hstu.keep_last=[32]"])
  assert cfg.model.num_layers == 1 and cfg.model.hstu.keep_last == (32,)
  with pytest.raises(ValueError, match=r"--set model\.num_layers=3, model\.hstu\.keep_last=\[32\]: "
                                       r"model\.hstu\.keep_last has 1 entries for 3 layers"):
    apply_overrides(configs.get("tiny"), ["model.num_layers=3", "model.hstu.keep_last=[32]"])
  assert apply_overrides(configs.get("tiny"), ["train.steps=5", "train.steps=6"]).train.steps == 6
  with pytest.raises(ValueError, match="set as a value and as a section"):
    apply_overrides(configs.get("tiny"), ["train.steps=5", "train.steps.every=1"])
