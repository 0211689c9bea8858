"""Checkpoints of a training run, via orbax: crash-safe, verified on restore, restorable onto another mesh.

One checkpoint (a directory named by its step) holds four orbax items:
  state      the array pytree (params, optimizer state, step, rng key data), an orbax PyTree item: each
             process writes its own shards, and restore reshards into whatever layout the abstract target
             asks for, so a run can resume on a different mesh (other axis sizes, other device count)
  extra      a JSON dict from the caller (data iterator position, label counts, ...)
  meta       JSON: the format version, every state leaf's path, shape and dtype, which PRNG
             implementation each typed key had (keys are stored as their uint32 `jax.random.key_data`),
             and a CRC32 of `extra`'s JSON
  integrity  two uint32 hashes of every state leaf's bits (position-weighted sums mod 2**32), computed on
             the device in one jitted pass, so they cost no host round trip; on CPU, when this process holds
             every leaf whole, leaf by leaf, and in a multi-process CPU run each process over its own shards,
             the parts added up over the coordination service (the same sums: one pass over a few hundred
             leaves compiles in 3 to 4 s, per process, for every new state layout)

Crash safety. orbax writes a checkpoint into a temporary directory and renames it to its step only once
every item (and, multi-process, every process) is done, so a save interrupted at any moment (SIGKILL,
node loss) leaves the previous checkpoints untouched; the leftover temporary directory is deleted by the
next save. Saving is asynchronous: `save` returns once the arrays are copied off the device.

Verification. orbax reads whatever bytes are on disk: a flipped bit in a data file restores silently as
a wrong value (a truncated file at least raises). So restore re-hashes the restored arrays, on their new
mesh, and compares with the hashes written at save time (integer sums are exact in any reduction order,
so the check is mesh-independent). A checkpoint that cannot be read, or whose hashes differ, is corrupt:
`restore()` says so (warning, and `self.fallbacks`), moves it aside to `<step>.corrupt` (so later saves
of that step can proceed and the evidence stays on disk) and restores the next older one. When every
checkpoint is corrupt it raises CheckpointCorruptError listing each reason; it never starts from nothing.

A checkpoint whose leaves do not match the abstract target (another model config) is not corrupt: that
raises ValueError naming the first differing leaf, without falling back, as every older checkpoint of
the run would differ the same way.

Multi-process runs: every process constructs the Checkpointer on the same directory (a filesystem all
processes share) and calls save / restore / wait together; orbax coordinates the writes (each process
its own shards, process 0 the JSON items and metadata), and the processes agree on whether a checkpoint
read cleanly before any of them compares hashes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 1
_ARRAY_ITEMS = ("state", "integrity")


def _array_handler() -> ocp.PyTreeCheckpointHandler:
  """orbax's PyTree handler with replica-parallel saving off, for this manager only (not orbax's global
  registry). Replica-parallel saving splits every replicated array into one slice per replica so that each
  replica writes a part; the slicing compiles a program per (shape, device), which on a CPU mesh is most
  of a checkpoint's first save (333 compiles, 12 of 15 s for `tiny` on cpu_8) and buys nothing, since
  the replicas share one host's memory. orbax already turns it off by default on GPU. Every state leaf
  is a jax.Array; numpy arrays and scalars get orbax's usual handlers."""
  th = ocp.type_handlers
  registry = th.create_type_handler_registry(
      (jax.Array, th.ArrayHandler(use_replica_parallel=False)), (np.ndarray, th.NumpyHandler()),
      (np.number, th.ScalarHandler()), (int, th.ScalarHandler()), (float, th.ScalarHandler()))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class CheckpointCorruptError(ValueError):
  """A checkpoint on disk cannot be used: unreadable, truncated, or its contents fail their hashes."""


