"""What the compiler made of a program: its kernels, FP8 GEMMs and scatter atomics, read from the optimized
HLO (`compiled.as_text()`) and, for atomics, from the PTX that XLA's dump wrote (`xla_dump_to`).

  kernels(hlo_text) -> [{"name", "kind", "count"}]     kind: triton | mosaic_gpu | interpreted | xla
  fp8_gemms(hlo_text) -> [{"name", "kind", "count"}]   every GEMM with float8 operands
  scatter_atomics(hlo_text, dump_dir) -> {"verdict": "native" | "cas" | "none", "fusions": [...]}

kernels: the package's Pallas kernels (pallas_kernels.PALLAS_KERNELS) as XLA:GPU holds them: a Triton custom
call (`__gpu$xla.gpu.triton`, named by its backend config), a Mosaic GPU custom call, or `interpreted` when
the kernel's named scope shows up on ordinary HLO ops (Pallas interpret mode: a while loop over the grid,
which is what a program built for the wrong platform gets). Besides those, XLA's own library and generated
kernels (kind `xla`): custom calls by target (`__cublas$lt$matmul$f8`, cuDNN) and custom fusions by their
backend kind (`__triton_nested_gemm_fusion`). `count` is call sites, not executions.

fp8_gemms: a cuBLASLt FP8 matmul (`__cublas$lt$matmul$f8`), a fusion or bare dot whose dot has float8
operands (XLA's Triton GEMMs), a block-scaled cuDNN dot, or one of the package's FP8 Pallas kernels.

scatter_atomics: each scatter fusion of the HLO is found in the PTX by its kernel name (`.entry`, the fusion's
name with dots as underscores) and classed by its atomics: `native` (float `atom`/`red` add, scalar or
vector), `cas` (a compare-and-swap loop: `atom.*.cas`, the jaxlib 0.10.2-0.11.0 regression that
gem_jax/xla_env.py works around), `none` (no float atomics: integer scatters, sorted unique indices).
The verdict is `cas` if any scatter fusion loops, else `native` if any uses float atomics, else `none`.

This module reads text only: it never compiles, and never guesses from the model what the compiler did.
"""

from __future__ import annotations

import glob
import os
import re

from gem_jax.observe import hlo
from pallas_kernels import PALLAS_KERNELS

_TRITON_CALL = "__gpu$xla.gpu.triton"
_FP8_TYPE = re.compile(r"\bf8e\w+\[")
_FP8_TARGETS = ("__cublas$lt$matmul$f8",)
_FP8_PALLAS = ("fp8_mx_gemm", "fp8_scaled_gemm")


_ATTRS = {"target": r'custom_call_target="([^"]*)"', "kind": r'"kind":"([^"]*)"', "name": r'\bname = "([^"]*)"',
          "op_name": r'op_name="((?:[^"\\]|\\.)*)"'}


def _attr(instr: hlo.Instr, which: str, default: str = "") -> str:
  """One attribute of an instruction's text: its custom-call target, backend-config kind, Triton kernel name
  or op_name metadata (`default` when it has none)."""
  m = re.search(_ATTRS[which], instr.attrs)
  return m.group(1) if m else default


def _target(instr: hlo.Instr) -> str:
  return _attr(instr, "target")


def _backend_kind(instr: hlo.Instr) -> str:
  return _attr(instr, "kind")


def _triton_name(instr: hlo.Instr) -> str:
  return _attr(instr, "name", instr.name)


def _op_name(instr: hlo.Instr) -> str:
  return _attr(instr, "op_name")


def _mosaic_name(instr: hlo.Instr) -> str:
  scopes = _op_name(instr).split("/")
  named = [s for s in scopes if s in PALLAS_KERNELS]
  return named[-1] if named else instr.name


def _add(found: dict, name: str, kind: str) -> None:
  found[(name, kind)] = found.get((name, kind), 0) + 1


