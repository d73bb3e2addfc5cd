"""`make test`: the suite as two pytest processes at once, the compile-heavy files and the
documentation's examples in the second.

CI has two cores. The in-process tests keep about one busy (tests/background.py runs the
subprocess jobs on the other, at idle priority), and the files that compile with Inductor and
AOTInductor spend most of their time in Dynamo's and Inductor's Python and in gcc: one core.
Run in a second pytest process beside the rest, they use the core the first leaves idle.
Measured on this two-core machine, one run each, nothing else running, from a cold Inductor
cache (a fresh TORCHINDUCTOR_CACHE_DIR, as on CI), 2026-11-28 (wall s / CPU s):
- one process (``pytest -q``): 763 / 1187;
- test_compile_package, test_compile_streamed and test_compile_pass in a second process on one
  intra-op thread, the first as it is: 724 / 1296 (the first's OpenMP team of two spun while
  the second process held a core);
- the same with the first's idle OpenMP thread sleeping (``OMP_WAIT_POLICY=PASSIVE``): 652 /
  1127 (the first 644 s, the second 485);
- both processes on one thread: 637 / 1120, but then the host optimizer's threaded step
  (``torch.get_num_threads()`` threads) would run on one thread in every test;
- with SECOND as below (the three, test_compile_probe, test_compile and test_docs), from a fresh
  clone (``CI=true bash .ci/run``, set-up, docs and lint included: 727 s): the first 600 s, the
  second 536;
- the same, 2026-11-28 (session 28), with the fuzzer's compiled-program regressions moved to
  the second (tests/test_fuzz_compiled.py) and the AOTI decode smoke at two layers: the first
  514 s, the second 531 (675 s in all, set-up, docs and lint included);
- the same, 2026-11-28 (session 29), torch installed beside the test tools and the docs built
  in their own environment during set-up (Makefile): the first 532 s, the second 550 (642 s
  in all);
- 2026-11-29 (session 38), three compiles fewer in the second (test_compile_pass,
  test_compile_package) and tests/test_weights_contract.py moved to it: the first 578 s, the
  second 632 (756 s in all, on a slower run of this machine): the file went back;
- 2026-11-29 (session 39), set-up without byte-compiling, these processes writing bytecode:
  the first 636 s, the second 624 (703 s in all, against 742 the day before); other runs
  646 / 644 (717 s in all) and 667 / 649 (738 s);
- 2026-11-29 (session 41), the background scripts forked from a process that imported torch
  once (tests/background.py, tests/zygote.py): the first 565 s, the second 558 (627 s in all,
  against 691-693 s that day without the forks; 55-85 CPU-s less).
The threaded host step stays tested in the first process (test_optim); the documentation's
examples run it on one thread.

AOTInductor's C++ wrapper (the glue that allocates buffers and calls the kernels; the kernels
keep -O3) is compiled at -O0 here rather than torch's -O1
(``AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL``, unless set): gcc spent 8 s instead of 10-12 on
each wrapper, and the suite builds many (29 calls of `save_streamed_package` or
`aoti_compile_and_package` in the files it runs; the test_compile_package fixture's two
packages: 55 s instead of 63, one process on this machine, 2026-11-29). The GPU machine's runs
(``pytest -m gpu``) keep torch's default.

The test set-up installs without byte-compiling (Makefile: PIP_DEV), so both processes (and
the subprocesses they start) may write the bytecode of the modules they import: where
PYTHONDONTWRITEBYTECODE is set it is dropped from their environment, and each module is compiled
once, by its first importer, instead of every module at set-up.

It takes no arguments: for a subset of the tests or other options, call pytest itself. The
second process's output is printed after the first's, then both exit statuses; the exit status
is the first nonzero of the two. Interrupted (Ctrl-C, SIGTERM), both processes get SIGINT (so
pytest stops its background jobs) and are killed if they have not ended 30 s later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECOND = ("tests/test_compile_package.py", "tests/test_compile_streamed.py",
          "tests/test_compile_pass.py", "tests/test_compile_probe.py", "tests/test_compile.py",
          "tests/test_fuzz_compiled.py", "tests/test_docs.py")  # fmt: skip


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    if argv:
        print("tests/run_suite.py takes no arguments: run pytest itself for a subset or options")
        return 2
    signal.signal(signal.SIGTERM, _interrupted)
    py = sys.executable
    # the second: one intra-op thread (its work is compiling). The first keeps its team of
    # two (the host optimizer's threaded step is tested there), whose idle thread sleeps
    # instead of spinning against the second process
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first_env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    for e in (env, first_env):  # see the module doc: the wrapper's glue code, not its kernels
        e.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
        e.pop("PYTHONDONTWRITEBYTECODE", None)  # the module doc: bytecode written on import
    ignore = [f"--ignore={f}" for f in SECOND]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryFile("w+") as log:
        try:
            procs.append(subprocess.Popen(
                [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SECOND],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
            procs.append(subprocess.Popen([py, "-m", "pytest", "-q", *ignore], cwd=ROOT,
                                          env=first_env))  # fmt: skip
            second, first = (p.wait() for p in procs)
        except BaseException:
            _stop(procs)
            raise
        finally:
            log.seek(0)
            print(f"\n--- {' '.join(SECOND)} (a second pytest process) ---", flush=True)
            sys.stdout.write(log.read())
    print(f"\nrun_suite: first process exit {first}, second process exit {second}", flush=True)
    return first or second


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
