"""Collective traffic per kind and mesh axis, and device memory, read from a compiled XLA program.

`collectives(compiled.as_text(), mesh)` lists every collective of the optimized HLO once, with the bytes
it moves per device and the mesh axes its device groups span; `summarize` totals them per kind and per
axis set; `memory(compiled)` reads XLA's buffer assignment. Everything comes from the compiled program,
so it shows what XLA actually emits (combined all-reduces, collectives the partitioner inserted, what
fusion removed). This module must never guess traffic from the model config or from shard_map specs.

Device ids in replica groups are positions in the program's device assignment, `mesh.devices.flat`
order for a jit over a mesh (tests/test_hlo.py: a mesh of permuted devices compiles to the same HLO).
Position i sits at mesh coordinate np.unravel_index(i, mesh shape); the axes whose coordinate varies
inside a group are the collective's axes. XLA:CPU prints all three group forms, and
`parse_replica_groups` decodes each exactly:
  explicit   {{0,2},{1,3}}
  iota       [G,S]<=[d0,d1,..]T(perm)          iota over dims, transposed, reshaped to [G, S]
  mesh axes  mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}    XLA's own mesh (not the jax one)

Traffic model (bytes leaving one device, ring/direct algorithms; n = group size):
  all-gather result*(n-1)/n, reduce-scatter operand*(n-1)/n, all-reduce 2*operand*(n-1)/n,
  all-to-all operand*(n-1)/n, collective-permute operand (0 if every pair is a self-pair),
  ragged-all-to-all input buffer*(n-1)/n (an upper bound: the real sizes are only known at run time).
Async pairs (`all-gather-start`/`-done`, `all-to-all-start` sugar, `async-start` wrappers) count once;
`overlap` is how many compute instructions (fusions, custom calls, loops, dots: not parameters, tuples,
bitcasts or other collectives) the schedule puts between a start and its done, None for a synchronous
collective (XLA:CPU's) — what the compiler left free to hide the transfer behind.
`count` is how often a collective runs per program execution: the product of the known trip counts of
the while loops around it (1 where XLA does not know it). Expects `as_text()` output: one instruction a
line, one replica (jit over a mesh; multi-replica programs are refused).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")

# Bits per element; sub-byte types take a whole byte unless the layout packs them (E(bits)).
_DTYPE_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
               "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128,
               "s1": 8, "u1": 8, "s2": 8, "u2": 8, "s4": 8, "u4": 8, "token": 0, "opaque": 0}
_LEAF = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_NAME = r"%?([\w.\-]+)"


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str                # one of KINDS
  operand_bytes: int       # per device, summed over tuple operands
  result_bytes: int
  group_size: int          # devices per replica group (permute: of the sub-mesh its pairs cross)
  axes: tuple[str, ...]    # mesh axes the groups span, in mesh order; () when it moves nothing
  moved_bytes: float       # bytes leaving one device per execution (module docstring)
  op_name: str             # metadata op_name, "" if none
  computation: str         # HLO computation holding the instruction
  conditional: bool        # only reached through a `conditional` branch
  count: int = 1           # executions per program run (known while-loop trip counts)
  array_bytes: int = 0     # the largest single array among its operands and results (XLA combines
                           # collectives into tuples: this is what one of them carried at most)
  overlap: int | None = None  # compute instructions scheduled between its start and done; None: synchronous


# ---------------------------------------------------------------------------------------------- shapes

def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, tuples summed: 'f32[64,4]{1,0}', '(bf16[8], s32[])', 'f8e4m3fn[2]'."""
  total = 0
  for dtype, dims, layout in _LEAF.findall(shape):
    if packed := re.search(r"E\((\d+)\)", layout):
      bits = int(packed.group(1))
    elif dtype.startswith(("f8", "f6", "f4")):     # every FP8 / MX sub-byte float is stored in a byte
      bits = 8
    elif dtype in _DTYPE_BITS:
      bits = _DTYPE_BITS[dtype]
    else:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
    n = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
    total += -(-n * bits // 8)
  return total


def _split_top(text: str) -> list[str]:
  """Split at commas outside any bracket."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  return parts + ([text[start:].strip()] if text[start:].strip() else [])


def _take_balanced(text: str, i: int) -> int:
  """Index just past the bracket group opening at text[i]."""
  depth = 0
  for j in range(i, len(text)):
    depth += text[j] in "([{"
    depth -= text[j] in ")]}"
    if depth == 0:
      return j + 1
  raise ValueError(f"unbalanced brackets in HLO: {text[:120]!r}")


# --------------------------------------------------------------------------------------- module parsing

@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]   # raw operand tokens: '%x' or 'f32[4]{0} %x'
  attrs: str            # everything after the operand list
  bare: str             # attrs with quoted strings blanked (metadata, backend_config)


@dataclasses.dataclass
class Module:
  comps: dict[str, list[Instr]]
  entry: str
  replicas: int
  partitions: int


_COMMENT = re.compile(r"/\*.*?\*/")


def _parse_instr(line: str) -> Instr | None:
  # Long operand and tuple lists carry position comments (`/*index=5*/%dot.69`); they are not operands.
  line = _COMMENT.sub("", line)
  m = re.match(r"\s*(?:ROOT\s+)?" + _NAME + r"\s*=\s*", line)
  if not m:
    return None
  i = m.end()
  end = _take_balanced(line, i) if line[i] == "(" else line.index(" ", i)   # the result shape
  if not (op := re.match(r"\s*([\w\-]+)\(", line[end:])):
    return None
  open_at = end + op.end() - 1
  close = _take_balanced(line, open_at)
  return Instr(m.group(1), line[i:end], op.group(1), _split_top(line[open_at + 1:close - 1]),
                line[close:], _QUOTED.sub('""', line[close:]))


def parse_module(text: str) -> Module:
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if not line.strip() or line.startswith("HloModule"):
      continue
    if not line[0].isspace() and line.rstrip().endswith("{"):
      head = re.match(r"(ENTRY\s+)?" + _NAME, line)
      current = comps.setdefault(head.group(2), [])
      entry = head.group(2) if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (instr := _parse_instr(line)) is not None:
      current.append(instr)
  header = next((line for line in text.splitlines() if line.startswith("HloModule")), "")
  get = lambda key: int(m.group(1)) if (m := re.search(key + r"=(\d+)", header)) else 1
  return Module(comps, entry or (list(comps)[-1] if comps else ""), get("replica_count"),
                 get("num_partitions"))


def callees(instr: Instr) -> list[tuple[str, int, bool]]:
  """(computation, executions per call, is a conditional branch) for every computation it calls."""
  if instr.opcode in ("async-update", "async-done"):   # the async-start already called it
    return []
  a, out = instr.bare, []
  trips = int(m.group(1)) if (m := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)) else 1
  for key, name in re.findall(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                              + _NAME, a):
    out.append((name, trips if key in ("body", "condition") else 1, key.endswith("_computation")))
  for key, names in re.findall(r"\b(branch_computations|calls|called_computations)=\{([^}]*)\}", a):
    out += [(n.strip().lstrip("%"), 1, key == "branch_computations") for n in names.split(",")]
  return out


def reach(mod: Module) -> tuple[dict[str, int], dict[str, bool]]:
  """Executions per run and 'only reached through a conditional branch' for every computation."""
  callers: dict[str, list[tuple[str, int, bool]]] = {c: [] for c in mod.comps}
  for comp, instrs in mod.comps.items():
    for instr in instrs:
      for callee, mult, branch in callees(instr):
        callers.setdefault(callee, []).append((comp, mult, branch))
  count, cond = {}, {}           # HLO call graphs have no cycles: plain recursion terminates

  def visit(c: str) -> None:
    if c in count:
      return
    if c == mod.entry or not callers.get(c):   # a call this parser does not know: count it once
      count[c], cond[c] = 1, False
      return
    total, only_branch = 0, True
    for parent, mult, branch in callers.get(c, []):
      visit(parent)
      total += count[parent] * mult
      only_branch &= branch or cond[parent]
    count[c], cond[c] = total, only_branch
  for c in mod.comps:
    visit(c)
  return count, cond


# ------------------------------------------------------------------------------------- replica groups

def parse_replica_groups(text: str) -> list[list[int]] | None:
  """Decode the `replica_groups=` value that `text` starts with (trailing text is ignored).

  Returns one id list per group, or None for `{}` (one group holding every device)."""
  text = text.strip()
  if text.startswith("{"):
    body = text[1:_take_balanced(text, 0) - 1]
    return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", body)] or None
  if m := re.match(r"\[(\d+),\d+\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
    ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    return ids.reshape(int(m.group(1)), -1).tolist()
  if m := re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^()]*(?:\([^()]*\))?)\))?\s*\{([^}]*)\}", text):
    return _mesh_axes_groups(m.group(1), m.group(2), m.group(3))
  raise ValueError(f"unrecognised replica_groups form: {text[:80]!r}")


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v.strip()]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _mesh_axes_groups(axes_text: str, ids_text: str | None, sel_text: str) -> list[list[int]]:
  """Groups of XLA's mesh-axes form: devices of its mesh varying along the selected (sub-)axes."""
  items = [item.rsplit("=", 1) for item in _split_top(axes_text)]
  names, sizes = [name.strip().strip("'\"") for name, _ in items], [int(size) for _, size in items]
  if ids_text is None:
    devices = np.arange(math.prod(sizes))
  elif m := re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids_text):
    devices = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)
  else:
    devices = np.array(_ints(ids_text))
  # Split every mesh axis into the sub-axes the selection names ("a":(pre)size), then move the selected
  # pieces last: each row of the flattened result is one group.
  cuts: list[set[int]] = [{1, s} for s in sizes]
  selected: list[tuple[int, int]] = []   # (mesh axis, pre-size) of each selected piece, in listed order
  for item in _split_top(sel_text):
    m = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", item.strip())
    if not m or m.group(1) not in names:
      raise ValueError(f"unrecognised mesh axis {item!r} in replica_groups mesh form")
    a = names.index(m.group(1))
    pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[a])
    cuts[a] |= {pre, pre * size}
    selected.append((a, pre))
  dims, where = [], {}
  for a in range(len(sizes)):
    bounds = sorted(cuts[a])   # pre-size = product of the sizes on the major side: major first
    for lo, hi in zip(bounds, bounds[1:]):
      where[(a, lo)] = len(dims)
      dims.append(hi // lo)
  grouped = [where[key] for key in selected]
  order = [d for d in range(len(dims)) if d not in grouped] + grouped
  size = math.prod(dims[d] for d in grouped)
  return devices.reshape(dims).transpose(order).reshape(-1, size).tolist()


def _device_groups(instr: Instr, kind: str, n: int) -> list[list[int]]:
  """Groups of device positions. With one replica, partition id = position, and XLA's group modes
  (what the listed ids mean: channel_id present? use_global_device_ids=true?) reduce to these cases."""
  channel, bare = "channel_id=" in instr.bare, instr.bare
  if kind == "collective-permute":   # each pair is a group of its own (a self-pair spans no axis)
    m = re.search(r"source_target_pairs=(\{(?:\{\d+,\d+\},?)*\})", bare)
    pairs = [_ints(g) for g in re.findall(r"\{(\d+,\d+)\}", m.group(1))] if m else []
    return pairs if channel else []
  if not channel:                  # cross-replica among one replica: every device alone
    return [[i] for i in range(n)]
  if kind in ("all-gather", "all-reduce", "reduce-scatter") and "use_global_device_ids=true" not in bare:
    return [list(range(n))]        # cross-replica-and-partition: every partition of replica 0
  at = bare.find("replica_groups=")
  groups = parse_replica_groups(bare[at + len("replica_groups="):]) if at >= 0 else None
  return groups or [list(range(n))]


# ------------------------------------------------------------------------------------------ public API

def collectives(hlo_text: str, mesh: Any) -> list[Collective]:
  """Every collective of `compiled.as_text()` once, attributed to the axes of `mesh` (any jax Mesh or
  AbstractMesh whose size matches the program's device count). The last few answers are kept: a run's
  meter and its report read the same program (70,000 instructions for tiny's train step on cpu_8)."""
  names = tuple(mesh.axis_names)
  mesh_shape = tuple(int(mesh.shape[a]) for a in names)
  key = (hash(hlo_text), len(hlo_text), names, mesh_shape)
  if key not in _RECENT:
    _RECENT[key] = _collectives(hlo_text, names, mesh_shape)
    while len(_RECENT) > 4:
      _RECENT.pop(next(iter(_RECENT)))
  return list(_RECENT[key])


_RECENT: dict[tuple, tuple[Collective, ...]] = {}


_ANY_KIND = re.compile(r"\s(?:" + "|".join(re.escape(k) for k in KINDS) + r")(?:-start)?\(")


def _collectives(hlo_text: str, names: tuple[str, ...], mesh_shape: tuple[int, ...]) -> tuple[Collective, ...]:
  if not _ANY_KIND.search(hlo_text) and " async-start(" not in hlo_text:
    return ()   # nothing to parse for (one device's programs: 60,000 instructions for tiny's train step)
  mod = parse_module(hlo_text)
  n = math.prod(mesh_shape)
  count, cond = reach(mod)
  overlaps = _overlaps(mod)
  out = []
  for comp, instrs in mod.comps.items():
    shapes = {i.name: i.shape for i in instrs}
    done_shape = {operand_name(i.operands[0]): i.shape for i in instrs
                  if i.opcode.endswith("-done") and i.operands}
    for instr in instrs:
      kind = instr.opcode[:-len("-start")] if instr.opcode.endswith("-start") else instr.opcode
      if kind not in KINDS:
        continue
      if mod.replicas != 1 or mod.partitions != n:
        raise ValueError(f"{instr.name}: program runs on {mod.replicas} replica(s) x {mod.partitions} "
                         f"partitions, expected 1 x {n} for a jit over a mesh of {n} devices")
      operand_bytes, result_bytes, array_bytes = _bytes(instr, kind, shapes, done_shape)
      groups = _device_groups(instr, kind, n)
      axes = _varying_axes(instr, groups, mesh_shape)
      group_size = (math.prod(mesh_shape[a] for a in axes) if kind == "collective-permute"
                    else max(len(g) for g in groups))
      op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instr.attrs)
      out.append(Collective(
          kind=kind, operand_bytes=operand_bytes, result_bytes=result_bytes, group_size=group_size,
          axes=tuple(names[a] for a in axes),
          moved_bytes=_moved(kind, operand_bytes, result_bytes, group_size),
          op_name=op_name.group(1) if op_name else "", computation=comp, conditional=cond[comp],
          count=count[comp], array_bytes=array_bytes,
          overlap=overlaps.get(instr.name, overlaps.get(("wrapped", comp)))))
  return tuple(out)