def _is_key(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _abstract(x):
  """A restore target leaf: shape, dtype and sharding (this process's first device when the leaf has
  none: jax.devices()[0] belongs to process 0 only); a numpy leaf stays numpy, read into host memory (a host
  table: gem_jax/run/host_tables.py)."""
  if isinstance(x, np.ndarray):
    return x
  sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _leaf_hash(x):
  """(2,) uint32: the sum of x's 32-bit words and their position-weighted sum, both mod 2**32."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  words = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32).reshape(-1)
  index = jnp.arange(words.shape[0], dtype=jnp.uint32)
  weights = index * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


def _hash_sums(words: np.ndarray, index: np.ndarray) -> tuple[int, int]:
  """(sum of words, sum of words * weight(index)) mod 2**32 for uint32 words at uint32 flat positions."""
  weights = index * np.uint32(0x9E3779B1) + np.uint32(0x7F4A7C15)
  return int(np.sum(words, dtype=np.uint32)), int(np.sum(words * weights, dtype=np.uint32))


def _words(x) -> np.ndarray:
  """x's bits as uint32 words, one per element, as _leaf_hash reads them (64-bit leaves canonicalized)."""
  x = np.asarray(x)
  x = x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)
  if x.dtype == np.bool_:
    x = x.astype(np.uint8)
  return np.ascontiguousarray(x).view(np.dtype(_UNSIGNED[x.dtype.itemsize])).astype(np.uint32)


_HOST_ELEMENTS = 1 << 16  # larger CPU leaves: a jitted pass of their own (numpy takes ~9x longer per word)


def _leaf_hash_host(x) -> np.ndarray:
  """_leaf_hash in numpy, for an array this process holds whole in host memory: the same (2,) uint32. A
  64-bit leaf is hashed as the 32-bit value jit would make of it (without jax_enable_x64), as the jitted
  pass sees it."""
  words = _words(x).reshape(-1)
  return np.array(_hash_sums(words, np.arange(words.shape[0], dtype=np.uint32)), np.uint32)


_leaf_hash_jit = jax.jit(_leaf_hash)


def _positions(shape: tuple, index: tuple) -> np.ndarray:
  """uint32 flat positions (mod 2**32) in an array of `shape` of the block at `index` (a shard's slices)."""
  pos = np.zeros((), np.uint64)
  stride = 1
  for dim, s in reversed(list(zip(shape, index))):
    start, stop, _ = s.indices(dim)
    pos = pos + (np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)).reshape((-1,) + (1,) * pos.ndim)
    stride *= dim
  return pos.astype(np.uint32)


def _local_sums(x) -> tuple[int, int]:
  """This process's part of _leaf_hash(x): its shards of replica 0, at their positions in the whole array
  (a numpy leaf, which every process holds whole, counts on process 0 only). Summed over the processes,
  the parts are the whole leaf's hash."""
  if isinstance(x, (np.ndarray, np.generic)):
    return (0, 0) if jax.process_index() else tuple(int(v) for v in _leaf_hash_host(x))
  total, weighted = 0, 0
  for shard in x.addressable_shards:
    if shard.replica_id:
      continue
    s, w = _hash_sums(_words(shard.data).reshape(-1), _positions(x.shape, shard.index).reshape(-1))
    total, weighted = total + s, weighted + w
  return total % 2**32, weighted % 2**32


_PROCESS_HASHES = None   # the Exchange of the multi-process CPU hashes (_fingerprint), made at first use


def _fingerprint_processes(leaves: list) -> np.ndarray:
  """_fingerprint of a multi-process CPU run: each process hashes its shards in numpy, and the processes add
  their parts up over the coordination service (no program to compile, per process and start)."""
  global _PROCESS_HASHES
  if _PROCESS_HASHES is None:
    from gem_jax.parallel import host_exchange
    _PROCESS_HASHES = host_exchange.Exchange("checkpoint_hashes", numbered=False)
  every = _PROCESS_HASHES.all([list(_local_sums(x)) for x in leaves])
  return (np.sum(np.asarray(every, np.uint64), axis=0) % 2**32).astype(np.uint32)


@jax.jit
def _fingerprint_jit(leaves: list) -> jax.Array:
  return jnp.stack([_leaf_hash(x) for x in leaves])


def _on_cpu(x) -> bool:
  """numpy, or a jax.Array all of whose devices (in any process) are CPUs."""
  return isinstance(x, (np.ndarray, np.generic)) or (
      isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set))


