"""Small host values agreed between the processes of a run, without a device: JSON over the key-value store of
JAX's coordination service (the one jax.distributed.initialize starts; gem_jax/parallel/distributed.py).

A process that reads only its own rows (gem_jax/data/parquet_source.py, readers) still needs a few numbers of
the whole step before it can lay its shards out: the history capacity every shard shares, and the label counts
the run's summary and checkpoints carry. `Exchange.all(value)` posts this process's value under the next round
number and returns every process's, in process order. Rounds are numbered per Exchange, so the processes must
call it in the same order (they run the same loop); a process's key of round n - 1 is deleted once it has read
every value of round n, when every peer has read round n - 1. A peer that never posts fails the call after
TIMEOUT_S instead of hanging the run. One process: no store, the value itself.

The store's client is `jax._src.distributed.global_state.client` (jax has no public handle on it); its absence
raises with what to do.
"""

from __future__ import annotations

import itertools
import json

import jax

TIMEOUT_S = 300
_IDS = itertools.count()


def _client():
  try:
    from jax._src import distributed
    client = distributed.global_state.client
  except (ImportError, AttributeError):
    client = None
  if client is None:
    raise RuntimeError("host_exchange: a multi-process run has no coordination-service client (jax."
                       "distributed.initialize was not called, or this jax keeps it elsewhere); run each "
                       "process with data.readers=1 to read every row on every process instead")
  return client


class Exchange:
  """Rounds of one JSON value per process (module docstring)."""

  def __init__(self, name: str, *, numbered: bool = True):
    # Numbered: every process builds its Exchanges in the same order. Not numbered: the name alone, for one
    # Exchange per process that a module keeps (its name must be unique among those).
    self.name = f"gem_jax/{name}/{next(_IDS)}" if numbered else f"gem_jax/{name}"
    self.round = 0

  def all(self, value) -> list:
    if jax.process_count() == 1:
      return [value]
    client, me, n = _client(), jax.process_index(), self.round
    self.round += 1
    client.key_value_set(f"{self.name}/{n}/{me}", json.dumps(value))
    out = [json.loads(client.blocking_key_value_get(f"{self.name}/{n}/{p}", TIMEOUT_S * 1000))
           for p in range(jax.process_count())]
    if n:
      client.key_value_delete(f"{self.name}/{n - 1}/{me}")
    return out