# Instructions that compute nothing a collective could hide behind.
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
                "opt-barrier"}


def _overlaps(mod: Module) -> dict:
  """{start instruction name: compute instructions between it and its done} for every async pair of the
  scheduled module, and {("wrapped", computation): ...} for the computation an async-start wraps."""
  out: dict = {}
  for instrs in mod.comps.values():
    at = {i.name: n for n, i in enumerate(instrs)}
    for n, instr in enumerate(instrs):
      if not (instr.opcode.endswith("-done") and instr.operands):
        continue
      start = at.get(operand_name(instr.operands[0]))
      if start is None:
        continue
      between = sum(1 for i in instrs[start + 1:n] if i.opcode not in _NOT_COMPUTE
                    and not i.opcode.endswith(("-start", "-done", "-update")))
      head = instrs[start]
      out[head.name] = between
      if head.opcode == "async-start":
        for callee, _, _ in callees(head):
          out[("wrapped", callee)] = between
  return out


def select(colls: list[Collective], op_name_contains: str | None = None,
           exclude: str | None = None) -> list[Collective]:
  """The collectives whose op_name contains `op_name_contains` and does not contain `exclude`."""
  return [c for c in colls if (op_name_contains is None or op_name_contains in c.op_name)
          and (exclude is None or exclude not in c.op_name)]


