"""Topology-aware mesh planner: the 5D layout of N devices that the cluster simulator says trains a config
fastest while it still fits in HBM, written out as a mesh file.

  plan(cfg, devices, hardware="h200") -> Plan      ranked layouts, named naive baselines, search counts

What a plan prints and writes (its table, explanation, mesh file and JSON) is gem_jax/observe/cluster_text.py.

Every number is a prediction of gem_jax/observe/simulate.py (bytes per collective and mesh axes, memory per
device, seconds from the hardware's intra- and inter-node bandwidths); nothing is compiled or measured, so
a plan is as good as that model (its docstring says what it leaves out).

Search space, for N devices in nodes of `devices_per_node` (a hardware preset, HARDWARE):
  sizes      ordered factorizations of N over (replica, fsdp, sparse, context, tensor) with context <= 8,
             tensor <= 8 and dividing every tensor-parallel width of the model (HSTU heads, Wukong MLP
             hidden, tower hidden; a width it does not divide stays whole and its layers run replicated),
             and the config's global batch dividing over the data shards replica x fsdp x sparse.
  table rows the mesh file's `rules: {table_rows: ...}`: [sparse] (the default) or [fsdp, sparse]. Rows
             over a set with replica in it are the same layout as rows without it on a sparse axis of size
             replica x sparse (the step and the simulator see only the product of the table's axes, and
             whether they stay inside a node), so they are not enumerated twice; [fsdp] alone is
             [fsdp, sparse] with sparse 1. Context and tensor devices hold the same data shard, and do not
             take table rows.
  placement  each split of a node over the axes: intra_a divides size_a, the intra sizes multiply to
             devices_per_node.
Cost: one simulate() per (sizes, rules), on abstract params built once (simulate.model_shapes); bytes and
memory depend only on those, so each placement is only re-timed (simulate.retime). A (sizes, rules) whose
table row blocks alone (parameters + gradients) exceed HBM is not simulated.

Ranking: simulated step time among the layouts that fit (memory total <= hbm_bytes); one that does not fit
is never ranked. "exposed comm" = step - compute: what the step waits for on the wire (lookups,
tensor / context-parallel sums, and parameter traffic beyond the share that overlaps compute).

Naive baselines (naive_layouts): "all fsdp" (every device on fsdp, table rows over fsdp: they fit when
their row counts divide over N) and "sparse across nodes" (fsdp over the devices of a node, the embedding
axis sparse over the nodes, the default rules), plus any hand-written mesh file the caller passes.

This module must never compile or touch a device, and never rank a layout that does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Iterator, Sequence

from gem_jax.model import embeddings as embeddings_lib
from gem_jax.observe import simulate as sim_lib
from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel import placement
from gem_jax.parallel.mesh import Hardware, MeshSpec
from gem_jax.parallel.rules import DATA_AXES, MESH_AXES

GB = 1e9
MAX_TENSOR = 8
MAX_CONTEXT = 8
TABLE_RULES = (("sparse",), ("fsdp", "sparse"))
DEFAULT_TABLE_ROWS = ("sparse",)


# ------------------------------------------------------------------------------------------ hardware

@dataclasses.dataclass(frozen=True)
class Preset:
  """A node type: how many devices share the fast links, and each device's numbers (per device, bytes
  and bytes/s, dense FLOP/s)."""
  name: str
  devices_per_node: int
  hardware: Hardware
  source: str
  target: str | None = None   # the compile target a planned mesh file names (gem_jax/parallel/targets/)


HARDWARE: dict[str, Preset] = {p.name: p for p in (
    Preset("h200", 8, Hardware("NVIDIA H200 SXM", 9.89e14, 1.979e15, 1.41e11, 4.8e12, 4.5e11, 5.0e10, 6.3e10),
           "NVIDIA H200 data sheet: 989 TFLOP/s bf16 and 1979 fp8 dense, 141 GB HBM3e at 4.8 TB/s, NVLink "
           "900 GB/s (450 each way); one 400 Gb/s NIC per GPU (50 GB/s); PCIe Gen5 x16 to the host (63 GB/s "
           "each way). Same as meshes/h200_1024_5d.yaml", "h200"),
    Preset("h100", 8, Hardware("NVIDIA H100 SXM", 9.89e14, 1.979e15, 8.0e10, 3.35e12, 4.5e11, 5.0e10, 6.3e10),
           "NVIDIA H100 SXM data sheet: 989 TFLOP/s bf16 and 1979 fp8 dense (half its with-sparsity "
           "figures), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 each way), PCIe Gen5 x16 to the host "
           "(63 GB/s each way); DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s)", "h100"),
)}


def get_preset(hardware: str | Preset) -> Preset:
  if isinstance(hardware, Preset):
    return hardware
  if hardware not in HARDWARE:
    raise ValueError(f"unknown hardware {hardware!r}; known presets: {sorted(HARDWARE)}")
  return HARDWARE[hardware]


# ------------------------------------------------------------------------------------------ layouts

@dataclasses.dataclass(frozen=True)
class Layout:
  """One candidate: axis sizes and their intra-node parts (in MESH_AXES order) and the table-row axes."""
  sizes: tuple[int, ...]
  intra: tuple[int, ...]
  table_rows: tuple[str, ...] = DEFAULT_TABLE_ROWS

  @classmethod
  def of(cls, spec: MeshSpec) -> "Layout":
    rows = dict(spec.rules)["table_rows"]
    rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    return cls(tuple(s for _, s in spec.axes), tuple(s for _, s in spec.intra_node), rows)

  def mesh_data(self, name: str, description: str, preset: Preset) -> dict:
    """The mesh file's content (meshes/README.md)."""
    data = {"name": name, "description": description,
            "axes": dict(zip(MESH_AXES, self.sizes)), "devices_per_node": preset.devices_per_node,
            "intra_node": {a: n for a, n in zip(MESH_AXES, self.intra) if n > 1},
            "hardware": dataclasses.asdict(preset.hardware)}
    if self.table_rows != DEFAULT_TABLE_ROWS:
      data["rules"] = {"table_rows": list(self.table_rows)}
    if preset.target is not None:
      data["target"] = preset.target
    return data

  def mesh_spec(self, name: str, preset: Preset) -> MeshSpec:
    return mesh_lib.parse(self.mesh_data(name, "", preset), f"plan layout {name}")

  @property
  def axes_label(self) -> str:
    return " ".join(f"{a}{n}" for a, n in zip(MESH_AXES, self.sizes) if n > 1) or "-"

  @property
  def intra_label(self) -> str:
    return " ".join(f"{a}{n}" for a, n in zip(MESH_AXES, self.intra) if n > 1) or "-"

  @property
  def rows_label(self) -> str:
    shards = math.prod(self.sizes[MESH_AXES.index(a)] for a in self.table_rows)
    return f"{','.join(self.table_rows) or 'replicated'} ({shards})"


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
  """Every ordered tuple of `parts` positive ints whose product is n."""
  if parts == 1:
    return [(n,)]
  return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, parts - 1)]


