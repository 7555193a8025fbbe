"""The provider installer's parts: each prerequisite check against a host described as files
and command answers, the consented root step, the configuration file, and the systemd unit
(checked by systemd's own verifier)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from campugrid.agent import prereqs
from campugrid.agent.install import AgentConfig, scope_of
from campugrid.protocol.errors import InvalidInput


class Answers:
    """What each command prints on this imagined host."""

    def __init__(self, **by_command: tuple[int, str]) -> None:
        self.by_command = by_command

    def __call__(self, argv, **_):
        code, text = self.by_command.get(" ".join(argv[:3]), (127, "not found"))
        return SimpleNamespace(returncode=code, stdout=text, stderr="")


def host(tmp_path: Path, *, tools=("podman", "runsc", "skopeo"), subids=65536, v2=False,
         delegated=(), answers=None, systemd=True) -> prereqs.Host:
    (tmp_path / "subuid").write_text(f"someone:100000:65536\nada:200000:{subids}\n")
    (tmp_path / "subgid").write_text(f"ada:200000:{subids}\n")
    cg = tmp_path / "cgroup"
    cg.mkdir()
    if v2:
        (cg / "cgroup.controllers").write_text("cpu io memory pids\n")
    for c in delegated:
        (cg / c / "campugrid-ada").mkdir(parents=True)
    (tmp_path / "systemd").mkdir()
    return prereqs.Host(
        "ada", tmp_path / "home", cgroup=cg, subuid=tmp_path / "subuid",
        subgid=tmp_path / "subgid", linger=tmp_path / "linger",
        systemd=tmp_path / ("systemd" if systemd else "none"),
        run=answers or Answers(**{"podman --version": (0, "podman version 4.3.1"),
                                  "runsc --version": (0, "runsc version 0.0~20240729.0"),
                                  "podman info --format": (0, "overlay\n"),
                                  "podman image exists": (0, "")}),
        which=lambda t: f"/usr/bin/{t}" if t in tools else None)


def test_a_ready_host_passes_and_needs_no_root_step(tmp_path, monkeypatch):
    h = host(tmp_path, delegated=("memory", "cpu", "pids"))
    monkeypatch.setattr(prereqs, "_uid_or", lambda _h: (tmp_path / "cgroup").stat().st_uid)
    (tmp_path / "linger").mkdir()
    (tmp_path / "linger" / "ada").touch()
    checks = prereqs.check_all(h, tmp_path, nvml=_NoNvml())
    assert all(c.ok for c in checks if c.name != "free disk"), [c.line for c in checks]
    assert prereqs.root_step("ada", checks) == ""


def test_a_runsc_without_systrap_is_a_warning_with_the_way_to_a_newer_one(tmp_path):
    answers = Answers(**{"runsc --version": (0, "runsc version 0.0~20221219.0\nspec: 1.0.2-dev")})
    h = host(tmp_path, answers=answers)
    old = prereqs.runsc(h)
    assert not old.ok and not old.blocking and "ptrace" in old.found, old.line
    assert "bookworm-backports" in old.fix and "install Go 1.26" in old.fix, old.fix
    assert prereqs.pinned_runsc() in old.fix  # the gVisor prepare would build
    upstream = Answers(**{"runsc --version": (0, "runsc version release-20250106.0")})
    assert prereqs.runsc(dataclasses.replace(h, run=upstream)).ok
    built = Answers(**{"runsc --version": (0, "runsc version go-20260905-160fafc42237")})
    assert prereqs.runsc(dataclasses.replace(h, run=built)).ok
    assert prereqs.runsc_date("go-20260905-160fafc42237") == "20260905"


def test_where_go_is_here_the_root_step_builds_the_pinned_gvisor(tmp_path):
    """Go on the machine (on PATH, or where Go's archive puts it): a runsc older than the pin,
    or none, is built from gVisor's Go module by the root step (runsc-from-go.sh, which
    infra/setup.sh runs too); the pinned one passes."""
    pinned = prereqs.pinned_runsc()
    assert pinned.startswith("go-") and prereqs.runsc_date(pinned)
    build = f"bash {prereqs.RUNSC_FROM_GO}"
    for i, go in enumerate(("go", "/usr/local/go/bin/go")):
        (tmp_path / str(i)).mkdir()
        h = host(tmp_path / str(i), tools=("podman", "runsc", "skopeo", go))
        old = prereqs.runsc(h)  # Debian 12 backports' 2024 runsc
        assert (old.ok, old.blocking, old.root, old.fix) == (False, False, True, build), old.line
        assert f"older than gVisor {pinned}" in old.found
        assert prereqs.root_step("ada", [old]) == f"set -eu\n{build}\n"  # no apt-get for it
        current = Answers(**{"runsc --version": (0, f"runsc version {pinned}\nspec: 1.2.1")})
        assert prereqs.runsc(dataclasses.replace(h, run=current)).ok
    (tmp_path / "none").mkdir()
    none = host(tmp_path / "none", tools=("go",))
    missing = prereqs.runsc(none)
    assert (missing.ok, missing.blocking, missing.fix) == (False, True, build)
    # podman missing too: Debian's packages first (its runsc the fallback), then the build
    script = prereqs.root_step("ada", [prereqs.podman(none), missing])
    assert script == f"set -eu\napt-get install -y {' '.join(prereqs.PACKAGES)}\n{build}\n"
    assert prereqs.RUNSC_FROM_GO.stat().st_mode & 0o444  # shipped beside prereqs.py


def test_each_missing_piece_is_explained_with_its_fix_and_root_fixes_go_in_one_script(tmp_path):
    h = host(tmp_path, tools=(), subids=1000)
    checks = {c.name: c for c in prereqs.check_all(h, tmp_path, nvml=_NoNvml())}
    assert not checks["podman"].ok and checks["podman"].root and "apt-get install" in checks["podman"].fix
    assert not checks["runsc (gVisor)"].ok and "inside gVisor" in checks["runsc (gVisor)"].found
    assert not checks["subuid range"].ok and "1000 subordinate ids" in checks["subuid range"].found
    assert not checks["cgroup limits"].ok and not checks["cgroup limits"].blocking
    assert not checks["lingering"].ok and checks["lingering"].fix == "loginctl enable-linger ada"
    assert not checks["skopeo"].ok and not checks["skopeo"].blocking
    script = prereqs.root_step("ada", list(checks.values()), cgroup=tmp_path / "cgroup",
                               subuid=tmp_path / "subuid", subgid=tmp_path / "subgid")
    assert script.startswith("set -eu\napt-get install -y podman runsc uidmap slirp4netns skopeo")
    # the first range that overlaps nobody's (someone: 100000+65536, ada's own 200000+1000)
    assert "usermod --add-subuids 231072-296607 ada" in script
    assert "usermod --add-subgids 231072-296607 ada" in script
    assert f"mkdir -p {tmp_path}/cgroup/memory/campugrid-ada" in script
    assert f"chown -R ada: {tmp_path}/cgroup/pids/campugrid-ada" in script
    assert script.rstrip().endswith("loginctl enable-linger ada")


def test_cgroup_v2_needs_systemd_delegation_and_no_systemd_needs_no_lingering(tmp_path):
    h = host(tmp_path, v2=True, systemd=False)
    checks = {c.name: c for c in prereqs.check_all(h, tmp_path, nvml=_NoNvml())}
    assert "cgroup v2 without" in checks["cgroup limits"].found
    assert checks["lingering"].ok and "foreground" in checks["lingering"].found
    script = prereqs.root_step("ada", list(checks.values()), cgroup=tmp_path / "cgroup")
    assert "Delegate=cpu cpuset io memory pids" in script and "linger" not in script


def test_a_slow_storage_driver_is_said_with_its_fix(tmp_path):
    h = host(tmp_path, answers=Answers(**{"podman --version": (0, "podman version 4"),
                                          "podman info --format": (0, "vfs\n")}))
    check = prereqs.storage(h)
    assert not check.ok and not check.blocking and "vfs" in check.found
    assert 'driver = "overlay"' in check.fix and "podman system reset" in check.fix


class _NoNvml:
    def nvmlInit(self):
        raise RuntimeError("NVMLError_LibraryNotFound")


class _Nvml:
    def __init__(self, driver: str) -> None:
        self.driver = driver

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlSystemGetDriverVersion(self): return self.driver
    def nvmlDeviceGetCount(self): return 1


def test_gpus_need_a_runsc_with_nvproxy_that_lists_this_exact_driver(tmp_path):
    (tmp_path / "a").mkdir()
    old = host(tmp_path / "a", answers=Answers(**{"runsc flags": (0, "-debug\n-network\n")}))
    [_, no_nvproxy] = prereqs.gpus(old, _Nvml("550.90.12"))
    assert not no_nvproxy.ok and "no nvproxy" in no_nvproxy.found
    (tmp_path / "b").mkdir()
    listed = Answers(**{"runsc flags": (0, "-nvproxy\n"),
                        "runsc nvproxy list-supported-drivers": (0, "535.161.07\n550.90.12\n")})
    new = host(tmp_path / "b", answers=listed)
    [found, fine] = prereqs.gpus(new, _Nvml("550.90.12"))
    assert found.ok and "driver 550.90.12" in found.found and fine.ok
    [_, unknown] = prereqs.gpus(new, _Nvml("595.71.05"))
    assert not unknown.ok and "does not support driver 595.71.05" in unknown.found
    assert "'EOF'" in unknown.found
    [none] = prereqs.gpus(new, _NoNvml())
    assert none.ok and "CPU jobs only" in none.found


def test_the_configuration_file_round_trips_and_refuses_what_it_does_not_know(tmp_path):
    cfg = AgentConfig(state_dir=tmp_path / "state", name='pc "one"', shares={"pics": "/srv/p"},
                      gpus=("0", "GPU-x"), keep_free_mb=2048, protect=("steam", "blender"),
                      hours="22:00-07:00")
    path = tmp_path / "agent.toml"
    cfg.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert AgentConfig.load(path) == cfg
    assert AgentConfig.load(_write(tmp_path, 'gpus = "all"\n')).gpus is None
    for text, words in (('protet = ["steam"]\n', "did you mean 'protect'"),
                        ("keep_free_mb = -1\n", "0 or more"),
                        ('shares = "x"\n', "table of NAME"),
                        ("name = [\n", "not valid TOML")):
        with pytest.raises(InvalidInput, match=words):
            AgentConfig.load(_write(tmp_path, text))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "other.toml"
    path.write_text(text)
    return path


def test_the_scope_is_the_state_folders(tmp_path):
    assert scope_of(tmp_path) == scope_of(tmp_path / ".") != scope_of(tmp_path / "x")


def test_the_root_step_names_only_plain_user_names_and_quotes_paths(tmp_path):
    fail = [prereqs.Check("lingering", False, "off", root=True)]
    for name in ("ada; rm -rf /", "$(id)", "a b", "Ada", ""):
        with pytest.raises(ValueError, match="the root step handles names"):
            prereqs.root_step(name, fail)
    weird = tmp_path / "cg roups"
    weird.mkdir()
    script = prereqs.root_step("ada", [prereqs.Check("cgroup limits", False, "", root=True)],
                               cgroup=weird)
    assert f"mkdir -p '{weird}/memory/campugrid-ada'" in script
    undo = prereqs.undo_root_step("ada", cgroup=weird)
    assert f"find '{weird}/pids/campugrid-ada' -depth -type d -exec rmdir" in undo


def test_a_free_range_overlaps_no_one(tmp_path):
    (tmp_path / "u").write_text("a:100000:65536\nb:165536:65536\nbad line\n")
    (tmp_path / "g").write_text("c:300000:10\n")
    assert prereqs.free_range(tmp_path / "u", tmp_path / "g") == 231072
    assert prereqs.free_range(tmp_path / "none") == 100000


def test_a_missing_base_image_or_skopeo_is_a_warning_that_says_where_such_jobs_go(tmp_path):
    answers = Answers(**{"podman image exists": (1, "")})
    h = host(tmp_path, answers=answers, tools=("podman", "runsc"))
    base = prereqs.base_images(h, ["localhost/campugrid/python:bookworm"])
    assert not base.ok and not base.blocking and "infra/base-image.sh ada" in base.fix, base.line
    assert base.found == ("localhost/campugrid/python:bookworm missing: jobs built FROM it go "
                          "to other machines")
    assert prereqs.base_images(dataclasses.replace(
        h, run=Answers(**{"podman image exists": (0, "")})), ["a:1"]).ok
    assert prereqs.root_step("ada", [prereqs.skopeo(h)]) == "set -eu\napt-get install -y skopeo\n"
