"""The native host step of `LowPrecisionAdamW`: ``_lowbit_step.c``, built once per machine with
the system's C compiler and loaded with ctypes, stepping a parameter's blocks on the process's
intra-op threads.

Note: [The native host step]
Per-op PyTorch steps an 8-bit or bf16 state with about forty operations a chunk, each a pass
over memory and several of them gathers: on the H200 machine's host 18-21 ns a parameter on
16 threads with 8-bit moments, against 0.25 for torch's fused fp32 AdamW, so the state that
takes fewer bytes took a step 80 times longer. The kernel: 0.26-0.28 ns (8-bit moments; the
code lookups bind it, not memory) and 0.19 (bf16 masters, fp32 moments), against 0.30 for
fused fp32 AdamW in the same run (benchmarks/log/2026-11-27-native-host-step.md). The C
kernel does one block of 256 elements at a time, everything in registers or a few KiB of
stack, each byte of the parameter, gradient and state read and written once.
- Same bits: the C code does the per-op step's IEEE operations in its order (no fused
  multiply-add, a correctly rounded square root, wrapping 32-bit hash arithmetic), and the
  per-op step does nothing the C code cannot (its square root is taken in float64 on a CPU,
  since ATen's float32 `sqrt` there goes through MKL's vector math, which is not correctly
  rounded). `tests/test_optim_lowbit.py` checks the two bitwise over every format, sizes with
  short last blocks, special values and thread counts, so a machine without a C compiler (or
  with ``TORCHOFFLOAD_NATIVE=0``) steps the same bits, only slower.
- Threads: `LowPrecisionAdamW.step` gathers its CPU parameters' steps and makes one call into
  C, which releases the GIL once and spreads the blocks of all of them, end to end, in pieces
  of 64 blocks that each of ``torch.get_num_threads()`` threads (the host worker sets that to
  ``host_threads``; pthreads started for the call, one call a bucket) takes in turn when free,
  so a thread the host deschedules does not hold up the call (with one static share a
  thread, the 8-bit step took 0.35-0.43 ns a parameter on 16 threads, 0.26-0.28 so).
  A first version split each parameter over a pool of Python threads: each needed the GIL to
  start and to finish its share while the main thread ran forward and backward, and the host
  step of a Llama-3.2-3B shape with 8-bit moments took 1774 ms against 1269 ms so
  (benchmarks/log/2026-11-27-native-host-step.md). A block is done by one thread, so the
  split changes no bit.
- Build: ``cc -O3 -march=native -ffp-contract=off -fno-math-errno``, once per source, flags,
  compiler and CPU (the name of the shared object hashes them all, so a home directory shared
  by different machines holds one per CPU), into ``$TORCHOFFLOAD_CACHE`` (default
  ``~/.cache/torchoffload``), written to a temporary name and renamed, so processes building
  at once do not see half a file; a cached file shorter than its ELF headers say (a full
  disk, a crash before the data reached it) is built again, since loading it would be a
  SIGBUS. ``$CC`` picks the compiler (with its arguments, if any). A failed build warns once
  and the per-op step is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("_lowbit_step.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c99", "-fPIC",
         "-shared", "-pthread")  # fmt: skip
# flags of the kernel's `flags` argument (see the C source)
PARAM_BF16, QUANTIZED, STOCHASTIC, KAHAN, ADD_COMP = 1, 2, 4, 8, 16

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": the loaded kernel or None


def enabled() -> bool:
    return os.environ.get("TORCHOFFLOAD_NATIVE", "1") != "0"


def kernel() -> Any | None:
    """The loaded kernel, built on first use; None where it is disabled or cannot be built."""
    if not enabled():
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _load() -> Any | None:
    cc = os.environ.get("CC")  # may hold arguments ("ccache gcc"), as make's $CC does
    found = shutil.which("cc") or shutil.which("gcc")
    command = shlex.split(cc) if cc else [found] if found else []
    if not command:
        _warn("no C compiler found (set CC)")
        return None
    source = SOURCE.read_bytes()
    parts = [" ".join(FLAGS), " ".join(command), _cpu_id(), platform.machine()]
    digest = hashlib.sha256(b"\0".join([source, *(x.encode() for x in parts)])).hexdigest()[:16]
    cache = Path(os.environ.get("TORCHOFFLOAD_CACHE") or Path.home() / ".cache" / "torchoffload")
    path = cache / f"lowbit_step-{digest}.so"
    if not _whole(path):  # absent, or cut short (a full disk, a crash): built again
        why = _build(command, cache, path)
        if why is not None:
            _warn(why)
            return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        _warn(f"loading {path}: {e}")
        return None
    fn = lib.lowbit_adamw_steps
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _build(command: list[str], cache: Path, path: Path) -> str | None:
    """Build the kernel into ``path`` (through a temporary file, renamed); None, or why not."""
    tmp = None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        run = subprocess.run([*command, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        if run.returncode != 0:
            return f"{command[0]} failed: {run.stderr.strip()[-300:]}"
        os.replace(tmp, path)
        tmp = None
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _whole(path: Path) -> bool:
    """Whether the shared object at ``path`` is there and, on Linux, as long as its ELF headers
    say: dlopen maps a file cut short without a complaint, and the first touch of the missing
    part is a SIGBUS that kills the process."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not sys.platform.startswith("linux"):
        return True
    if len(data) < 64 or data[:5] != b"\x7fELF\x02":  # ELF, 64-bit
        return False
    order = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + "QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, 0x36)
    end = shoff + shentsize * shnum
    for k in range(phnum):
        at = phoff + k * phentsize
        if at + 40 > len(data):
            return False
        offset, _, _, size = struct.unpack_from(order + "QQQQ", data, at + 8)
        end = max(end, offset + size)
    return end <= len(data)


