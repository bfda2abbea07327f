"""Bounded rank logs (workers/logrotate.py) and reading across their rotation (control/logs.py),
on real files in a temp dir; the daemon-level case is in test_limits_privacy.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from elasticd import errors
from elasticd.control import logs as logfiles
from elasticd.workers import logrotate
from elasticd.control.streamgate import StreamGate

CAP = 1 << 20


def can_collapse(directory) -> bool:
    """Whether this filesystem cuts a file's head in place (ext4, xfs)."""
    path = os.path.join(str(directory), "probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"x" * (3 * 65536))
        return logrotate._collapse_head(fd, 0, 2 * 65536) > 0
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture(params=["collapse", "copytruncate"])
def way(request, tmp_path, monkeypatch):
    """Each case runs both ways a log's head is cut: in place where the
    filesystem can, else copied and truncated."""
    if request.param == "collapse" and not can_collapse(tmp_path):
        pytest.skip("needs a filesystem with FALLOC_FL_COLLAPSE_RANGE (ext4, xfs) under "
                    "the temp dir")
    if request.param == "copytruncate":
        monkeypatch.setattr(logrotate, "_collapse_head", lambda fd, start, size: 0)
    return request.param


def writer(path):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return lambda data: os.write(fd, data.encode())


def text(reader, final=True) -> str:
    return "".join(t for _, t in reader.read(final=final))


def test_a_follower_sees_every_line_once_in_order_across_rotations(tmp_path, way):
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    follower = logfiles.LogReader(str(tmp_path), None)
    got, rotations = [], 0
    for i in range(40_000):
        if i % 10_000 == 0:
            write(f"==== elasticd: job j rank 0 starting (restart {i // 10_000}) ====\n")
        write(f"line {i:08d} {'x' * 40}\n")
        if i % 2_000 == 0:
            got.append(text(follower, final=False))
        if os.path.getsize(path) > CAP // 2:
            logrotate.rotate(path, CAP)
            rotations += 1
    got.append(text(follower))
    lines = [ln for ln in "".join(got).splitlines() if ln.startswith("line")]
    assert [int(ln.split()[1]) for ln in lines] == list(range(40_000))
    assert rotations >= 3
    assert os.path.getsize(path) + os.path.getsize(path + ".1") <= CAP
    assert os.stat(path + ".1").st_mode & 0o777 == 0o600


def test_the_whole_log_keeps_every_restart_marker_and_the_newest_output(tmp_path, way):
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    for restart in range(4):
        write(f"==== elasticd: job j rank 0 starting (restart {restart}) ====\n")
        write("".join(f"r{restart} {i:06d} {'y' * 60}\n" for i in range(10_000)))
        logrotate.rotate(path, CAP)
    write("the end\n")
    whole = text(logfiles.LogReader(str(tmp_path), None))
    markers = [ln for ln in whole.splitlines() if "starting (restart" in ln]
    assert [m.split("restart ")[1] for m in markers] == ["0) ====", "1) ====", "2) ====",
                                                         "3) ===="]
    assert whole.endswith("r3 009999 " + "y" * 60 + "\nthe end\n")
    assert "r0 000000" not in whole  # the oldest output went first
    assert "log rotated (generation 4)" in whole


def test_a_rotation_right_after_a_big_catch_up_copy_keeps_the_newest_lines(tmp_path, way):
    """A fast rank can make rank-R.log.1 big (the rotation copies what it wrote
    meanwhile) and then end with a short live log: both parts past the cap, so
    the keeper rotates again. That rotation keeps the old part's newest lines
    (the job's last words may be there), and a follower reads on without a
    gap or a repeat."""
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    follower = logfiles.LogReader(str(tmp_path), None)
    write("==== elasticd: job j rank 0 starting (restart 0) ====\n")
    write("".join(f"a {i:07d} {'x' * 90}\n" for i in range(10_000)))
    logrotate.rotate(path, CAP)
    # What a catch-up copy leaves: an old part far past its share, ending where
    # the live log begins (a collapse leaves less than a block there; moved on).
    with open(path, "rb") as fh:
        rest = fh.read()
    os.truncate(path, 0)
    with open(path + ".1", "ab") as fh:
        fh.write(rest)
        fh.write("".join(f"b {i:07d} {'y' * 90}\n" for i in range(20_000)).encode())
        fh.write(b"THE-END\n")
    got = [text(follower, final=False)]
    write("after 1\n")
    got.append(text(follower, final=False))
    logrotate.rotate(path, CAP)
    write("after 2\n")
    got.append(text(follower))
    assert os.path.getsize(path) + os.path.getsize(path + ".1") <= CAP
    whole = text(logfiles.LogReader(str(tmp_path), None))
    assert whole.endswith("b 0019999 " + "y" * 90 + "\nTHE-END\nafter 1\nafter 2\n")
    assert "starting (restart 0)" in whole  # the marker stays in the header
    assert "".join(got).endswith("after 1\nafter 2\n") and "".join(got).count("after 1") == 1
    tail = text(logfiles.LogReader(str(tmp_path), None, 3))
    assert tail == "THE-END\nafter 1\nafter 2\n"


def test_tail_reads_into_the_rotated_part(tmp_path, way):
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    write("".join(f"old {i}\n" for i in range(100)))
    logrotate.rotate(path, CAP)
    write("new 0\nnew 1\n")
    assert text(logfiles.LogReader(str(tmp_path), None, 4)) == "old 98\nold 99\nnew 0\nnew 1\n"
    assert text(logfiles.LogReader(str(tmp_path), [0], 1)) == "new 1\n"


def test_tail_counts_a_line_cut_by_a_rotation_once(tmp_path, way):
    """A rotation may cut a line in two (a rank mid-line; a collapse cuts in whole
    blocks): its head ends the rotated part, its rest begins the live log. --tail N
    still gives N whole lines."""
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    write("".join(f"line {i:05d} {'w' * 50}\n" for i in range(2_000)) + "half a li")
    logrotate.rotate(path, CAP)
    write("ne\nlast\n")
    for n in (1, 2, 3):
        got = text(logfiles.LogReader(str(tmp_path), None, n))
        assert got.splitlines() == ([f"line 01999 {'w' * 50}"] + ["half a line", "last"])[-n:]


def test_a_forged_rotation_line_in_the_output_does_not_move_a_reader(tmp_path, way):
    path = str(tmp_path / "rank-0.log")
    write = writer(path)
    write("==== elasticd: x ==== elasticd: log rotated (generation 9) at now: 0 bytes "
          "dropped; what follows is from byte 0 of the log before ====\n"
          "==== elasticd: log rotated (generation 9) at now: 0 bytes dropped; what follows "
          "is from byte 0 of the log before ====\n" + "a\n" * 10)
    reader = logfiles.LogReader(str(tmp_path), None)
    assert text(reader, final=False).endswith("a\n")
    logrotate.rotate(path, CAP)
    write("b\n")
    assert text(reader) == "b\n"


def test_rotations_under_a_rank_writing_flat_out_lose_no_line(tmp_path):
    """A rank writing as fast as it can while its log rotates: where the
    filesystem cuts a log's head in place, every rotated part runs on into the
    live log without a gap (copytruncate loses what lands between its last read
    and the truncate: the failure once seen from `elasticctl logs`). The rank
    writes until eight rotations are done, then its last line."""
    if not can_collapse(tmp_path):
        pytest.skip("needs a filesystem with FALLOC_FL_COLLAPSE_RANGE (ext4, xfs) under "
                    "the temp dir")
    path = str(tmp_path / "rank-0.log")
    enough = str(tmp_path / "enough")
    open(path, "w").close()
    rank = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
        "i = 0\n"
        "while not os.path.exists(sys.argv[2]):\n"
        "    os.write(fd, ''.join(f'n {j:07d} {\"z\" * 30}\\n' for j in range(i, i + 50)).encode())\n"
        "    i += 50\n"
        "os.write(fd, b'THE-END\\n')\n"), path, enough])

    def rotate_and_check(when: str) -> str:
        logrotate.rotate(path, CAP // 4)
        whole = text(logfiles.LogReader(str(tmp_path), None))
        # Its lines as far as the last newline: a line the rank is writing now may be
        # read in part ("n 0005" of "n 0005994 ...": ci92), as cat would show it.
        done = whole[:whole.rfind("\n") + 1]
        numbers = [int(ln.split()[1]) for ln in done.splitlines() if ln.startswith("n ")]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), \
            f"a gap after rotation {when}"
        return whole
    try:
        deadline = time.monotonic() + 60
        for rotation in range(8):
            while os.path.getsize(path) <= CAP // 8:
                assert rank.poll() is None and time.monotonic() < deadline
                time.sleep(0.001)
            rotate_and_check(str(rotation + 1))   # while the rank writes
        open(enough, "w").close()
        assert rank.wait(30) == 0
        whole = rotate_and_check("after the rank's end")
    finally:
        rank.kill()
        rank.wait()
    assert whole.endswith("\nTHE-END\n") and whole.count("THE-END") == 1


def test_the_stream_gate_names_the_limit_and_frees_slots():
    gate = StreamGate(total=3, per_user=2)
    with gate.slot(1001, "logs"), gate.slot(1001, "logs"):
        with pytest.raises(errors.ResourceExhausted,
                           match=r"uid 1001 has 2 long-lived calls open "
                                 r"\(limits.streams_per_user 2\)"):
            with gate.slot(1001, "logs"):
                pass
        with gate.slot(1002, "wait"):
            with pytest.raises(errors.ResourceExhausted, match="limits.streams_total 3"):
                with gate.slot(1003, "events"):
                    pass
    assert gate.open == 0
    with gate.slot(1001, "logs"):
        assert gate.open == 1
