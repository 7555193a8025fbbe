import re

import pytest

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import LIMITS, JobSpec, limits_mask


def test_defaults_and_round_trip():
    spec = JobSpec.from_dict({"command": ["python3", "train.py"], "env": {"SEED": "1"},
                              "resources": {"memory_mb": 2048}, "client_job_id": "run-1",
                              "datasets": [{"name": "mnist", "uri": "s3://data/mnist/"}]})
    assert spec.resources.memory_mb == 2048 and spec.resources.cpus == 1.0
    assert spec.max_attempts == 3
    assert JobSpec.from_json(spec.to_json()) == spec


def test_every_kind_of_dataset_reference_round_trips_and_names_its_content():
    spec = JobSpec.from_dict({"datasets": [
        {"name": "one", "uri": "s3://data/w.bin", "sha256": "a" * 64},
        {"name": "many", "uri": "s3://data/mnist/", "sha256": {"train.csv": "b" * 64,
                                                                "sub/test.csv": "c" * 64}},
        {"name": "mine", "ticket": "upl_" + "t" * 32},
        {"name": "theirs", "share": "imagenet", "sha256": {"val/x.jpg": "d" * 64}},
        {"name": "old", "uri": "s3://data/legacy/"},  # as stored before contents were pinned
    ]})
    assert JobSpec.from_json(spec.to_json()) == spec
    assert [d.pinned() for d in spec.datasets] == [True, True, True, True, False]
    assert spec.share == "imagenet"
    assert dict(spec.datasets[1].sha256) == {"train.csv": "b" * 64, "sub/test.csv": "c" * 64}


def test_required_limits_are_kept_in_one_order_and_only_when_set():
    spec = JobSpec.from_dict({"resources": {"require_limits": ["sandbox_seccomp", "memory",
                                                               "memory"]}})
    assert spec.resources.require_limits == ("memory", "sandbox_seccomp")
    assert JobSpec.from_json(spec.to_json()) == spec
    assert limits_mask(spec.resources.require_limits) == (
        1 << LIMITS.index("memory") | 1 << LIMITS.index("sandbox_seccomp"))
    # A spec that requires none is stored exactly as before the field existed.
    assert "require_limits" not in JobSpec.from_dict({}).to_dict()["resources"]


def test_string_command_runs_through_a_shell():
    assert JobSpec.from_dict({"command": "echo hi"}).command == ("sh", "-c", "echo hi")


@pytest.mark.parametrize(("raw", "says"), [
    ({"comand": ["x"]}, "unknown field 'comand' (did you mean 'command'?)"),
    ({"command": []}, "command: must be a string or a list"),
    ({"command": ["ok", 3]}, "command[1]"),
    ({"env": {"1BAD": "x"}}, "env.1BAD"),
    ({"env": {"CAMPUGRID_JOB_ID": "x"}}, "reserved for the platform"),
    ({"resources": {"memory_mb": 10}}, "resources.memory_mb: must be an integer from 64"),
    ({"resources": {"memory_mb": True}}, "resources.memory_mb"),
    ({"resources": {"gpu": 1}}, "did you mean 'gpus'"),
    ({"max_attempts": 0}, "max_attempts: must be an integer from 1 to 50"),
    ({"datasets": [{"name": "d", "uri": "http://x/y"}]}, "datasets[0].uri: must be s3://"),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a/../../etc"}]}, "may not start with / or contain a .."),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a"}, {"name": "d", "uri": "s3://bkt/b"}]},
     "'d' is used twice"),
    ({"datasets": [{"name": "../x", "uri": "s3://bkt/a"}]}, "datasets[0].name"),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a", "sha256": "A" * 64}]}, "64 lowercase hex"),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a/", "sha256": "a" * 64}]},
     "for a prefix: an object {path: sha256}"),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a/", "sha256": {"x/../../y": "a" * 64}}]},
     "is not a path under the prefix"),
    ({"datasets": [{"name": "d", "uri": "s3://bkt/a/", "sha256": {"x//y": "a" * 64}}]},
     "is not a path under the prefix"),
    ({"datasets": [{"name": "d", "ticket": "upl_" + "x" * 20, "sha256": "a" * 64}]},
     "give a ticket alone"),
    ({"datasets": [{"name": "d", "ticket": "../../etc"}]}, "must be an upload ticket"),
    ({"datasets": [{"name": "d", "share": "s", "sha256": {"/etc/passwd": "a" * 64}}]},
     "is not a path under the share"),
    ({"datasets": [{"name": "d", "share": "../s", "sha256": {"a": "a" * 64}}]},
     "datasets[0].share"),
    ({"datasets": [{"name": "d", "share": "s"}]}, "for a share: an object {path: sha256}"),
    ({"datasets": [{"name": "a", "share": "s", "sha256": {"a": "a" * 64}},
                   {"name": "b", "share": "t", "sha256": {"a": "a" * 64}}]}, "files of one share only"),
    ({"client_job_id": "has space"}, "client_job_id"),
    ({"resources": {"require_limits": ["memroy"]}},
     "resources.require_limits: no limit 'memroy' (did you mean 'memory'?)"),
    ({"resources": {"require_limits": "memory"}}, "resources.require_limits: must be a list"),
    ({"resources": {"require_limits": [1]}}, "resources.require_limits: must be a list"),
    ([], "spec: must be a JSON object"),
])
def test_refusals_name_the_field(raw, says):
    with pytest.raises(InvalidInput) as err:
        JobSpec.from_dict(raw)
    assert says in str(err.value)


