"""The command line refuses with a reason, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

from campugrid.cli.seaweed import free_port
from campugrid.client import Identity
from campugrid.protocol import keys

CLI = [sys.executable, "-m", "campugrid.cli"]


def identity(tmp_path: Path) -> dict[str, str]:
    """An app identity of its own (for a coordinator that is not there)."""
    key_file = tmp_path / "app.key"
    keys.write_private(key_file, keys.Ed25519PrivateKey.generate())
    path = Identity("http://127.0.0.1:1", "app-id", "app", key_file).save(tmp_path / "app.json")
    return {**os.environ, "CAMPUGRID_IDENTITY": str(path)}


def test_an_unreachable_coordinator_is_an_error_not_a_traceback(tmp_path):
    out = subprocess.run([*CLI, "jobs", "--server", f"http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=60, env=identity(tmp_path))
    assert out.returncode == 2 and "cannot reach the coordinator" in out.stderr
    assert "Traceback" not in out.stderr


def test_without_an_identity_the_cli_says_how_to_get_one(tmp_path):
    env = {**os.environ, "CAMPUGRID_IDENTITY": str(tmp_path / "none.json")}
    out = subprocess.run([*CLI, "jobs"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no identity at" in out.stderr and "campugrid login" in out.stderr


def test_a_key_readable_by_others_is_refused(tmp_path):
    env = identity(tmp_path)
    (tmp_path / "app.key").chmod(0o644)
    out = subprocess.run([*CLI, "jobs"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "readable by others" in out.stderr


def test_a_bad_spec_file_is_refused_before_anything_is_sent(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    for name, content in (("list.json", json.dumps([1])), ("bin.json", b"\xff\xfe"),
                          ("typo.json", json.dumps({"comand": "x"}))):
        spec = tmp_path / name
        spec.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = subprocess.run([*CLI, "submit", str(tmp_path), "--spec", str(spec), "--server",
                              f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                             timeout=60, env=identity(tmp_path))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("error: ")


# --- shell completion -----------------------------------------------------------------------

SCRIPT = Path(sys.executable).parent / "campugrid"  # the console script, as users run it


def complete(words: str, cword: int) -> list[str]:
    env = {**os.environ, "_CAMPUGRID_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(cword)}
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_completion_offers_commands_subcommands_and_options():
    assert complete("campugrid ma", 1) == ["machines"]
    assert complete("campugrid machines ap", 2) == ["approve"]
    assert "--spec" in complete("campugrid submit --sp", 2)
    assert "--json" in complete("campugrid status --j", 2)


def test_the_bash_script_it_installs_completes_in_a_real_bash():
    script = ('eval "$(campugrid --show-completion bash)"; COMP_WORDS=(campugrid ma); COMP_CWORD=1; '
              '_campugrid_completion campugrid; printf "%s\\n" "${COMPREPLY[@]}"')
    env = {**os.environ, "PATH": f"{SCRIPT.parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["machines"], out


def test_help_offers_to_install_completion():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0
    assert "--install-completion" in out.stdout and "--show-completion" in out.stdout


# --- --json ---------------------------------------------------------------------------------

JSON_COMMANDS = (["submit", "."], ["status", "j"], ["logs", "j"], ["shards", "j"], ["cancel", "j"],
                 ["jobs"], ["output", "j", "-o", "out.tgz"], ["login", "http://x", "--invite", "c"],
                 ["apps"], ["apps", "invite", "n"], ["apps", "revoke", "n"], ["machines"],
                 ["machines", "invite"], ["machines", "approve", "m"], ["machines", "revoke", "m"],
                 ["agent", "join", "h:1", "--pin", "p"], ["provider", "status"])


def test_every_command_that_prints_takes_json():
    from typer.testing import CliRunner

    from campugrid.cli.main import app

    runner = CliRunner()
    for command in JSON_COMMANDS:
        out = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
        assert out.exit_code == 0 and "--json" in out.output, (command, out.output)


def test_with_json_an_error_is_still_an_error_on_stderr_and_nothing_on_stdout(tmp_path):
    for command in (["jobs"], ["status", "j"], ["output", "j", "-o", str(tmp_path / "o.tgz")],
                    ["logs", "j", "--follow"]):
        out = subprocess.run([*CLI, *command, "--json", "--server", f"http://127.0.0.1:{free_port()}"],
                             capture_output=True, text=True, timeout=60, env=identity(tmp_path))
        assert out.returncode == 2 and out.stdout == "", (command, out)
        assert out.stderr.startswith("error: ") and "cannot reach the coordinator" in out.stderr


def test_output_to_a_folder_that_is_not_there_says_what_to_do(tmp_path):
    out = subprocess.run([*CLI, "output", "j", "-o", str(tmp_path / "no" / "o.tgz"), "--server",
                          f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=60, env=identity(tmp_path))
    assert out.returncode == 2 and "does not exist; create it or save elsewhere" in out.stderr


def test_the_agents_poll_interval_must_be_a_positive_number_of_seconds(tmp_path):
    from campugrid.agent.worker import AgentSettings

    for flag, value, env in (("--poll-seconds", "0", {}), ("--poll-seconds", "nan", {}),
                             ("--poll-seconds", "3601", {}),
                             (None, "-1", {"CAMPUGRID_AGENT_POLL_SECONDS": "-1"})):
        argv = [*CLI, "agent", "run", "--state-dir", str(tmp_path / "agent")]
        out = subprocess.run([*argv, flag, value] if flag else argv, capture_output=True,
                             text=True, timeout=60, env={**os.environ, **env})
        assert out.returncode == 2 and "Traceback" not in out.stderr, (value, out.stderr)
        says = f"error: --poll-seconds {float(value)}: must be a number of seconds above 0"
        assert says in out.stderr and "at most 3600" in out.stderr, out.stderr
        assert not (tmp_path / "agent").exists()  # refused before anything was made
    assert AgentSettings("c:1", tmp_path, "m").poll_seconds == 1.0  # the product's default
    assert AgentSettings("c:1", tmp_path, "m", poll_seconds=0.2).poll_seconds == 0.2


def test_a_jobs_text_gives_its_reason_once_with_its_lines_and_no_exit_for_no_process():
    from campugrid.cli.show import job_text

    reason = "build failed: RUN exited 4; last lines of the build log:\nSTEP 2/2\nboom"
    text = job_text({"id": "abc", "name": "t", "state": "failed", "attempt": 1,
                      "max_attempts": 3, "reason": reason, "exit_code": -1,
                      "events": [{"at": "2026-12-05T08:00:00", "attempt": 1, "kind": "failed",
                                  "detail": reason}]})
    assert text.count("boom") == 1 and "STEP 2/2" in text
    assert "reason   build failed: RUN exited 4; last lines of the build log:\n" \
           "         STEP 2/2\n         boom" in text
    assert "exit" not in text.replace("exited", "")
    assert text.endswith("#1  failed         build failed: RUN exited 4; last lines of the "
                         "build log: (…)")


def test_sizes_read_as_people_read_them():
    from campugrid.cli.follow import _news_text, size_text

    assert [size_text(n) for n in (812, 10 * 1024 + 200, 126_353_408, 5 * 1024**3)] == [
        "812 bytes", "10.2 KB", "120.5 MB", "5.0 GB"]
    assert _news_text({"kind": "checkpoint", "detail": "epoch 3, 10445 bytes"}) == \
        "checkpoint epoch 3 saved (10.2 KB)"


def test_a_sharded_jobs_results_table_has_a_column_per_key_its_results_have():
    from types import SimpleNamespace

    from campugrid.console.jobs import _result_keys

    shards = [SimpleNamespace(result={"loss": 0.1, "lr": 3e-4}), SimpleNamespace(result=None),
              SimpleNamespace(result='{"acc": 0.9, "loss": 0.2}'), SimpleNamespace(result=7)]
    assert _result_keys(shards) == ["loss", "lr", "acc"]
    assert _result_keys([SimpleNamespace(result=[1, 2])]) == []  # not objects: one column
