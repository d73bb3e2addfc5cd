"""`make test`: the suite as two pytest processes at once, the compile-heavy files in one.

CI has two cores. The in-process tests keep about one busy (tests/background.py runs the
subprocess jobs on the other, at idle priority), and the files that compile with Inductor and
AOTInductor spend most of their time in Dynamo's and Inductor's Python and in gcc: one core.
Run in a second pytest process beside the rest, they use the core the first leaves idle.
Measured on this two-core machine, one run each, nothing else running, from a cold Inductor
cache (a fresh TORCHINDUCTOR_CACHE_DIR, as on CI), 2026-11-28 (wall s / CPU s):
- one process (``pytest -q``): 763 / 1187;
- SECOND's three files in a second process on one intra-op thread, the first as it is: 724 /
  1296 (the first's OpenMP team of two spun while the second process held a core);
- the same with the first's idle OpenMP thread sleeping (``OMP_WAIT_POLICY=PASSIVE``), what
  this runs: 652 / 1127;
- both processes on one thread: 637 / 1120, but then the host optimizer's threaded step
  (``torch.get_num_threads()`` threads) would run on one thread in every test.

Options go to both processes (``python tests/run_suite.py -x``); to run some tests, call pytest
itself. The second process's output is printed after the first's; the exit status is the first
nonzero of the two.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECOND = ("tests/test_compile_package.py", "tests/test_compile_streamed.py",
          "tests/test_compile_pass.py")  # fmt: skip


def main(argv: list[str]) -> int:
    py = sys.executable
    # the second: one intra-op thread (its work is compiling). The first keeps its team of
    # two (the host optimizer's threaded step is tested there), whose idle thread sleeps
    # instead of spinning against the second process
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first_env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with tempfile.TemporaryFile("w+") as log:
        second = subprocess.Popen(
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SECOND, *argv],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            ignore = [f"--ignore={f}" for f in SECOND]
            first = subprocess.call([py, "-m", "pytest", "-q", *ignore, *argv], cwd=ROOT,
                                    env=first_env)  # fmt: skip
        except BaseException:  # interrupted: the second process goes too
            second.kill()
            raise
        code = second.wait()
        log.seek(0)
        print(f"\n--- {' '.join(SECOND)} (a second pytest process) ---", flush=True)
        sys.stdout.write(log.read())
    for rc in (first, code):
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
