#!/usr/bin/env bash
# slurm-test-cluster.sh start|stop|status - rlctl's own multi-node Slurm on one Linux machine (root).
#
# start: installs slurmctld, slurmd, slurm-client and munge from Debian if missing, then starts
#   a private munged, slurmctld on a bridge address, and one slurmd per node, each in its own
#   network namespace (a veth on the bridge) and UTS namespace (hostname = node name), so that
#   rlctl's trainer and rollout components really run on different hosts. Node names go into
#   /etc/hosts between marker lines. Everything else lives under $RLCTL_SLURM_DIR.
# stop: cancels the cluster's jobs, stops the daemons it started (by pid file, checked against
#   this cluster's directory), kills what is left inside the node namespaces, and removes the
#   namespaces, the bridge and the /etc/hosts lines. Nothing it did not start is touched.
# status: prints sinfo.
#
# Then: export SLURM_CONF=$RLCTL_SLURM_DIR/slurm.conf (start prints it; `source $DIR/env.sh`).
# Every node has RLCTL_SLURM_GPUS fake GPUs: gres/gpu with File=$RLCTL_SLURM_DIR/dev/gpuN, links to
# /dev/null (slurmd wants character devices and opens none), so that Slurm allocates GPUs and sets
# CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS in each step as on a GPU cluster; runs stay on the CPU.
# Settings: RLCTL_SLURM_DIR (/tmp/rlctl-slurm), RLCTL_SLURM_NODES (3), RLCTL_SLURM_SUBNET (10.231.0),
#   RLCTL_SLURM_GPUS (4, at least 1), RLCTL_SLURM_CPUS (4 per node whatever this machine has: Slurm only
#   counts them, and tests/test_slurm_cluster.py runs a job beside a run).
set -euo pipefail

DIR=${RLCTL_SLURM_DIR:-/tmp/rlctl-slurm}
NODES=${RLCTL_SLURM_NODES:-3}
SUBNET=${RLCTL_SLURM_SUBNET:-10.231.0}
GPUS=${RLCTL_SLURM_GPUS:-4}
CPUS=${RLCTL_SLURM_CPUS:-4}
[ "$GPUS" -ge 1 ] || { echo "RLCTL_SLURM_GPUS must be at least 1" >&2; exit 2; }
BRIDGE=rlctlsl0
NS=rlctlsl-
CTL_ADDR=$SUBNET.1
MARK_BEGIN="# rlctl-slurm-test-cluster begin ($DIR)"
MARK_END="# rlctl-slurm-test-cluster end ($DIR)"
export SLURM_CONF=$DIR/slurm.conf

log() { printf '[slurm-test-cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
node_ip() { echo "$SUBNET.$((10 + $1))"; }

# ours PIDFILE: the pid in it is a live, non-zombie process started for this cluster.
ours() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  [ "$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)" != Z ] || return 1
  tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ" | grep -qxF "RLCTL_SLURM_DIR=$DIR"
}

wait_until() {  # wait_until SECONDS WHAT COMMAND...
  local end=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$end" ] || die "timed out waiting for $what"
    sleep 0.1
  done
}

