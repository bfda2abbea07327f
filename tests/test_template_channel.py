"""What the daemon takes from a worker template's channel (workers/template.py).

The template runs the job's user's code, so every message on its channel is
the user's word: unit cases on the parser, no process needed (the fork
reply's pid check runs end to end in test_worker_template.py)."""
from __future__ import annotations

import json

from elasticd.workers import template as tmpl
from elasticd.workers.template import TemplateState, WorkerTemplate


def said(t: WorkerTemplate, *messages) -> None:
    for m in messages:
        t._message(json.dumps(m).encode())


def test_a_ready_message_with_garbage_counts_is_taken_without_an_error():
    t = WorkerTemplate("j")
    t.state = TemplateState.STARTING
    said(t, {"ready": True, "modules": "many"})
    assert t.state is TemplateState.READY


def test_exit_reports_for_pids_never_forked_are_bounded():
    t = WorkerTemplate("j")
    said(t, *({"exit": 1000 + i, "status": 0} for i in range(10_000)))
    assert len(t._statuses) == tmpl._UNCLAIMED_MAX
    assert 1000 + 9_999 in t._statuses  # the newest kept: a real rank's comes just before its reply


def test_replies_to_requests_never_made_are_dropped():
    t = WorkerTemplate("j")
    t._next_id = 3
    said(t, *({"id": i, "pid": 4242} for i in range(10_000)), {"id": True, "pid": 1},
         {"id": 3.0, "pid": 1})
    assert list(t._replies) == [3] and t._replies[3]["pid"] == 4242


def test_a_malformed_line_fails_the_template_and_nothing_else():
    t = WorkerTemplate("j")
    t.state = TemplateState.READY
    t._message(b"{not json")
    assert t.state is TemplateState.FAILED and "malformed" in t.reason


def test_hostile_lines_fail_the_template_and_never_raise():
    """Issue 29: '[' * 50000 raised RecursionError out of _message (it caught only
    ValueError), and so did a wait status no wait() returns, into the agent's pump."""
    for line in (b"[" * 50000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b'{"exit": 1e999}',
                 b'{"exit": NaN, "status": 0}', b"\xff\xfe", b'{"n": ' + b"9" * 5000 + b"}"):
        t = WorkerTemplate("j")
        t.state = TemplateState.READY
        t._message(line)
        assert t.state is TemplateState.FAILED and "malformed" in t.reason, line[:20]
    t = WorkerTemplate("j")
    said(t, {"exit": 4242, "status": 10 ** 30}, {"exit": 10 ** 30, "status": 0},
         {"exit": -1, "status": 0}, {"exit": 4243, "status": -5})
    assert t._statuses == {}