def tensor_widths(params) -> tuple[int, ...]:
  """The widths a tensor axis must divide for every tensor-parallel layer to be split: the sizes of every
  tensor-parallel dim of the model's parameters (placement.tensor_parallel_parts)."""
  return tuple(sorted({part.size for part in placement.tensor_parallel_parts(params)}))


def axis_sizes(params, devices: int, batch: int, max_tensor: int = MAX_TENSOR,
               max_context: int = MAX_CONTEXT) -> list[tuple[int, ...]]:
  """The (replica, fsdp, sparse, context, tensor) sizes the planner considers (module docstring)."""
  widths = tensor_widths(params)
  out = []
  for sizes in factorizations(devices, len(MESH_AXES)):
    shape = dict(zip(MESH_AXES, sizes))
    if shape["tensor"] > max_tensor or shape["context"] > max_context:
      continue
    if any(w % shape["tensor"] for w in widths) or batch % math.prod(shape[a] for a in DATA_AXES):
      continue
    out.append(sizes)
  return out


def node_splits(sizes: Sequence[int], devices_per_node: int) -> list[tuple[int, ...]]:
  """Every intra-node part per axis: each divides its axis size, together they fill one node."""
  return [intra for intra in factorizations(devices_per_node, len(sizes))
          if all(s % i == 0 for s, i in zip(sizes, intra))]


