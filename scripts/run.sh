#!/usr/bin/env bash
# One entry for a fresh machine: builds the virtual environment if it is missing or stale,
# then runs the main job or the test suite.
#
#   bash scripts/run.sh main [CONFIG.yaml|CONFIG.yml] [ARGS...]
#                                        # the main job: the tiny-GPT demo (configs/tiny-cpu.yaml, or the
#                                        #   CONFIG given, e.g. configs/tiny-cpu-fsdp.yaml,
#                                        #   configs/tiny-cpu-fsdp2.yaml or configs/moe-tiny-cpu.yaml): byte-level data from the stdlib, then
#                                        #   Megatron's own training loop with --optimizer muon on 2 processes
#   bash scripts/run.sh test [ARGS...]   # the test suite (pytest, every tier), ARGS passed through
#   bash scripts/run.sh test-fast [ARGS...]
#                                        # the fast tier: the same pytest with -m "not megatron and not e2e"
#                                        #   (tests/unit and tests/dist: no Megatron world, no training job)
#   bash scripts/run.sh bench [ARGS...]  # the TP-mode benchmark (python -m scripts.bench.bench_tp_modes)
#   bash scripts/run.sh dry-run ARGS...  # the real step at production scale on the meta device
#                                        #   (scripts/dry_run.py --model llama3-405b --tp 8 --pp 16 --dp 64)
#   bash scripts/run.sh perf             # docs/performance.md's tables, into bench-results/: hardware
#                                        #   calibration, optimizer-step benchmark, cost-model validation,
#                                        #   planner quality, GPU projection (about 3 minutes on 2 cores)
#   bash scripts/run.sh compare [ARGS...] # the convergence comparison (python -m scripts.bench.compare_optimizers,
#                                        #   about 30 minutes on 2 cores), into bench-results/compare/
#
# The venv lives in .venv/ and is reused while the requirements pinned in pyproject.toml and
# the interpreter are unchanged; a fresh install downloads about 4.7 GB.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGATRON_MUON_VENV:-$repo/.venv}"

find_python312() {
    # pyenv shims answer `python3.12` even when 3.12 is not the selected version, and then
    # fail at run time, so every candidate is tried by running it.
    local candidates=(python3.12)
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
    fi
    candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12)
    local c
    for c in "${candidates[@]}"; do
        if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            command -v "$c" 2>/dev/null || echo "$c"
            return 0
        fi
    done
    echo "error: Python 3.12 not found (tried: ${candidates[*]}). Install it, e.g. 'pyenv install 3.12'." >&2
    return 1
}

ensure_venv() {
    local py stamp
    py="$(find_python312)"
    # The stamp covers only what decides the installed set: the lock file, the package's declared
    # requirements and the interpreter (the package itself is installed editable, so code edits
    # need no rebuild).
    stamp="$("$py" - "$repo/pyproject.toml" "$repo/scripts/requirements.lock" <<'PY' | sha256sum | cut -d' ' -f1
import json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(json.dumps([project["dependencies"], project.get("optional-dependencies", {}), open(sys.argv[2]).read(),
                  sys.version]))
PY
)"
    if [[ -x "$venv/bin/python" && -f "$venv/.requirements-stamp" \
          && "$(cat "$venv/.requirements-stamp")" == "$stamp" ]]; then
        return 0
    fi
    echo "[run.sh] creating $venv with $py (pinned requirements changed or venv missing)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # Exact versions from the lock, then the package itself without resolving again; pip check
    # fails the setup if the lock no longer satisfies the package's declared ranges.
    "$venv/bin/python" -m pip install --quiet -r "$repo/scripts/requirements.lock"
    "$venv/bin/python" -m pip install --quiet --no-deps -e "$repo"
    "$venv/bin/python" -m pip check
    echo "$stamp" > "$venv/.requirements-stamp"
}

