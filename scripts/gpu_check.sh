#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a CUDA machine (1 or 8 GPUs): Megatron's training loop
# on NCCL + bf16 with a save and a bitwise resume, the TP2 x DP2 equivalence on NCCL with a GPU per
# rank (skipped, with the reason in the report, on one GPU), the busiest rank of Llama-3 8B / 70B /
# 405B (owner and auto) and DeepSeek-V3 (auto, TP1: DP teams) production layouts stepped on real
# CUDA tensors under the fake process group, and bf16
# Newton–Schulz speed per method. Writes gpu_check.json and gpu_check.md into $OUT (or
# ./gpu-check), headed by the installed torch / megatron-core / TE against pyproject's ranges.
# Parts run in order of value (ns, real-step, train, equivalence) within a budget (--budget-s,
# 480 s by default: the whole check ends within 8 minutes on one H200, every subprocess capped by
# what is left of it), and the report is written after each part, with a line on stderr as each
# part finishes: a check cut short keeps what it did. Exit status 1 if a part failed.
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
# The megatron-core the plugin is built against (the lock's pin), checked by the version the module
# itself reports: an NGC image ships another megatron-core (often a source install with no
# distribution metadata), with which the plugin's subclasses do not line up. The carried wheels in
# .whl/ go first on the path when the importable one is another version or none.
want="$(sed -n 's/^megatron-core==//p' scripts/requirements.lock)"
megatron_version() {  # the public version (0.19.2 of 0.19.2+703ec6b), or nothing when it does not import
    local v
    v="$("$python" -c 'from megatron.core.package_info import __version__; print(__version__)' 2>/dev/null || true)"
    echo "${v%%+*}"
}
have="$(megatron_version)"
if [[ "$have" != "$want" ]]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "gpu_check.sh: megatron-core ${have:-not importable} here, ${want} wanted: installing .whl/ into /tmp/site" >&2
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
        have="$(megatron_version)"
    fi
    if [[ "$have" != "$want" ]]; then
        echo "gpu_check.sh: megatron-core ${want} is needed (scripts/requirements.lock), ${have:-none} is importable," \
             "and .whl/ holds no wheel of it" >&2
        exit 2
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # megatron_muon from this checkout
exec "$python" -m scripts.gpu_check --out "${OUT:-gpu-check}" "$@"