def table_rules(sizes: Sequence[int]) -> list[tuple[str, ...]]:
  """The distinct table-row choices for these sizes (module docstring)."""
  shape = dict(zip(MESH_AXES, sizes))
  return [rows for rows in TABLE_RULES if rows == DEFAULT_TABLE_ROWS or shape["fsdp"] > 1]


def layouts(cfg, devices: int, hardware: str | Preset = "h200", *, batch_size: int | None = None,
            max_tensor: int = MAX_TENSOR, max_context: int = MAX_CONTEXT,
            shapes: sim_lib.ModelShapes | None = None) -> Iterator[Layout]:
  """Every candidate layout, before pruning."""
  preset = get_preset(hardware)
  _check_devices(devices, preset)
  batch = int(batch_size or cfg.data.pipeline.batch_size)
  shapes = shapes or sim_lib.model_shapes(cfg)
  for sizes in axis_sizes(shapes.params, devices, batch, max_tensor, max_context):
    for rows in table_rules(sizes):
      for intra in node_splits(sizes, preset.devices_per_node):
        yield Layout(sizes, intra, rows)


def naive_layouts(devices: int, hardware: str | Preset = "h200") -> dict[str, Layout]:
  """The layouts one would write without a planner (module docstring)."""
  preset = get_preset(hardware)
  _check_devices(devices, preset)
  per, nodes = preset.devices_per_node, devices // preset.devices_per_node
  return {"all fsdp": Layout((1, devices, 1, 1, 1), (1, per, 1, 1, 1), ("fsdp",)),
          "sparse across nodes": Layout((1, per, nodes, 1, 1), (1, per, 1, 1, 1), DEFAULT_TABLE_ROWS)}


def _check_devices(devices: int, preset: Preset) -> None:
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices must be a positive integer, got {devices!r}")
  if devices % preset.devices_per_node:
    raise ValueError(f"{devices} devices do not fill whole {preset.name} nodes of {preset.devices_per_node} "
                     f"devices; use a multiple of {preset.devices_per_node}")


# ------------------------------------------------------------------------------------------ scoring

@dataclasses.dataclass(frozen=True, eq=False)
class Scored:
  """A layout on a mesh spec with its simulate() result (shared by every placement of the same sizes and
  rules) and the times of this placement."""
  layout: Layout
  mesh_spec: MeshSpec
  sim: dict
  time: dict | None
  name: str = ""
  compiled_peak: float | None = None   # bytes per device of its compiled train step (check_compiled)

  @property
  def step_s(self) -> float | None:
    return None if self.time is None else self.time["step_s"]

  @property
  def mfu(self) -> float | None:
    if self.time is None:
      return None
    hw = self.mesh_spec.hardware
    return self.sim["flops"]["model_flops_per_step"] / (self.step_s * hw.peak_bf16_flops * self.sim["devices"])

  @property
  def memory_bytes(self) -> float:
    return self.sim["memory"]["total"]

  @property
  def fits(self) -> bool | None:
    """By the compiled peak where the layout was compiled, else by the simulated memory."""
    hbm = self.mesh_spec.hardware.hbm_bytes
    peak = self.memory_bytes if self.compiled_peak is None else self.compiled_peak
    return None if hbm is None else peak <= hbm

  @property
  def exposed_s(self) -> float | None:
    return None if self.time is None else self.time["step_s"] - self.time["compute_s"]

  def comm(self) -> list[tuple[float, str, str, float, str]]:
    """(seconds, part, axes key, bytes, "intra"|"inter") per part and axes, most seconds first."""
    hw, links = self.mesh_spec.hardware, (self.time or {}).get("bandwidth_by_axis", {})
    out = []
    for part, summary in self.sim["comm"]["parts"].items():
      for key, moved in summary["by_axis"].items():
        link = links.get(key)
        bw = {"intra": hw.intra_node_bandwidth, "inter": hw.inter_node_bandwidth}.get(link)
        out.append((moved / bw if bw else 0.0, part, key, moved, link or "-"))
    return sorted(out, key=lambda x: (-x[0], -x[3]))

  def biggest_axis(self) -> tuple[str, float, str] | None:
    if not self.time or not self.time["comm_s_by_axis"]:
      return None
    key, s = max(self.time["comm_s_by_axis"].items(), key=lambda kv: kv[1])
    return key, s, self.time["bandwidth_by_axis"][key]

  @property
  def table_shards(self) -> int:
    return math.prod(self.layout.sizes[MESH_AXES.index(a)] for a in self.layout.table_rows)

  @property
  def sparse_engine(self) -> bool:
    return self.sim.get("embedding_update") == "sparse"

  @property
  def table_sync_bytes(self) -> float:
    """What keeps the tables' copies in sync, per device and step: the sparse engine's update collectives
    (their touched rows), or the dense path's all-reduce of the table blocks' gradients over the axes that
    hold copies."""
    if self.sparse_engine:
      return self.sim["comm"]["parts"]["embedding_update"]["total"]
    return self.sim["comm"]["analytic_params"]["table_grad_sync"]