def kernels(hlo_text: str) -> list[dict]:
  """The Pallas kernels and XLA's GEMM / library kernels of a compiled program (module docstring)."""
  mod = hlo.parse_module(hlo_text)
  found: dict[tuple[str, str], int] = {}
  scoped: set[str] = set()
  for instrs in mod.comps.values():
    for instr in instrs:
      if instr.opcode == "custom-call":
        target = _target(instr)
        if target == _TRITON_CALL:
          _add(found, _triton_name(instr), "triton")
        elif "mosaic" in target.lower():
          _add(found, _mosaic_name(instr), "mosaic_gpu")
        else:
          _add(found, target, "xla")
        continue
      if instr.opcode == "fusion" and "kind=kCustom" in instr.bare and (kind := _backend_kind(instr)):
        _add(found, kind, "xla")
      scoped.update(s for s in _op_name(instr).split("/") if s in PALLAS_KERNELS)
  compiled = {name for name, kind in found if kind in ("triton", "mosaic_gpu")}
  for name in sorted(scoped - compiled):
    found[(name, "interpreted")] = 1
  order = {"triton": 0, "mosaic_gpu": 1, "interpreted": 2, "xla": 3}
  return [{"name": n, "kind": k, "count": c} for (n, k), c in sorted(found.items(), key=lambda x: (order[x[0][1]], x[0][0]))]


def _computation_has_fp8_dot(mod: hlo.Module, comp: str, seen: set) -> bool:
  if comp in seen or comp not in mod.comps:
    return False
  seen.add(comp)
  instrs = mod.comps[comp]
  shapes = {i.name: i.shape for i in instrs}
  for instr in instrs:
    if instr.opcode in ("dot", "scaled-dot") and _dot_is_fp8(instr, shapes):
      return True
    if instr.opcode == "fusion" and any(_computation_has_fp8_dot(mod, c, seen) for c, _, _ in hlo.callees(instr)):
      return True
  return False


def _dot_is_fp8(instr: hlo.Instr, shapes: dict[str, str]) -> bool:
  operands = []
  for token in instr.operands[:2]:
    operands.append(token.rsplit(None, 1)[0] if len(token.split()) > 1 else shapes.get(hlo.operand_name(token), ""))
  return any(_FP8_TYPE.search(s) for s in operands)


_SITE = re.compile(r"fp8_site=([\w.\-]+)")


def _site_and_pass(instr: hlo.Instr) -> tuple[str, str]:
  """(the Dense site of an FP8 GEMM, "forward" | "backward") from its op_name (gem_jax/model/layers.py names
  the scope; the backward GEMMs sit under transpose(...)); ("", "") when the op_name names none."""
  op_name = _op_name(instr)
  m = _SITE.search(op_name)
  if not m:
    return "", ""
  return m.group(1), "backward" if "transpose(" in op_name[:m.start()] else "forward"


def fp8_gemms(hlo_text: str) -> list[dict]:
  """Every GEMM of the program with float8 operands: {"name", "kind", "site", "pass", "count"} (module
  docstring); site and pass come from the op_name when the model named them."""
  mod = hlo.parse_module(hlo_text)
  fused = {c for instrs in mod.comps.values() for i in instrs if i.opcode == "fusion" for c, _, _ in hlo.callees(i)}
  found: dict[tuple[str, str, str, str], int] = {}
  for comp, instrs in mod.comps.items():
    if comp in fused:    # counted at the fusion that calls it
      continue
    shapes = {i.name: i.shape for i in instrs}
    for instr in instrs:
      target = _target(instr) if instr.opcode == "custom-call" else ""
      if target in _FP8_TARGETS:
        name, kind = target, "xla"
      elif target == _TRITON_CALL and _triton_name(instr) in _FP8_PALLAS:
        name, kind = _triton_name(instr), "triton"
      elif target and "cudnn" in target.lower() and "scaled" in target.lower():
        name, kind = target, "xla"
      elif instr.opcode in ("dot", "scaled-dot") and _dot_is_fp8(instr, shapes):
        name, kind = instr.opcode, "xla"
      elif instr.opcode == "fusion" and any(_computation_has_fp8_dot(mod, c, set()) for c, _, _ in hlo.callees(instr)):
        name, kind = _backend_kind(instr) or "fusion", "xla"
      else:
        continue
      key = (name, kind, *_site_and_pass(instr))
      found[key] = found.get(key, 0) + 1
  return [{"name": n, "kind": k, "site": site, "pass": p, "count": c}
          for (n, k, site, p), c in sorted(found.items())]


