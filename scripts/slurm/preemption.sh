# Sourced by the sbatch scripts: a stop signal reaches the training processes, which save.
#
# The scripts always pass Megatron's --exit-signal-handler: on its --exit-signal (SIGTERM unless
# the config says otherwise) every rank finishes the iteration in flight, the ranks agree, the
# checkpoint is saved to --save and the job exits 0. Without it a SIGTERM stops the processes where
# they are and saves nothing (Megatron's rule; docs/checkpoints.md "Preemption").
#
# torchrun must stay out of the signal's way: on SIGTERM it signals its workers itself and
# SIGKILLs them 30 s later, which cuts any save longer than that. So torchrun is started with the
# exit signal ignored and left out of its --signals-to-handle; its workers inherit the
# ignored disposition until Megatron installs its handler, early in initialization.

exit_signal_name() {
    # The job's exit signal as `kill` names it (TERM), from the last --exit-signal in "$@".
    local sig=SIGTERM i
    local -a args=("$@")
    for ((i = 0; i < ${#args[@]} - 1; i++)); do
        [[ "${args[i]}" == --exit-signal ]] && sig="${args[i+1]}"
    done
    sig="${sig#Signals.}"
    sig="${sig#SIG}"
    [[ "$sig" =~ ^[0-9]+$ ]] && sig="$(kill -l "$sig")"
    echo "$sig"
}

torchrun_signals_without() {
    # torchrun's default --signals-to-handle less SIG$1.
    local kept=() s
    for s in SIGTERM SIGINT SIGHUP SIGQUIT; do
        [[ "$s" != "SIG$1" ]] && kept+=("$s")
    done
    (IFS=,; echo "${kept[*]}")
}
