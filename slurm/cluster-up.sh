#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one machine, for development and the tests:
# munge, MariaDB + slurmdbd (real accounting, so sacct - which submitit polls - works),
# slurmctld, and two compute nodes node1 and node2 (two slurmd processes, each in its own UTS
# namespace so a job's `hostname` is its node's name). Needs root and Debian's packages
# (installed when missing). Idempotent: a running cluster is left as it is; a stale one
# (dead daemons, e.g. after a machine restart) is cleaned up and started fresh.
# See docs/slurm.md, "The local test cluster".
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/cluster-env.sh"

if [ "$(id -u)" -ne 0 ]; then
  echo "The local Slurm test cluster needs root (daemons, /etc/hosts, /etc/slurm, UTS namespaces)." >&2
  exit 3
fi
take_lock

# Clients find the config without SLURM_CONF; node names resolve (submitit's MASTER_ADDR is the
# first node's name). The link and the marked /etc/hosts line are what cluster-down removes.
link_etc() {
  if [ -e "$ETC_LINK" ] && [ ! -L "$ETC_LINK" ]; then
    log "warning: $ETC_LINK exists and is not ours; clients need SLURM_CONF=$SLURM_CONF"
  else
    mkdir -p "$(dirname "$ETC_LINK")" && ln -sfn "$SLURM_CONF" "$ETC_LINK"
  fi
  grep -qF "$MARKER" /etc/hosts || echo "127.0.0.1 ${NODES[*]} $MARKER" >> /etc/hosts
}

