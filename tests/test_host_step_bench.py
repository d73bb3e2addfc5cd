"""benchmarks/host_step.py and benchmarks/clip_kernels.py at a tiny size: they run, and their
tables parse with every row (so that they cannot rot between runs on the GPU machine)."""

from __future__ import annotations

from background import Job, output

PARAMS, PLACEMENT = 2_000_000, 1_000_000

# Run beside the other modules' tests (background.py): a few seconds on two cores.
BACKGROUND = {
    "test_host_step_benchmark_tables": Job((
        "benchmarks/host_step.py", "--params", str(PARAMS), "--placement-params",
        str(PLACEMENT), "--triad-mib", "8", "--reps", "1", "--triad-reps", "2", "--buckets", "4",
        "--per-bucket", "2", "--threads", "1,2", "--gil-cap", "5",
    ), timeout=120),
    "test_clip_kernels_table": Job((
        "benchmarks/clip_kernels.py", "--buckets", "3", "--per-bucket", "2", "--numel",
        "100000", "--reps", "1",
    ), timeout=120),
}  # fmt: skip


def table(lines: list[str], head: str) -> list[list[str]]:
    """The cells of the rows of the markdown table whose header starts with ``head``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    assert lines[start + 1].startswith("|---")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_host_step_benchmark_tables():
    result = output(__name__, "test_host_step_benchmark_tables")
    assert result.code == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "host:" and any("NUMA nodes (sysfs)" in line for line in lines)

    triads = {int(t): float(gbs) for t, gbs in table(lines, "| threads | triad GB/s |")}
    assert set(triads) == {1, 2} and all(gbs > 0 for gbs in triads.values())
    bound = float(next(line for line in lines if line.startswith("bound: ")).split()[1])
    assert bound == max(triads.values())

    rows = table(lines, "| section | optimizer |")
    by_section: dict[str, list[list[str]]] = {}
    for cells in rows:
        assert len(cells) == 9, cells
        section, _, _, threads, _, huge, ms, gbs, ratio = cells
        by_section.setdefault(section, []).append(cells)
        int(threads)
        assert huge.endswith("%")
        n = PARAMS if section in ("kernels", "threads") else PLACEMENT
        # 28 bytes a parameter (fp32 AdamW) over the step's time, as printed (rounded)
        assert abs(28 * n / (float(ms) / 1e3) / 1e9 - float(gbs)) <= 0.01 * float(gbs) + 0.06
        # the ratio of the unrounded values, printed to 0.01, from two printed to 0.1: off by
        # at most 0.005 + (0.05 * bound + 0.05 * gbs) / (bound * (bound - 0.05)), and a hair
        g = float(gbs)
        slack = 0.005 + 0.05 * (bound + g + 0.05) / (bound * (bound - 0.05)) + 1e-9
        assert abs(g / bound - float(ratio)) <= slack, (g, bound, ratio)
    assert list(by_section) == ["kernels", "threads", "gil", "placement"]

    kernels = {(c[1], c[2]) for c in by_section["kernels"]}
    for kind in ("fused", "foreach", "single-tensor"):
        assert {(kind, "one call"), (kind, "buckets")} <= kernels
    if "skipped deepspeed" not in result.stdout:
        assert ("deepspeed", "buckets") in kernels
    assert [int(c[3]) for c in by_section["threads"]] == [1, 2]
    gil = [c[4] for c in by_section["gil"]]
    assert gil[0] == "main idle" and len(gil) == 6
    assert all(s.startswith("main runs Python") for s in gil[1:])

    placed = [c[4] for c in by_section["placement"]]
    wanted = ["worker", "main, 1 thread", "engine (not pinned: no CUDA)"]
    if "skipped placement thp" not in result.stdout:
        wanted += ["thp", "engine, thp p, g (not pinned: no CUDA)"]
    for label in wanted:
        assert f"{label} #1" in placed and f"{label} #2" in placed, (label, placed)
    assert result.stdout.rstrip().splitlines()[-1].startswith("done in ")


def test_clip_kernels_table():
    result = output(__name__, "test_clip_kernels_table")
    assert result.code == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = table(lines, "| kernel | ms | GB/s |")
    assert [r[0] for r in rows] == [
        "norm, foreach per bucket",
        "norm, on a pool",
        "multiply by the coefficient",
        "copy",
        "fused AdamW",
    ]
    n = 3 * 2 * 100_000
    for (_, ms, gbs), nbytes in zip(rows, (4, 4, 8, 8, 28), strict=True):
        assert abs(nbytes * n / (float(ms) / 1e3) / 1e9 - float(gbs)) <= 0.01 * float(gbs) + 0.06
    # Note: [Gradient norms on a pool] relies on it
    assert lines[-1].endswith("on the pool and over one list: True")
