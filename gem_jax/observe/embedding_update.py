"""What the sparse engine's update moves and touches, from the compiled step and the steps' metrics.

The update (gem_jax/run/table_update.py) runs under the named scope "embedding_update", one scope
"table=<name>" per table, and its later rounds (inside conditionals) under "spill" or "rest" / "second" /
"last_resort". Its step metrics say, per table: unique and touched rows, whether a spill or a later round
ran (sync_spill, sync_rest), the touched rows' ideal sync bytes (sync_ideal_bytes) and the static row slots
the rule read (update_slots; touched and update_slots are per copy of the table, over all its owners, so
the "tables" entries' update bytes are too).

account() charges each collective of the update once per step and each conditional one on the fraction
of steps its table's round of that kind ran (a round that did not run moves nothing), and puts the bytes
next to their ideal: the touched rows' ids and gradients for the sync, the touched rows (row and its
optimizer slots, read and written once) for the update. mesh_sweep and the efficiency report
(report.json "embedding_update") both read it.
"""

from __future__ import annotations

import numpy as np

from gem_jax import scopes
from gem_jax.observe import hlo

SCOPE = scopes.EMBEDDING_UPDATE


def _mean(stats: list[dict], key: str) -> float:
  return float(np.mean([st.get(key, 0.0) for st in stats])) if stats else 0.0


def account(colls: list, stats: list[dict], row_bytes: dict[str, float]) -> dict:
  """colls: hlo.collectives of the compiled train step; stats: each step's metrics (host floats);
  row_bytes: per table, the bytes of one row and its optimizer slots. Bytes are per device and step."""
  sync = hlo.select(colls, op_name_contains=SCOPE)
  tables = sorted({k.split("/")[1] for st in stats[:1] for k in st if k.endswith("/sync_spill")}
                  | {k.split("/")[1] for st in stats[:1] for k in st if k.endswith("/touched")})
  ran = lambda t, kind: float(np.mean([st.get(f"emb/{t}/sync_{kind}", 0.0) > 0 for st in stats])) if stats else 0.0
  rates = {t: {kind: ran(t, kind) for kind in ("spill", "rest")} for t in tables}

  def charge(c) -> float:
    if not c.conditional:
      return 1.0
    kind = scopes.SPILL if scopes.in_round(c.op_name, scopes.SPILL) else scopes.REST
    owners = [t for t in tables if scopes.in_table(c.op_name, t)]
    return max((rates[t][kind] for t in owners), default=1.0)  # unknown owner: as if it always ran

  by_axis: dict[str, float] = {}
  total = 0.0
  for c in sync:
    moved = charge(c) * c.moved_bytes * c.count
    total += moved
    if c.axes and moved:
      key = ",".join(c.axes)
      by_axis[key] = by_axis.get(key, 0.0) + moved
  ideal = sum(_mean(stats, f"emb/{t}/sync_ideal_bytes") for t in tables)
  per_table = {}
  for t in tables:
    touched, slots = _mean(stats, f"emb/{t}/touched"), _mean(stats, f"emb/{t}/update_slots")
    b = float(row_bytes.get(t, 0.0))
    per_table[t] = {"unique": _mean(stats, f"emb/{t}/unique"), "touched": touched, "update_slots": slots,
                    "update_bytes": (slots + touched) * b, "update_ideal_bytes": 2.0 * touched * b,
                    "sync_ideal_bytes": _mean(stats, f"emb/{t}/sync_ideal_bytes"), "fallback_rates": rates[t]}
  update = sum(r["update_bytes"] for r in per_table.values())
  update_ideal = sum(r["update_ideal_bytes"] for r in per_table.values())
  return {
      "sync_bytes": total, "sync_ideal_bytes": ideal, "sync_ratio": total / ideal if ideal else None,
      "sync_bytes_by_axis": by_axis, "sync_by_kind": hlo.summarize(sync, include_conditional=True)["by_kind"],
      "fallback_rate": float(np.mean([any(st.get(f"emb/{t}/sync_{k}", 0.0) > 0 for t in tables
                                          for k in ("spill", "rest")) for st in stats])) if stats else 0.0,
      # The rule gathers every slot (row and optimizer slots) and writes the touched rows back.
      "update_bytes": update, "update_ideal_bytes": update_ideal,
      "update_ratio": update / update_ideal if update_ideal else None,
      "tables": per_table,
  }
