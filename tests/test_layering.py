"""Import arrows point one way: experiments -> gem_jax -> pallas_kernels, with no cycle between the packages
of gem_jax (a package is the first name under gem_jax/: model, data, train, ..., or a top-level module such
as config or runtime), no cycle between the modules of one package (run/step.py importing run/table_update.py
and back, even inside a function), and pallas_kernels imports only jax, numpy and triton (torch only for
Triton's CPU interpreter). Tests import library functions, never a script by path, and never another test module.

The graph is read from every import statement (ast), function-level imports included: an import that is
deferred to call time is still an arrow. `package_cycles`, `module_graph` and `violations` are plain functions so that
tests/test_layering.py::test_a_back_import_is_caught can show them fire on an added back-import.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# jax_triton: the Triton kernels' JAX binding, imported only behind an availability guard.
KERNEL_ALLOWED = {"jax", "jaxlib", "jax_triton", "numpy", "triton", "torch", "ml_dtypes", "pallas_kernels"}


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
  """Absolute module names imported anywhere in the file (relative imports resolved)."""
  tree = ast.parse(path.read_text(), filename=str(path))
  package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
  return out


def _unit(module: str) -> str | None:
  """The gem_jax package (or top-level module) a module belongs to; None outside gem_jax."""
  parts = module.split(".")
  return parts[1] if parts[0] == "gem_jax" and len(parts) > 1 else None


def _known_units(root: pathlib.Path) -> set[str]:
  return {p.stem if p.is_file() else p.name for p in (root / "gem_jax").iterdir()
          if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}


def package_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """gem_jax unit -> the units it imports."""
  units = _known_units(root)
  graph = {u: set() for u in units}
  for path in (root / "gem_jax").rglob("*.py"):
    src = _unit(".".join(path.relative_to(root).with_suffix("").parts))
    if src is None or src == "__init__":  # gem_jax/__init__.py is the root every unit's import runs
      continue
    for name in _imports(path, root):
      dst = _unit(name)
      if dst in units and dst != src:
        graph[src].add(dst)
  return graph


def _module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Every module of gem_jax by dotted name (a package by its folder's name) -> its file."""
  out = {}
  for path in (root / "gem_jax").rglob("*.py"):
    parts = path.relative_to(root).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
  """gem_jax module -> the modules of its own package it imports (`from pkg import mod` and `import pkg.mod`
  alike; the package's __init__ is not a module of it)."""
  modules = _module_names(root)
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    package = module.rsplit(".", 1)[0]
    for name in _imports(path, root):
      # `from gem_jax.run import step` records gem_jax.run and gem_jax.run.step; `from gem_jax.run.step import
      # TrainState` records gem_jax.run.step.TrainState, whose module is its parent.
      for candidate in (name, name.rsplit(".", 1)[0]):
        if candidate in modules and candidate not in (module, package) and candidate.rsplit(".", 1)[0] == package:
          graph[module].add(candidate)
          break
  return graph


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every strongly connected component of more than one unit (Tarjan), each as a sorted list."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def violations(root: pathlib.Path = ROOT) -> list[str]:
  """Arrows that point the wrong way between the top-level folders, one line each."""
  out = []
  for path in sorted((root / "pallas_kernels").rglob("*.py")):
    for name in sorted(_imports(path, root)):
      top = name.split(".")[0]
      if top not in KERNEL_ALLOWED and top not in sys.stdlib_module_names and top != "__future__":
        out.append(f"{path.relative_to(root)} imports {name}")
  for path in sorted((root / "gem_jax").rglob("*.py")):
    for name in sorted(_imports(path, root)):
      if name.split(".")[0] in ("experiments", "tests"):
        out.append(f"{path.relative_to(root)} imports {name}")
  for path in sorted((root / "tests").rglob("*.py")):
    text = path.read_text()
    if path.name != "test_layering.py" and "spec_from_file_location" in text and '"experiments"' in text:
      out.append(f"{path.relative_to(root)} loads a script from experiments/ by path")
    for name in sorted(_imports(path, root)):
      parts = name.split(".")
      if parts[0] == "tests" and len(parts) > 1 and parts[1].startswith("test_"):
        out.append(f"{path.relative_to(root)} imports another test module {name}")
  return out


def test_no_cycle_between_gem_jax_packages():
  assert package_cycles(package_graph()) == []


def test_no_cycle_between_modules_of_one_package():
  assert package_cycles(module_graph()) == []


def test_arrows_point_one_way():
  assert violations() == []


def test_a_back_import_is_caught(tmp_path):
  """The checks fire: a copy of the tree with model importing train (a cycle) and a kernel importing
  gem_jax."""
  import shutil
  for folder in ("gem_jax", "pallas_kernels", "tests"):
    shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
  with open(tmp_path / "gem_jax" / "model" / "gem.py", "a") as f:
    f.write("\nfrom gem_jax.train import trainer  # a back-import\n")
  with open(tmp_path / "pallas_kernels" / "conformance.py", "a") as f:
    f.write("\nimport gem_jax.ops\n")
  cycles = package_cycles(package_graph(tmp_path))
  assert any({"model", "train"} <= set(c) for c in cycles), cycles
  # Inside one package: the table update reaching back into the step that calls it, deferred to call time.
  with open(tmp_path / "gem_jax" / "run" / "table_update.py", "a") as f:
    f.write("\n\ndef _late():\n  from gem_jax.run import step  # a back-import inside run\n  return step\n")
  cycles = package_cycles(module_graph(tmp_path))
  assert any({"gem_jax.run.step", "gem_jax.run.table_update"} <= set(c) for c in cycles), cycles
  assert "pallas_kernels/conformance.py imports gem_jax.ops" in violations(tmp_path)