def _sort_key(s: Scored):
  return (s.step_s, s.memory_bytes, s.layout.sizes, s.layout.table_rows, s.layout.intra)


def tables_of(shapes: sim_lib.ModelShapes) -> dict[str, tuple[int, float]]:
  """name -> (rows, bytes) of the tables large enough to be row sharded (placement.of replicates the rest)."""
  import jax
  out = {}
  for path, var in jax.tree_util.tree_leaves_with_path(shapes.params, is_leaf=placement.is_variable):
    if isinstance(var, embeddings_lib.Table):
      w = sim_lib.nbytes(var.get_value())
      if w > placement.REPLICATE_TABLE_BYTES:
        out[str(placement.path_names(path)[-1])] = (int(var.get_value().shape[0]), w)
  return out


def table_memory_bound(tables: dict[str, tuple[int, float]], shards: int, sparse_engine: bool = False) -> float:
  """A lower bound of the memory per device: each table's row block, and its gradient unless the sparse
  engine updates it (no table-sized gradient exists then); a table whose rows do not divide over `shards`
  stays whole, as placement.of keeps it."""
  copies = 1 if sparse_engine else 2
  return sum(copies * w / (shards if rows % shards == 0 else 1) for rows, w in tables.values())


@dataclasses.dataclass
class Plan:
  config: str
  devices: int
  preset: Preset
  batch_size: int
  ranked: list[Scored]           # the layouts that fit, fastest first
  rejected: list[Scored]         # simulated, do not fit
  baselines: dict[str, Scored]   # naive layouts and hand-written mesh files, by name
  baseline_errors: dict[str, str]  # baselines that cannot run this config (why)
  counts: dict[str, int]
  tables: dict[str, tuple[int, float]]  # row-sharded tables: name -> (rows, bytes)
  options: dict                  # overlap, efficiency, mean_history, limits: what the numbers assume
  seconds: float = 0.0

  @property
  def best(self) -> Scored:
    if not self.ranked:
      raise ValueError(f"no layout of {self.devices} {self.preset.name} devices fits config {self.config!r} in "
                       f"{self.preset.hardware.hbm_bytes / GB:.0f} GB per device ({len(self.rejected)} tried)")
    return self.ranked[0]

  def best_baseline(self) -> tuple[str, Scored] | None:
    fitting = [(name, s) for name, s in self.baselines.items() if s.fits and s.step_s is not None]
    return min(fitting, key=lambda kv: kv[1].step_s) if fitting else None


