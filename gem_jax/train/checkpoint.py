"""Checkpoints of a training run: the array state plus a small JSON sidecar, via orbax.

One checkpoint (a directory named by its step) holds three orbax items:
  state   the array pytree (params, optimizer state, step, rng key data), written by StandardSave: each
          process writes its own shards, and restore reshards into whatever layout the abstract target
          asks for, so a run can resume on a different mesh
  extra   a JSON dict from the caller (data iterator position, config name, ...)
  prng    which PRNG implementation each typed key had; typed keys are stored as their uint32
          `jax.random.key_data` so that the array item holds only plain dtypes

Multi-process runs: every process constructs the Checkpointer on the same directory (a filesystem all
processes share) and calls save / restore / wait together; orbax coordinates them (each process writes
its own shards, process 0 the JSON items and metadata, and a save commits once all are done).

Restore is bit-exact: values, dtypes (bfloat16 included) and the pytree structure of the abstract target
come back unchanged. This module never decides *what* to save (the train loop does) and never resumes
silently from nothing: restoring from an empty directory or a missing step raises.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _abstract(x):
  """A restore target leaf: shape, dtype and sharding (this process's first device when the leaf has
  none: jax.devices()[0] belongs to process 0 only)."""
  sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class Checkpointer:
  """Saves every `save_every` steps (or when forced) and keeps the newest `keep` checkpoints.

  Saving is asynchronous: `save` returns once the arrays are copied off the device (so the caller may
  donate or overwrite them) and the write finishes in the background. `wait()` blocks until it is on
  disk; `close()` waits and releases the manager. Also a context manager.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int, save_every: int, async_save: bool = True):
    if keep < 1 or save_every < 1:
      raise ValueError(f"Checkpointer: keep and save_every must be >= 1, got keep={keep}, save_every={save_every}")
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.save_every = save_every
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save),
        item_names=("state", "extra", "prng"),
    )

  # ---- queries ------------------------------------------------------------------------------------
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  # ---- save ---------------------------------------------------------------------------------------
  def save(self, step: int, state: Any, extra: dict | None = None, *, force: bool = False) -> bool:
    """Saves `state` (a pytree of jax arrays) and `extra` (JSON) as `step` if it is a save step or
    `force`; returns whether it saved. Re-saving an existing step raises."""
    if not (force or self.should_save(step)):
      return False
    extra = {} if extra is None else extra
    try:
      json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
      raise ValueError(f"Checkpointer.save(step={step}): extra is not JSON-serializable: {e}") from None
    if step in self._manager.all_steps():
      raise ValueError(f"Checkpointer.save: step {step} already exists in {self.directory}")

    prng = {}

    def plain(path, x):
      if _is_key(x):
        prng[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
        return jax.random.key_data(x)
      return x

    arrays = jax.tree_util.tree_map_with_path(plain, state)
    return self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(arrays), extra=ocp.args.JsonSave(extra), prng=ocp.args.JsonSave(prng)))

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- restore ------------------------------------------------------------------------------------
  def restore(self, step: int | None = None, *, abstract_state: Any) -> tuple[int, Any, dict]:
    """(step, state, extra) of checkpoint `step` (default: the latest).

    `abstract_state`: the target pytree, of jax.ShapeDtypeStruct leaves (from jax.eval_shape, with the
    shardings to restore into) or of live arrays whose shapes, dtypes and shardings are copied. Typed
    PRNG keys are given as key-dtype leaves and come back as typed keys.
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; steps there: {steps}")

    prng = self._manager.restore(step, args=ocp.args.Composite(prng=ocp.args.JsonRestore())).prng or {}

    def plain_target(path, x):
      if not _is_key(x):
        return _abstract(x)
      name = jax.tree_util.keystr(path)
      if name not in prng:
        raise ValueError(f"checkpoint step {step}: {name} is a PRNG key in abstract_state but was saved as a "
                         "plain array")
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      # A key's sharding spec names only the key's own dims, so it also fits its key data.
      return _abstract(jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None)))

    target = jax.tree_util.tree_map_with_path(plain_target, abstract_state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"checkpoint step {step} in {self.directory} does not match abstract_state: {e}") from e

    def typed(path, x, want):
      if not _is_key(want):
        return x
      key = jax.random.wrap_key_data(x, impl=prng[jax.tree_util.keystr(path)])
      if key.dtype != want.dtype:
        raise ValueError(f"checkpoint step {step}: {jax.tree_util.keystr(path)} was saved as {key.dtype}, "
                         f"abstract_state wants {want.dtype}")
      return key

    state = jax.tree_util.tree_map_with_path(typed, restored.state, abstract_state)
    return step, state, dict(restored.extra or {})
