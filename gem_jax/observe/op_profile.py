"""Where a step's time goes, op by op: a jax.profiler trace joined with the compiled program's HLO.

  ops = hlo_ops(module_text)                      # instruction name -> HloOp (opcode, op_name, source line)
  busy = exclusive_busy(trace_file)               # instruction name -> busy ns in the trace
  rows = attribute(busy, ops, steps=k)            # one row per source place, slowest first

The trace (the one gem_jax/observe/profile.py reads) has one event per executed HLO instruction: on a GPU on
the device's "XLA Ops" line, on the CPU on the XLA worker threads, where loops, calls and conditionals are
events that hold their body's events. Each event counts its exclusive time (its duration less that of the
events nested in it), so a while loop's body instructions carry the loop's time and the loop keeps only its
own bookkeeping. The times are thread-busy seconds summed over threads (on a multi-threaded CPU run they can
exceed the wall time); read shares, not sums.

Each instruction is attributed to the place in this project's code that made it, taken from the module's
stack frame tables (`HloModule.to_string()` prints them; `compiled.as_text()` does not): the innermost frame
in a file under one of `roots`. A Dense layer's ops name their site instead (gem_jax/model/layers.py puts
`site=<site>` in the op_name scope), an embedding table's update its table (`table=<name>`). An instruction
with neither falls back to its op_name's last scopes. The pass is "bwd" where the op_name runs under
transpose(...) (autodiff's backward), else "fwd". A custom_vjp's backward (the tiled kernels') has no
frames of its own body: its ops go to the line that calls the custom_vjp function, pass "bwd".
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

import jax
import numpy as np

from gem_jax.observe import hlo, profile
from gem_jax.observe.profile import COLLECTIVE_RE

_TABLE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\s*$")
_FIELDS = re.compile(r"(\w+)=(-?\d+)")
_SITE = re.compile(r"(?<![\w])(?:fp8_)?(site|table)=([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
ROOTS = ("gem_jax", "pallas_kernels", "experiments")


@dataclasses.dataclass(frozen=True)
class HloOp:
  name: str
  opcode: str        # fusion, dot, while, scatter, ... (a fusion's kind: "fusion:kLoop")
  op_name: str       # the jax scope path, "" if none
  where: str         # "path/file.py:line function" of the innermost frame under the roots, "" if none
  backward: bool     # made by autodiff's transpose (the backward pass)


def _frame_tables(text: str) -> dict[str, dict[int, object]]:
  """The module text's FileNames, FunctionNames, FileLocations and StackFrames tables, by id."""
  tables: dict[str, dict[int, object]] = {}
  current = None
  for line in text.splitlines():
    if (m := _TABLE.match(line)):
      current = tables.setdefault(m.group(1), {})
      continue
    if current is None:
      continue
    if not line.strip() or not line[0].isdigit():
      current = None
      continue
    key, _, rest = line.partition(" ")
    rest = rest.strip()
    current[int(key)] = rest[1:-1] if rest.startswith('"') else {k: int(v) for k, v in _FIELDS.findall(rest)}
  return tables


