from __future__ import annotations

import subprocess
import sys

from torchoffload.cli import main


def test_demo_runs_and_reports_bitwise_equal(capsys):
    rc = main(["demo", "--steps", "2", "--hidden", "64", "--layers", "2", "--seq", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "offload_activations" in out and "ms/step" in out
    assert "bitwise equal over 2 steps: True" in out
    assert "stream_weights" in out and "tokens bitwise equal: True" in out


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "torchoffload", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_import_is_light():
    code = (
        "import sys, torchoffload; "
        "bad = [m for m in ('matplotlib', 'transformers', 'torch._dynamo') if m in sys.modules]; "
        "print(bad)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bad_arguments_get_a_message_not_a_traceback(capsys):
    import pytest

    for argv, flag in (
        (["demo", "--steps", "0"], "--steps: must be >= 1"),
        (["demo", "--seq", "8"], "--seq: must be >= 16"),
        (["demo", "--batch", "0"], "--batch: must be >= 1"),
        (["plan", "--prefetch-layers", "-1"], "--prefetch-layers: must be >= 0"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and flag in capsys.readouterr().err
    assert main(["plan", "--hf-config", "/nonexistent/config.json"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
