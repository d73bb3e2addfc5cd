"""A fork server for background.py's script jobs: one process imports what the scripts import
(torch, Dynamo and Inductor, transformers, accelerate, this package) once, then forks a child
per job that runs the script as ``python script args`` would (``__main__``, ``sys.argv``, the
script's folder first on ``sys.path``, the job's environment, working directory and output
files, a session of its own). Each job otherwise paid those imports itself: on this two-core
machine (2026-11-29) ``python -c "import torch"`` took 3.1 CPU-s, with transformers,
accelerate and this package 4.4, and with Dynamo and Inductor too 9.5; the suite runs about a
dozen such jobs, on a core the tests would otherwise use.

Only what is the same for every job may be done before the fork: the environment torch reads
as it loads (OMP_NUM_THREADS, which libgomp reads when it is loaded, and CUDA_VISIBLE_DEVICES)
is the server's own, so background.py sends it only jobs whose values match; nothing runs an
op before the fork (no OpenMP team, no thread exists in the server).

Protocol, one JSON object a line: background.py writes a job (``args``, ``cwd``, ``env``,
``stdout``, ``stderr``, ``pythonpath``), the server answers ``{"pid": p}`` once the child runs
and ``{"code": c}`` when it ended (the child's exit status, or minus the signal that killed
it). One job at a time. Run as ``python tests/zygote.py`` (``-- module...``: those imported
instead of ``PRELOAD``); it ends when its input closes."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "transformers", "accelerate",
           "torchoffload")  # fmt: skip


def _preload(names: tuple[str, ...]) -> list[str]:
    loaded = []
    for name in names:
        try:
            __import__(name)
            loaded.append(name)
        except Exception:  # an optional one missing: the script imports it, or skips
            pass
    return loaded


def _child(job: dict) -> None:
    """In the forked child: become ``python script args`` and never return."""
    code = 1
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115 (not the server's buffered requests)
        script = job["args"][0]
        sys.argv = list(job["args"])
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *job["pythonpath"], *_BASE]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _answer(obj: dict) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def main() -> int:
    args = sys.argv[1:]
    loaded = _preload(tuple(args[1:]) if args[:1] == ["--"] else PRELOAD)
    _answer({"ready": loaded})
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"code": os.waitstatus_to_exitcode(status)})
    return 0


# the server's own path without its folder (tests/), which a script's run does not have
_BASE = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(__file__)]

if __name__ == "__main__":
    sys.exit(main())
