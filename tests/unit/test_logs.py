"""Every line about a job names it, in text or in JSON lines, also from the job's threads."""

from __future__ import annotations

import io
import json
import logging

import pytest

from campugrid.protocol import logs


@pytest.fixture
def captured():
    def make(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.addFilter(logs.JobFields())
        handler.setFormatter(formatter)
        logger = logging.getLogger(f"test-logs-{id(stream)}")
        logger.propagate, logger.level = False, logging.INFO
        logger.addHandler(handler)
        made.append((logger, handler))
        return logger, stream

    made: list[tuple[logging.Logger, logging.Handler]] = []
    yield make
    for logger, handler in made:
        logger.removeHandler(handler)


def test_json_lines_carry_the_job_and_attempt_also_from_its_threads(captured):
    log, out = captured(logs.JsonFormatter())
    log.info("before any job")
    t = logs.thread(lambda: log.warning("from a helper thread"))  # made before, started in
    with logs.about_job("job-1", 3):
        log.info("building %s", "x")
        t.start()
        t.join()
    log.info("named itself", extra={"job_id": "job-2", "attempt": 1})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(x["message"], x["job_id"], x["attempt"]) for x in lines] == [
        ("before any job", None, None), ("building x", "job-1", 3),
        ("from a helper thread", "job-1", 3), ("named itself", "job-2", 1)]
    assert lines[2]["level"] == "WARNING" and lines[0]["time"].endswith("+00:00")


def test_text_lines_name_the_job_after_the_message_and_before_a_traceback(captured):
    log, out = captured(logs.TextFormatter())
    with logs.about_job("job-1", 2):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("task crashed")
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("task crashed [job=job-1 attempt=2]")
    assert rest[0].startswith("Traceback") and rest[-1] == "ValueError: boom"


def test_a_plain_thread_does_not_inherit_the_job(captured):
    import threading

    log, out = captured(logs.JsonFormatter())
    with logs.about_job("job-1", 1):
        t = threading.Thread(target=lambda: log.info("elsewhere"))
        t.start()
        t.join()
    assert json.loads(out.getvalue())["job_id"] is None


def test_configure_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="one of text, json"):
        logs.configure("xml")


def test_a_rest_request_about_a_job_logs_as_about_that_job(captured):
    import asyncio

    from campugrid.coordinator.api import AboutJob

    log, out = captured(logs.JsonFormatter())

    async def app(scope, receive, send):
        log.info("serving %s", scope["path"])

    for path in ("/v1/jobs/3f2a/cancel", "/v1/jobs", "/healthz"):
        asyncio.run(AboutJob(app)({"type": "http", "path": path}, None, None))
    assert [json.loads(line)["job_id"] for line in out.getvalue().splitlines()] == [
        "3f2a", None, None]