set_hosts() {  # set_hosts [LINE...]: replace our block in /etc/hosts, in place (it may be a bind mount)
  local tmp
  tmp=$(mktemp)
  awk -v b="$MARK_BEGIN" -v e="$MARK_END" '$0==b{skip=1;next} $0==e{skip=0;next} !skip' /etc/hosts > "$tmp"
  if [ $# -gt 0 ]; then { echo "$MARK_BEGIN"; printf '%s\n' "$@"; echo "$MARK_END"; } >> "$tmp"; fi
  cat "$tmp" > /etc/hosts
  rm -f "$tmp"
}

install_packages() {
  local missing=() pair
  for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge ip:iproute2 nsenter:util-linux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  local policy=0
  # Debian's maintainer scripts would start the services; this cluster starts its own daemons.
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy=1; fi
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

write_conf() {
  local i
  {
    echo "# written by scripts/slurm-test-cluster.sh"
    echo "ClusterName=rlctltest"
    echo "SlurmctldHost=localhost($CTL_ADDR)"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    # cred_expire: how long Slurm holds a requeued job before it starts it again (120 s by default);
    # short, so that the requeue test's attempts follow each other quickly.
    echo "AuthInfo=socket=$DIR/munge/socket,cred_expire=10"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    # a container: no cgroups, no task binding
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "GresTypes=gpu"
    # heterogeneous jobs start only from the backfill scheduler: run it every second
    echo "SchedulerType=sched/backfill"
    # sched_interval: the main scheduler every 2 s (60 by default), which starts a requeued job
    echo "SchedulerParameters=bf_interval=1,sched_interval=2"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "KillWait=5"
    echo "MinJobAge=300"
    echo "MailProg=/bin/true"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/filetxt"
    echo "JobCompLoc=$DIR/log/jobcomp.txt"
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=node$i NodeHostname=node$i NodeAddr=$(node_ip "$i") CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4096 Gres=gpu:$GPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$SLURM_CONF"
  # gres.conf sits beside slurm.conf. Fake GPUs, no driver to ask (AutoDetect=off).
  mkdir -p "$DIR/dev"
  for i in $(seq 0 $((GPUS - 1))); do ln -sfn /dev/null "$DIR/dev/gpu$i"; done
  { echo "AutoDetect=off"; echo "NodeName=node[1-$NODES] Name=gpu File=$DIR/dev/gpu[0-$((GPUS - 1))]"; } > "$DIR/gres.conf"
}

start() {
  [ "$(id -u)" = 0 ] || die "run as root (it makes network namespaces and runs slurmd)"
  install_packages
  mkdir -p "$DIR"/{run,log,state,munge}
  chmod 755 "$DIR" "$DIR/munge"   # munge clients need every directory on the socket's path
  export RLCTL_SLURM_DIR=$DIR     # in every daemon's environment: how `ours` knows them
  printf 'export SLURM_CONF=%q\n' "$SLURM_CONF" > "$DIR/env.sh"

  if ! ours "$DIR/run/munged.pid"; then
    [ -s "$DIR/munge/key" ] || mungekey --create --keyfile="$DIR/munge/key"
    chmod 600 "$DIR/munge/key"
    rm -f "$DIR/munge/socket" "$DIR/munge/socket.lock"
    munged --socket="$DIR/munge/socket" --key-file="$DIR/munge/key" --pid-file="$DIR/run/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    wait_until 20 munged sh -c "munge -S '$DIR/munge/socket' -n | unmunge -S '$DIR/munge/socket'"
  fi

  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr show dev "$BRIDGE" | grep -qF " $CTL_ADDR/24 " || ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i hosts=("$CTL_ADDR rlctl-slurm-ctl")
  for i in $(seq 1 "$NODES"); do
    [ -e "/run/netns/${NS}node$i" ] || ip netns add "${NS}node$i"
    ip link show "rlsl-node$i" >/dev/null 2>&1 || ip link add "rlsl-node$i" type veth peer name eth0 netns "${NS}node$i"
    ip link set "rlsl-node$i" master "$BRIDGE" up
    ip -n "${NS}node$i" addr show dev eth0 | grep -qF " $(node_ip "$i")/24 " || ip -n "${NS}node$i" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "${NS}node$i" link set eth0 up
    ip -n "${NS}node$i" link set lo up
    hosts+=("$(node_ip "$i") node$i")
  done
  set_hosts "${hosts[@]}"

  if ! ours "$DIR/run/slurmctld.pid"; then
    write_conf
    slurmctld -f "$SLURM_CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    wait_until 30 slurmctld sh -c 'scontrol ping | grep -q "is UP"'
  fi
  for i in $(seq 1 "$NODES"); do
    ours "$DIR/run/slurmd-node$i.pid" && continue
    mkdir -p "$DIR/spool/node$i"
    # nsenter, not `ip netns exec`, which remounts /sys and leaves slurmd without /sys/fs/cgroup
    nsenter --net="/run/netns/${NS}node$i" -- unshare --uts -- \
      sh -c "hostname node$i && exec slurmd -f '$SLURM_CONF' -N node$i" || die "slurmd node$i did not start; see $DIR/log/slurmd-node$i.log"
    wait_until 20 "slurmd node$i" test -s "$DIR/run/slurmd-node$i.pid"
  done
  wait_until 60 "$NODES usable nodes" sh -c "[ \$(sinfo -h -N -r -t idle,mixed,allocated -o %N | sort -u | wc -l) -ge $NODES ]"
  log "up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile FILE
  local pid i
  if ! ours "$1"; then rm -f "$1"; return 0; fi
  pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 100); do ours "$1" || break; sleep 0.1; done
  ours "$1" && kill -KILL "$pid" 2>/dev/null
  rm -f "$1"
}

stop() {
  [ "$(id -u)" = 0 ] || die "run as root"
  [ -f "$SLURM_CONF" ] || { log "nothing to stop in $DIR"; return 0; }
  if ours "$DIR/run/slurmctld.pid"; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.1; done
    fi
  fi
  local f ns pids
  for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
  stop_pidfile "$DIR/run/munged.pid"
  # Whatever a job left inside a node (slurmstepd, tasks): only this cluster's namespaces hold them.
  for ns in /run/netns/"$NS"node*; do
    [ -e "$ns" ] || continue
    pids=$(ip netns pids "$(basename "$ns")" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      log "killing left-overs in $(basename "$ns"): $pids"
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
      for _ in $(seq 50); do [ -z "$(ip netns pids "$(basename "$ns")" 2>/dev/null)" ] && break; sleep 0.1; done
    fi
    ip netns del "$(basename "$ns")" 2>/dev/null || true
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
  set_hosts
  log "stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
