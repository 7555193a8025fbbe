"""A dishonest provider for tests: the real agent, run as the provider user, lying in one
chosen way. Run as a program in place of `python -m campugrid.cli`:

    python tests/support/liar.py --lie output agent run --state-dir ... --name ...

The lies (what a provider who owns its machine can make its agent do), one or several
(`--lie output,shards`; a wrong result line is the store tests' case):
    output       one byte of the job's /output is changed before the archive is packed
    shards       each shard's result it reports is another value (a number plus one)
    checkpoints  from epoch 1 on, one byte of each checkpoint is changed, and its manifest
                 rewritten to match (epoch 0 stays honest: the job has one to go back to)
    image        the image it pushes for other machines under a build's key is not its build:
                 it adds /answer.txt saying 43 (the tests' jobs answer with that file); its
                 own tasks run its honest build

Nothing here is reachable from an installed agent: the switch is this file's argument, and
the file lives in tests/.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

LIES = ("output", "shards", "checkpoints", "image")


def lie_about(lie: str) -> None:
    from campugrid.agent import client, transfers

    if lie == "output":
        honest_upload = transfers.upload_output

        def upload(url: str, output_dir: Path, tarball: Path):  # type: ignore[no-untyped-def]
            with tempfile.TemporaryDirectory() as tmp:
                forged = Path(tmp) / "output"
                shutil.copytree(output_dir, forged, symlinks=True)
                first = min(p for p in forged.rglob("*") if p.is_file() and not p.is_symlink())
                data = bytearray(first.read_bytes() or b"\0")
                data[0] ^= 1
                first.write_bytes(bytes(data))
                return honest_upload(url, forged, tarball)

        transfers.upload_output = upload
    elif lie == "shards":
        honest_next = client.CoordinatorApi.next_shard

        def next_shard(self, hold, done):  # type: ignore[no-untyped-def]
            import dataclasses
            import json
            if done is not None and done.succeeded and done.result_json:
                value = json.loads(done.result_json)
                forged = value + 1 if isinstance(value, (int, float)) else [value, "a lie"]
                done = dataclasses.replace(done, result_json=json.dumps(forged))
            return honest_next(self, hold, done)

        client.CoordinatorApi.next_shard = next_shard  # type: ignore[method-assign]
    elif lie == "checkpoints":
        from campugrid import hooks
        from campugrid.agent import checkpoints

        honest_checkpoint = checkpoints.CheckpointUploader._upload

        def upload_checkpoint(self, epoch: int, path: Path):  # type: ignore[no-untyped-def]
            if epoch >= 1:  # `path` is the agent's own copy, checked against its manifest
                import json
                manifest = json.loads((path / hooks.MANIFEST).read_text())
                name = sorted(manifest["files"])[0]
                data = bytearray((path / name).read_bytes() or b"\0")
                data[-1] ^= 1
                (path / name).write_bytes(bytes(data))
                manifest["files"][name] = {"size": len(data),
                                           "sha256": hooks.sha256_file(path / name)}
                (path / hooks.MANIFEST).write_text(json.dumps(manifest, indent=1,
                                                              sort_keys=True))
            return honest_checkpoint(self, epoch, path)

        checkpoints.CheckpointUploader._upload = upload_checkpoint  # type: ignore[method-assign]
    elif lie == "image":
        import subprocess

        from campugrid.agent import images
        from campugrid.protocol.errors import SandboxError

        honest_push = images.ImageCache.push

        def push(self, image, registry, repository, tag, token, work, *, cancel):  # type: ignore[no-untyped-def]
            # COPY only: nothing of the job runs outside its sandbox to make the forgery.
            (work / "lie").mkdir(exist_ok=True)
            (work / "lie" / "answer.txt").write_text("43\n")
            forged = f"{image}-forged"
            why = ""
            for _ in range(3):  # a busy machine's podman may fail once; a liar tries again
                try:
                    made = subprocess.run(["podman", "build", "--pull=never", "--timestamp",
                                           "0", "-t", forged, "-f", "-", str(work / "lie")],
                                          input=f"FROM {image}\nCOPY answer.txt /answer.txt\n",
                                          text=True, capture_output=True, timeout=120)
                except subprocess.TimeoutExpired:
                    why = "podman build took over 120 s"
                    continue
                if made.returncode == 0:
                    break
                why = made.stderr[-2000:]
            else:  # shown in the job's log by the agent's _share
                raise SandboxError(f"the liar's forgery failed: {why}")
            return honest_push(self, forged, registry, repository, tag, token, work,
                               cancel=cancel)

        images.ImageCache.push = push  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    lies = argv[1].split(",") if len(argv) >= 2 and argv[0] == "--lie" else []
    if not lies or not set(lies) <= set(LIES):
        sys.exit(f"usage: liar.py --lie {{{','.join(LIES)}}}[,...] <campugrid arguments>")
    for lie in lies:
        lie_about(lie)
    from campugrid.cli.main import app

    sys.argv = ["campugrid", *argv[2:]]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
