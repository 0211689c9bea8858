"""Helpers of tests/test_gpu_check.py: a stand-in section module (run as `python -m`) and fake wheels."""

import base64
import hashlib
import json
import os
import sys
import time
import zipfile


def fake_wheel(folder: str, name: str, version: str, init_source: str) -> str:
  """A minimal pure-Python wheel of package `name` whose __init__.py is `init_source`."""
  dist = f"{name}-{version}.dist-info"
  files = {f"{name}/__init__.py": init_source,
           f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
           f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
  record = []
  for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{path},sha256={digest},{len(text.encode())}")
  files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
  path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
  with zipfile.ZipFile(path, "w") as z:
    for p, text in files.items():
      z.writestr(p, text)
  return path


def main(argv) -> int:
  """A section that records once, then behaves as its name says: "sleepy" outlives any limit, "crashy"
  exits with an error before finishing, "failing" finishes with an error."""
  name, work = argv[0], argv[argv.index("--work") + 1]
  path = os.path.join(work, f"{name}.json")
  data = {"notes": ["started"], "result": {"x": 1}, "records": [{"i": 0}], "finished": False, "error": None}
  with open(path, "w") as f:
    json.dump(data, f)
  print(f"{name}: first record written", flush=True)
  if name == "sleepy":
    time.sleep(600)
  if name == "crashy":
    raise SystemExit("crashy: the device went away")
  data.update(finished=True, error="failing: a kernel raised" if name == "failing" else None)
  with open(path, "w") as f:
    json.dump(data, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
