"""gem_jax/bench/ab_trees.py: alternating order, medians and ratios (the jobs themselves are stubbed: each
real one is a full training run; experiments/ab_default_job.py runs them)."""

from gem_jax.bench import ab_trees


def test_rounds_alternate_and_medians_and_ratios_come_from_every_run(monkeypatch, tmp_path):
  calls = []
  speed = {"/a": [100.0, 130.0, 90.0], "/b": [200.0, 180.0, 260.0]}

  def fake(tree, args, out_dir, timeout=1800):
    calls.append(tree)
    i = sum(1 for t in calls if t == tree) - 1
    return {"examples_per_s": speed[tree][i], "hfu": speed[tree][i] / 1000, "wall_s": 1.0,
            "click/eval_ne": 0.9 - 0.01 * i, "click/gap_closed": None if tree == "/b" and i == 0 else 0.6 + 0.01 * i}

  monkeypatch.setattr(ab_trees, "run_job", fake)
  result = ab_trees.compare({"new": "/a", "old": "/b"}, ["--config", "tiny"], repeats=3, out_dir=str(tmp_path),
                            log=lambda *_: None)
  assert calls == ["/a", "/b", "/b", "/a", "/a", "/b"]
  assert result["medians"]["new"]["examples_per_s"] == 100.0 and result["medians"]["old"]["examples_per_s"] == 200.0
  assert result["examples_per_s_ratio"] == {"new": 0.5, "old": 1.0}
  assert result["medians"]["new"]["click/eval_ne"] == 0.89
  assert result["medians"]["old"]["click/gap_closed"] == 0.615  # the run without a value is left out
  assert result["hfu_ratio"] == {"new": 0.5, "old": 1.0}
  assert "| HFU vs old | 0.500x | 1.000x |" in ab_trees.table(result) and not result["notes"]
  calls.clear()
  once = ab_trees.compare({"new": "/a", "old": "/b"}, ["--config", "tiny"], repeats=1, out_dir=str(tmp_path),
                          log=lambda *_: None)
  assert "note: one run per tree, new then old in that order" in ab_trees.table(once)


def test_a_run_gives_its_report_s_mfu_and_hfu(monkeypatch, tmp_path):
  import json
  import subprocess

  def fake_run(cmd, cwd, env, capture_output, text, timeout):
    out_dir = cmd[cmd.index("--out") + 1]
    with open(f"{out_dir}/summary.json", "w") as f:
      json.dump({"examples_per_s": 1500.0, "efficiency": {"mfu": 0.14, "hfu": 0.21},
                 "tasks": {"click": {"eval_ne": 0.86, "gap_closed": 0.67}}}, f)
    return subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(ab_trees.subprocess, "run", fake_run)
  got = ab_trees.run_job(str(tmp_path), [], str(tmp_path))
  assert (got["examples_per_s"], got["mfu"], got["hfu"], got["click/gap_closed"]) == (1500.0, 0.14, 0.21, 0.67)
