"""The host step of `torchoffload.OffloadedOptimizer` against the host's memory bandwidth: a
STREAM-like triad and fp32 AdamW over N parameters, each stepped as the engine's worker does (on
a Python thread of its own, its intra-op threads set with ``torch.set_num_threads`` there).

    python benchmarks/host_step.py                      # 3.2 B parameters (a Llama-3.2-3B)
    python benchmarks/host_step.py --params 4e6 --placement-params 2e6 --triad-mib 16 --reps 1

Prints the host (CPU, cores, NUMA nodes from sysfs, ``lscpu`` and ``numactl --hardware`` where
present, transparent huge pages), then two tables:

- triad: ``a = b + s * c`` over fp32 arrays of ``--triad-mib`` MiB each (default: the larger
  of 1 GiB and 4x the L3 cache), best of ``--triad-reps``, per thread count. GB/s count 12
  bytes an element (STREAM's convention: no write-allocate). The best of the thread counts is
  the bound the ratios use.
- AdamW: ms per step (median of ``--reps`` after one warm-up step; ``--slow-reps`` for the
  foreach and single-tensor rows), GB/s at 28 bytes a parameter (read p, g, m, v; write p, m,
  v: counted like the triad) and the ratio to the triad, one row per measurement, in
  sections:

  - ``kernels``: torch.optim.AdamW ``fused=True``, ``foreach=True`` and the single-tensor path
    (and ``DeepSpeedCPUAdam`` where it imports; ``--deepspeed DIR`` puts a ``pip install
    --target DIR deepspeed`` on the path), over ``--tensors`` large tensors in one call, and
    in ``--buckets`` buckets of ``--per-bucket`` tensors, one optimizer each, stepped in turn
    (the engine's layout: about 50 buckets). The process's thread count.
  - ``threads``: fused AdamW in buckets at each of ``--threads`` (default: a quarter, half and
    three quarters of the process's threads, all of them less one, and all).
  - ``gil``: fused AdamW in buckets over the first ``--placement-params`` parameters while the
    main thread runs Python (as backward's recomputation and hooks, or the next forward with
    ``step_ahead``, do while the engine's worker steps): idle, holding the GIL but for a small
    op every 10 or 100 us, or always; under a GIL switch interval of 5 ms (Python's default)
    or 1 ms; with a core left to the main thread, and with all of them (the engine's default).
  - ``placement``: fused AdamW in buckets over ``--placement-params`` parameters whose four
    arrays were first written by the worker's threads (as the optimizer class's state is), by
    the main thread alone, in transparent huge pages (``madvise``), page-locked after (with
    CUDA), or as the engine places them (master and gradient from ``_pool.pinned_buffer``
    written by the main thread, the moments allocated by the optimizer class in its first step
    on the worker; also with the master and gradient in huge pages). Two rounds, the second
    in reverse order (``#1``, ``#2``), so that an effect of the order shows.

  ``setting``: who first wrote the memory, or what the main thread did; ``huge pages``: the
  share of the four arrays' bytes in transparent huge pages (the process's AnonHugePages).

State is shared: every optimizer of a section steps the same four arrays (its state is set to
views of them), so the process holds 16 bytes a parameter plus the foreach path's temporaries
(4 bytes a parameter; the triad's arrays are freed before): about 64 GB (60 GiB) at the default
3.2 B, checked against MemAvailable before anything is allocated. Every step of every
optimizer is the user's class with its own rounding; the benchmark compares speeds, not values.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

GiB = 2**30
BYTES_PER_PARAM = 28  # fp32 AdamW: read p, g, m, v; write p, m, v


# - The host
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _command(*args: str) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        run = subprocess.run(args, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout if run.returncode == 0 else None


def meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    """A ``key: N kB`` line of ``path`` in bytes, or None."""
    text = _read(path) or ""
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def huge_bytes() -> int:
    """This process's anonymous memory in transparent huge pages."""
    return meminfo("AnonHugePages", "/proc/self/smaps_rollup") or 0


def thp_mode() -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled, or None."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    m = re.search(r"\[(\w+)\]", text or "")
    return m.group(1) if m else None