def test_invalid_json_is_refused_with_the_parser_message():
    with pytest.raises(InvalidInput, match="spec: not valid JSON"):
        JobSpec.from_json("{nope")


def test_absurdly_nested_json_is_refused_not_crashed():
    with pytest.raises(InvalidInput, match="nested too deeply"):
        JobSpec.from_json("[" * 100000 + "]" * 100000)


def test_shards_are_validated_and_kept_apart_from_the_stored_spec():
    spec = JobSpec.from_dict({"command": ["python3", "s.py"], "shard_mode": "serve",
                              "shards": [{"payload": {"lr": 0.1}, "cost": 4},
                                         {"payload": [1, "two"]}]})
    assert [s.payload for s in spec.shards] == [{"lr": 0.1}, [1, "two"]]
    assert [s.cost for s in spec.shards] == [4.0, 1.0]
    assert JobSpec.from_json(spec.to_json()) == spec
    stored = JobSpec.from_json(spec.without_shards().to_json())
    assert stored.shards == () and stored.shard_mode == "serve"
    other = JobSpec.from_dict({"command": ["python3", "s.py"], "shard_mode": "serve",
                               "shards": [{"payload": {"lr": 0.1}, "cost": 4},
                                          {"payload": [1, "three"]}]})
    assert spec.shards_sha256 != other.shards_sha256
    assert spec.without_shards().to_json() == other.without_shards().to_json()


@pytest.mark.parametrize(("raw", "says"), [
    ({"shards": [{"payload": 1}]}, "command: a sharded job needs a command"),
    ({"command": ["x"], "shards": {"a": 1}}, "shards: must be a list of 1 to"),
    ({"command": ["x"], "shards": [{"payload": 1}, 7]}, "shards[1]: must be an object"),
    ({"command": ["x"], "shards": [{"payload": 1, "weight": 2}]},
     "shards[0]: unknown field 'weight'"),
    ({"command": ["x"], "shards": [{"payload": 1, "cost": 0}]}, "shards[0].cost"),
    ({"command": ["x"], "shards": [{"payload": "x" * 70_000}]}, "shards[0].payload: at most 64 KiB"),
    ({"command": ["x"], "shards": [{"payload": 1}], "shard_mode": "threads"},
     "shard_mode: must be one of process, serve"),
])
def test_bad_shards_are_refused_with_the_field(raw, says):
    with pytest.raises(InvalidInput) as e:
        JobSpec.from_dict(raw)
    assert says in str(e.value)


def test_a_spec_takes_plain_values_as_json_has_them_and_checks_them_alike():
    spec = JobSpec(command=["python3", "train.py"], env={"SEED": "1"},
                   resources={"memory_mb": 4096, "cpus": 2}, build={"network": "none"})
    assert spec == JobSpec.from_dict({"command": ["python3", "train.py"], "env": {"SEED": "1"},
                                      "resources": {"memory_mb": 4096, "cpus": 2},
                                      "build": {"network": "none"}})
    assert spec.resources.memory_mb == 4096 and spec.build.network == "none"
    ds = {"name": "d", "uri": "s3://bucket/k", "sha256": "a" * 64}
    assert JobSpec(datasets=(ds,)).datasets == JobSpec(datasets=[ds]).datasets  # a tuple too
    with pytest.raises(InvalidInput, match="did you mean 'memory_mb'"):
        JobSpec(resources={"memry_mb": 1})
    with pytest.raises(InvalidInput, match="CAMPUGRID_ are reserved"):
        JobSpec(env={"CAMPUGRID_X": "1"})


@pytest.mark.parametrize(("verify", "message"), [
    ({"replicas": 1}, "one replica and no checkpoints checked verify nothing"),
    ({"checkpoints": 0}, "one replica and no checkpoints checked verify nothing"),
    ({"replicas": 17}, "verify.replicas: must be an integer from 1 to 16"),
    ({"replicas": 2, "quorum": 3}, "verify.quorum: must be an integer from 2 to 2"),
    ({"replicas": 3, "max_replicas": 2}, "verify.max_replicas: must be an integer from 3 to 16"),
    ({"replica": 2}, "did you mean 'replicas'"),
    ("always", 'verify: must be "adaptive" or an object'),
    ({"adaptive": True, "replicas": 3}, 'give "adaptive" alone'),
    ({"checkpoints": 1.5}, "verify.checkpoints: must be a number from 0.0 to 1.0"),
    ({"checkpoints": "all"}, "verify.checkpoints: must be a number"),
    ({"checkpoints": 0.5, "replicas": 1, "quorum": 2}, "one replica has no quorum"),
])
def test_verify_is_checked_field_by_field(verify, message):
    with pytest.raises(InvalidInput, match=re.escape(message)):
        JobSpec.from_dict({"verify": verify})