def smallest(cfg, hardware: str | Preset = "h200", *, max_devices: int,
             on_count: Callable[[int, int | str], None] | None = None, **options) -> tuple[Plan | None, list]:
  """The smallest device count, whole nodes doubling from one (1, 2, 4, ... nodes up to max_devices), on
  which some layout of `cfg` fits (with host tables: their caches, not the tables, in HBM): (its Plan, or
  None when none fits up to max_devices; [(devices, layouts that fit, or why none could be laid out)]).
  on_count(devices, what) is called as each count is done. options: plan()'s keywords; the model is read
  once for every count."""
  preset = get_preset(hardware)
  _check_devices(max_devices, preset)
  options.setdefault("shapes", sim_lib.model_shapes(cfg))
  tried, devices = [], preset.devices_per_node
  while devices <= max_devices:
    try:
      result = plan(cfg, devices, preset, **options)
    except ValueError as e:  # no way to lay this count out (the batch does not divide, ...)
      tried.append((devices, str(e)))
      result = None
    else:
      tried.append((devices, len(result.ranked)))
    if on_count is not None:
      on_count(*tried[-1])
    if result is not None and result.ranked:
      return result, tried
    devices *= 2
  return None, tried


def plan(cfg, devices: int, hardware: str | Preset = "h200", *, batch_size: int | None = None,
         mean_history: float | None = None, overlap: float = 0.9, efficiency: float = 0.5,
         max_tensor: int = MAX_TENSOR, max_context: int = MAX_CONTEXT,
         baseline_meshes: Sequence[MeshSpec] = (), shapes: sim_lib.ModelShapes | None = None,
         progress: Callable[[dict], None] | None = None) -> Plan:
  """Rank every candidate layout of `devices` devices of `hardware` for `cfg` (module docstring).

  baseline_meshes: hand-written mesh specs to compare with (same device count), reported by their name.
  progress: called with {"done", "total", "counts", "best", "seconds"} after each simulated size and rule
  (best: the fastest fitting Scored so far, or None), so a long search can say where it is.
  """
  t0 = time.perf_counter()
  preset = get_preset(hardware)
  _check_devices(devices, preset)
  if preset.hardware.hbm_bytes is None or preset.hardware.peak_bf16_flops is None:
    raise ValueError(f"hardware preset {preset.name!r} needs hbm_bytes and peak_bf16_flops to rank layouts")
  for name, limit in (("max_tensor", max_tensor), ("max_context", max_context)):
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
      raise ValueError(f"{name} must be a positive integer, got {limit!r}")
  for spec in baseline_meshes:
    if spec.num_devices != devices:
      raise ValueError(f"baseline mesh {spec.name!r} has {spec.num_devices} devices, the plan is for {devices}")
  batch = int(batch_size or cfg.data.pipeline.batch_size)
  shapes = shapes or sim_lib.model_shapes(cfg)
  kw = dict(batch_size=batch, mean_history=mean_history, overlap=overlap, efficiency=efficiency, shapes=shapes)
  tables = tables_of(shapes)
  hbm = preset.hardware.hbm_bytes

  sizes_list = axis_sizes(shapes.params, devices, batch, max_tensor, max_context)
  if not sizes_list:
    raise ValueError(f"no way to lay {devices} devices over the five axes for config {cfg.name!r}: the global batch "
                     f"{batch} must divide over replica x fsdp x sparse, tensor <= {max_tensor} must divide the "
                     f"tensor-parallel widths {tensor_widths(shapes.params)}, context <= {max_context} takes the rest")
  counts = {"axis_sizes": len(sizes_list), "sizes_and_rules": 0, "pruned_tables_exceed_hbm": 0,
            "simulated": 0, "layouts_timed": 0, "fitting": 0}
  scored, best, total = [], None, sum(len(table_rules(sizes)) for sizes in sizes_list)
  for sizes in sizes_list:
    for rows in table_rules(sizes):
      counts["sizes_and_rules"] += 1
      if table_memory_bound(tables, math.prod(sizes[MESH_AXES.index(a)] for a in rows),
                            cfg.train.embedding_update == "sparse") > hbm:
        counts["pruned_tables_exceed_hbm"] += 1
        continue
      splits = node_splits(sizes, preset.devices_per_node)
      specs = [Layout(sizes, intra, rows).mesh_spec("candidate", preset) for intra in splits]
      sim = sim_lib.simulate(cfg, specs[0], **kw)
      counts["simulated"] += 1
      for intra, spec in zip(splits, specs):
        t = sim_lib.retime(sim, spec, overlap=overlap, efficiency=efficiency)
        scored.append(Scored(Layout(sizes, intra, rows), spec, sim, t))
        if scored[-1].fits and (best is None or _sort_key(scored[-1]) < _sort_key(best)):
          best = scored[-1]
      if progress is not None:
        progress({"done": counts["sizes_and_rules"], "total": total, "counts": dict(counts, layouts_timed=len(scored)),
                  "best": best, "seconds": time.perf_counter() - t0})
  counts["layouts_timed"] = len(scored)
  ranked = sorted((s for s in scored if s.fits), key=_sort_key)
  counts["fitting"] = len(ranked)

  named = [(name, layout.mesh_spec(name.replace(" ", "_"), preset))
           for name, layout in naive_layouts(devices, preset).items()]
  baselines, baseline_errors = {}, {}
  for name, spec in named + [(spec.name, spec) for spec in baseline_meshes]:
    try:
      sim = sim_lib.simulate(cfg, spec, **kw)
    except mesh_lib.MeshFileError as e:  # e.g. the batch does not divide over its data shards
      baseline_errors[name] = str(e)
      continue
    baselines[name] = Scored(Layout.of(spec), spec, sim,
                             sim_lib.retime(sim, spec, overlap=overlap, efficiency=efficiency), name)
  options = {"overlap": overlap, "efficiency": efficiency, "mean_history": mean_history,
             "max_tensor": max_tensor, "max_context": max_context}
  rejected = [s for s in scored if not s.fits]
  return Plan(cfg.name, devices, preset, batch, ranked, rejected, baselines, baseline_errors, counts, tables, options,
              time.perf_counter() - t0)