def l3_bytes(lscpu: str | None) -> int:
    m = re.search(r"^L3 cache:\s+([\d.]+)\s*([KMG])i?B", lscpu or "", re.M)
    if not m:
        return 0
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def host_lines(lscpu: str | None) -> list[str]:
    """What the host is: CPU, cores, NUMA nodes, huge pages, memory, threads."""
    keep = ("Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "L3 cache",
            "NUMA node")  # fmt: skip
    lines = [ln.strip() for ln in (lscpu or "").splitlines() if ln.strip().startswith(keep)]
    nodes = [d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)] \
        if os.path.isdir("/sys/devices/system/node") else []  # fmt: skip
    out = [f"lscpu: {'; '.join(lines) if lines else 'not available'}"]
    numactl = _command("numactl", "--hardware")
    if numactl:
        keep_n = ("available", "node distances") + tuple(f"node {i} size" for i in range(64))
        picked = [ln.strip() for ln in numactl.splitlines() if ln.startswith(keep_n)]
        out.append(f"numactl --hardware: {'; '.join(picked)}")
    else:
        out.append("numactl: not available")
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    avail = meminfo("MemAvailable")
    out.append(
        f"NUMA nodes (sysfs): {len(nodes) or '?'}; cpus {os.cpu_count()}, usable {affinity}; "
        f"transparent huge pages: {_read('/sys/kernel/mm/transparent_hugepage/enabled') or '?'}"
        f", defrag {_read('/sys/kernel/mm/transparent_hugepage/defrag') or '?'}; MemAvailable "
        f"{avail / GiB if avail else float('nan'):.1f} GiB"
    )
    backend = re.search(r"ATen parallel backend: (.*)", torch.__config__.parallel_info())
    out.append(
        f"torch {torch.__version__}, {backend.group(1) if backend else '?'}, "
        f"{torch.get_num_threads()} intra-op threads; OMP_NUM_THREADS "
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, OMP_PROC_BIND "
        f"{os.environ.get('OMP_PROC_BIND', 'unset')}, CUDA "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}"
    )
    return out


