"""Mesh files: every shipped file parses, bad files fail naming the field, devices follow the topology."""

from __future__ import annotations

import collections
import copy
import pathlib

import jax
import pytest
import yaml

from gem_jax.parallel import mesh as mesh_lib
from gem_jax.parallel.mesh import MeshFileError
from gem_jax.parallel.rules import MESH_AXES

MESHES = pathlib.Path(__file__).resolve().parents[1] / "meshes"
FakeDevice = collections.namedtuple("FakeDevice", "id process_index")


@pytest.mark.parametrize("path", sorted(MESHES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_mesh_file_parses(path):
  spec = mesh_lib.load(path)
  assert spec.name == path.stem
  assert [a for a, _ in spec.axes] == list(MESH_AXES)
  assert spec.num_devices % spec.devices_per_node == 0
  grid = mesh_lib.device_grid(spec, [FakeDevice(i, 0) for i in range(spec.num_devices)])
  assert grid.shape == tuple(s for _, s in spec.axes)


def test_shipped_set():
  names = {p.stem for p in MESHES.glob("*.yaml")}
  assert {"cpu_1", "cpu_8", "cpu_16_5d", "h200_8", "h200_1024_5d"} <= names
  five_d = mesh_lib.load(MESHES / "h200_1024_5d.yaml")
  assert five_d.num_devices == 1024 and five_d.num_nodes == 128
  assert all(s > 1 for _, s in five_d.axes)
  cpu16 = mesh_lib.load(MESHES / "cpu_16_5d.yaml")
  assert cpu16.num_devices == 16 and sum(s > 1 for _, s in cpu16.axes) >= 4


def node_of(device, per_node):
  return device.id // per_node


def test_intra_node_axes_stay_inside_a_node():
  spec = mesh_lib.load(MESHES / "h200_1024_5d.yaml")
  grid = mesh_lib.device_grid(spec, [FakeDevice(i, i // 8) for i in range(1024)])
  axis = {a: i for i, a in enumerate(MESH_AXES)}
  # Moving along sparse or tensor never leaves the node; along fsdp, context or replica it always does.
  base = (3, 5, 0, 1, 0)
  for a in ("sparse", "tensor"):
    idx = list(base)
    for k in range(spec.shape[a]):
      idx[axis[a]] = k
      assert node_of(grid[tuple(idx)], 8) == node_of(grid[base], 8), a
  for a in ("replica", "fsdp", "context"):
    idx = list(base)
    idx[axis[a]] = (base[axis[a]] + 1) % spec.shape[a]
    assert node_of(grid[tuple(idx)], 8) != node_of(grid[base], 8), a
  assert len({d.id for d in grid.ravel()}) == 1024


def test_build_mesh_on_virtual_cpu_devices():
  spec = mesh_lib.load(MESHES / "cpu_8.yaml")
  m = mesh_lib.build_mesh(spec, jax.devices()[:8])
  assert m.axis_names == MESH_AXES and dict(m.shape) == spec.shape
  one = mesh_lib.build_mesh(mesh_lib.load(MESHES / "cpu_1.yaml"), jax.devices()[:1])
  assert one.size == 1


def test_wrong_device_count_names_the_mesh_and_axes():
  spec = mesh_lib.load(MESHES / "cpu_16_5d.yaml")
  with pytest.raises(MeshFileError, match=r"needs 16 devices \(replica=2 x fsdp=2 x sparse=2 x context=1 x "
                                          r"tensor=2\), but 8 are available"):
    mesh_lib.build_mesh(spec, jax.devices()[:8])


def test_batch_must_split_over_the_data_axes():
  spec = mesh_lib.load(MESHES / "cpu_16_5d.yaml")
  mesh_lib.check_batch(spec, 64)
  with pytest.raises(MeshFileError, match="batch size 20 does not divide .* 8 shards"):
    mesh_lib.check_batch(spec, 20)


GOOD = yaml.safe_load((MESHES / "cpu_8.yaml").read_text())


def broken(edit):
  data = copy.deepcopy(GOOD)
  edit(data)
  return data


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["axes"].update(pipeline=2), "unknown mesh axis 'pipeline'"),
    (lambda d: d["axes"].pop("context"), "missing mesh axis 'context'"),
    (lambda d: d["axes"].update(tensor=0), "axes.tensor must be a positive integer"),
    (lambda d: d["intra_node"].update(sparse=1), "multiply to 2, but devices_per_node is 4"),
    (lambda d: d["hardware"].update(hbm_bytes="lots"), "hardware.hbm_bytes must be a positive number"),
    (lambda d: d["intra_node"].update(tensor=4), "intra_node.tensor = 4 does not divide axes.tensor = 2"),
    (lambda d: d.update(devices_per_node=8), "multiply to 4, but devices_per_node is 8"),
    (lambda d: d["hardware"].update(tflops=1), "unknown hardware key 'tflops'"),
    (lambda d: d["hardware"].update(peak_bf16_flops=-1), "hardware.peak_bf16_flops must be a positive number"),
    (lambda d: d.update(topology="torus"), r"unknown keys \['topology'\]"),
    (lambda d: d.pop("devices_per_node"), "missing key 'devices_per_node'"),
    (lambda d: d.update(rules={"embed": "model"}), "rules.embed: 'model' is not a mesh axis"),
    (lambda d: d.update(rules={"vocab": "sparse"}), "rules.vocab: unknown logical axis"),
    (lambda d: d.update(rules=["fsdp"]), "rules must map logical axes to a mesh axis, a list of them or null"),
    (lambda d: d.update(rules={"embed": 5}), "rules.embed must be a mesh axis, a list of mesh axes or null, got 5"),
    (lambda d: d.update(rules={"table_rows": ["sparse", "sparse"]}), r"rules.table_rows: \['sparse', 'sparse'\] "
                                                                      "names a mesh axis twice"),
    (lambda d: d.update(rules={"batch": ["fsdp"]}), "rules.batch: the SPMD step always splits batch over the data"),
    (lambda d: d.update(rules={"table_rows": ["sparse", "tensor"]}), r"rules.table_rows: \['tensor'\] hold copies"),
    (lambda d: d.update(rules={"table_rows": "context"}), r"rules.table_rows: \['context'\] hold copies"),
    (lambda d: d["axes"].update(fsdp="2"), "axes.fsdp must be a positive integer, got '2'"),
    (lambda d: d["axes"].update(fsdp=2.0), "axes.fsdp must be a positive integer, got 2.0"),
    (lambda d: d.update(name=None), "name must be a non-empty string, got None"),
    (lambda d: d["hardware"].update(peak_bf16_flops=float("nan")), "hardware.peak_bf16_flops must be a positive"),
    (lambda d: d["hardware"].update(hbm_bandwidth=float("inf")), "hardware.hbm_bandwidth must be a positive"),
])
def test_bad_mesh_files_fail_naming_the_field(edit, message):
  with pytest.raises(MeshFileError, match=message):
    mesh_lib.parse(broken(edit), "bad.yaml")


def test_rules_override_and_unreadable_files(tmp_path):
  spec = mesh_lib.parse(broken(lambda d: d.update(rules={"table_rows": ["sparse", "fsdp"]})), "x")
  assert dict(spec.rules)["table_rows"] == ("sparse", "fsdp")
  with pytest.raises(MeshFileError, match="does not exist"):
    mesh_lib.load(tmp_path / "nope.yaml")
  (tmp_path / "bad.yaml").write_text("axes: [1, 2\n")
  with pytest.raises(MeshFileError, match="not valid YAML"):
    mesh_lib.load(tmp_path / "bad.yaml")
  (tmp_path / "twice.yaml").write_text("axes:\n  sparse: 2\n  replica: 1\n  sparse: 4\n")
  with pytest.raises(MeshFileError, match=r"(?s)twice.yaml: not valid YAML: .*key 'sparse' a second time \(first given "
                     r"at line 2\)"):
    mesh_lib.load(tmp_path / "twice.yaml")
  (tmp_path / "twice.yaml").write_text("axes: {sparse: 2, sparse: 4}\n")
  with pytest.raises(MeshFileError, match=r"key 'sparse' a second time \(first given at line 1\)"):
    mesh_lib.load(tmp_path / "twice.yaml")
