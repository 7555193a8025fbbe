"""Ships a task's output lines to the coordinator in small numbered chunks."""

from __future__ import annotations

import logging
import threading

import grpc

from campugrid.agent.client import CoordinatorApi
from campugrid.agent.messages import Hold
from campugrid.protocol import logs

log = logging.getLogger("campugrid.agent")
MAX_CHUNK = 32 * 1024
MAX_TASK_LOG_BYTES = 32 * 1024 * 1024  # beyond this, lines are counted, not kept


class LogShipper:
    """Collects lines from any thread; a background thread sends them every `every_s`."""

    def __init__(self, client: CoordinatorApi, hold: Hold, every_s: float = 0.5) -> None:
        self.client, self.hold = client, hold
        self.every_s = every_s
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str]] = []
        self._seq = 0
        self._bytes = 0
        self._dropped = 0
        self._stop = threading.Event()
        self._thread = logs.thread(self._loop, name=f"logs-{hold.job_id}")
        self._thread.start()

    def line(self, stream: str, text: str) -> None:
        with self._lock:
            if self._bytes + len(text) > MAX_TASK_LOG_BYTES:
                self._dropped += 1
                return
            self._bytes += len(text) + 1
            self._pending.append((stream, text))

    def for_stream(self, stream: str) -> LineSink:
        return LineSink(self, stream)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._dropped:
            with self._lock:
                self._pending.append(("run", f"[campugrid] {self._dropped} more lines not kept: "
                                             f"the log limit is {MAX_TASK_LOG_BYTES // 1024**2} MiB"))
        self._flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        # Group consecutive lines of one stream into chunks of at most MAX_CHUNK.
        chunks: list[tuple[str, str]] = []
        for stream, text in pending:
            if chunks and chunks[-1][0] == stream and len(chunks[-1][1]) + len(text) < MAX_CHUNK:
                chunks[-1] = (stream, chunks[-1][1] + text + "\n")
            else:
                chunks.append((stream, text[:MAX_CHUNK] + "\n"))
        for stream, text in chunks:
            self._seq += 1
            for _ in range(3):
                try:
                    self.client.logs(self.hold, stream, self._seq, text)
                    break
                except grpc.RpcError as e:
                    log.warning("log upload failed (%s), retrying", e.code())


class LineSink:
    def __init__(self, shipper: LogShipper, stream: str) -> None:
        self.shipper, self.stream = shipper, stream

    def __call__(self, text: str) -> None:
        self.shipper.line(self.stream, text)
