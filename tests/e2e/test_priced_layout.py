"""``--muon-dp-layout priced`` through Megatron's own training loop: the DDP factory reads the
price from Megatron's args at wrap time (``megatron.layout.megatron_layout_price``), every DP
rank lays its buffer out alike, and the startup report prints the choice.

The tiny GPT of ``test_pretrain`` at TP1 × DP2 on the CPU (``--muon-auto-hardware detect``:
the cpu-gloo profile), ``--overlap-grad-reduce``.
"""

from __future__ import annotations

import re

from entry_harness import TINY, launch


def test_priced_layout_trains_and_reports_its_choice(tmp_path):
    job = launch([*TINY, "--tensor-model-parallel-size", "1", "--train-iters", "3", "--log-interval", "1",
                  "--overlap-grad-reduce", "--muon-dp-layout", "priced"], tmp_path, nproc=2, timeout=300)
    assert job.returncode == 0, f"pretrain_gpt.py failed (rc={job.returncode}):\n{job.out[-6000:]}"
    # M = global batch 4 / (micro-batch 2 x DP 2) = 1, priced on the profile detected on this CPU
    line = re.search(r"DDP buckets \(float32 params, float32 grads\): (whole|megatron|row-aligned), \d+ buckets?: "
                     r"exposed DDP [0-9.]+ ms \+ Muon step [0-9.]+ ms per iteration predicted \(whole matrices: .*\), "
                     r"cpu-gloo, M 1", job.out)
    assert line, job.out[-6000:]
    assert "iteration        3/       3" in job.out
