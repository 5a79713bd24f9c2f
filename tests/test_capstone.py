"""Chapter 08's walk-through (`make capstone`), at its quick size: train a GPT-MoE on 4 ranks,
resume it on 2 under another layout, export it to Hugging Face and back, generate, plan. It
checks each step itself (the history continues, the round trip is bit-identical, transformers'
greedy text is the book's when installed) and ends with DONE and exit 0."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_walk_through_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "chapters/08_capstone/capstone.py", "--quick", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "resharded from 4 ranks (tp 2, pp 1, cp 1, ep 2" in out
    assert "MixtralForCausalLM" in out and "back again bit-identical" in out
    assert "top 3 by estimated step time" in out
    assert out.splitlines()[-1].startswith("DONE")
