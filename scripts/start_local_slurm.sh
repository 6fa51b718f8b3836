#!/usr/bin/env bash
# A single-node SLURM on this machine (Debian/Ubuntu, as root): munge, slurmctld and slurmd on
# localhost, one partition "debug" with this machine's cores. For trying `--cluster slurm` and for
# the slow test tests/test_cluster_real_slurm.py. No accounting storage: sacct answers nothing, and
# sparsecomm falls back to squeue to see that a job ended (docs/cluster.md).
#   bash scripts/start_local_slurm.sh          # install if needed, configure, start
#   bash scripts/start_local_slurm.sh stop
set -euo pipefail
if [ "${1:-}" = "stop" ]; then
  pkill -x slurmd || true; pkill -x slurmctld || true; pkill -x munged || true
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get install -y -q slurm-wlm munge
fi
host=$(hostname -s)
cores=$(nproc)
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p /run/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
chmod 0711 /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=${host} CPUs=${cores} RealMemory=${memory_mb} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
pgrep -x munged >/dev/null || su -s /bin/sh munge -c "munged --force"
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do
  if sinfo --noheader --states=idle 2>/dev/null | grep -q debug; then sinfo; exit 0; fi
  sleep 1
done
echo "SLURM did not come up: see /var/log/slurm/" >&2
exit 1