def summarize(colls: list[Collective], *, include_conditional: bool = False) -> dict:
  """Bytes moved per device per program run: {"by_kind": {kind: b}, "by_axis": {"replica,sparse": b},
  "total": b}. Each collective counts moved_bytes * count; axis-less (trivial) collectives move 0 and
  are left out of by_axis; collectives inside conditional branches only with include_conditional."""
  by_kind: dict[str, float] = {}
  by_axis: dict[str, float] = {}
  for c in colls:
    if include_conditional or not c.conditional:
      by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.moved_bytes * c.count
      if c.axes:
        key = ",".join(c.axes)
        by_axis[key] = by_axis.get(key, 0.0) + c.moved_bytes * c.count
  return {"by_kind": by_kind, "by_axis": by_axis, "total": float(sum(by_kind.values()))}


def memory(compiled: Any) -> dict:
  """Per-device bytes from `compiled.memory_analysis()`: argument, output, temp, alias, generated_code,
  peak_estimate (argument + output + temp - alias) and, where XLA reports it, peak_reported.

  Returns {} when the backend has no memory analysis (it raises, returns None, or lacks the fields)."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, AttributeError):
    return {}
  if isinstance(stats, (list, tuple)):    # one entry per device on some versions
    stats = stats[0] if stats else None
  out = {k: getattr(stats, f"{k}_size_in_bytes", None) for k in ("argument", "output", "temp", "alias")}
  if any(v is None for v in out.values()):
    return {}
  out = {k: int(v) for k, v in out.items()}
  out["generated_code"] = int(getattr(stats, "generated_code_size_in_bytes", 0) or 0)
  out["peak_estimate"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  if peak := getattr(stats, "peak_memory_in_bytes", None):
    out["peak_reported"] = int(peak)
  return out


# ------------------------------------------------------------------------------------------- helpers

def operand_name(token: str) -> str:
  return token.split()[-1].lstrip("%")


def _bytes(instr: Instr, kind: str, shapes: dict[str, str], done_shape: dict[str, str]) -> tuple[int, int, int]:
  """(operand bytes, result bytes, the largest single array's bytes) of one collective."""
  operands = []
  for token in instr.operands:
    if len(token.split()) > 1:         # older printers put the operand's shape before its name
      operands.append(token.rsplit(None, 1)[0])
    elif (name := operand_name(token)) in shapes:
      operands.append(shapes[name])
    else:
      raise ValueError(f"{instr.name}: operand {name!r} is not defined in its computation")
  if kind == "ragged-all-to-all" or "slice_sizes=" in instr.bare:
    operands = operands[:1]            # the rest are offsets/sizes (or the in-place output buffer)
  result = instr.shape
  if instr.opcode.endswith("-start"):  # the -done carries exactly the result; failing that,
    # all-reduce-start has the result's shape and the others hold (operands, result[, context...]).
    result = done_shape.get(instr.name) or (
        result if kind == "all-reduce" else _split_top(result.strip()[1:-1])[1])
  largest = max((shape_bytes(m.group(0)) for x in operands + [result] for m in _LEAF.finditer(x)), default=0)
  return sum(shape_bytes(s) for s in operands), shape_bytes(result), largest


def _varying_axes(instr: Instr, groups: list[list[int]], mesh_shape: tuple[int, ...]) -> list[int]:
  varying = np.zeros(len(mesh_shape), bool)
  for size in {len(g) for g in groups}:          # one vectorised pass per group size (usually one)
    ids_GxS = np.array([g for g in groups if len(g) == size], np.int64)
    if ids_GxS.min() < 0 or ids_GxS.max() >= math.prod(mesh_shape):
      raise ValueError(f"{instr.name}: device ids up to {ids_GxS.max()} outside a mesh of "
                       f"{math.prod(mesh_shape)} devices")
    coords_AxGxS = np.stack(np.unravel_index(ids_GxS, mesh_shape))
    varying |= (coords_AxGxS.min(axis=2) != coords_AxGxS.max(axis=2)).any(axis=1)
  return [a for a in range(len(mesh_shape)) if varying[a]]


def _moved(kind: str, operand: int, result: int, n: int) -> float:
  if kind == "collective-permute":
    return float(operand) if n > 1 else 0.0
  full = {"all-gather": result, "all-reduce": 2 * operand}.get(kind, operand)
  return full * (n - 1) / n
