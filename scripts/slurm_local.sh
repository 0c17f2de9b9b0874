#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the launchers tier
# (tests/startup/test_launchers.py runs `srun -n 2` on it). Needs root (it installs
# Debian's slurmd/slurmctld/slurm-client/munge where missing, and runs the
# daemons as root with no systemd).
#   bash scripts/slurm_local.sh start   # prints the SLURM_CONF to export
#   bash scripts/slurm_local.sh stop    # ends the daemons it started
# Everything lives under $STREAMCOLL_SLURM_DIR (default /tmp/streamcoll-slurm):
# the configuration, state, spool, logs, pid files and munge's key and socket.
# The settings are the ones measured to come up in seconds here (no systemd,
# no cgroups): proctrack/linuxproc, task/none, select/cons_tres with CR_CPU,
# one node with this machine's hostname and cores, a partition that may be
# oversubscribed (the tier's jobs are tiny).
set -euo pipefail
D="${STREAMCOLL_SLURM_DIR:-/tmp/streamcoll-slurm}"
CMD="${1:-start}"
say() { echo "[slurm_local] $*" >&2; }

stop() {
  for p in slurmd slurmctld munged; do
    if [ -f "$D/$p.pid" ]; then
      pid="$(cat "$D/$p.pid" 2>/dev/null || true)"
      [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
      rm -f "$D/$p.pid"
    fi
  done
}

if [ "$CMD" = stop ]; then
  stop
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  say "needs root (daemons run as root without systemd)"; exit 3
fi
if ! command -v slurmd >/dev/null || ! command -v slurmctld >/dev/null || ! command -v srun >/dev/null \
    || ! command -v munged >/dev/null; then
  say "installing slurmd slurmctld slurm-client munge (apt)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmd slurmctld slurm-client munge) \
    >"${TMPDIR:-/tmp}/streamcoll-slurm-apt.log" 2>&1 || { say "apt-get failed (see ${TMPDIR:-/tmp}/streamcoll-slurm-apt.log)"; exit 4; }
fi

host="$(hostname -s)"
mkdir -p "$D"/{state,spool,log,munge}
export SLURM_CONF="$D/slurm.conf"
if [ -f "$D/slurmctld.pid" ] && kill -0 "$(cat "$D/slurmctld.pid")" 2>/dev/null \
    && [ -f "$D/slurmd.pid" ] && kill -0 "$(cat "$D/slurmd.pid")" 2>/dev/null \
    && timeout 10 sinfo -h -o %T 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
  echo "$SLURM_CONF"; exit 0
fi
stop

# munge: its own key and socket (a system munged, if any, is left alone).
chown munge:munge "$D/munge" 2>/dev/null || true
chmod 700 "$D/munge"
if [ ! -f "$D/munge/munge.key" ]; then
  dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
fi
chown munge:munge "$D/munge/munge.key" 2>/dev/null || true
chmod 400 "$D/munge/munge.key"
sock="$D/munge/munge.socket"
runuser -u munge -- munged --key-file="$D/munge/munge.key" --socket="$sock" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/seed" --force
cp "$D/munge/munged.pid" "$D/munged.pid"

# CPUs: the machine's (nproc --all), not this process's affinity: a caller pinned to
# one core (a test harness, taskset) would declare a node that can never run srun -n 2.
cat >"$SLURM_CONF" <<EOF
ClusterName=streamcoll
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.log
SlurmctldPort=${STREAMCOLL_SLURMCTLD_PORT:-6917}
SlurmdPort=${STREAMCOLL_SLURMD_PORT:-6918}
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$(nproc --all) RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 100); do
  if timeout 5 sinfo -h -o %T 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
    echo "$SLURM_CONF"; exit 0
  fi
  sleep 0.2
done
say "the node did not become idle within 20 s; logs in $D/log"
timeout 5 sinfo >&2 || true
exit 5