def _warn(why: str) -> None:
    warnings.warn(
        f"torchoffload: the native low-precision host step is not available ({why}); "
        "LowPrecisionAdamW steps CPU tensors with per-op PyTorch instead: the same bits, "
        "about ten times slower",
        RuntimeWarning,
        stacklevel=4,
    )


class _Task(ctypes.Structure):
    """`task_t` of the C source: one parameter's step."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("n", "flags")]
        + [(name, ctypes.c_void_p) for name in ("param", "grad", "m_codes", "m_scales",
                                                "v_codes", "v_scales", "m32", "v32", "comp")]
        + [("hs", ctypes.c_float * 8), ("key", ctypes.c_int64)]
    )  # fmt: skip


class _Tables(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("m_map", "m_below", "m_next", "v_map",
                                                     "v_below", "v_next")]  # fmt: skip


class Steps:
    """The native steps of one `step()` call, gathered, then run by one call into C (which
    releases the GIL once and spreads all of their blocks over the intra-op threads)."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.tasks: list[_Task] = []
        self.alive: list[Any] = []  # the tensors of the tasks' pointers, until `run` returns

    def add(
        self,
        flags: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        compensation: torch.Tensor | None,
        scalars: list[float],
        key: int,
    ) -> None:
        """Step contiguous CPU ``param`` (its flat view) in place at `run`. ``moments``: (m
        codes, m scales, v codes, v scales) when ``flags`` has QUANTIZED, else (m, v) in fp32;
        ``scalars``: the 7 values the C source lists, in float64 (rounded to fp32 here, as
        PyTorch rounds a Python scalar for an fp32 op)."""
        mc = ms = vc = vs = m32 = v32 = None
        if flags & QUANTIZED:
            mc, ms, vc, vs = moments
        else:
            m32, v32 = moments
        task = _Task(param.numel(), flags, *(None if t is None else t.data_ptr() for t in
                     (param, grad, mc, ms, vc, vs, m32, v32, compensation)))  # fmt: skip
        task.hs[:7] = scalars
        task.key = key & 0xFFFFFFFF
        self.tasks.append(task)
        self.alive.append((param, grad, moments, compensation))

    def run(self, tables: tuple[torch.Tensor, ...]) -> None:
        if not self.tasks:
            return
        array = (_Task * len(self.tasks))(*self.tasks)
        ptrs = _Tables(*(t.data_ptr() for t in tables))
        error = self.fn(array, len(self.tasks), torch.get_num_threads(), ctypes.byref(ptrs))
        if error:  # the step is done all the same, on fewer threads
            warnings.warn(
                f"torchoffload: the native host step could not start a thread (error {error}); "
                "it ran on fewer",
                RuntimeWarning,
                stacklevel=3,
            )
        self.tasks.clear()
        self.alive.clear()