def _on_host(x) -> bool:
  """A leaf whose bits this process reads without a device copy or another process: numpy, or a CPU
  jax.Array held whole here."""
  return isinstance(x, (np.ndarray, np.generic)) or (_on_cpu(x) and x.is_fully_addressable)


def _fingerprint(leaves: list) -> jax.Array:
  """(num_leaves, 2) uint32 hashes of the leaves' bits; identical for any sharding of the same values, and
  however computed (integer sums are exact in any order): on CPU, small leaves in numpy and each large one
  in a jitted pass cached by its shape (no program over the whole state to compile), elsewhere one jitted
  pass over every leaf."""
  if not leaves:
    return jnp.zeros((0, 2), jnp.uint32)
  # One process holding every leaf: numpy per leaf. Several processes on CPUs: each its own shards, summed
  # over the processes (a leaf held whole by some and not others cannot split them: every process takes the
  # same path). Elsewhere (GPU), one jitted pass that every process joins.
  if jax.process_count() == 1 and all(_on_host(x) for x in leaves):
    return jnp.asarray(np.stack([_leaf_hash_host(x) if np.size(x) <= _HOST_ELEMENTS else
                                 np.asarray(_leaf_hash_jit(x)) for x in leaves]))
  if jax.process_count() > 1 and all(_on_cpu(x) for x in leaves):
    # orbax saves an array item of a multi-process run from global arrays: the hashes replicated on every
    # device (placed, not computed: nothing compiles).
    hashes = _fingerprint_processes(leaves)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback(hashes.shape, replicated, lambda index: hashes[index])
  return _fingerprint_jit(leaves)


def fingerprint(tree) -> np.ndarray:
  """The integrity hashes of a pytree of arrays (typed keys hashed as their key data), on the host."""
  leaves = [jax.random.key_data(x) if _is_key(x) else x for x in jax.tree_util.tree_leaves(tree)]
  return np.asarray(jax.device_get(_fingerprint(leaves)))


def _extra_crc(extra: dict) -> int:
  return zlib.crc32(json.dumps(extra, sort_keys=True, allow_nan=False).encode())


