"""The named scopes a step's collectives are found by: written here once, read by the code that opens them
(jax.named_scope) and by the code that finds their collectives in the compiled HLO's op names
(gem_jax/observe/mesh_sweep.py, embedding_update.py). Imports nothing, so every package may read it.

  EMBEDDING_LOOKUP    parallel/sparse.py sharded_lookup: ids to their owners and rows back
  GRAD_TO_OWNER       parallel/sparse.py send_to_owners: the sparse engine's row gradients to their owners
  EMBEDDING_UPDATE    run/step.py: the table update (the sparse engine's merges and syncs)
  CONTEXT_PARALLEL    parallel/spmd.py: the context-parallel all-gathers
  TENSOR_PARALLEL     model/layers.py: the tensor-parallel sums
  table(name)         one table's (or one lookup call's, "table/N") collectives
  SPILL, SECOND, LAST_RESORT, REST    the fallback rounds after a collective's first (parallel/sparse.py
                      fallback_rounds); they run inside a conditional
"""

EMBEDDING_LOOKUP = "embedding_lookup"
GRAD_TO_OWNER = "embedding_grad_to_owner"
EMBEDDING_UPDATE = "embedding_update"
CONTEXT_PARALLEL = "context_parallel"
TENSOR_PARALLEL = "tensor_parallel"
SPILL, SECOND, LAST_RESORT, REST = "spill", "second", "last_resort", "rest"


def table(name: str) -> str:
  """The scope of one table's collectives (`name` a table, or a lookup call's "table/N")."""
  return f"table={name}"


def in_table(op_name: str, table_name: str) -> bool:
  """Whether an HLO op name lies in `table_name`'s scope (a table's, or any of its lookup calls')."""
  return f"table={table_name}/" in op_name


def in_round(op_name: str, round_name: str) -> bool:
  """Whether an HLO op name lies in the fallback round `round_name`."""
  return f"/{round_name}/" in op_name
