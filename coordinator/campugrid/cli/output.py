"""How the CLI prints: human text or `--json` on stdout (one document; JSON Lines where a
command streams), and progress bars and a phase line on stderr, only where stderr is a
terminal and no JSON was asked for, so that stdout stays clean for scripts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, NoReturn

import typer

from campugrid.client.api import Progress
from campugrid.protocol.logs import configure as configure_logging

Json = Annotated[bool, typer.Option(
    "--json", help="Print JSON, for scripts: one document (JSON Lines where the command "
                   "streams), nothing else on stdout; no progress bars.")]
LogFormat = Annotated[str, typer.Option(
    "--log-format", envvar="CAMPUGRID_LOG_FORMAT",
    help="How to log: text, or json (one object per line, for a log system). Lines about a "
         "job name its id and attempt either way.")]


def fail(message: str) -> NoReturn:
    """The command failed: say why on stderr, exit with status 2."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def log_as(fmt: str = "text") -> None:
    """Log in `fmt` (LogFormat), and have the processes we start do the same."""
    try:
        configure_logging(fmt)
    except ValueError as e:
        fail(f"--log-format: {e}")
    os.environ["CAMPUGRID_LOG_FORMAT"] = fmt  # for the processes we start (up's agent)


def emit(as_json: bool, data: Any, text: str) -> None:
    """The command's one result: `data` as a JSON document, or `text` for people."""
    if as_json:
        typer.echo(json.dumps(data, indent=1))
    elif text:
        typer.echo(text)


def emit_line(as_json: bool, data: Any, text: str) -> None:
    """One item of a stream: a JSON Lines object, or `text` (lines) for people."""
    if as_json:
        typer.echo(json.dumps(data, separators=(",", ":")))
    elif text:
        typer.echo(text)


def emit_array(items: Iterable[Any]) -> None:
    """A JSON array written as its items come (a long, paged list is never held whole)."""
    typer.echo("[", nl=False)
    for i, item in enumerate(items):
        typer.echo(("," if i else "") + "\n" + json.dumps(item), nl=False)
    typer.echo("\n]")


def interactive(as_json: bool) -> bool:
    """Whether to draw on stderr: a person is watching it, and no script reads stdout."""
    return not as_json and sys.stderr.isatty()


class Transfers:
    """Progress bars on stderr, one per transfer (`bar(label)` is its Progress callback);
    when not drawing, every bar is None and nothing is drawn."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bars: Any = None

    def __enter__(self) -> Transfers:
        if self.enabled:
            from rich import progress as rp
            from rich.console import Console

            self._bars = rp.Progress(rp.TextColumn("{task.description:<12}"), rp.BarColumn(),
                                     rp.DownloadColumn(), rp.TransferSpeedColumn(),
                                     rp.TimeRemainingColumn(), console=Console(stderr=True))
            self._bars.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._bars is not None:
            self._bars.stop()

    def bar(self, label: str) -> Progress | None:
        if self._bars is None:
            return None
        bars, task = self._bars, self._bars.add_task(label, total=None)

        def update(done: int, total: int | None) -> None:
            bars.update(task, completed=done, total=total)
        return update


class Phase:
    """A spinner line on stderr saying what a job does now (`show`), with the job's own lines
    (`echo`) printed to stdout above it. Not drawing: `show` does nothing."""

    def __init__(self, live: Any = None, spinner: Any = None) -> None:
        self._live, self._spinner = live, spinner

    def show(self, text: str) -> None:
        if self._spinner is not None:
            self._spinner.update(text=text)

    def echo(self, text: str) -> None:
        if self._live is not None and self._live.is_started and sys.stdout.isatty():
            print(text)  # through rich's stand-in for sys.stdout: above the spinner line
        else:
            typer.echo(text)


@contextlib.contextmanager
def phase(enabled: bool) -> Iterator[Phase]:
    if not enabled:
        yield Phase()
        return
    from rich.console import Console
    from rich.live import Live
    from rich.spinner import Spinner

    spinner = Spinner("dots", text="")
    # stdout goes above the line only when it is the same terminal; a pipe gets it untouched.
    with Live(spinner, console=Console(stderr=True), transient=True,
              redirect_stdout=sys.stdout.isatty(), redirect_stderr=False,
              refresh_per_second=8) as live:
        yield Phase(live, spinner)
