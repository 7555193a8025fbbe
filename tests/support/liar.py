"""A dishonest provider for tests: the real agent, run as the provider user, lying in one
chosen way. Run as a program in place of `python -m campugrid.cli`:

    python tests/support/liar.py --lie output agent run --state-dir ... --name ...

The lies (what a provider who owns its machine can make its agent do):
    result  the result line it reports is not the one the job printed
    output  one byte of the job's /output is changed before the archive is packed

Nothing here is reachable from an installed agent: the switch is this file's argument, and
the file lives in tests/.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

LIES = ("result", "output")


def lie_about(lie: str) -> None:
    from campugrid.agent import client, task

    if lie == "result":
        honest_complete = client.CoordinatorClient.complete

        def complete(self, hold, outcome):  # type: ignore[no-untyped-def]
            import dataclasses
            outcome = dataclasses.replace(outcome, result=f"{outcome.result or ''} (a lie)")
            return honest_complete(self, hold, outcome)

        client.CoordinatorClient.complete = complete  # type: ignore[method-assign]
    elif lie == "output":
        honest_upload = task._upload_output

        def upload(url: str, output_dir: Path, tarball: Path):  # type: ignore[no-untyped-def]
            with tempfile.TemporaryDirectory() as tmp:
                forged = Path(tmp) / "output"
                shutil.copytree(output_dir, forged, symlinks=True)
                first = min(p for p in forged.rglob("*") if p.is_file() and not p.is_symlink())
                data = bytearray(first.read_bytes() or b"\0")
                data[0] ^= 1
                first.write_bytes(bytes(data))
                return honest_upload(url, forged, tarball)

        task._upload_output = upload


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--lie" or argv[1] not in LIES:
        sys.exit(f"usage: liar.py --lie {{{','.join(LIES)}}} <campugrid arguments>")
    lie_about(argv[1])
    from campugrid.cli.main import app

    sys.argv = ["campugrid", *argv[2:]]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
