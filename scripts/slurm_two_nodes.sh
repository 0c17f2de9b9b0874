#!/usr/bin/env bash
# A two-node SLURM cluster on this machine, each node a simulated host (the
# namespace harness of tests/netns.py, in shell): its own network namespace
# joined to the other's by a veth pair (mn0, 10.79.0.1 and 10.79.0.2), its
# own hostname (node01, node02), IPC, PID namespace and tmpfs on /dev/shm.
# slurmctld and one slurmd run on node01, one slurmd on node02; the node
# names in slurm.conf resolve to the veth addresses through each
# namespace's /etc/netns/<ns>/hosts. One munged (outside the namespaces)
# serves both: its key and socket are on the common file system, as a
# cluster's shared munge key is. For tests/multihost/test_two_nodes.py (the
# `two_nodes` tier). Needs root (ip netns, unshare, the daemons run as root
# with no systemd); installs Debian's slurmd/slurmctld/slurm-client/munge
# where missing, as scripts/slurm_local.sh does.
#   bash scripts/slurm_two_nodes.sh start       # prints the SLURM_CONF to export
#   bash scripts/slurm_two_nodes.sh exec 0 CMD  # CMD on node01 (its namespaces), e.g. srun/sbatch/sinfo
#   bash scripts/slurm_two_nodes.sh pid 1       # node02's init, outside pid (its /proc/PID/root/dev/shm)
#   bash scripts/slurm_two_nodes.sh stop        # ends the nodes and munged, deletes the namespaces
# Everything lives under $STREAMCOLL_SLURM2_DIR (default /tmp/streamcoll-slurm2).
# Exit codes of start: 3 not root, 4 apt failed, 6 no namespaces, 5 the nodes
# did not come up (logs under the directory).
set -euo pipefail
D="${STREAMCOLL_SLURM2_DIR:-/tmp/streamcoll-slurm2}"
CMD="${1:-start}"
HOLDING_NETNS_LOCK=0  # set by start while it holds the namespace lock (never taken from the environment)
NODES=(node01 node02)
ADDRS=(10.79.0.1 10.79.0.2)
TAG="$(printf %s "$D" | cksum | cut -c1-8)"
NS=("scslurm-$TAG-0" "scslurm-$TAG-1")
say() { echo "[slurm_two_nodes] $*" >&2; }

init_pid() {  # the host's PID-namespace init (outside pid): the child of its unshare
  local u
  u="$(cat "$D/host$1.pid" 2>/dev/null)" || return 1
  [ -n "$u" ] && kill -0 "$u" 2>/dev/null || return 1
  local c
  c="$(cat "/proc/$u/task/$u/children" 2>/dev/null | awk '{print $1}')"
  [ -n "$c" ] || return 1
  echo "$c"
}

in_host() {  # in_host I CMD...: CMD in host I's network, UTS, IPC, mount and PID namespaces
  local i="$1"; shift
  local p
  p="$(init_pid "$i")" || { say "node ${NODES[$i]} is not running (bash $0 start)"; return 2; }
  nsenter -t "$p" -n -u -i -m -p --wd="$PWD" -- "$@"
}

stop() {
  for i in 0 1; do
    if [ -f "$D/host$i.pid" ]; then
      u="$(cat "$D/host$i.pid" 2>/dev/null || true)"
      # unshare --kill-child: its end SIGKILLs the namespace's init, and so every process in it
      [ -n "$u" ] && kill -KILL "$u" 2>/dev/null || true
      for _ in $(seq 1 50); do [ -n "$u" ] && kill -0 "$u" 2>/dev/null || break; sleep 0.1; done
      rm -f "$D/host$i.pid"
    fi
  done
  if [ -f "$D/munged.pid" ]; then
    pid="$(cat "$D/munged.pid" 2>/dev/null || true)"
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    rm -f "$D/munged.pid"
  fi
  # the namespaces go under the suite's namespace lock, as they were made (fd 8: start holds 9)
  # (not when start itself holds it: a failed start's trap; a second open would wait on it)
  local locked=0
  if [ "${HOLDING_NETNS_LOCK:-0}" = 1 ]; then
    :
  elif { mkdir -p /run/lock && exec 8>/run/lock/streamcoll-netns.lock; } 2>/dev/null; then
    flock -w 60 8 && locked=1 || say "the namespace lock was busy for 60 s: deleting without it"
  fi
  for ns in "${NS[@]}"; do
    for _ in 1 2 3 4 5; do
      [ -e "/var/run/netns/$ns" ] || break
      timeout 20 ip netns del "$ns" 2>/dev/null && break
      sleep 0.2
    done
    rm -rf "/etc/netns/$ns"
  done
  [ "$locked" = 1 ] && { flock -u 8; exec 8>&-; } 2>/dev/null || true
}

