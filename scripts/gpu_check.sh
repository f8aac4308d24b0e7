#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a CUDA machine (1 or 8 GPUs): Megatron's training loop
# on NCCL + bf16 with a save and a bitwise resume, the TP2 x DP2 equivalence on NCCL with a GPU per
# rank (skipped, with the reason in the report, on one GPU), rank 0 of Llama-3 8B / 70B / 405B
# production layouts stepped on real CUDA tensors under the fake process group, and bf16
# Newton–Schulz speed per method. Writes gpu_check.json and gpu_check.md into $OUT (or
# ./gpu-check), headed by the installed torch / megatron-core / TE against pyproject's ranges.
# Exit status 1 if a part failed.
#
#   bash scripts/gpu_check.sh                      # every part
#   bash scripts/gpu_check.sh --parts ns           # a subset (train, equivalence, real-step, ns)
#
# Uses the machine's python3 (torch with CUDA). megatron-core is not on such a machine by default:
# carry its wheels in .whl/ (megatron-core==0.19.2 and what it needs that the machine lacks; see
# the device notes), and they are installed into /tmp/site first. Without a GPU it stops with a
# clear message; `python -m scripts.gpu_check --device cpu --train-iters 10 --scale 64` rehearses
# every part on the CPU (tests/e2e/test_gpu_check_cpu_rehearsal.py runs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-python3}"
if ! "$python" -c 'import megatron.core' 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    else
        echo "gpu_check.sh: megatron-core is not importable and no wheels are in .whl/" >&2
        exit 2
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # megatron_muon from this checkout
exec "$python" -m scripts.gpu_check --out "${OUT:-gpu-check}" "$@"
