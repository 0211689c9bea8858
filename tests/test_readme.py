"""The README's newcomer commands and .ci/run stay in sync."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
  return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
              if l.strip() and not l.lstrip().startswith("#") and not l.startswith(("set ", "cd "))]
  blocks = _bash_blocks(readme)
  test_cmds = [b for b in blocks if "pytest" in b]
  assert test_cmds, "README has no test command"
  assert test_cmds[0] in ci_lines, f".ci/run does not run the README test command {test_cmds[0]!r}"


def test_readme_main_job_is_complete_from_a_fresh_clone():
  blocks = _bash_blocks((ROOT / "README.md").read_text())
  main = [b for b in blocks if "experiments/train.py" in b]
  assert main and "python3 -m venv" in main[0] and "pip install" in main[0]
