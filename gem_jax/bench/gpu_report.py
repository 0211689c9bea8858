"""The GPU check's output: the keys every run writes (a rehearsal and a GPU run alike), the list of what was
skipped and why, and the markdown summary (gpu_check.md) that the README's "Measured on GPU" section takes.
No jax here: the runner renders whatever the sections left, also after a crash."""

from __future__ import annotations

SCHEMA_VERSION = 1
TOP_KEYS = ("schema_version", "mode", "command", "started_utc", "budget_s", "elapsed_s", "install", "sections",
            "skipped")
SECTION_KEYS = ("status", "elapsed_s", "limit_s", "notes", "result", "records", "error")
RESULT_KEYS = {
    "environment": ("python", "packages", "backend", "device_kind", "device_count", "compute_capability",
                    "memory_bytes", "nvidia_smi", "install", "datasheet_peak_flops", "measured_gemm",
                    "expected_skips", "jax_triton_import_error"),
    "correctness": ("checked", "failed"),
    "kernel_speed": ("peak_flops", "peak_source", "dtype", "speedups"),
    "fp8_speed": ("peaks", "rows"),
    "train_step": ("config", "mesh", "steps", "batch_size"),
    "sparse_scaling": ("table_params", "step_ms"),
}
# Record keys by section (correctness: by the record's "check").
RECORD_KEYS = {
    "attention": ("check", "family", "impl", "case", "dtype", "tolerance", "errors", "tail_zero", "passed",
                  "skipped", "error"),
    "fp8_gemm": ("check", "recipe", "impl", "shape", "max_rel_err", "bound_ratio", "passed", "error"),
    "kernel_speed": ("kernel", "impl", "shape", "pass", "dtype", "batch", "max_len", "heads", "head_dim", "lengths",
                     "tokens", "mean_length", "median_ms", "real_tflops", "pct_of_peak", "max_rel_err", "skipped",
                     "error"),
    "fp8_speed": ("table", "shape", "recipe", "impl", "median_ms", "tflops", "pct_of_peak", "max_rel_err",
                  "speedup_vs_bf16", "error"),
    "train_step": ("config", "policy", "attn_impl", "steps", "step_time_s", "examples_per_s", "mfu", "hfu",
                   "padding_waste", "peak_memory_bytes", "compile_s", "host_data_s", "eval_ne", "notes",
                   "skipped", "error"),
}


def record_keys(section: str, record: dict) -> tuple[str, ...]:
  return RECORD_KEYS[record.get("check")] if section == "correctness" else RECORD_KEYS[section]


def skipped(result: dict) -> list[dict]:
  """Everything the run did not do, with why: whole sections, skipped records, expected skips."""
  out = []
  for name, s in result.get("sections", {}).items():
    if s["status"] != "ok":
      out.append({"what": name, "why": f"{s['status']}: {s.get('error') or '; '.join(s.get('notes', []))}"[:500]})
    for r in s.get("records", []):
      if r.get("skipped"):
        what = " ".join(str(r.get(k)) for k in ("check", "family", "kernel", "impl", "case", "shape", "pass", "policy")
                        if r.get(k) is not None)
        out.append({"what": f"{name}: {what}", "why": r["skipped"]})
  env = result.get("sections", {}).get("environment", {}).get("result", {})
  out += env.get("expected_skips", [])
  return out