def test_a_verified_spec_round_trips_and_runs_a_verified_image_unless_it_says_otherwise():
    for given in ({"replicas": 3, "quorum": 2}, "adaptive"):
        spec = JobSpec.from_dict({"verify": given, "shards": [{"payload": 1}], "command": "x"})
        assert JobSpec.from_json(spec.to_json()) == spec and spec.image.reuse == "verified"
        assert spec.as_replica().verify is None and spec.as_replica().image.reuse == "verified"
        assert JobSpec(verify=given).image.reuse == "verified"
    first = JobSpec.from_dict({"verify": {"replicas": 2}, "image": {"reuse": "first"}})
    assert JobSpec.from_json(first.to_json()).image.reuse == "first"
    assert JobSpec.from_dict({}).verify is None and "verify" not in JobSpec().to_dict()


def test_checkpoints_alone_run_the_job_once_and_round_trip():
    alone = JobSpec.from_dict({"verify": {"checkpoints": 0.25}})
    assert alone.verify is not None and not alone.verify.replicated
    assert (alone.verify.replicas, alone.verify.quorum, alone.verify.checkpoints) == (1, 1, 0.25)
    both = JobSpec.from_dict({"verify": {"replicas": 3, "checkpoints": 1}})
    assert both.verify is not None and both.verify.replicated and both.verify.quorum == 2
    for spec in (alone, both):
        assert JobSpec.from_json(spec.to_json()) == spec
    off = JobSpec.from_dict({"verify": {"replicas": 2, "checkpoints": 0}})
    assert off.verify is not None and off.verify.checkpoints == 0 and off.verify.replicated
    compared = JobSpec.from_dict({"verify": {"replicas": 2, "compare": "python3 cmp.py"}})
    assert compared.verify is not None
    assert compared.verify.compare == ("sh", "-c", "python3 cmp.py")
    assert JobSpec.from_json(compared.to_json()) == compared
    tolerant = JobSpec.from_dict({"verify": {"checkpoints": 0.5, "compare": ["./cmp"]}})
    assert tolerant.verify is not None and tolerant.verify.compare == ("./cmp",)
    assert not tolerant.verify.replicated
    for bad, message in (({"replicas": 2, "compare": []}, "verify.compare: must be a string"),
                         ({"replicas": 1, "compare": "x"}, "verify nothing"),
                         ({"adaptive": True, "compare": "x"}, 'give "adaptive" alone')):
        with pytest.raises(InvalidInput, match=re.escape(message)):
            JobSpec.from_dict({"verify": bad})
    with pytest.raises(InvalidInput, match="compare is for a job's replicas"):
        JobSpec.from_dict({"verify": {"replicas": 2, "compare": "x"}, "shards": [{"payload": 1}],
                           "command": "x"})
    with pytest.raises(InvalidInput, match="a sharded job keeps no checkpoints"):
        JobSpec.from_dict({"verify": {"checkpoints": 0.5}, "shards": [{"payload": 1}],
                           "command": "x"})


def test_a_folder_the_jobs_own_code_checkpoints_to_is_checked_and_round_trips():
    spec = JobSpec.from_dict({"checkpoints": {"dir": "/app//outputs/./", "match": "step_*.pt"}})
    assert spec.checkpoints is not None
    assert (spec.checkpoints.dir, spec.checkpoints.match) == ("/app/outputs", "step_*.pt")
    assert JobSpec.from_json(spec.to_json()) == spec
    assert JobSpec.from_dict({"checkpoints": {"dir": "/app/outputs"}}).checkpoints.match == "*"
    assert "checkpoints" not in JobSpec().to_dict()  # stored specs stay as they were
    for bad, message in (
            ("outputs", "checkpoints: must be an object"),
            ({"dir": "outputs"}, "checkpoints.dir: must be an absolute path"),
            ({"dir": "/"}, "checkpoints.dir: must be an absolute path"),
            ({"dir": "/./"}, "checkpoints.dir: / cannot be the checkpoint folder"),
            ({"dir": "/tmp"}, "checkpoints.dir: /tmp cannot be"),
            ({"dir": "/output/ckpt"}, "checkpoints.dir: /output/ckpt is the platform's"),
            ({"dir": "/app/../checkpoints"}, "checkpoints.dir: /checkpoints is the platform's"),
            ({"dir": "/opt/campugrid/hooks"}, "is the platform's"),
            ({"dir": "/app/a:b"}, "checkpoints.dir: must be an absolute path"),
            ({"dir": "/app/a,b"}, "checkpoints.dir: must be an absolute path"),
            ({"dir": "/app", "match": "a/b"}, "checkpoints.match: must be a file name pattern"),
            ({"dir": "/app", "every": 10}, "checkpoints: unknown field 'every'")):
        with pytest.raises(InvalidInput, match=re.escape(message)):
            JobSpec.from_dict({"checkpoints": bad})
    with pytest.raises(InvalidInput, match="a sharded job keeps no checkpoints"):
        JobSpec.from_dict({"checkpoints": {"dir": "/app/o"}, "shards": [{"payload": 1}],
                           "command": "x"})