case "$CMD" in
  stop) stop; exit 0 ;;
  exec) shift; i="${1:?exec: a node index, 0 or 1}"; shift; in_host "$i" "$@"; exit $? ;;
  pid) init_pid "${2:?pid: a node index, 0 or 1}"; exit $? ;;
  start) ;;
  *) say "unknown command $CMD (start, exec, pid, stop)"; exit 2 ;;
esac

if [ "$(id -u)" != 0 ]; then
  say "needs root (network namespaces; the daemons run as root without systemd)"; exit 3
fi
for tool in ip unshare nsenter mount; do
  command -v "$tool" >/dev/null || { say "no $tool: simulated hosts need it"; exit 6; }
done
if ! command -v slurmd >/dev/null || ! command -v slurmctld >/dev/null || ! command -v srun >/dev/null \
    || ! command -v munged >/dev/null; then
  say "installing slurmd slurmctld slurm-client munge (apt)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmd slurmctld slurm-client munge) \
    >"${TMPDIR:-/tmp}/streamcoll-slurm2-apt.log" 2>&1 || { say "apt-get failed (see ${TMPDIR:-/tmp}/streamcoll-slurm2-apt.log)"; exit 4; }
fi

mkdir -p "$D"/{state,spool,log,munge}
export SLURM_CONF="$D/slurm.conf"
if init_pid 0 >/dev/null && init_pid 1 >/dev/null \
    && [ "$(in_host 0 timeout 10 sinfo -h -N -o %T 2>/dev/null | grep -c -E '^(idle|mixed|allocated)')" = 2 ]; then
  echo "$SLURM_CONF"; exit 0
fi
stop
trap 'rc=$?; [ $rc = 0 ] || stop; exit $rc' EXIT  # a failed start leaves nothing running

# The two hosts: namespaces, a veth pair, addresses, each resolving both node names.
# Made under the suite's namespace lock (tests/netns.py takes it too): in CI the
# veth's `netns` argument once failed to open a namespace made just before
# ("Invalid netns value") while another pytest worker made and deleted one.
# Bounded retries; the last failure prints what /run/netns held.
if { mkdir -p /run/lock && exec 9>/run/lock/streamcoll-netns.lock; } 2>/dev/null; then
  flock -w 60 9 && HOLDING_NETNS_LOCK=1 || say "the namespace lock was busy for 60 s: going on without it"
else
  say "no namespace lock (/run/lock/streamcoll-netns.lock): going on without it"
fi
made=0
for attempt in 1 2 3; do
  for i in 0 1; do
    [ -e "/var/run/netns/${NS[$i]}" ] && timeout 20 ip netns del "${NS[$i]}" 2>/dev/null || true
    timeout 20 ip netns add "${NS[$i]}" || { say "ip netns add failed (attempt $attempt)"; exit 7; }
    mkdir -p "/etc/netns/${NS[$i]}"
    printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${ADDRS[0]}" "${NODES[0]}" "${ADDRS[1]}" "${NODES[1]}" \
      >"/etc/netns/${NS[$i]}/hosts"
  done
  if err="$(timeout 20 ip link add mn0 netns "${NS[0]}" type veth peer name mn0 netns "${NS[1]}" 2>&1)"; then
    made=1; break
  fi
  say "attempt $attempt: ip link add failed: $err; /run/netns: $(ls -la /var/run/netns/ 2>&1 | tr '\n' ' ');" \
    "its mounts: $(grep netns /proc/self/mountinfo | tr '\n' ' ')"
  sleep 1