# - Running on a worker thread, as the engine does
def on_worker(fn: Callable[[], Any], threads: int) -> Any:
    """``fn()`` on a new Python thread whose intra-op threads are ``threads`` (Note: [Host
    threads] in torchoffload/optim/_worker.py)."""
    box: dict[str, Any] = {}

    def work() -> None:
        torch.set_num_threads(threads)
        try:
            box["out"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["exc"] = exc

    t = threading.Thread(target=work, name="host-step-bench")
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


@contextlib.contextmanager
def main_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# - Memory
class Arrays:
    """Four fp32 arrays of ``n`` elements (p, g, m, v), allocated by ``how``:
    ``worker``: ``torch.empty``, first written by a worker thread of ``threads`` threads;
    ``main``: first written by the main thread with one thread; ``thp``: an anonymous mapping
    advised MADV_HUGEPAGE, first written by the worker; ``pin``: page-locked
    (cudaHostRegister) after it is written."""

    def __init__(self, n: int, threads: int, how: str = "worker", pin: bool = False):
        self._keep: list[Any] = []  # mappings the arrays' memory belongs to
        self._pinned: list[int] = []
        before = huge_bytes()
        flats = [self._alloc(n, how == "thp") for _ in range(4)]
        values = (1.0, 1e-3, 0.0, 0.0)

        def touch() -> None:
            for flat, x in zip(flats, values, strict=True):
                flat.fill_(x)

        if how == "main":
            with main_threads(1):
                touch()
        else:
            on_worker(touch, threads)
        if pin:
            for flat in flats:
                self._pinned.append(register(flat))
        self.flats = tuple(flats)
        self.huge = (huge_bytes() - before) / (16 * n)  # the share in huge pages

    def _alloc(self, n: int, thp: bool) -> torch.Tensor:
        if not thp:
            return torch.empty(n, dtype=torch.float32)
        mm = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)  # before the first write: faults take huge pages
        self._keep.append(mm)
        return torch.frombuffer(mm, dtype=torch.float32)

    def free(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
        self.flats = ()
        self._pinned, self._keep = [], []


def register(t: torch.Tensor) -> int:
    """Page-lock ``t``'s memory (cudaHostRegister); returns its address for unregistering."""
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.itemsize, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed (error {err})")
    return t.data_ptr()


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` (offset, length) ranges covering ``range(n)`` as evenly as possible."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def groups(n: int, layout: str, args) -> list[list[tuple[int, int]]]:
    """The tensors of each optimizer: one optimizer over ``--tensors`` tensors, or
    ``--buckets`` optimizers of ``--per-bucket`` tensors each."""
    if layout == "one call":
        return [split(n, args.tensors)]
    return [[(o + a, k) for a, k in split(length, args.per_bucket)]
            for o, length in split(n, args.buckets)]  # fmt: skip


def deepspeed_adam():
    """DeepSpeedCPUAdam, or the reason it cannot be used."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or it does not import here
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    return DeepSpeedCPUAdam, None


def optimizers(kind: str, arrays, parts: list[list[tuple[int, int]]]) -> list:
    """One optimizer of ``kind`` per entry of ``parts`` over views of ``arrays`` (p, g, m, v),
    its state set to views of the moments; where m is None, left to its first step to
    allocate (as in the engine)."""
    p_all, g_all, m_all, v_all = arrays
    out = []
    for part in parts:
        ps = []
        for off, k in part:
            p = p_all.narrow(0, off, k)
            p.grad = g_all.narrow(0, off, k)
            ps.append(p)
        hyper = dict(lr=1e-3, weight_decay=0.01)
        if kind == "deepspeed":
            cls, _ = deepspeed_adam()
            opt = cls(ps, adamw_mode=True, **hyper)
        else:
            flags = {"fused": dict(fused=True), "foreach": dict(foreach=True),
                     "single-tensor": dict(foreach=False, fused=False)}[kind]  # fmt: skip
            opt = torch.optim.AdamW(ps, **hyper, **flags)
        if m_all is not None:
            for p, (off, k) in zip(ps, part, strict=True):
                step = 0 if kind == "deepspeed" else torch.zeros((), dtype=torch.float32)
                opt.state[p] = {"step": step, "exp_avg": m_all.narrow(0, off, k),
                                "exp_avg_sq": v_all.narrow(0, off, k)}  # fmt: skip
        out.append(opt)
    return out


def step_ms(opts: list, threads: int, reps: int, here: bool = False) -> float:
    """Median ms of stepping every optimizer in turn, on a worker thread (``here``: on this
    thread, already one), after one warm-up."""

    def run() -> float:
        for o in opts:
            o.step()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for o in opts:
                o.step()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2] * 1e3

    return run() if here else on_worker(run, threads)


def triad_gbs(n: int, threads: int, reps: int, arrays: tuple[torch.Tensor, ...]) -> float:
    """Best GB/s of ``a = b + s * c`` (12 bytes an element) on a worker thread."""
    a, b, c = arrays

    def run() -> float:
        best = float("inf")
        torch.add(b, c, alpha=3.0, out=a)
        for _ in range(reps):
            t = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            best = min(best, time.perf_counter() - t)
        return 12 * n / best / 1e9

    return on_worker(run, threads)


# - The tables
def default_threads(cores: int) -> list[int]:
    picks = {cores // 4, cores // 2, 3 * cores // 4, cores - 1, cores}
    return sorted(t for t in picks if t >= 1)


class Table:
    """The AdamW table: one row per measurement, printed as it is measured."""

    HEAD = ("| section | optimizer | layout | threads | setting | huge pages | ms/step | GB/s "
            "| x triad |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip

    def __init__(self, triad: float):
        self.triad = triad
        print(self.HEAD, flush=True)

    def row(self, section, kind, layout, threads, setting, huge, ms, n) -> None:
        """``huge``: the share of the arrays' bytes in transparent huge pages."""
        gbs = BYTES_PER_PARAM * n / (ms / 1e3) / 1e9
        print(f"| {section} | {kind} | {layout} | {threads} | {setting} | {huge:.0%} | "
              f"{ms:.{1 if ms >= 100 else 3}f} | {gbs:.1f} | {gbs / self.triad:.2f} |",
              flush=True)  # fmt: skip


def spin(k: int) -> int:
    """``k`` iterations of Python that hold the GIL."""
    x = 0
    for _ in range(k):
        x ^= 1
    return x


def python_rate() -> float:
    """Iterations of `spin` per microsecond on this thread."""
    t = time.perf_counter()
    spin(200_000)
    return 200_000 / ((time.perf_counter() - t) * 1e6)


def busy_main(work: Callable[[], Any], threads: int, every_us: float | None, interval: float,
              rate: float, cap_s: float) -> tuple[Any, bool]:  # fmt: skip
    """``work()`` on a worker thread while this thread runs Python, holding the GIL but for
    a small op every ``every_us`` microseconds (None: never), as backward's recomputation and
    hooks do while they launch kernels, under a GIL switch interval of ``interval`` s. The
    loop stops after ``cap_s`` s (returned: whether it did)."""
    box: dict[str, Any] = {}

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            box["out"] = work()
        except BaseException as exc:
            box["exc"] = exc

    k = max(1, int((every_us or 100) * rate))
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    t = threading.Thread(target=run, name="host-step-bench")
    deadline = time.perf_counter() + cap_s
    try:
        t.start()
        while t.is_alive() and time.perf_counter() < deadline:
            spin(k)
            if every_us is not None:
                torch.empty(0)
    finally:
        capped = t.is_alive()
        t.join()
        sys.setswitchinterval(old)
    if "exc" in box:
        raise box["exc"]
    return box["out"], capped


def section_kernels(table, arr, n, layouts, kinds, cores, args, notes) -> None:
    huge = arr.huge
    for kind in kinds:
        if kind == "deepspeed":
            cls, why = deepspeed_adam()
            if cls is None:
                notes.append(f"skipped deepspeed: {why}")
                continue
            t = time.perf_counter()
            try:  # builds its extension on first use
                optimizers(kind, arr.flats, [[(0, 1)]])
            except Exception as exc:
                notes.append(f"skipped deepspeed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            notes.append(f"DeepSpeedCPUAdam built or loaded in {time.perf_counter() - t:.0f} s")
        reps = args.slow_reps if kind in ("foreach", "single-tensor") else args.reps
        for name, parts in layouts.items():
            ms = step_ms(optimizers(kind, arr.flats, parts), cores, reps)
            table.row("kernels", kind, name, cores, "worker", huge, ms, n)


def section_gil(table, arr, n, parts, cores, args) -> None:
    """The bucketed fused step while the main thread runs Python: backward's recomputation
    and hooks, or the next forward with ``step_ahead``, hold the GIL while the engine's worker
    steps, and each bucket's step takes the GIL several times."""
    huge = arr.huge
    rate = python_rate()
    below = max(1, cores - 1)  # a core left to the main thread: the GIL's cost alone
    rows = [(below, "idle", 0.005), (below, 10, 0.005), (below, 100, 0.005), (below, 100, 0.001),
            (below, None, 0.005), (cores, 10, 0.005)]  # fmt: skip
    for threads, every, interval in rows:
        opts = optimizers("fused", arr.flats, parts)
        work = functools.partial(step_ms, opts, threads, args.reps, here=True)
        if every == "idle":
            ms, setting = on_worker(work, threads), "main idle"
        else:
            ms, capped = busy_main(work, threads, every, interval, rate, args.gil_cap)
            op = "GIL held" if every is None else f"an op every {every} us"
            setting = f"main runs Python, {op}, switch {interval * 1e3:g} ms"
            setting += f" (stopped after {args.gil_cap:g} s)" if capped else ""
        table.row("gil", "fused", "buckets", threads, setting, huge, ms, n)


def section_placement(table, n, parts, cores, args, notes) -> None:
    cuda = torch.cuda.is_available()
    thp = thp_mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")
    variants = [("worker", "worker", False), ("main, 1 thread", "main", False)]
    if thp:
        variants.append(("thp", "thp", False))
    else:
        notes.append(f"skipped placement thp: transparent huge pages {thp_mode()}")
    if cuda:
        variants += [("pinned", "worker", True)] + ([("thp, pinned", "thp", True)] if thp else [])
    else:
        notes.append("skipped placement pinned: no CUDA")
    variants += [("engine", "engine", False)] + ([("engine, thp p, g", "engine", True)] if thp
                                                 else [])  # fmt: skip
    # Two rounds, the second in reverse order: memory freed and allocated again can step at
    # another speed than fresh memory (seen on a virtual machine), so an order effect shows.
    for round_, order in enumerate((variants, variants[::-1]), 1):
        for label, how, flag in order:
            if how == "engine":
                ms, huge = engine_placement(n, cores, parts, args.reps, cuda, flag)
                label += "" if cuda else " (not pinned: no CUDA)"
            else:
                arr = Arrays(n, cores, how, flag)
                ms = step_ms(optimizers("fused", arr.flats, parts), cores, args.reps)
                huge = arr.huge
                arr.free()
            table.row("placement", "fused", "buckets", cores, f"{label} #{round_}", huge, ms, n)


def engine_placement(n: int, threads: int, parts, reps: int, cuda: bool, thp: bool):
    """Fused AdamW in buckets over arrays placed as `OffloadedOptimizer` places them: master
    and gradient in `_pool.pinned_buffer` (page-locked with CUDA) allocated and written by the
    main thread, the moments allocated by the optimizer class in its first step, on the
    worker; ``thp``: the master and gradient in huge pages (advised before they are pinned).
    Returns (ms, share of the four arrays in huge pages)."""
    from torchoffload._pool import pinned_buffer

    before = huge_bytes()
    keep = []
    if thp:
        pg = []
        for _ in range(2):
            mm = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.madvise(mmap.MADV_HUGEPAGE)
            keep.append(mm)
            t = torch.frombuffer(mm, dtype=torch.float32)
            t.fill_(0.0)
            if cuda:
                register(t)
            pg.append(t)
        p, g = pg
    else:
        keep = [pinned_buffer(4 * n, pin=cuda) for _ in range(2)]  # kept: their registration
        p, g = (buf.view(torch.float32) for buf in keep)
    p.fill_(1.0)
    g.fill_(1e-3)
    opts = optimizers("fused", (p, g, None, None), parts)
    ms = step_ms(opts, threads, reps)  # its warm-up step allocates the moments
    huge = (huge_bytes() - before) / (16 * n)
    if thp and cuda:
        for t in (p, g):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    del opts, p, g, keep
    return ms, huge


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=3.2e9, help="AdamW parameters (3.2e9)")
    p.add_argument("--placement-params", type=float, default=2e8,
                   help="parameters of the placement section (at most --params)")  # fmt: skip
    p.add_argument("--tensors", type=int, default=4, help="tensors of the one-call layout")
    p.add_argument("--buckets", type=int, default=50)
    p.add_argument("--per-bucket", type=int, default=4, help="tensors per bucket")
    p.add_argument("--threads", help="comma-separated thread counts of the sweep")
    p.add_argument("--reps", type=int, default=3, help="timed steps per row (median)")
    p.add_argument(
        "--slow-reps",
        type=int,
        default=1,
        help="timed steps of the foreach and single-tensor rows (far from the bound)",
    )
    p.add_argument("--triad-mib", type=int, default=0, help="MiB per triad array (0: auto)")
    p.add_argument("--triad-reps", type=int, default=10)
    p.add_argument("--kernels", default="fused,foreach,single-tensor,deepspeed")
    p.add_argument("--sections", default="kernels,threads,gil,placement")
    p.add_argument("--gil-cap", type=float, default=10.0,
                   help="seconds a gil row's main thread runs Python at most")  # fmt: skip
    p.add_argument("--deepspeed", metavar="DIR", help="a pip --target directory with deepspeed")
    args = p.parse_args()
    if args.deepspeed:
        sys.path.insert(0, args.deepspeed)
        os.environ["PATH"] = os.path.join(args.deepspeed, "bin") + os.pathsep + os.environ["PATH"]
    n, n_place = int(args.params), int(min(args.placement_params, args.params))
    sections = args.sections.split(",")
    kinds = args.kernels.split(",") if "kernels" in sections else []
    cores = torch.get_num_threads()
    sweep = [int(t) for t in args.threads.split(",")] if args.threads else default_threads(cores)
    lscpu = _command("lscpu")
    triad_mib = args.triad_mib or max(1024, 4 * l3_bytes(lscpu) >> 20)
    n_triad = triad_mib << 18
    # The peak: the triad's three arrays, then the four arrays and the foreach path's
    # temporaries (one array).
    peak = max(12 * n_triad, 16 * n + (4 * n if "foreach" in kinds else 0))
    avail = meminfo("MemAvailable")
    t_start = time.perf_counter()
    print("host:")
    for line in host_lines(lscpu):
        print(f"  {line}")
    print(f"  memory planned: {peak / GiB:.1f} GiB at most", flush=True)
    if avail is not None and peak > 0.9 * avail:
        sys.exit(f"{peak / GiB:.1f} GiB planned, {avail / GiB:.1f} GiB available: lower --params")

    # The bound: the triad at each thread count, on a worker thread.
    abc = tuple(torch.empty(n_triad) for _ in range(3))
    on_worker(lambda: [x.fill_(1.0) for x in abc], max(sweep + [cores]))
    triads = {t: triad_gbs(n_triad, t, args.triad_reps, abc) for t in sorted({*sweep, cores})}
    abc = ()
    triad = max(triads.values())
    print(f"\ntriad a = b + s*c, fp32, 3 x {triad_mib} MiB, best of {args.triad_reps}, GB/s "
          f"at 12 bytes an element:")  # fmt: skip
    print("| threads | triad GB/s |\n|---|---|")
    for t, gbs in triads.items():
        print(f"| {t} | {gbs:.1f} |")
    print(f"bound: {triad:.1f} GB/s", flush=True)

    print(f"\nAdamW, fp32, {BYTES_PER_PARAM} bytes a parameter, over {n / 1e9:.3f} B parameters "
          f"({n_place / 1e9:.3f} B for placement); buckets = {args.buckets} optimizers of "
          f"{args.per_bucket} tensors, one call = {args.tensors} tensors; median of {args.reps} "
          f"steps after one ({args.slow_reps} for foreach and single-tensor); sections "
          f"{args.sections}")  # fmt: skip
    table = Table(triad)
    notes: list[str] = []
    spent = {}
    if {"kernels", "threads", "gil"} & set(sections):
        t = time.perf_counter()
        arr = Arrays(n, cores)
        spent["allocation"] = time.perf_counter() - t
        layouts = {name: groups(n, name, args) for name in ("one call", "buckets")}
        if "kernels" in sections:
            t = time.perf_counter()
            section_kernels(table, arr, n, layouts, kinds, cores, args, notes)
            spent["kernels"] = time.perf_counter() - t
        if "threads" in sections:
            t = time.perf_counter()
            for threads in sweep:
                ms = step_ms(optimizers("fused", arr.flats, layouts["buckets"]), threads, args.reps)
                table.row("threads", "fused", "buckets", threads, "worker", arr.huge, ms, n)
            spent["threads"] = time.perf_counter() - t
        if "gil" in sections:  # over the first --placement-params parameters
            t = time.perf_counter()
            section_gil(table, arr, n_place, groups(n_place, "buckets", args), cores, args)
            spent["gil"] = time.perf_counter() - t
        arr.free()
        del arr, layouts
    if "placement" in sections:
        t = time.perf_counter()
        section_placement(table, n_place, groups(n_place, "buckets", args), cores, args, notes)
        spent["placement"] = time.perf_counter() - t
    for line in notes:
        print(line)
    print(
        f"done in {time.perf_counter() - t_start:.0f} s ("
        f"{', '.join(f'{k} {v:.0f} s' for k, v in spent.items())})"
    )


if __name__ == "__main__":
    main()