def _f(x, fmt="{:.3g}"):
  return "-" if x is None else fmt.format(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def markdown(result: dict) -> str:
  secs = result.get("sections", {})
  env = secs.get("environment", {}).get("result", {})
  lines = [f"# gem-jax GPU check ({result['mode']})", "",
           f"Started {result['started_utc']}; {_f(result.get('elapsed_s'), '{:.0f}')} s of a "
           f"{result['budget_s']:.0f} s budget. Command: `{result['command']}`", ""]
  if env:
    pk = env.get("packages", {})
    gemm = env.get("measured_gemm") or {}
    lines += [f"Device: {env.get('device_kind')} x {env.get('device_count')} ({env.get('backend')}), "
              f"compute capability {env.get('compute_capability')}, {_f((env.get('memory_bytes') or 0) / 2**30, '{:.0f}')} "
              f"GiB; nvidia-smi: {env.get('nvidia_smi') or '-'}.",
              "Packages: " + ", ".join(f"{k} {v}" for k, v in pk.items() if v) + ".",
              f"Measured {gemm.get('dtype')} GEMM ({gemm.get('n')}^3): {_f((gemm.get('flops') or 0) / 1e12)} TFLOP/s; "
              f"datasheet bf16 peak {_f((env.get('datasheet_peak_flops') or {}).get('bf16'))} FLOP/s.", ""]
  lines += ["| section | status | s | notes |", "|---|---|---|---|"]
  for name, s in secs.items():
    note = "; ".join(s.get("notes", []))[:200] or (s.get("error") or "")[:200]
    lines.append(f"| {name} | {s['status']} | {_f(s.get('elapsed_s'), '{:.0f}')} | {note.replace('|', '/')} |")
  lines += [""] + _correctness(secs.get("correctness")) + _kernels(secs.get("kernel_speed")) + \
      _fp8(secs.get("fp8_speed")) + _train(secs.get("train_step"))
  skips = result.get("skipped") or []
  if skips:
    lines += ["## Skipped", ""] + [f"- {s['what']}: {s['why']}" for s in skips] + [""]
  return "\n".join(lines)


def _correctness(s) -> list[str]:
  if not s or not s.get("records"):
    return []
  groups: dict = {}
  for r in s["records"]:
    if r.get("skipped"):
      continue
    if r["check"] == "attention":
      key = (f"{r['family']} attention", r["impl"], r["dtype"])
      worst = max((r["errors"] or {}).values(), default=None)
    else:
      key = (f"fp8 gemm {r['recipe']}", r["impl"], "fp8")
      worst = r.get("bound_ratio")
    g = groups.setdefault(key, {"n": 0, "ok": 0, "worst": None, "errors": []})
    g["n"] += 1
    g["ok"] += bool(r.get("passed"))
    if worst is not None:
      g["worst"] = worst if g["worst"] is None else max(g["worst"], worst)
    if r.get("error"):
      g["errors"].append(r["error"][:120])
  rows = [[k[0], k[1], k[2], f"{g['ok']}/{g['n']}", _f(g["worst"]), "; ".join(g["errors"])[:200]]
          for k, g in groups.items()]
  return ["## Correctness on the device", "",
          "Attention: max_rel_err of the output and every gradient against the f32 reference (bound 1e-5 f32, "
          "2e-2 bf16). FP8: worst |err| / summation bound against the emulation (<= 1 passes).", ""] + \
      _table(["check", "impl", "dtype", "passed", "worst", "errors"], rows) + [""]


def _kernels(s) -> list[str]:
  if not s or not s.get("records"):
    return []
  by = {}
  for r in s["records"]:
    by.setdefault((r["shape"], r["kernel"], r["impl"]), {})[r["pass"]] = r
  speed = {(x["shape"], x["kernel"], x["impl"], x["pass"]): x for x in s.get("result", {}).get("speedups", [])}
  rows = []
  for (shape, kernel, impl), p in by.items():
    fwd, both = p.get("fwd", {}), p.get("fwd+bwd", {})
    sp = speed.get((shape, kernel, impl, "fwd"), {})
    why = fwd.get("skipped") or fwd.get("error") or both.get("skipped") or both.get("error") or ""
    rows.append([shape, kernel, impl, _f(fwd.get("median_ms")), _f(fwd.get("real_tflops")),
                 _f(fwd.get("pct_of_peak"), "{:.1f}"), _f(both.get("median_ms")), _f(both.get("real_tflops")),
                 _f(both.get("pct_of_peak"), "{:.1f}"), _f(sp.get("vs_padded"), "{:.2f}"),
                 _f(sp.get("vs_padded_same_op"), "{:.2f}"), _f(sp.get("vs_cudnn"), "{:.2f}"),
                 _f(fwd.get("max_rel_err"), "{:.1e}"), why[:80]])
  res = s.get("result", {})
  return [f"## Jagged attention speed ({res.get('dtype')}; % of {_f(res.get('peak_flops'))} FLOP/s, "
          f"{res.get('peak_source')})", "",
          "TFLOP/s count the unmasked causal pairs only; 'vs' columns: forward time of the padded softmax "
          "baseline / of the padded baseline of the same operation (HSTU or softmax) / of cuDNN flash attention, "
          "over this one's.", ""] + \
      _table(["shape", "kernel", "impl", "fwd ms", "TFLOP/s", "%", "fwd+bwd ms", "TFLOP/s", "%", "vs padded",
              "vs same op", "vs cuDNN", "fwd err", "note"], rows) + [""]


def _fp8(s) -> list[str]:
  if not s or not s.get("records"):
    return []
  rows = [["x".join(map(str, r["shape"])), r["recipe"], r["impl"], _f(r.get("median_ms")), _f(r.get("tflops")),
           _f(r.get("pct_of_peak"), "{:.1f}"), _f(r.get("speedup_vs_bf16"), "{:.2f}"),
           _f(r.get("max_rel_err"), "{:.1e}"), (r.get("error") or "")[:80]] for r in s["records"]]
  return ["## FP8 GEMM (pre-quantized operands; % of the datasheet bf16 / fp8 peak)", ""] + \
      _table(["M x K x N", "recipe", "impl", "ms", "TFLOP/s", "% peak", "vs bf16", "rel err", "error"], rows) + [""]


def _train(s) -> list[str]:
  if not s or not s.get("records"):
    return []
  res = s.get("result", {})
  rows = [[r["policy"], r.get("attn_impl"), _f(None if r.get("step_time_s") is None else r["step_time_s"] * 1e3),
           _f(r.get("examples_per_s"), "{:.0f}"), _f(None if r.get("mfu") is None else 100 * r["mfu"], "{:.1f}"),
           _f(None if r.get("hfu") is None else 100 * r["hfu"], "{:.1f}"),
           _f(None if r.get("peak_memory_bytes") is None else r["peak_memory_bytes"] / 2**30, "{:.1f}"),
           _f(r.get("compile_s"), "{:.0f}"), (r.get("skipped") or r.get("error") or "")[:100]]
          for r in s["records"]]
  return [f"## Train step: `{res.get('config')}` on {res.get('mesh')}, batch {res.get('batch_size')}, "
          f"{res.get('steps')} steps (efficiency report)", ""] + \
      _table(["policy", "attention", "step ms", "examples/s", "MFU %", "HFU %", "peak GiB", "compile s", "note"],
             rows) + [""]