def _leaf_table(tree) -> list[list]:
  """[path, shape, dtype] of every leaf, the record a restore target is compared against."""
  return [[jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype)]
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclasses.dataclass(frozen=True)
class Fallback:
  """A checkpoint restore skipped: its step, why, and where it was moved."""
  step: int
  reason: str
  moved_to: str | None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class Checkpointer:
  """Saves every `save_every` steps (or when forced) and keeps the newest `keep` checkpoints (None: every
  one, until drop_before / drop_after delete some).

  Saving is asynchronous: `save` returns once the arrays are copied off the device (so the caller may
  donate or overwrite them) and the write finishes in the background. `wait()` blocks until it is on
  disk; `close()` waits and releases the manager. Also a context manager.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None, save_every: int, async_save: bool = True):
    if (keep is not None and keep < 1) or save_every < 1:
      raise ValueError(f"Checkpointer: keep and save_every must be >= 1, got keep={keep}, save_every={save_every}")
    directory = os.fspath(directory)
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.save_every = save_every
    self.fallbacks: list[Fallback] = []  # corrupt checkpoints skipped by restore(), oldest first
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True,
                                             enable_async_checkpointing=async_save),
        item_handlers={**{name: _array_handler() for name in _ARRAY_ITEMS},
                       "extra": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )

  # ---- queries ------------------------------------------------------------------------------------
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  # ---- save ---------------------------------------------------------------------------------------
  def save(self, step: int, state: Any, extra: dict | None = None, *, force: bool = False) -> bool:
    """Saves `state` (a pytree of jax arrays) and `extra` (JSON) as `step` if it is a save step or
    `force`; returns whether it saved. Re-saving an existing step raises."""
    if not (force or self.should_save(step)):
      return False
    extra = {} if extra is None else extra
    try:
      crc = _extra_crc(extra)
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
    meta = {"format": FORMAT, "leaves": _leaf_table(state), "prng": prng, "extra_crc": crc}
    # In a multi-process run the hashes are a global array (one jit over the global state, or on CPUs the
    # processes' sums placed on every device), which orbax requires of everything in an array item.
    integrity = {"leaves": _fingerprint(jax.tree_util.tree_leaves(arrays))}
    return self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(arrays), extra=ocp.args.JsonSave(extra), meta=ocp.args.JsonSave(meta),
        integrity=ocp.args.PyTreeSave(integrity)))

  def quarantined(self) -> list[str]:
    """The step directories an earlier restore moved aside as unreadable (`<step>.corrupt[.n]`), sorted."""
    if "://" in self.directory or not os.path.isdir(self.directory):
      return []
    return sorted(n for n in os.listdir(self.directory) if re.fullmatch(r"\d+\.corrupt(\.\d+)?", n))

  def drop_before(self, step: int) -> list[int]:
    """Deletes every checkpoint older than `step`; returns their steps, oldest first."""
    return self._delete([s for s in self.all_steps() if s < step])

  def drop_after(self, step: int) -> list[int]:
    """Deletes every checkpoint newer than `step`; returns their steps, oldest first."""
    return self._delete([s for s in self.all_steps() if s > step])

  def _delete(self, steps: list[int]) -> list[int]:
    for s in steps:
      self._manager.delete(s)
    return steps

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- restore ------------------------------------------------------------------------------------
  def restore(self, step: int | None = None, *, abstract_state: Any, fallback: bool = True,
              max_step: int | None = None) -> tuple[int, Any, dict]:
    """(step, state, extra) of checkpoint `step`, or of the newest usable one (at most `max_step`).

    `abstract_state`: the target pytree, of jax.ShapeDtypeStruct leaves (from jax.eval_shape, with the
    shardings to restore into) or of live arrays whose shapes, dtypes and shardings are copied. Typed
    PRNG keys are given as key-dtype leaves and come back as typed keys.

    Without `step` and with `fallback`, a corrupt checkpoint is moved aside and recorded in
    `self.fallbacks` (and warned about), and the next older one is tried. An explicit `step` that is
    corrupt raises CheckpointCorruptError.
    """
    self.wait()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; steps there: {steps}")
      state, extra = self._restore_one(step, abstract_state)
      return step, state, extra
    candidates = [s for s in reversed(steps) if max_step is None or s <= max_step]
    if not candidates:
      raise FileNotFoundError(f"no checkpoint at or before step {max_step} in {self.directory}; steps there: "
                              f"{steps}")
    problems = []
    for s in candidates:
      try:
        state, extra = self._restore_one(s, abstract_state)
        return s, state, extra
      except CheckpointCorruptError as e:
        if not fallback:
          raise
        problems.append(str(e))
        moved = self._quarantine(s)
        self.fallbacks.append(Fallback(s, str(e), moved))
        warnings.warn(f"{e}; moved to {moved}, trying the previous checkpoint", RuntimeWarning, stacklevel=2)
    raise CheckpointCorruptError(f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(problems))

  def _restore_one(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    where = f"checkpoint step {step} in {self.directory}"
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - any read failure of a committed checkpoint is corruption
      raise CheckpointCorruptError(f"{where} is unreadable (meta: {type(e).__name__}: {_short(e)})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointCorruptError(f"{where} has no gem-jax format {FORMAT} record (meta item: {_short(meta)})")
    _check_leaves(where, meta["leaves"], _leaf_table(abstract_state))
    prng = meta["prng"]

    def plain_target(path, x):
      if not _is_key(x):
        return _abstract(x)
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      # A key's sharding spec names only the key's own dims, so it also fits its key data.
      return _abstract(jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None)))

    target = jax.tree_util.tree_map_with_path(plain_target, abstract_state)
    integrity_target = {"leaves": jax.ShapeDtypeStruct((len(meta["leaves"]), 2), jnp.uint32)}
    restored, failure = None, None
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=_restore_args(target), extra=ocp.args.JsonRestore(),
          integrity=_restore_args(jax.tree.map(_abstract, integrity_target))))
    except Exception as e:  # noqa: BLE001
      failure = _describe(e)
    failure = _agree(failure)
    if failure is not None:
      raise CheckpointCorruptError(f"{where} could not be read ({failure})")
    extra = dict(restored.extra or {})
    want = np.asarray(jax.device_get(restored.integrity["leaves"]))
    got = np.asarray(jax.device_get(_fingerprint(jax.tree_util.tree_leaves(restored.state))))
    bad = np.flatnonzero(np.any(want != got, axis=1))
    if bad.size:
      names = [meta["leaves"][i][0] for i in bad[:3]]
      raise CheckpointCorruptError(f"{where} fails its integrity hashes in {bad.size} leaves (first: "
                                   f"{', '.join(names)}): the bytes on disk changed after the save")
    if meta.get("extra_crc") != _extra_crc(extra):
      raise CheckpointCorruptError(f"{where}: its extra JSON fails its CRC32: the file changed after the save")

    def typed(path, x, want):
      if not _is_key(want):
        return x
      return jax.random.wrap_key_data(x, impl=prng[jax.tree_util.keystr(path)])

    return jax.tree_util.tree_map_with_path(typed, restored.state, abstract_state), extra

  def _quarantine(self, step: int) -> str | None:
    """Moves a corrupt step directory to `<step>.corrupt[.n]` (process 0); returns the new path."""
    src, moved = self.step_dir(step), None
    if jax.process_index() == 0 and "://" not in self.directory and os.path.exists(src):
      moved, n = f"{src}.corrupt", 1
      while os.path.exists(moved):
        moved, n = f"{src}.corrupt.{n}", n + 1
      os.rename(src, moved)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"gem_jax_checkpoint_quarantine_{step}")
    self._manager.reload()
    return moved


def _restore_args(target):
  """PyTree restore of `target` (ShapeDtypeStruct leaves): each leaf read into its shape, dtype and sharding."""
  return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _check_leaves(where: str, saved: list, wanted: list) -> None:
  """Raises ValueError at the first leaf where the checkpoint and the restore target differ."""
  saved_paths = [p for p, _, _ in saved]
  wanted_paths = [p for p, _, _ in wanted]
  if saved_paths != wanted_paths:
    only_saved = sorted(set(saved_paths) - set(wanted_paths))
    only_wanted = sorted(set(wanted_paths) - set(saved_paths))
    # A moving average of the parameters lives in the optimizer state only with train.ema_decay > 0.
    hint = ("; the parameter average's leaves differ: was one of the two runs configured with train.ema_decay "
            "and the other without?" if any("average" in p for p in only_saved + only_wanted) else "")
    raise ValueError(f"{where} does not match abstract_state: leaves only in the checkpoint {only_saved[:5]}, "
                     f"only in the target {only_wanted[:5]}{hint}")
  for (path, shape, dtype), (_, want_shape, want_dtype) in zip(saved, wanted):
    if list(shape) != list(want_shape) or dtype != want_dtype:
      raise ValueError(f"{where} does not match abstract_state at {path}: saved {dtype}{list(shape)}, target "
                       f"wants {want_dtype}{list(want_shape)}")


def _agree(failure: str | None) -> str | None:
  """Multi-process: a read failure on any process is a failure on all (before anyone runs a collective)."""
  if jax.process_count() == 1:
    return failure
  from jax.experimental import multihost_utils
  flags = multihost_utils.process_allgather(np.int32(failure is not None))
  if failure is None and np.any(flags):
    failure = f"process {int(np.flatnonzero(flags)[0])} could not read its shards"
  return failure


def _describe(e: BaseException) -> str:
  """An exception and its root cause (tensorstore's reason sits at the bottom of orbax's chain), short."""
  root = e
  while (root.__cause__ or root.__context__) is not None and root is not (root.__cause__ or root.__context__):
    root = root.__cause__ or root.__context__
  text = f"{type(e).__name__}: {_short(e)}"
  return text if root is e else f"{text}; cause: {type(root).__name__}: {_short(root)}"


def _short(x, limit: int = 300) -> str:
  text = " ".join(str(x).split(" See full TensorStore details")[0].split())
  return text if len(text) <= limit else text[:limit] + " ..."
