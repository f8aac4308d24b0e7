# Sourced by scripts/run.sh and scripts/slurm/*.sbatch: CUDA_DEVICE_MAX_CONNECTIONS as the run needs it.
#
# Megatron's validate_args wants 1 whenever TP > 1 (kernel ordering on pre-Blackwell GPUs);
# Megatron-FSDP and torch FSDP2 assert it is not 1 (they overlap communication on several
# connections). A value already exported is kept, except a 1 under FSDP, which would be refused.

# set_cuda_connections CONFIG.yaml [EXTRA MEGATRON ARGS...]
set_cuda_connections() {
    local config="$1"
    shift
    if grep -qE '^use_(megatron_fsdp|torch_fsdp2): *true' "$config" \
            || [[ " $* " == *" --use-megatron-fsdp "* || " $* " == *" --use-torch-fsdp2 "* ]]; then
        if [[ "${CUDA_DEVICE_MAX_CONNECTIONS:-}" == 1 ]]; then
            echo "[cuda_connections] CUDA_DEVICE_MAX_CONNECTIONS=1 unset: Megatron-FSDP and FSDP2 refuse it" >&2
            unset CUDA_DEVICE_MAX_CONNECTIONS
        fi
    else
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    fi
}