ensure_slurm() {
    # tests/e2e/test_slurm.py runs the sbatch scripts under a real one-node Slurm. Install it once
    # (root with apt-get: this project's machines and CI); elsewhere that test skips, saying why.
    if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "[run.sh] Slurm is not installed and cannot be (needs root and apt-get): tests/e2e/test_slurm.py will skip" >&2
        return 0
    fi
    echo "[run.sh] installing slurm-wlm and munge for tests/e2e/test_slurm.py" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

closing_hint() {
    # What the run left and how to go on, from the job's own argument list (the config's flags
    # and the user's, as the preflight resolved them): the last --save, --load and --train-iters win.
    local config="$1"; shift
    local save="" load="" iters="" user=() i
    local args=()
    while [[ $# -gt 0 && "$1" != "--" ]]; do args+=("$1"); shift; done
    shift || true
    while [[ $# -gt 0 ]]; do  # the user's arguments, less the ones the hint sets again
        case "$1" in
            --train-iters) shift 2 || shift ;;
            --override-opt-param-scheduler) shift ;;
            *) user+=("$1"); shift ;;
        esac
    done
    for ((i = 0; i < ${#args[@]} - 1; i++)); do
        case "${args[i]}" in
            --save) save="${args[i+1]}" ;;
            --load) load="${args[i+1]}" ;;
            --train-iters) iters="${args[i+1]}" ;;
        esac
    done
    if [[ -z "$save" ]]; then
        echo "No checkpoint: this run has no --save."
        return 0
    fi
    local more=()
    [[ "$config" != configs/tiny-cpu.yaml ]] && more+=("$config")
    more+=("${user[@]}")
    [[ "$load" != "$save" ]] && more+=(--load "$save")  # after the user's own --load: the last one wins
    [[ -n "$iters" ]] && more+=(--train-iters "$((iters * 2))")
    more+=(--override-opt-param-scheduler)
    if [[ "$load" == "$save" ]]; then
        echo "Checkpoint: $save. Running the same command again resumes from it; to train on:"
    else
        echo "Checkpoint: $save. This command loads from ${load:-nothing (no --load)}, not from there, when run" \
             "again; to resume from $save and train on:"
    fi
    echo "  bash scripts/run.sh main $(printf '%q ' "${more[@]}" | sed 's/ $//')"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    main)
        cd "$repo"
        # The config: a first argument that is not a flag (Megatron's all start with -). Checked
        # before the venv, the data and the preflight, so that a typo costs no install or build;
        # the first two are yaml_config's lines.
        config=configs/tiny-cpu.yaml
        if [[ $# -gt 0 && "$1" != -* ]]; then
            config="$1"
            shift
            if [[ -d "$config" ]]; then
                echo "megatron-muon: error: $config: is a directory; expected a YAML config file" >&2
                exit 2
            elif [[ ! -e "$config" ]]; then
                echo "megatron-muon: error: $config: no such config file" >&2
                exit 2
            elif [[ "$config" != *.yaml && "$config" != *.yml ]]; then
                echo "megatron-muon: error: $config: expected a YAML config file (.yaml or .yml) before the Megatron flags" >&2
                exit 2
            fi
        fi
        ensure_venv
        if [[ ! -f data/train_text_document.bin ]]; then
            # Megatron's import warnings (no GPU, no Transformer Engine) are not the user's answer:
            # shown only when the build fails, so that a bad flag below is still one line.
            echo "[run.sh] building the demo dataset in data/ (scripts/prepare_data.py)" >&2
            if ! log="$("$venv/bin/python" scripts/prepare_data.py --out data 2>&1)"; then
                echo "$log" >&2
                exit 1
            fi
        fi
        port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        # CUDA_DEVICE_MAX_CONNECTIONS: 1 for TP, unset for Megatron-FSDP / FSDP2
        source scripts/cuda_connections.sh
        set_cuda_connections "$config" "$@"
        # The config and ARGS, checked as the job's rank 0 of 2 will check them before torchrun
        # starts anything (megatron_muon.megatron.preflight): a mistake is one line and exit 2.
        # Its arguments come back NUL-terminated, through a file (a shell variable cannot hold NUL):
        # an empty argument ('') or one holding a newline arrives as it was given (one per line,
        # `$(...)` dropped trailing empty ones and `<<<` made a newline two).
        args_file="$(mktemp)"
        "$venv/bin/python" -m megatron_muon.megatron.preflight --null --nproc 2 "$config" "$@" > "$args_file" \
            || { rc=$?; rm -f "$args_file"; exit "$rc"; }
        mapfile -d '' -t config_args < "$args_file"
        rm -f "$args_file"
        # The job runs in the background so that a SIGTERM to this script (a supervisor, `kill`)
        # reaches the training processes themselves, not torchrun (which would give them 30 s and
        # then SIGKILL): with --exit-signal-handler Megatron saves a checkpoint at the end of the
        # iteration and exits 0; without it they stop at once, as before. Ctrl-C (SIGINT to the
        # whole process group) is unchanged.
        ( trap - INT QUIT; exec "$venv/bin/torchrun" --nproc-per-node 2 --master-addr 127.0.0.1 \
            --master-port "$port" scripts/pretrain_gpt.py "${config_args[@]}" ) &
        job=$!
        trap 'pkill -TERM -P "$job" 2>/dev/null || kill -TERM "$job" 2>/dev/null || true' TERM
        rc=0
        while true; do  # `wait` returns early when the trapped signal arrives
            wait "$job" && rc=0 || rc=$?
            kill -0 "$job" 2>/dev/null || break
        done
        trap - TERM
        [[ "$rc" -eq 0 ]] || exit "$rc"
        echo
        closing_hint "$config" "${config_args[@]}" -- "$@"
        ;;
    bench)
        ensure_venv
        cd "$repo"
        exec "$venv/bin/python" -m scripts.bench.bench_tp_modes "$@"
        ;;
    dry-run)
        ensure_venv
        exec "$venv/bin/python" "$repo/scripts/dry_run.py" "$@"
        ;;
    perf)
        ensure_venv
        cd "$repo"
        out=bench-results
        mkdir -p "$out"
        py="$venv/bin/python"
        "$py" -m scripts.bench.calibrate_hardware --nproc 2 --out "$out/hardware-2proc.json" | tee "$out/hardware-2proc.md"
        "$py" -m scripts.bench.calibrate_hardware --nproc 4 --out "$out/hardware-4proc.json" | tee "$out/hardware-4proc.md"
        "$py" -m scripts.bench.bench_optimizer_step --out-dir "$out"
        # predicted on the constants the benchmark's own ranks probed around its timed rounds
        "$py" -m scripts.bench.validate_cost_model --bench "$out/optimizer_step.json" \
            --json "$out/cost_model_validation.json" | tee "$out/cost_model_validation.md"
        "$py" -m scripts.bench.planner_quality --json "$out/planner_quality.json" | tee "$out/planner_quality.md"
        "$py" -m scripts.bench.project_performance --json "$out/projection.json" | tee "$out/projection.md"
        ;;
    compare)
        ensure_venv
        cd "$repo"
        if [[ ! -f data/train_text_document.bin ]]; then
            # Megatron's import warnings (no GPU, no Transformer Engine) are not the user's answer:
            # shown only when the build fails, so that a bad flag below is still one line.
            echo "[run.sh] building the demo dataset in data/ (scripts/prepare_data.py)" >&2
            if ! log="$("$venv/bin/python" scripts/prepare_data.py --out data 2>&1)"; then
                echo "$log" >&2
                exit 1
            fi
        fi
        exec "$venv/bin/python" -m scripts.bench.compare_optimizers "$@"
        ;;
    test)
        ensure_venv
        ensure_slurm
        cd "$repo"
        exec "$venv/bin/python" -m pytest "$@"
        ;;
    test-fast)
        # No Slurm: its only test (tests/e2e/test_slurm.py) is not in this tier.
        ensure_venv
        cd "$repo"
        exec "$venv/bin/python" -m pytest -m "not megatron and not e2e" "$@"
        ;;
    *)
        echo "usage: bash scripts/run.sh {main|test|test-fast|bench|dry-run|perf|compare} [ARGS...]" >&2
        exit 2
        ;;
esac
