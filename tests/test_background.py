"""tests/background.py's fork server (tests/zygote.py): a script forked from it gives what the
same script gives as a process of its own (exit status, output, ``sys.argv``, ``__main__``,
``sys.path``), and a job whose environment is not the server's runs as its own process. The
servers here import nothing ahead (the session's imports torch and more: seconds a start)."""

from __future__ import annotations

import os

import background
import pytest

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "main", __name__, "path0", sys.path[0] == os.path.dirname(
    os.path.abspath(__file__)), "port", os.environ.get("MASTER_PORT") is not None)
print("err line", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork: jobs run on their own")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture
def server():
    s = background._Zygote(preload=())
    yield s
    s.close()


def test_a_forked_job_is_what_its_own_process_is(script, server):
    for arg in ("0", "3", "raise"):
        job = background.Job((script, arg))
        forked = background.run(job, idle=True, server=server)  # idle: served by the server
        own = background.run(job)  # not idle: a process of its own
        assert forked.code == own.code == (1 if arg == "raise" else int(arg))
        assert forked.stdout == own.stdout
        assert f"argv ['{arg}'] main __main__ path0 True port True" in forked.stdout
        assert forked.stderr.splitlines()[0] == "err line"
        assert forked.stderr.splitlines()[-1] == own.stderr.splitlines()[-1]
    assert server.served == 3 and not server.failed
    assert forked.stderr.splitlines()[-1] == "ValueError: boom"


def test_a_job_in_another_environment_runs_as_its_own_process(script, server, monkeypatch):
    assert background.run(background.Job((script, "0")), idle=True, server=server).code == 0
    monkeypatch.setenv("TORCHINDUCTOR_SOMETHING", "1")  # read by a module as it loads
    assert background.run(background.Job((script, "0")), idle=True, server=server).code == 0
    assert server.served == 1
