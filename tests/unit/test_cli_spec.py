"""`--spec FILE` in YAML or JSON: the same spec either way, and every YAML trick refused with
its line and column before anything is sent."""

import json
from pathlib import Path

import pytest

from campugrid.cli import specfile
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import MAX_SPEC_BYTES, JobSpec

SPEC = {
    "name": "sweep 2024-01-01",
    "command": ["python3", "train.py", "--lr", "0.1", "="],
    "env": {"MODE": "fast", "SEED": "7"},
    "resources": {"cpus": 2.5, "memory_mb": 2048, "gpus": 1, "gpu_memory_mb": 8000,
                  "gpu_kinds": ["nvidia"]},
    "max_attempts": 2,
    "shards": [{"payload": {"lr": 0.1}}, {"payload": ["b", None], "cost": 2}],
    "shard_mode": "process",
}
YAML = """\
# the same spec as SPEC, the way a person writes it
name: sweep 2024-01-01
command: [python3, train.py, --lr, "0.1", "="]
env:
  MODE: fast
  SEED: "7"
resources:
  cpus: 2.5
  memory_mb: 2048
  gpus: 1
  gpu_memory_mb: 8000
  gpu_kinds:
    - nvidia
max_attempts: 2
shards:
  - payload: {lr: 0.1}
  - {payload: [b, null], cost: 2}
shard_mode: process
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["job.yaml", "job.yml", "job.spec"])
def test_a_yaml_spec_is_the_same_spec_as_its_json_twin(tmp_path, name):
    twin = specfile.load(write(tmp_path, "job.json", json.dumps(SPEC)))
    data = specfile.load(write(tmp_path, name, YAML))
    assert data == twin == SPEC  # dates and "=" stay strings; numbers stay numbers
    assert JobSpec.from_dict(data) == JobSpec.from_dict(twin)
    assert JobSpec.from_dict(data).to_json() == JobSpec.from_json(json.dumps(SPEC)).to_json()


def test_a_json_spec_without_the_json_suffix_is_read_as_json(tmp_path):
    assert specfile.load(write(tmp_path, "spec.txt", json.dumps(SPEC))) == SPEC


def refused(path: Path, *words: str) -> str:
    with pytest.raises(InvalidInput) as e:
        specfile.load(path)
    message = str(e.value)
    for w in words:
        assert w in message, message
    return message


def test_anchors_and_aliases_are_refused_with_where(tmp_path):
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    refused(write(tmp_path, "laughs.yaml", laughs), "laughs.yaml:1:4", "anchors and aliases")
    # an alias alone (to an anchor nowhere) is refused as an alias, not as a missing anchor
    refused(write(tmp_path, "alias.yaml", "name: ok\ncommand: *x\n"), "alias.yaml:2:10",
            "anchors and aliases")
    # a merge key without an alias
    refused(write(tmp_path, "merge.yaml", "resources:\n  <<: {cpus: 2}\n"), "merge.yaml:2:3",
            "merge keys")


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    refused(write(tmp_path, "dup.yaml", "name: a\nenv:\n  X: '1'\n  X: '2'\n"),
            "dup.yaml:4:3", "'X' is given twice (first on line 3)")
    refused(write(tmp_path, "dup.json", '{"name": "a", "name": "b"}'), "'name' is given twice")


def test_keys_that_are_not_strings_are_refused(tmp_path):
    refused(write(tmp_path, "int.yaml", "env:\n  1: x\n"), "int.yaml:2:3", "the key 1 is not a string")
    refused(write(tmp_path, "bool.yaml", "env:\n  on: x\n"), "bool.yaml:2:3", "the key True")
    refused(write(tmp_path, "null.yaml", "~: x\n"), "null.yaml:1:1", "the key None")


def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path):
    refused(write(tmp_path, "list.yaml", "\n- a\n- b\n"), "list.yaml:2:1", "must be a mapping")
    refused(write(tmp_path, "scalar.yaml", "just words\n"), "scalar.yaml:1:1", "must be a mapping")
    refused(write(tmp_path, "empty.yaml", "# nothing\n"), "empty.yaml", "must be a mapping")
    refused(write(tmp_path, "list.json", "[1]"), "must be a JSON object")


def test_values_json_has_no_kind_of_are_refused(tmp_path):
    refused(write(tmp_path, "bin.yaml", "name: !!binary aGVsbG8=\n"), "bin.yaml:1:7", "binary value")
    refused(write(tmp_path, "obj.yaml", "name: !!python/object:os.system x\n"), "obj.yaml:1:7",
            "python/object:os.system value is not allowed")


def test_a_spec_over_the_size_limit_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.write("name: x\n")
        f.truncate(MAX_SPEC_BYTES + 1)
    refused(big, "larger than 16 MiB")
    # at the limit it is read (and then refused only for what it holds)
    edge = tmp_path / "edge.yaml"
    edge.write_text("name: x\n" + "#" * (MAX_SPEC_BYTES - 9) + "\n")
    assert specfile.load(edge) == {"name": "x"}


def test_broken_yaml_json_and_text_say_where(tmp_path):
    refused(write(tmp_path, "bad.yaml", "name: x\ncommand: [a, b\n"), "bad.yaml:3:1", "not valid YAML")
    refused(write(tmp_path, "bad.json", '{"name": "x",\n "command": }'), "bad.json:2:13", "not valid JSON")
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\xfe\n")
    refused(tmp_path / "bin.yaml", "not UTF-8", "save it as UTF-8")
    refused(write(tmp_path, "two.yaml", "name: a\n---\nname: b\n"), "two.yaml:2:1", "not valid YAML")
    refused(tmp_path / "missing.yaml", "cannot read the spec", "missing.yaml")
