"""The scripts in examples/ run as written (on CPU here; on GPUs: benchmarks/README.md)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from dist_workers import loopback_env

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: int = 240) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    for key, value in loopback_env().items():
        env.setdefault(key, value)
    with socket.socket() as s:  # a free port for a single-process group
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_fsdp_offload_two_ranks_on_gloo():
    out = run(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "examples/train_fsdp_offload.py", "--model", "gpt", "--steps", "2",
    )  # fmt: skip
    assert "2 rank(s) on cpu" in out
    assert "losses identical with and without offloading: True" in out
    lines = [line for line in out.splitlines() if line.startswith("offload ")]
    assert len(lines) == 1 and "MiB" in lines[0]  # it offloaded something


def test_train_fsdp_offload_single_process_llama():
    pytest.importorskip("transformers")
    out = run("examples/train_fsdp_offload.py", "--steps", "2", "--batch", "1,2")
    assert "llama" in out and "1 rank(s) on cpu" in out
    assert out.count("losses identical with and without offloading: True") == 2


def test_generate_streamed():
    pytest.importorskip("transformers")
    out = run("examples/generate_streamed.py", "--new-tokens", "8")
    assert "tokens identical to the all-on-device run: True" in out
    assert "stream_weights" in out
    assert "CUDA-graph tokens identical to the all-on-device static-cache decode: True" in out
    assert "CUDA-graph decode: 13 of 16 calls replayed" in out  # eager: prefills, warm-up


def test_generate_streamed_aoti():
    pytest.importorskip("transformers")
    out = run("examples/generate_streamed.py", "--new-tokens", "4", "--no-compare", "--aoti")
    assert "holding no weight bytes" in out
    assert "AOTI streamed tokens identical to the same package all kept: True" in out


def test_train_offloaded_optimizer_bitwise_on_cpu():
    pytest.importorskip("transformers")
    out = run(
        "examples/train_offloaded_optimizer.py", "--dtype", "fp32", "--steps", "3",
        "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "512", "--vocab", "2048", "--seq", "64",
    )  # fmt: skip
    assert "bitwise equal losses: True" in out
    assert "host step" in out and out.count("tokens/s") == 3
    assert "parameters: at most" in out
