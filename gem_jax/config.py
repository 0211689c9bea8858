"""The run configuration: frozen dataclasses composed from each part's own config.

  Config(name, model, data, train: TrainConfig, task, mesh)

TrainConfig lives here (not in gem_jax/train/) so that everything below the trainer can read it without
importing the trainer.

Named configs are built by functions in gem_jax/configs.py. `apply_overrides(cfg, ["train.steps=200"])` sets
nested fields from strings (the `--set` flag of experiments/train.py); an unknown key, a value that does
not parse (tuple elements included) or one its dataclass rejects raises a ValueError naming the key, before
anything is compiled. Checks across fields, against the mesh file and the devices are in gem_jax/check.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import typing
from typing import Any



# ---- training: optimizer, schedule, evaluation, checkpointing and logging cadence ------------------------
# Two optimizers, as in TorchRec/FBGEMM recommenders (gem_jax/run/optim.py):
#   dense params      AdamW, linear warmup to `learning_rate` then cosine decay to
#                     `learning_rate * end_lr_fraction` at `steps`, global-norm clipping at `grad_clip_norm`
#   embedding tables  a row optimizer (`embedding_optimizer`: row-wise Adagrad, SGD or row-wise Adam) at a
#                     constant `embedding_learning_rate`; `embedding_update` = "sparse" (the default) applies
#                     it to the rows a batch touched (the sparse engine, gem_jax/run/table_update.py),
#                     "dense" to a V x E gradient per table (the reference the engine is tested against)
# CPU-sized defaults (a laptop run of a few hundred steps); named configs replace fields.

@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 500
  # Dense AdamW.
  learning_rate: float = 1e-3     # peak, reached at the end of warmup
  warmup_steps: int = 50
  end_lr_fraction: float = 0.1    # lr at `steps` = learning_rate * end_lr_fraction
  weight_decay: float = 1e-4      # decoupled, on >= 2-D dense kernels only
  b1: float = 0.9
  b2: float = 0.999
  grad_clip_norm: float = 1.0     # global norm over the dense gradients; tables are not clipped
  # Parameter averaging: > 0 keeps an exponential moving average of the dense parameters at this decay
  # (warmed up as min(decay, (1 + t) / (ema_warmup + t)) at update t) in the optimizer state, and every
  # evaluation, the kept parameters and the final evaluation read it in their place. Tables are not averaged:
  # an average of a table would be written in full at every step, where the sparse engine writes the rows a
  # batch read. While the warm-up rate is below the decay, the average spans about the last
  # t / (ema_warmup - 1) updates (a ninth of the run so far at 10); the decay binds from
  # t = (ema_warmup * decay - 1) / (1 - decay) on (4,491 updates for 0.998 at 10), and from there the span is
  # about 1 / (1 - decay) updates.
  ema_decay: float = 0.0
  ema_warmup: float = 10.0
  # Embedding tables (gem_jax/run/table_optim.py, gem_jax/run/table_update.py). Row-wise Adam uses b1 / b2
  # above and adagrad_eps.
  embedding_optimizer: str = "rowwise_adagrad"
  embedding_update: str = "sparse"
  embedding_learning_rate: float = 0.05
  adagrad_initial_accumulator: float = 0.0
  adagrad_eps: float = 1e-8
  # Host tables (gem_jax/run/host_tables.py): these tables keep their rows and row-optimizer slots in host
  # memory, and the device a cache of host_cache_rows rows each (0: host_cache_fraction of the table's rows),
  # filled a step ahead by the host; victims by host_cache_policy, "lru" or "lfu".
  host_tables: tuple[str, ...] = ()
  host_cache_fraction: float = 0.2
  host_cache_rows: int = 0
  host_cache_policy: str = "lru"
  # Cadence.
  eval_every: int = 100
  eval_examples: int = 4096
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  log_every: int = 10
  # Steps in the efficiency report's profiler window (gem_jax/observe/meter.py; 0 = no window). On CPU a
  # profiled step runs far slower than a plain one (a trace event per XLA thunk per device).
  profile_steps: int = 3
  seed: int = 0
  # Runs over a finite dataset (a source with steps_per_epoch, e.g. the next-item datasets): when epochs > 0
  # the run lasts epochs x steps_per_epoch steps (`steps` is ignored) and eval_every_epochs > 0 evaluates
  # every that many epochs instead of every `eval_every` steps.
  epochs: int = 0
  eval_every_epochs: int = 0
  # Model selection: the evaluation metric whose best value picks the parameters the final evaluation
  # reads ("" = the last ones), and how many evaluations without a better one end the run (0 = never).
  select_metric: str = ""
  patience: int = 0
  max_train_minutes: float = 0.0  # end training after this long (0 = no limit); the stop is recorded
  # Non-finite guard (gem_jax/run/step.py skips such a step's update): after `nonfinite_patience`
  # skipped steps in a row, "restore" reloads the newest checkpoint from before the streak (weights and
  # optimizer state; the data goes on) at most `max_nonfinite_restores` times, "stop" ends the run.
  nonfinite_patience: int = 3
  on_nonfinite: str = "restore"
  max_nonfinite_restores: int = 3

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"TrainConfig.{field.name} must be an integer, got {value!r}")
      # NaN slips through the `< 0` checks below, and an infinite rate, decay or accumulator makes the first
      # update NaN (an infinite adagrad_eps: tables that never move). An infinite clip norm means no clipping.
      number = not isinstance(value, bool) and isinstance(value, numbers.Real)
      if field.type in ("float", float) and (not number or math.isnan(value) or
                                    (math.isinf(value) and field.name != "grad_clip_norm")):
        raise ValueError(f"TrainConfig.{field.name} must be a finite number, got {value!r}")
    positive = ("steps", "learning_rate", "embedding_learning_rate", "eval_every", "eval_examples",
                "checkpoint_every", "keep_checkpoints", "log_every", "grad_clip_norm", "adagrad_eps")
    for name in positive:
      if not getattr(self, name) > 0:
        raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.warmup_steps < self.steps:
      raise ValueError(f"TrainConfig.warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
    if not 0.0 <= self.end_lr_fraction <= 1.0:
      raise ValueError(f"TrainConfig.end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"TrainConfig.ema_decay must be in [0, 1) (0: no average), got {self.ema_decay}")
    if not self.ema_warmup > 1.0:
      raise ValueError(f"TrainConfig.ema_warmup must be > 1 (the average's rate is min(ema_decay, (1 + t) / "
                       f"(ema_warmup + t))), got {self.ema_warmup}")
    if self.embedding_optimizer not in ("rowwise_adagrad", "sgd", "rowwise_adam"):
      raise ValueError(f"TrainConfig.embedding_optimizer must be rowwise_adagrad, sgd or rowwise_adam, got "
                       f"{self.embedding_optimizer!r}")
    if self.embedding_update not in ("sparse", "dense"):
      raise ValueError(f"TrainConfig.embedding_update must be 'sparse' or 'dense', got {self.embedding_update!r}")
    if self.on_nonfinite not in ("restore", "stop"):
      raise ValueError(f"TrainConfig.on_nonfinite must be 'restore' or 'stop', got {self.on_nonfinite!r}")
    if self.nonfinite_patience < 1 or self.max_nonfinite_restores < 0:
      raise ValueError(f"TrainConfig: nonfinite_patience must be >= 1 and max_nonfinite_restores >= 0, got "
                       f"{self.nonfinite_patience} and {self.max_nonfinite_restores}")
    if self.weight_decay < 0 or self.adagrad_initial_accumulator < 0:
      raise ValueError("TrainConfig.weight_decay and adagrad_initial_accumulator must be non-negative")
    for name in ("epochs", "eval_every_epochs", "patience", "profile_steps"):
      if getattr(self, name) < 0:
        raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
    if not 0.0 < self.host_cache_fraction <= 1.0 or self.host_cache_rows < 0:
      raise ValueError(f"TrainConfig: host_cache_fraction must be in (0, 1] and host_cache_rows >= 0, got "
                       f"{self.host_cache_fraction} and {self.host_cache_rows}")
    if self.host_cache_policy not in ("lru", "lfu"):
      raise ValueError(f"TrainConfig.host_cache_policy must be 'lru' or 'lfu', got {self.host_cache_policy!r}")
    if len(set(self.host_tables)) != len(self.host_tables):
      raise ValueError(f"TrainConfig.host_tables names a table twice: {list(self.host_tables)}")
    if self.max_train_minutes < 0:
      raise ValueError(f"TrainConfig.max_train_minutes must be >= 0, got {self.max_train_minutes}")


@dataclasses.dataclass(frozen=True)
class Config:
  """A run: `data` picks the data source by its type (gem_jax/data/sources.py: DataConfig for the synthetic
  ads stream, SeqRecDataConfig for the public next-item datasets), `task` the task by its type
  (gem_jax/run/tasks.py), `model` is what that task builds (ModelConfig for GEM)."""
  name: str
  model: Any
  data: Any
  train: TrainConfig
  task: Any = None
  mesh: str | None = None  # path of a meshes/*.yaml file; None: one device (the 1x1x1x1x1 mesh)


def _parse(value: str, typ, key: str):
  """`value` (a --set string) as a field of type `typ`; `key` is the whole dotted key, for the errors."""
  if typing.get_origin(typ) is tuple or typ is tuple:
    return _parse_tuple(value, typ, key)
  try:
    if typ is bool:
      if value.lower() in ("1", "true", "yes"):
        return True
      if value.lower() in ("0", "false", "no"):
        return False
      raise ValueError(value)
    if typ in (int, float, str):
      return typ(value)
    if typ == (str | None) or typ == typing.Optional[str]:
      return None if value.lower() == "none" else value
  except ValueError as e:
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ}") from e
  raise ValueError(f"--set {key}: fields of type {typ} cannot be set from the command line")


def _parse_tuple(value: str, typ, key: str) -> tuple:
  """A JSON list ("[8, 4]") or comma-separated values ("8,4"); every element must be of the element type
  (a float keep_last or a string fraction would otherwise fail only where the model or pipeline uses it)."""
  args = typing.get_args(typ)
  item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
  if item not in (int, float, str):
    raise ValueError(f"--set {key}: fields of type {typ} cannot be set from the command line")
  try:
    if item is str and not value.startswith("["):  # names need no quotes: users,ads
      parsed = [x.strip() for x in value.split(",") if x.strip()]
    else:
      parsed = json.loads(value if value.startswith("[") else f"[{value}]")
  except json.JSONDecodeError as e:
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ} (a JSON list, or values separated by "
                     "commas)") from e
  if not isinstance(parsed, list):
    raise ValueError(f"--set {key}={value!r}: cannot parse as {typ}")
  out = []
  for x in parsed:
    if item is float and not isinstance(x, bool) and isinstance(x, (int, float)):
      x = float(x)
    if type(x) is not item:
      raise ValueError(f"--set {key}={value!r}: element {x!r} is not of type {item.__name__} ({typ})")
    out.append(x)
  return tuple(out)


def apply_overrides(cfg: Config, assignments: list[str]) -> Config:
  """cfg with every "dotted.key=value" of `assignments` set. They are applied together, one
  dataclasses.replace per config section, so a change that needs two fields at once (model.num_layers
  with model.hstu.keep_last) is checked only once both are set; a later assignment of the same key wins.
  Errors name the key (or, for a check across fields, the assignments of that section)."""
  tree: dict = {}
  for a in assignments:
    if "=" not in a:
      raise ValueError(f"--set expects key=value, got {a!r}")
    key, value = (x.strip() for x in a.split("=", 1))
    node, parts = tree, key.split(".")
    for i, part in enumerate(parts[:-1]):
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ValueError(f"--set {key}: {'.'.join(parts[:i + 1])} is set as a value and as a section")
    if isinstance(node.get(parts[-1]), dict):
      raise ValueError(f"--set {key}: {key} is set as a value and as a section")
    node[parts[-1]] = (value, a)
  return _apply(cfg, tree, "")


def _leaves(tree: dict) -> list[str]:
  """The assignments (as written) under a tree of overrides."""
  return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v[1]])]


def _first_key(sub, full: str) -> str:
  while isinstance(sub, dict):
    head, sub = next(iter(sub.items()))
    full = f"{full}.{head}"
  return full


def _apply(cfg, tree: dict, prefix: str):
  """cfg (a config section) with the overrides of `tree` ({field: (value, assignment) or subtree})."""
  if not dataclasses.is_dataclass(cfg):
    raise ValueError(f"--set {_first_key(tree, prefix[:-1])}: {prefix[:-1]} is not a config section (it holds a "
                     f"{type(cfg).__name__})")
  fields = {f.name for f in dataclasses.fields(cfg)}
  hints = typing.get_type_hints(type(cfg))
  changes = {}
  for head, sub in tree.items():
    full = prefix + head
    if head not in fields:
      raise ValueError(f"--set {_first_key(sub, full)}: unknown key {head!r} in {type(cfg).__name__}; known: "
                       f"{sorted(fields)}")
    changes[head] = (_apply(getattr(cfg, head), sub, full + ".") if isinstance(sub, dict)
                     else _parse(sub[0], hints[head], full))
  try:
    return dataclasses.replace(cfg, **changes)
  except ValueError as e:  # a section's own check (__post_init__) names the field, not the flag
    if str(e).startswith("--set"):
      raise
    raise ValueError(f"--set {', '.join(_leaves(tree))}: {e}") from e