# Up = every daemon alive, both nodes answering (idle, or busy with jobs), sacct working and
# the config this script writes now.
nodes_ready() {  # nodes_ready <states regex>: both nodes are in one of these states
  [ "$(timeout 10 sinfo -h -N -o %T 2>/dev/null | grep -cxE "$1")" -eq ${#NODES[@]} ]
}
cluster_ok() {
  local pair
  for pair in "${DAEMONS[@]}"; do daemon_pid "${pair%%:*}" "${pair#*:}" >/dev/null || return 1; done
  nodes_ready 'idle|mixed|allocated|completing' && timeout 10 sacct -n >/dev/null 2>&1 &&
    grep -q '^GresTypes=gpu' "$SLURM_CONF"  # else started by an older script: no fake GPUs
}
if [ -f "$SLURM_CONF" ] && cluster_ok; then
  link_etc
  log "already up ($D): $(sinfo -h -N -o '%N:%T' | tr '\n' ' ')"
  exit 0
fi

fail() {  # fail <message> [log file]: show the tail of that log (else of all), stop, exit 1
  echo "cluster-up failed: $1" >&2
  local f logs=("$LOG"/*.log)
  [ -s "${2:-}" ] && logs=("$2")  # the relevant log, else all of them
  for f in "${logs[@]}"; do
    [ -s "$f" ] && { echo "--- tail of $f" >&2; tail -n 20 "$f" >&2; }
  done
  # stop what did start (a failed start must not leave daemons behind); the logs stay
  bash "$HERE/cluster-down.sh" >/dev/null 2>&1 || true
  echo "(stopped again; all logs in $LOG)" >&2
  exit 1
}
wait_for() {  # wait_for <what> <seconds> <log file> <pid-file:program or -> <command...>
  # Polls <command> until it succeeds; fails at once when the daemon has died, else at the deadline.
  local what="$1" secs="$2" logf="$3" daemon="$4" deadline=$((SECONDS + $2)); shift 4
  while [ "$SECONDS" -lt "$deadline" ]; do
    "$@" >/dev/null 2>&1 && return 0
    if [ "$daemon" != - ] && ! daemon_pid "${daemon%%:*}" "${daemon#*:}" >/dev/null; then
      sleep 0.5  # a pid file may appear late; look once more before calling it dead
      daemon_pid "${daemon%%:*}" "${daemon#*:}" >/dev/null || fail "$what exited" "$logf"
    fi
    sleep 0.1
  done
  fail "$what not ready within ${secs}s" "$logf"
}

# --- packages -----------------------------------------------------------------------------
need=()
for pair in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge \
            slurmdbd:slurmdbd mariadbd:mariadb-server mariadb-install-db:mariadb-server; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Without systemd, the packages' scripts would start system-wide munged/mariadbd through
  # /etc/init.d; a policy-rc.d that says 101 ("not allowed") stops that (Docker images ship one).
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    policy=/usr/sbin/policy-rc.d; printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"
  fi
  apt=(apt-get -y -q -o DPkg::Lock::Timeout=300)  # wait for another apt rather than fail
  "${apt[@]}" install "${need[@]}" >"$D.apt.log" 2>&1 ||
    { "${apt[@]}" update >>"$D.apt.log" 2>&1 &&
      "${apt[@]}" install "${need[@]}" >>"$D.apt.log" 2>&1; } ||
    { rm -f "$policy"
      echo "cluster-up: installing ${need[*]} failed; tail of $D.apt.log:" >&2
      tail -n 20 $D.apt.log >&2; exit 1; }
  rm -f "$policy"  # ours only ("" when one was there already)
fi

# --- a fresh state directory (stale daemons and jobs of an earlier run are stopped first) ----
down_out="$(bash "$HERE/cluster-down.sh" 2>&1)" || fail "could not stop the stale cluster: $down_out"
# Job ids must never repeat (a reused submitit folder would hand an old result to a new job):
# start after the last run's ids (saved by cluster-down) and after a clock-based floor
# (seconds since 2026-01-01, which also covers a wiped state dir; Slurm's MaxJobId is 67043328).
next_id=$(cat "$D/next-job-id" 2>/dev/null | tr -dc 0-9) || true
clock_id=$(( ($(date +%s) - 1767225600) % 60000000 ))
clock_id=$(( (clock_id < 0 ? -clock_id : clock_id) + 1000 ))
first_job_id=$(( ${next_id:-0} > clock_id ? next_id : clock_id ))
rm -rf "$D"
mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/ctld" "$D/mysql"
[ -f $D.apt.log ] && mv $D.apt.log "$LOG/apt.log"
for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done
# Fake GPUs: Slurm's gres/gpu plugin wants a character device per GPU but never opens it (no
# cgroups here), so each node gets $GPUS_PER_NODE device nodes with NVIDIA's major number and no
# driver behind them. Slurm then sets CUDA_VISIBLE_DEVICES per task as on a GPU node (tests of
# train/distributed/devices.py's binding). A plain file is rejected ("not a valid character or block
# device": the GPUs are then never handed out), so without mknod rights say so and go on.
for node in "${NODES[@]}"; do
  mkdir -p "$D/dev/$node"
  for ((i = 0; i < GPUS_PER_NODE; i++)); do
    mknod "$D/dev/$node/nvidia$i" c 195 "$i" 2>/dev/null || {
      : > "$D/dev/$node/nvidia$i"; fake_gpus_warning=1; }
  done
done
[ -n "${fake_gpus_warning:-}" ] &&
  log "warning: mknod not allowed here: jobs get no CUDA_VISIBLE_DEVICES (GPU-binding tests fail)"
started=$(date +%s.%N)

# --- munge: its own key and socket ----------------------------------------------------------
dd if=/dev/urandom of="$ETC/munge.key" bs=1024 count=1 status=none
chmod 400 "$ETC/munge.key"
munged --force --socket="$RUN/munge.sock" --key-file="$ETC/munge.key" \
  --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$RUN/munge.seed" 9>&- ||
  fail "munged did not start" "$LOG/munged.log"
wait_for munged 10 "$LOG/munged.log" munged:munged test -S "$RUN/munge.sock"

# --- MariaDB for accounting, from a private datadir (it does not daemonize itself) ----------
cat > "$ETC/my.cnf" <<EOF
[mysqld]
datadir=$D/mysql
socket=$RUN/mysql.sock
pid-file=$RUN/mariadb.pid
log-error=$LOG/mariadb.log
# as root it refuses to start without this
user=root
skip-networking
innodb_buffer_pool_size=64M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
key_buffer_size=4M
aria_pagecache_buffer_size=4M
[client]
socket=$RUN/mysql.sock
EOF
mariadb-install-db --defaults-file="$ETC/my.cnf" --auth-root-authentication-method=normal \
  --skip-test-db >"$LOG/mariadb-install.log" 2>&1 9>&- || fail "mariadb-install-db" "$LOG/mariadb-install.log"
setsid mariadbd --defaults-file="$ETC/my.cnf" </dev/null >>"$LOG/mariadb.log" 2>&1 9>&- &
echo $! > "$RUN/mariadb.pid"  # mariadbd rewrites it (same pid); this covers an early crash
wait_for mariadb 30 "$LOG/mariadb.log" mariadb:mariadbd mariadb --defaults-file="$ETC/my.cnf" -uroot -e "SELECT 1"
mariadb --defaults-file="$ETC/my.cnf" -uroot -e "
  CREATE DATABASE slurm_acct_db; CREATE USER 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" ||
  fail "creating the accounting database" "$LOG/mariadb.log"

# --- slurm.conf and slurmdbd.conf -----------------------------------------------------------
cat > "$ETC/slurm.conf" <<EOF
# Generated by slurm/cluster-up.sh - a 2-node test cluster on one machine; see docs/slurm.md.
ClusterName=trainlocal
# must be \`hostname -s\`; the address in parentheses spares a name lookup
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire=5: a requeued job may start again after seconds, not ~2 min (2 is rejected)
AuthInfo=socket=$RUN/munge.sock,cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
# no cgroups and no systemd here
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# nodes declare more CPUs than the machine has; without this they go "inval"
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
# finished jobs stay visible to squeue/scontrol for an hour (sacct keeps them anyway)
MinJobAge=3600
KillWait=5
FirstJobId=$first_job_id
MpiDefault=none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# the munge socket for the slurmdbd connection is read from HERE, not from AuthInfo
AccountingStoragePass=$RUN/munge.sock
# fake GPUs (device files in $D/dev, see gres.conf): jobs may ask for --gres=gpu:N, --gpus-per-task
GresTypes=gpu
NodeName=node1 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=4 RealMemory=8000 Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=4 RealMemory=8000 Gres=gpu:$GPUS_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
# gres.conf sits next to slurm.conf; no NVML here, so the GPUs are listed by hand
{ echo "AutoDetect=off"
  for node in "${NODES[@]}"; do
    echo "NodeName=$node Name=gpu File=$D/dev/$node/nvidia[0-$((GPUS_PER_NODE - 1))]"
  done; } > "$ETC/gres.conf"
# slurmdbd refuses a config that others can read (mode 600, owned by SlurmUser)
(umask 077; cat > "$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$RUN/munge.sock
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StorageLoc=slurm_acct_db
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
EOF
)
chmod 600 "$ETC/slurmdbd.conf"
link_etc

# --- daemons -----------------------------------------------------------------------------
# slurmdbd has no option for MySQL's socket: the client library reads MYSQL_UNIX_PORT.
MYSQL_UNIX_PORT="$RUN/mysql.sock" SLURM_CONF="$SLURM_CONF" slurmdbd 9>&- ||
  fail "slurmdbd did not start" "$LOG/slurmdbd.log"
wait_for slurmdbd 30 "$LOG/slurmdbd.log" slurmdbd:slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
slurmctld -i 9>&- || fail "slurmctld did not start" "$LOG/slurmctld.log"
wait_for slurmctld 30 "$LOG/slurmctld.log" slurmctld:slurmctld timeout 5 scontrol ping
echo "$(cat /proc/sys/kernel/random/boot_id)" > "$RUN/boot-id"  # ns-* below are valid for this boot
for node in "${NODES[@]}"; do
  # its own UTS namespace: the node, its slurmstepds and its jobs see `hostname` = node name
  unshare --uts bash -c "hostname $node; exec slurmd -N $node" 9>&- ||
    fail "slurmd $node did not start" "$LOG/slurmd-$node.log"
  wait_for "slurmd $node" 10 "$LOG/slurmd-$node.log" - daemon_pid "slurmd-$node" slurmd
  readlink "/proc/$(daemon_pid "slurmd-$node" slurmd)/ns/uts" > "$RUN/ns-$node"
done
wait_for "idle nodes" 60 "$LOG/slurmctld.log" slurmctld:slurmctld nodes_ready idle
wait_for sacct 30 "$LOG/slurmdbd.log" slurmdbd:slurmdbd sacct -n

printf '[cluster] up in %.1f s: %s(first job id %s; state, logs, sockets in %s)\n' \
  "$(awk "BEGIN{print $(date +%s.%N) - $started}")" "$(sinfo -h -N -o '%N:%T' | tr '\n' ' ')" \
  "$first_job_id" "$D"
