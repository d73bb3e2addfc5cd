"""Subprocesses that tests wait on, started as soon as collection is done and run beside the
in-process tests: CI has two cores, and the in-process tests keep about one of them busy.

A test module declares ``BACKGROUND = {key: Job(...)}``. Once the session's tests are selected,
conftest.py calls `schedule`, which queues the jobs whose key is the name of a selected test of
that module or of a fixture one uses. A thread runs them one at a time, at the lowest CPU priority
(SCHED_IDLE: only on a core the tests leave idle), the modules in session order and each module's
jobs from its last to its first, each with one intra-op thread (OMP_NUM_THREADS=1): with the
default two, each job's OpenMP team and the tests' own spun against each other: back to back
on this two-core machine, nothing else running (2026-11-28), the suite took 797 s and 1335
CPU-seconds with two threads a job, 715 s and 1127 with one. A job that runs a script is
forked by a server that imported torch, Inductor, transformers and this package once
(tests/zygote.py: those imports were 4-10 CPU-s of each job), where its environment is the
server's. A test (or fixture) calls `output` for its job's result: it waits for the job if the
thread runs it or ran it, and runs it itself, at once, if it is still queued or was never
queued (a module run on its own). A job's command
and what the test asserts on its result are the same either way; only when it runs, and on how
many threads, changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Job:
    """``python args`` in the repository root. ``"{out}"`` in args: a path in a fresh directory,
    `Result.out`, where the job can write what it returns. ``needs``: modules it imports (not
    run ahead without them: its test skips). ``pythonpath``: PYTHONPATH, folders of this
    checkout. ``timeout``: seconds a test waits for it before it is killed."""

    args: tuple[str, ...]
    needs: tuple[str, ...] = ()
    pythonpath: tuple[Path, ...] = (ROOT,)
    timeout: int = 240
    enabled: bool = True

    def runnable(self) -> bool:
        return self.enabled and all(importlib.util.find_spec(m) is not None for m in self.needs)


@dataclasses.dataclass
class Result:
    code: int | None
    stdout: str
    stderr: str
    out: Path


def _env() -> dict[str, str]:
    from dist_workers import loopback_env

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for key, value in loopback_env().items():
        env.setdefault(key, value)
    with socket.socket() as s:  # a free port for a single-process group
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    return env


def _idle_prefix() -> list[str]:
    """A command prefix that runs a program at the lowest CPU priority: SCHED_IDLE (it runs only
    on a core nothing else wants) where ``chrt`` can set it here, else nice 19."""
    if shutil.which("chrt"):
        probe = subprocess.run(["chrt", "--idle", "0", "true"], capture_output=True)
        if probe.returncode == 0:
            return ["chrt", "--idle", "0"]
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def run(job: Job, idle: bool = False, entry: tuple[str, str] | None = None,
        server: _Zygote | None = None) -> Result:  # fmt: skip
    """Run ``job`` now and wait for it. ``idle``: at the lowest CPU priority, so that it takes
    only the time the tests leave (a multithreaded op in a test would otherwise wait, at each
    of its parallel sections, for the job to yield a core), and with no time limit of its own:
    starved while the tests run, it may take long; `output` limits how long a test waits.
    Otherwise killed after ``job.timeout`` seconds. ``server``: the fork server of an idle
    job that runs a script (default: the session's)."""
    work = Path(tempfile.mkdtemp(prefix="torchoffload_job_"))
    _DIRS.append(work)
    out = work / "out"
    env = dict(_env(), PYTHONPATH=os.pathsep.join(str(p) for p in job.pythonpath))
    args = [a.replace("{out}", str(out)) for a in job.args]
    prefix = _idle_prefix() if idle else []
    if idle:  # one core's worth: the tests' own intra-op threads take the other
        env.setdefault("OMP_NUM_THREADS", "1")
    with open(work / "stdout", "w+") as stdout, open(work / "stderr", "w+") as stderr:
        proc = (server or _ZYGOTE).start(args, env, job, work) if idle else None
        if proc is None:  # not a script, another environment, or no fork server: its own
            proc = subprocess.Popen([*prefix, sys.executable, *args], cwd=ROOT, env=env,
                                    text=True, stdout=stdout, stderr=stderr,
                                    start_new_session=True)  # fmt: skip
        with _LOCK:
            _RUNNING.add(proc)
            if entry is not None:
                _PROCS[entry] = proc
        try:
            proc.wait(timeout=None if idle else job.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill(proc)
            with _LOCK:
                _RUNNING.discard(proc)
        stdout.seek(0)
        stderr.seek(0)
        return Result(proc.returncode, stdout.read(), stderr.read(), out)


# what a forked job's environment may hold that the fork server's does not: the rest is read
# by modules as they load (OMP_NUM_THREADS by libgomp, TORCHINDUCTOR_* by Inductor's config)
_PER_JOB = frozenset({"MASTER_PORT", "PYTHONPATH", "PYTEST_CURRENT_TEST"})


class _Forked:
    """A job forked by the fork server (tests/zygote.py), as much of `subprocess.Popen` as
    this module uses; a thread reads its exit status from the server."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired("a forked job", timeout or 0)
        assert self.returncode is not None
        return self.returncode


class _Zygote:
    """The fork server (tests/zygote.py) of the idle jobs that run a script: started with
    the first, at the lowest CPU priority; `start` returns None (the job runs as its own
    process) where it cannot serve a job: not a script, a job running, another environment
    than the server's (but for `_PER_JOB`), or no server."""

    def __init__(self, preload: tuple[str, ...] | None = None) -> None:
        self.preload = preload  # the modules it imports (None: tests/zygote.py's PRELOAD)
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.failed = False
        self.lock = threading.Lock()
        self.busy = False
        self.served = 0  # jobs forked

    def _server(self) -> subprocess.Popen | None:
        if self.proc is None and not self.failed and hasattr(os, "fork"):
            env = dict(_env(), PYTHONPATH=str(ROOT))
            env.setdefault("OMP_NUM_THREADS", "1")
            self.env = env
            try:
                self.proc = subprocess.Popen(
                    [*_idle_prefix(), sys.executable, str(TESTS / "zygote.py"),
                     *(() if self.preload is None else ("--", *self.preload))], cwd=ROOT,
                    env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                if "ready" not in json.loads(self.proc.stdout.readline() or "{}"):
                    raise RuntimeError("the fork server did not start")
            except Exception:
                self.failed = True
                self.close()
        return self.proc

    def start(self, args: list[str], env: dict[str, str], job: Job,
              work: Path) -> _Forked | None:  # fmt: skip
        if not args or args[0].startswith("-") or not args[0].endswith(".py"):
            return None
        with self.lock:
            if self.busy:
                return None
            server = self._server()
            if server is None:
                return None
            if any(env.get(k) != self.env.get(k) for k in {*env, *self.env} - _PER_JOB):
                return None
            request = dict(args=args, cwd=str(ROOT), env=env, stdout=str(work / "stdout"),
                           stderr=str(work / "stderr"),
                           pythonpath=[str(p) for p in job.pythonpath])  # fmt: skip
            try:
                server.stdin.write(json.dumps(request) + "\n")
                server.stdin.flush()
                forked = _Forked(json.loads(server.stdout.readline())["pid"])
            except Exception:
                self.failed = True
                self.close()
                return None
            self.busy = True
            self.served += 1
        threading.Thread(target=self._reap, args=(server, forked), daemon=True).start()
        return forked

    def _reap(self, server: subprocess.Popen, forked: _Forked) -> None:
        try:
            code = json.loads(server.stdout.readline())["code"]
        except Exception:  # the server died (killed at the session's end, perhaps)
            code = -signal.SIGKILL
            self.failed = True
        forked.returncode = code
        with self.lock:
            self.busy = False
        forked.done.set()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.stdin.close()
            _kill(proc)


_ZYGOTE = _Zygote()


def _kill(proc: subprocess.Popen | _Forked) -> None:
    """Kill the job, if it still runs, and what it started (its session: torchrun's and
    spawn's workers)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_LOCK = threading.Lock()
_RUNNING: set[subprocess.Popen] = set()
_PROCS: dict[tuple[str, str], subprocess.Popen] = {}  # the process of each job started
_DIRS: list[Path] = []
_PENDING: list[tuple[str, str]] = []  # (module name, key), in the order the thread takes them
_DONE: dict[tuple[str, str], threading.Event] = {}
_RESULTS: dict[tuple[str, str], Result] = {}
_STOPPED = threading.Event()


def _job(module: str, key: str) -> Job:
    return sys.modules[module].BACKGROUND[key]


def _take(entry: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """Take ``entry`` (default: the next one) off the queue; None if it is not (any more) on it."""
    with _LOCK:
        if entry is None:
            entry = _PENDING[0] if _PENDING and not _STOPPED.is_set() else None
        if entry is None or entry not in _PENDING:
            return None
        _PENDING.remove(entry)
        return entry


def _run_entry(entry: tuple[str, str], idle: bool) -> None:
    try:
        _RESULTS[entry] = run(_job(*entry), idle=idle, entry=entry)
    except BaseException as e:  # reported by `output` (and raised on: Ctrl-C ends the session)
        _RESULTS[entry] = Result(None, "", f"the job did not finish: {e!r}", Path())
        raise
    finally:
        _DONE[entry].set()


def schedule(items: list[Any]) -> None:
    """Queue the jobs the selected ``items`` use (see the module's docstring) and start the
    thread that runs them."""
    per_module: dict[str, list[str]] = {}
    for item in items:
        module = getattr(item, "module", None)
        jobs = getattr(module, "BACKGROUND", None)
        if not jobs:
            continue
        used = per_module.setdefault(module.__name__, [])
        names = [getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ())]
        for key in jobs:
            if key in names and key not in used:
                used.append(key)
    entries = []
    for module, keys in per_module.items():
        entries += [(module, k) for k in reversed(keys) if _job(module, k).runnable()]
    with _LOCK:
        entries = [e for e in entries if e not in _DONE]
        for entry in entries:
            _DONE[entry] = threading.Event()
            _PENDING.append(entry)

    def work() -> None:
        while (entry := _take()) is not None:
            with contextlib.suppress(Exception):  # in its result
                _run_entry(entry, idle=True)

    if entries:
        threading.Thread(target=work, name="background jobs", daemon=True).start()


def stop() -> None:
    """End of the session: nothing more starts, what runs is killed, the folders go."""
    _STOPPED.set()
    with _LOCK:
        running = list(_RUNNING)
    for proc in running:
        _kill(proc)
    _ZYGOTE.close()
    for work in _DIRS:
        shutil.rmtree(work, ignore_errors=True)


def output(module: str, key: str) -> Result:
    """The result of ``module``'s job ``key``: waited for, or run now (see the docstring)."""
    entry = (module, key)
    if _take(entry) is not None:  # queued, not started: run here, beside the thread's job
        _run_entry(entry, idle=False)
    if entry in _DONE:
        if not _DONE[entry].wait(timeout=_job(*entry).timeout):  # a test waits that long
            with _LOCK:
                proc = _PROCS.get(entry)
            if proc is not None:
                _kill(proc)
            _DONE[entry].wait()
        return _RESULTS[entry]
    return run(_job(module, key))
