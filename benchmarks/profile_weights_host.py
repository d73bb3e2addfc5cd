"""Profile the host path of weight streaming: `python benchmarks/profile_weights_host.py`.

A development aid, not a benchmark: 200 tiny units, a 4-unit budget, cProfile by own time.
"""

import cProfile
import pstats
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchoffload import stream_weights  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)]).eval().to(dev)
x = torch.randn(1, 8, device=dev)
h = stream_weights(m, dev, budget_bytes=4 * 1024)
with torch.inference_mode():
    for _ in range(5):
        m(x)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        m(x)
    pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