def _frames(text: str, roots: tuple[str, ...]) -> dict[int, str]:
  """stack_frame_id -> "file:line function" of the innermost frame under `roots` ("" if none)."""
  t = _frame_tables(text)
  files, funcs, locs, frames = (t.get(k, {}) for k in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"))
  under = tuple(os.sep + r + os.sep for r in roots)

  def place(loc_id: int) -> tuple[str, bool]:
    loc = locs.get(loc_id) or {}
    path = str(files.get(loc.get("file_name_id"), ""))
    hit = next((path.rindex(u) for u in under if u in path), None)
    short = path[hit + 1:] if hit is not None else path
    return f"{short}:{loc.get('line', 0)} {funcs.get(loc.get('function_name_id'), '')}", hit is not None

  out = {}
  for frame_id in frames:
    seen, current, found = set(), frame_id, ""
    while current in frames and current not in seen:   # innermost first, then its callers
      seen.add(current)
      text_at, ours = place(frames[current].get("file_location_id", 0))
      if ours:
        found = text_at
        break
      # XLA prints a frame's parent_frame_id one past the parent's id, 0 for none (jaxlib 0.10.2: frames of
      # a() -> b() -> c() print 1 {parent 1}, 2 {parent 2}, 3 {parent 3}; tests/test_op_profile.py).
      current = frames[current].get("parent_frame_id", 0) - 1
    out[frame_id] = found
  return out


def hlo_ops(module_text: str, roots: tuple[str, ...] = ROOTS) -> dict[str, HloOp]:
  """Every instruction of an HLO module's text (with or without the frame tables), by name."""
  frames = _frames(module_text, roots)
  ops = {}
  for comp in hlo.parse_module(module_text).comps.values():
    for instr in comp:
      op_name = m.group(1) if (m := _OP_NAME.search(instr.attrs)) else ""
      frame = int(m.group(1)) if (m := _FRAME.search(instr.attrs)) else 0
      kind = re.search(r"kind=(\w+)", instr.bare)
      opcode = f"fusion:{kind.group(1)}" if instr.opcode == "fusion" and kind else instr.opcode
      ops[instr.name] = HloOp(instr.name, opcode, op_name, frames.get(frame, ""), "transpose(" in op_name)
  return ops


def module_text(compiled) -> str:
  """The compiled program's HLO with its frame tables where this jax exposes them, else `as_text()`."""
  try:
    return "\n".join(m.to_string() for m in compiled.runtime_executable().hlo_modules())
  except Exception:   # an executable without hlo_modules (another backend or jax version): no source lines
    return compiled.as_text()


def _exclusive(events) -> dict[str, int]:
  """name -> exclusive ns over one line's events: an event nested in another gives its time to itself,
  not to the event around it."""
  out: dict[str, int] = collections.Counter()
  stack: list[tuple[str, int]] = []   # (name, end_ns) of the events that hold the current one
  for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
    while stack and ev.start_ns >= stack[-1][1]:
      stack.pop()
    duration = max(ev.duration_ns, 0)
    out[ev.name] += duration
    if stack:
      out[stack[-1][0]] -= duration
    stack.append((ev.name, ev.start_ns + duration))
  return out


def exclusive_busy(planes) -> dict[str, int]:
  """HLO instruction name -> exclusive busy ns summed over the trace's XLA lines (profile.xla_lines: device
  lines on a GPU, the XLA worker threads on the CPU, where only events named like an HLO instruction count)."""
  lines, keep, _ = profile.xla_lines(planes)
  total: dict[str, int] = collections.Counter()
  for line in lines:
    for name, ns in _exclusive([e for e in line.events if keep(e.name)]).items():
      total[name] += ns
  return total


def place_of(op: HloOp | None, name: str) -> str:
  """The row an instruction's time goes to (module docstring)."""
  if op is None:
    return f"(not in the program) {name}"
  if COLLECTIVE_RE.search(op.opcode) or COLLECTIVE_RE.search(name):
    return f"collective {op.opcode}"
  if (m := _SITE.search(op.op_name)):
    return f"{'dense' if m.group(1) == 'site' else 'table'} {m.group(2)}"
  if op.where:
    return op.where
  scopes = [s for s in op.op_name.split("/") if s and not s.startswith("jit(")]
  return "/".join(scopes[-2:]) or f"({op.opcode})"


def attribute(busy: dict[str, int], ops: dict[str, HloOp], steps: int) -> list[dict]:
  """Rows {"place", "pass", "ms_per_step", "share", "ops", "opcodes"}, slowest first; "pass" is fwd, bwd or
  both (a place whose instructions serve both passes, or XLA fused them together)."""
  total = sum(max(ns, 0) for ns in busy.values()) or 1
  rows: dict[str, dict] = {}
  for name, ns in busy.items():
    if ns <= 0:
      continue
    op = ops.get(name)
    place = place_of(op, name)
    row = rows.setdefault(place, {"place": place, "passes": set(), "ns": 0, "ops": 0,
                                  "opcodes": collections.Counter()})
    row["passes"].add("bwd" if op is not None and op.backward else "fwd")
    row["ns"] += ns
    row["ops"] += 1
    row["opcodes"][op.opcode if op is not None else "?"] += ns
  out = []
  for row in sorted(rows.values(), key=lambda r: -r["ns"]):
    passes = row.pop("passes")
    ns = row.pop("ns")
    opcodes = row.pop("opcodes")
    out.append(dict(row, **{"pass": passes.pop() if len(passes) == 1 else "both",
                            "ms_per_step": ns / 1e6 / steps, "share": ns / total,
                            "opcodes": [k for k, _ in opcodes.most_common(3)]}))
  return out


def table(rows: list[dict], top: int) -> str:
  lines = [f"{'ms/step':>9} {'share':>6}  {'pass':<4}  {'ops':>4}  place (opcodes)"]
  for r in rows[:top]:
    lines.append(f"{r['ms_per_step']:9.2f} {100 * r['share']:5.1f}%  {r['pass']:<4}  {r['ops']:4d}  {r['place']}"
                 f"  ({', '.join(r['opcodes'])})")
  rest = rows[top:]
  if rest:
    lines.append(f"{sum(r['ms_per_step'] for r in rest):9.2f} {100 * sum(r['share'] for r in rest):5.1f}%  "
                 f"{'':<4}  {sum(r['ops'] for r in rest):4d}  ({len(rest)} more places)")
  return "\n".join(lines)


def same_shape_batches(run, count: int, max_draws: int = 200) -> list:
  """`count` training batches of the first one's shapes, for one compiled step: a source whose batches pad
  to a multiple of tokens (next-item rows) makes several shapes. Fewer found in `max_draws`: they repeat."""
  def shapes(batch):
    return [np.shape(x) for x in jax.tree_util.tree_leaves(batch)]

  it = run.source.train_iterator()
  first = next(it)
  kept = [first]
  for _ in range(max_draws):
    if len(kept) == count:
      break
    host = next(it, None)
    if host is None:
      break
    if shapes(host) == shapes(first):
      kept.append(host)
  return [run.device_batch(b) for b in kept]
