"""The GPU check (gem_jax/bench/gpu_check.py): the CPU rehearsal runs every section and writes every key a GPU
run writes; the runner keeps what a section recorded when it times out or crashes, skips sections when the
budget runs out, and picks the first working jax_triton wheel."""

import json
import os
import pathlib

import pytest

from gem_jax.bench import gpu_check, gpu_report
from tests import gpu_check_helpers
from tests.run_helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_check")
  result = gpu_check.run(str(out / "out"), rehearse=True, work=str(out / "work"))
  return result, out / "out"


@pytest.mark.slow
def test_rehearsal_runs_every_section_within_its_budget(rehearsal):
  result, out = rehearsal
  assert result["mode"] == "rehearsal" and result["elapsed_s"] < result["budget_s"] <= 180
  assert [s.name for s in gpu_check.SECTIONS] == list(result["sections"])
  for name, section in result["sections"].items():
    assert section["status"] == "ok", (name, section["error"], section["notes"])
  written = json.loads((out / "gpu_check.json").read_text())
  assert written["sections"].keys() == result["sections"].keys()
  md = (out / "gpu_check.md").read_text()
  for heading in ("## Correctness on the device", "## Jagged attention speed", "## FP8 GEMM", "## Train step"):
    assert heading in md


@pytest.mark.slow
def test_rehearsal_writes_every_key_of_the_full_run(rehearsal):
  result, _ = rehearsal
  assert set(gpu_report.TOP_KEYS) <= set(result)
  for name, section in result["sections"].items():
    assert set(gpu_report.SECTION_KEYS) <= set(section), name
    assert set(gpu_report.RESULT_KEYS[name]) <= set(section["result"]), name
    if name in ("environment", "sparse_scaling"):  # results only (sparse_scaling: not built yet)
      continue
    assert section["records"], name
    for r in section["records"]:
      assert set(gpu_report.record_keys(name, r)) <= set(r), (name, r)
  kinds = {r["check"] for r in result["sections"]["correctness"]["records"]}
  assert kinds == {"attention", "fp8_gemm"}


@pytest.mark.slow
def test_rehearsal_measurements_are_real(rehearsal):
  result, _ = rehearsal
  sections = result["sections"]
  checks = [r for r in sections["correctness"]["records"] if not r.get("skipped")]
  assert checks and all(r["passed"] for r in checks), [r for r in checks if not r["passed"]]
  assert {r["dtype"] for r in checks if r["check"] == "attention"} == {"float32", "bfloat16"}
  assert any(r["impl"].startswith("pallas") for r in checks)
  timed = [r for r in sections["kernel_speed"]["records"] if r["median_ms"]]
  assert {r["kernel"] for r in timed} >= {"hstu_attention", "padded_softmax_baseline", "dot_product_attention"}
  assert all(r["real_tflops"] > 0 and r["pct_of_peak"] > 0 for r in timed)
  assert all(r["max_rel_err"] <= 1e-5 for r in timed if r["pass"] == "fwd")
  assert all(r["error"] is None and r["tflops"] > 0 for r in sections["fp8_speed"]["records"])
  train = sections["train_step"]["records"]
  assert [r["policy"] for r in train] == ["bf16"]  # the GPU run adds rowwise and fp8
  for r in train:
    assert r["error"] is None and r["skipped"] is None, r
    assert r["step_time_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 0
  env = sections["environment"]["result"]
  assert env["backend"] == "cpu" and env["packages"]["jax"]


def _env(tmp_path):
  return gpu_check.section_env(True, [str(ROOT)], str(tmp_path))


def test_a_section_killed_at_its_limit_keeps_what_it_recorded(tmp_path):
  s = gpu_check.run_section("sleepy", str(tmp_path), _env(tmp_path), 4, True, str(tmp_path / "log"),
                            module="tests.gpu_check_helpers")
  assert s["status"] == "timed_out" and s["records"] == [{"i": 0}] and "4 s" in s["error"]
  assert "first record written" in (tmp_path / "log").read_text()


def test_a_crashed_or_failing_section_says_why(tmp_path):
  crashed = gpu_check.run_section("crashy", str(tmp_path), _env(tmp_path), 60, True, str(tmp_path / "log"),
                                  module="tests.gpu_check_helpers")
  assert crashed["status"] == "crashed" and "the device went away" in crashed["error"]
  assert crashed["records"] == [{"i": 0}]
  failed = gpu_check.run_section("failing", str(tmp_path), _env(tmp_path), 60, True, str(tmp_path / "log"),
                                 module="tests.gpu_check_helpers")
  assert failed["status"] == "failed" and failed["error"] == "failing: a kernel raised"


def test_sections_are_skipped_when_the_budget_runs_out(tmp_path):
  result = gpu_check.run(str(tmp_path / "out"), rehearse=True, work=str(tmp_path / "work"), budget_s=2.0)
  assert all(s["status"] == "skipped" for s in result["sections"].values())
  assert "budget" in result["sections"]["train_step"]["notes"][0]
  assert {s["what"] for s in result["skipped"]} >= {"train_step", "correctness"}
  assert (tmp_path / "out" / "gpu_check.md").exists()


def test_the_first_jax_triton_wheel_that_works_is_chosen(tmp_path):
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  gpu_check_helpers.fake_wheel(str(wheels), "jax_triton", "9.9.1", "raise ImportError('this build is broken')\n")
  gpu_check_helpers.fake_wheel(str(wheels), "jax_triton", "9.9.0", "triton_call = None\n")
  gpu_check_helpers.fake_wheel(str(wheels), "gem_jax_fake_dep", "1.0", "VALUE = 3\n")
  info = gpu_check.install_wheels(str(wheels), str(tmp_path / "work"), child_env())
  assert [p["wheel"] for p in info["probes"]] == ["jax_triton-9.9.1-py3-none-any.whl",
                                                  "jax_triton-9.9.0-py3-none-any.whl"]
  assert not info["probes"][0]["ok"] and "this build is broken" in info["probes"][0]["output"]
  assert info["probes"][1]["ok"] and info["jax_triton"].endswith("site-jax_triton-9.9.0")
  assert (pathlib.Path(info["site"]) / "gem_jax_fake_dep" / "__init__.py").exists()



def test_an_unknown_section_is_refused_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match=r"unknown sections \['corectness'\]; known: \["):
    gpu_check.run(str(tmp_path / "out"), rehearse=True, sections=("corectness",))
  assert not (tmp_path / "out").exists()