def fp8_by_site(gemms: list[dict]) -> dict[str, dict[str, int]]:
  """{site: {"forward": n, "backward": n}} of fp8_gemms' result ("" for GEMMs no site named)."""
  out: dict[str, dict[str, int]] = {}
  for g in gemms:
    per = out.setdefault(g["site"], {"forward": 0, "backward": 0})
    per[g["pass"] or "forward"] += g["count"]
  return out


def count(items: list[dict]) -> int:
  return sum(item["count"] for item in items)


# ------------------------------------------------------------------------------------------ PTX atomics

_ENTRY = re.compile(r"\.entry\s+([\w$]+)")
_FLOAT_ADD = re.compile(r"\b(?:atom|red)\.[\w.]*\badd\b[\w.]*\.(?:f16|bf16|bf16x2|f16x2|f32|f64)\b")
_CAS = re.compile(r"\batom\.[\w.]*\bcas\.b(?:16|32|64)\b")


def _ptx_functions(dump_dir: str) -> dict[str, str]:
  """{kernel name: its PTX text} over every .ptx file of the dump."""
  out = {}
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
    with open(path) as f:
      text = f.read()
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(text)]
    for (at, name), (end, _) in zip(starts, starts[1:] + [(len(text), "")]):
      out[name] = text[at:end]
  return out


def scatter_fusions(hlo_text: str) -> list[tuple[str, str, str]]:
  """(fusion name, the name of the kernel it runs, op_name) of every fusion of the program whose fused
  computation holds a scatter. Identical fusions share one kernel: XLA names it after the first
  (`deduplicated_name`)."""
  mod = hlo.parse_module(hlo_text)
  has_scatter = {comp for comp, instrs in mod.comps.items() if any(i.opcode == "scatter" for i in instrs)}
  out = []
  for instrs in mod.comps.values():
    for i in instrs:
      if i.opcode == "fusion" and any(c in has_scatter for c, _, _ in hlo.callees(i)):
        dedup = re.search(r'deduplicated_name="([^"]*)"', i.attrs)
        out.append((i.name, dedup.group(1) if dedup else i.name, _op_name(i)))
  return out


def scatter_atomics(hlo_text: str, dump_dir: str) -> dict:
  """How the scatter fusions' PTX adds floats (module docstring)."""
  functions = _ptx_functions(dump_dir)
  fusions = []
  found = scatter_fusions(hlo_text)
  # Fusions deduplicated into one kernel share it, named after any one of them.
  group: dict[str, list[str]] = {}
  for name, kernel, _ in found:
    group.setdefault(kernel, []).append(name)
  for name, kernel, op_name in found:
    symbols = [re.sub(r"[^\w$]", "_", k) for k in [name, kernel] + group[kernel]]
    ptx = next((functions[k] for k in symbols if k in functions), None)
    if ptx is None:
      fusions.append({"fusion": name, "op_name": op_name, "atomics": "not in PTX"})
      continue
    cas, native = len(_CAS.findall(ptx)), len(_FLOAT_ADD.findall(ptx))
    fusions.append({"fusion": name, "op_name": op_name,
                    "atomics": "cas" if cas else "native" if native else "none"})
  kinds = {f["atomics"] for f in fusions}
  verdict = "cas" if "cas" in kinds else "native" if "native" in kinds else "none"
  return {"verdict": verdict, "fusions": fusions, "ptx_files": len(glob.glob(os.path.join(dump_dir, "*.ptx")))}