done
[ "$made" = 1 ] || { say "the veth pair could not be made"; exit 7; }
{ flock -u 9; exec 9>&-; } 2>/dev/null || true  # the daemons started below must not inherit it
HOLDING_NETNS_LOCK=0
for i in 0 1; do
  timeout 20 ip -n "${NS[$i]}" addr add "${ADDRS[$i]}/24" dev mn0
  timeout 20 ip -n "${NS[$i]}" link set lo up
  timeout 20 ip -n "${NS[$i]}" link set mn0 up
done

# munge: its own key and socket (a system munged, if any, is left alone).
chown munge:munge "$D/munge" 2>/dev/null || true
chmod 700 "$D/munge"
[ -f "$D/munge/munge.key" ] || dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$D/munge/munge.key" 2>/dev/null || true
chmod 400 "$D/munge/munge.key"
sock="$D/munge/munge.socket"
runuser -u munge -- munged --key-file="$D/munge/munge.key" --socket="$sock" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/seed" --force
cp "$D/munge/munged.pid" "$D/munged.pid"

# CPUs: the machine's (nproc --all); both nodes share its cores, the partition may be oversubscribed.
{
  cat <<EOF
ClusterName=streamcoll2
SlurmctldHost=${NODES[0]}
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
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
EOF
  for n in "${NODES[@]}"; do echo "NodeName=$n CPUs=$(nproc --all) RealMemory=4000 State=UNKNOWN"; done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} >"$SLURM_CONF"
# A fresh cluster each start: no job of an earlier one (a job still running
# when it was stopped would hold both nodes for good).
rm -rf "$D/state" "$D/spool"
mkdir -p "$D/state" "$D/spool/${NODES[0]}" "$D/spool/${NODES[1]}"

# Each host's init (PID 1 of its namespace): starts the daemons in the
# foreground, reaps every orphan (slurmstepd, the tasks), ends with them.
# Entered with nsenter --net, not ip netns exec: that mounts a fresh /sys,
# without the machine's /sys/fs/cgroup, which slurmd 22.05 needs even with
# proctrack/linuxproc ("No filesystem mounted on /sys/fs/cgroup"); the
# namespace's hosts file is bind-mounted over /etc/hosts here instead.
cat >"$D/init.py" <<'EOF'
import os, signal, subprocess, sys
argv, cmds = sys.argv[1:] + ["--"], []
while argv:  # commands separated by "--"
    i = argv.index("--")
    cmds, argv = cmds + [argv[:i]], argv[i + 1:]
procs = [subprocess.Popen(c) for c in cmds if c]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])
while any(p.poll() is None for p in procs):
    try:
        os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        pass
EOF
for i in 0 1; do
  daemons=(slurmd -D -f "$SLURM_CONF")
  [ "$i" = 0 ] && daemons=(slurmctld -D -c -f "$SLURM_CONF" -- "${daemons[@]}")
  setsid nsenter --net="/var/run/netns/${NS[$i]}" unshare --uts --ipc --mount --propagation private --pid --fork \
    --mount-proc --kill-child sh -c 'hostname "$0" && mount --bind "$1" /etc/hosts \
    && mount -t tmpfs -o size=1g tmpfs /dev/shm && shift && exec python3 "$@"' \
    "${NODES[$i]}" "/etc/netns/${NS[$i]}/hosts" "$D/init.py" "${daemons[@]}" >"$D/log/host$i.log" 2>&1 </dev/null &
  echo $! >"$D/host$i.pid"
done
for _ in $(seq 1 150); do
  if [ "$(in_host 0 timeout 5 sinfo -h -N -o %T 2>/dev/null | grep -c -E '^(idle|mixed|allocated)')" = 2 ]; then
    echo "$SLURM_CONF"; exit 0
  fi
  sleep 0.2
done
say "the two nodes did not become idle within 30 s; logs in $D/log"
in_host 0 timeout 5 sinfo -N >&2 || true
exit 5
