#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying `kvreplay sweep --slurm` and for the test
# that submits a real job array: slurmctld and slurmd on localhost, munge for authentication,
# state and logs under one directory.
#   ci/slurm-local.sh install   # Debian's slurm-wlm and munge (root, apt)
#   ci/slurm-local.sh start DIR # writes DIR/slurm.conf, starts the daemons, waits for the node
#   ci/slurm-local.sh stop DIR
# Commands then need SLURM_CONF=DIR/slurm.conf in their environment.
set -euo pipefail

install() {
  command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
}

start() {
  local dir
  dir=$(realpath -m "$1")
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  local node
  node=$(hostname -s)
  cat >"$dir/slurm.conf" <<CONF
ClusterName=kvreplay-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
DependencyParameters=kill_invalid_depend
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
      runuser -u munge -- munged
    else
      munged --force
    fi
  fi
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; then
      echo "slurm up: SLURM_CONF=$SLURM_CONF"
      return
    fi
    sleep 1
  done
  echo "slurm did not come up; logs in $dir" >&2
  tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  exit 1
}

stop() {
  local dir
  dir=$(realpath -m "$1")
  for daemon in slurmd slurmctld; do
    if [[ -f "$dir/$daemon.pid" ]]; then
      kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
    fi
  done
}

case "${1:-}" in
  install) install ;;
  start) start "${2:?directory}" ;;
  stop) stop "${2:?directory}" ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
