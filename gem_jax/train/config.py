"""Training configuration: optimizer, schedule, evaluation, checkpointing and logging cadence.

A frozen dataclass with CPU-sized defaults (a laptop run of a few hundred steps). Named configs for real
runs are built by functions elsewhere with `dataclasses.replace`; this module holds no run logic.

Two optimizers, as in TorchRec/FBGEMM recommenders:
  dense params      AdamW, linear warmup to `learning_rate` then cosine decay to
                    `learning_rate * end_lr_fraction` at `steps`, global-norm clipping at `grad_clip_norm`
  embedding tables  row-wise Adagrad at a constant `embedding_learning_rate`
"""

from __future__ import annotations

import dataclasses
import math
import numbers


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
  # Row-wise Adagrad for embedding tables.
  embedding_learning_rate: float = 0.05
  adagrad_initial_accumulator: float = 0.0
  adagrad_eps: float = 1e-8
  # Cadence.
  eval_every: int = 100
  eval_examples: int = 4096
  checkpoint_every: int = 100
  keep_checkpoints: int = 3
  log_every: int = 10
  seed: int = 0
  # Non-finite guard (gem_jax/train/step.py skips such a step's update): after `nonfinite_patience`
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
    if self.on_nonfinite not in ("restore", "stop"):
      raise ValueError(f"TrainConfig.on_nonfinite must be 'restore' or 'stop', got {self.on_nonfinite!r}")
    if self.nonfinite_patience < 1 or self.max_nonfinite_restores < 0:
      raise ValueError(f"TrainConfig: nonfinite_patience must be >= 1 and max_nonfinite_restores >= 0, got "
                       f"{self.nonfinite_patience} and {self.max_nonfinite_restores}")
    if self.weight_decay < 0 or self.adagrad_initial_accumulator < 0:
      raise ValueError("TrainConfig.weight_decay and adagrad_initial_accumulator must be non-negative")