def check_compiled(p: Plan, cfg, top: int, compiled_peak: Callable[[MeshSpec, dict], float] | None = None) -> Plan:
  """The plan with its first `top` ranked layouts compiled for their GPU target (deviceless:
  gem_jax/observe/gpu_compile.py) and judged by the compiled memory: each gets its compiled peak, and one
  that does not fit by it leaves the ranking for `rejected` (the rest keep their simulated order). Only
  the planner's preset names the target: a preset without one cannot be compiled for.

  compiled_peak(mesh_spec, mesh file data) -> bytes: default compiles cfg's train step on that mesh file."""
  if top <= 0 or not p.ranked:
    return p
  if p.preset.target is None:
    raise ValueError(f"hardware preset {p.preset.name!r} names no compile target; cannot compile its layouts")
  compiled_peak = compiled_peak or functools.partial(_compiled_peak, cfg)
  checked = []
  for rank, s in enumerate(p.ranked[:top]):
    data = s.layout.mesh_data(f"plan_rank{rank + 1}", "", p.preset)
    checked.append(dataclasses.replace(s, compiled_peak=float(compiled_peak(s.mesh_spec, data))))
  ranked = [s for s in checked if s.fits] + p.ranked[top:]
  rejected = p.rejected + [s for s in checked if not s.fits]
  counts = dict(p.counts, compiled=len(checked), fitting=len(ranked))
  return dataclasses.replace(p, ranked=ranked, rejected=rejected, counts=counts)


def _compiled_peak(cfg, mesh_spec: MeshSpec, data: dict) -> float:
  import tempfile

  import yaml

  from gem_jax.observe import gpu_compile
  with tempfile.TemporaryDirectory() as folder:
    path = f"{folder}/{data['name']}.yaml"
    with open(path, "w") as f:
      yaml.safe_dump(data, f)
    report = gpu_compile.compile_for(dataclasses.replace(cfg, mesh=path), programs=("train",), simulate=False)
  train = report["programs"]["train"]
  if not train["compiled"]:
    raise RuntimeError(f"check_compiled: {mesh_spec.name}: the train step did not compile: {train['error']}")
  return train["memory"]["peak"]
