#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests of the sbatch scripts.
#
#   bash scripts/slurm/local_cluster.sh start DIR   # writes DIR/slurm.conf, starts munged (if none
#                                                   # answers), slurmctld and slurmd; waits until
#                                                   # `sinfo` shows the node idle
#   bash scripts/slurm/local_cluster.sh stop DIR    # stops what `start` started (by pid files),
#                                                   # removes state/spool; keeps DIR/log
#   export SLURM_CONF=DIR/slurm.conf                # then sbatch/squeue/sinfo/scontrol use it
#
# Installs nothing: it needs slurm-wlm and munge (Debian: apt-get install -y slurm-wlm munge) and
# runs as root (the daemons run as root, SlurmUser=root). What it writes:
#   DIR/slurm.conf  DIR/state/  DIR/spool/  DIR/log/{slurmctld,slurmd,munged}.log
#   DIR/slurmctld.pid  DIR/slurmd.pid  DIR/munged.pid (only when this script started munged)
# Plugins that need no cgroups: proctrack/linuxproc, task/none, select/cons_tres (CR_CPU); no
# accounting (sacct is not available: poll squeue / scontrol show job instead).
# Ports: SLURMCTLD_PORT / SLURMD_PORT (default: two free ports picked at start), so a second
# cluster or a system Slurm on 6817/6818 does not collide.
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action="$1"
mkdir -p "$2"
dir="$(cd "$2" && pwd)"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

log() { echo "[local_cluster] $*" >&2; }

port_in_use() {
    # /dev/tcp connects succeed only when something listens.
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {
    local p
    for _ in $(seq 1 100); do
        p=$((20000 + RANDOM % 30000))
        port_in_use "$p" || { echo "$p"; return 0; }
    done
    echo "no free port found" >&2; return 1
}

stop_pidfile() {
    # Kill the process named in a pid file (TERM, then KILL after 10 s) and remove the file.
    local name="$1" file="$2" pid
    [[ -f "$file" ]] || return 0
    pid="$(cat "$file" 2>/dev/null || true)"
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name (pid $pid) still alive after 10 s, sending KILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$file"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start() {
    for tool in slurmctld slurmd sinfo munged munge unmunge; do
        command -v "$tool" >/dev/null 2>&1 || {
            echo "error: $tool not found (Debian: apt-get install -y slurm-wlm munge)" >&2; exit 1; }
    done
    [[ "$(id -u)" -eq 0 ]] || { echo "error: run as root (the daemons run as SlurmUser=root)" >&2; exit 1; }
    if [[ -f "$dir/slurmctld.pid" ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        echo "error: a cluster is already running in $dir (stop it first)" >&2; exit 1
    fi

    mkdir -p "$dir/state" "$dir/spool" "$dir/log"

    # munge: reuse one that answers; otherwise start one with the key the package installed.
    if munge_ok; then
        log "munged already running"
    else
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        munged --force --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log"
        for _ in $(seq 1 50); do munge_ok && break; sleep 0.1; done
        munge_ok || { echo "error: munged did not come up (see $dir/log/munged.log)" >&2; exit 1; }
        log "munged started (pid $(cat "$dir/munged.pid"))"
    fi

    local host cpus ctld_port d_port
    host="$(hostname -s)"
    cpus="$(nproc)"
    ctld_port="${SLURMCTLD_PORT:-$(free_port)}"
    d_port="${SLURMD_PORT:-$(free_port)}"
    while [[ "$d_port" == "$ctld_port" ]]; do d_port="$(free_port)"; done

    cat > "$conf" <<EOF
# one-node test cluster written by scripts/slurm/local_cluster.sh
ClusterName=localtest
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

    # -c: a clean start (no state from an earlier cluster in DIR).
    slurmctld -c -f "$conf"
    slurmd -f "$conf"
    log "slurmctld and slurmd started (conf $conf, ports $ctld_port/$d_port)"

    local state=""
    for _ in $(seq 1 120); do
        state="$(sinfo -h -N -o '%t' 2>/dev/null | head -n1 || true)"
        [[ "$state" == "idle" ]] && break
        sleep 0.5
    done
    if [[ "$state" != "idle" ]]; then
        echo "error: node not idle after 60 s (state '${state}'); logs in $dir/log" >&2
        tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
        stop
        exit 1
    fi
    log "node $host idle ($cpus CPUs); export SLURM_CONF=$conf"
}

stop() {
    stop_pidfile slurmd "$dir/slurmd.pid"
    stop_pidfile slurmctld "$dir/slurmctld.pid"
    stop_pidfile munged "$dir/munged.pid"   # only present when `start` started munged
    rm -rf "$dir/state" "$dir/spool"
}

case "$action" in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
