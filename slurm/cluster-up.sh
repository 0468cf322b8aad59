#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one machine, for development and the tests:
# munge, MariaDB + slurmdbd (real accounting, so sacct - which submitit polls - works),
# slurmctld, and two compute nodes node1 and node2 (two slurmd processes, each in its own UTS
# namespace so a job's `hostname` is its node's name). Needs root and Debian's packages
# (installed when missing). Idempotent: a running cluster is left as it is.
# See slurm/README.md and ../shared/FIELD-NOTES.md (what works on this kind of machine).
set -euo pipefail
source "$(dirname "$0")/cluster-env.sh"

if [ "$(id -u)" -ne 0 ]; then
  echo "The local Slurm test cluster needs root (daemons, /etc/hosts, UTS namespaces)." >&2
  exit 3
fi

cluster_ok() {
  alive "$(pid_of slurmctld)" && sinfo -h -o %T 2>/dev/null | grep -q idle && sacct -n >/dev/null 2>&1
}
if [ -d "$D" ] && cluster_ok; then log "already up ($D)"; exit 0; fi

# --- packages -----------------------------------------------------------------------------
need=()
for pair in slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge slurmdbd:slurmdbd mariadbd:mariadb-server; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
fi

# --- a fresh state directory (stale daemons from an earlier run are stopped first) ---------
bash "$(dirname "$0")/cluster-down.sh" --purge >/dev/null 2>&1 || true
mkdir -p "$ETC" "$RUN" "$LOG" "$STATE/ctld" "$D/mysql"
for node in "${NODES[@]}"; do mkdir -p "$STATE/$node"; done
started=$(date +%s.%N)

fail() {
  echo "cluster-up failed: $1" >&2
  for f in "$LOG"/*.log; do [ -s "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done
  exit 1
}
wait_for() {  # wait_for <what> <seconds> <command...>
  local what="$1" secs="$2"; shift 2
  for _ in $(seq $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "$what did not come up within ${secs}s"
}

# --- munge: its own key and socket ----------------------------------------------------------
dd if=/dev/urandom of="$ETC/munge.key" bs=1024 count=1 status=none
chmod 400 "$ETC/munge.key"
munged --force --socket="$RUN/munge.sock" --key-file="$ETC/munge.key" \
  --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$RUN/munge.seed"
wait_for munged 10 test -S "$RUN/munge.sock"

# --- MariaDB for accounting, from a private datadir (it does not daemonize itself) ----------
cat > "$ETC/my.cnf" <<EOF
[mysqld]
datadir=$D/mysql
socket=$RUN/mysql.sock
pid-file=$RUN/mariadb.pid
log-error=$LOG/mariadb.log
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
  --skip-test-db >"$LOG/mariadb-install.log" 2>&1 || fail "mariadb-install-db"
setsid mariadbd --defaults-file="$ETC/my.cnf" </dev/null >>"$LOG/mariadb.log" 2>&1 &
wait_for mariadb 30 mariadb --defaults-file="$ETC/my.cnf" -uroot -e "SELECT 1"
mariadb --defaults-file="$ETC/my.cnf" -uroot -e "
  CREATE DATABASE slurm_acct_db; CREATE USER 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

# --- slurm.conf and slurmdbd.conf -----------------------------------------------------------
first_job_id=$(( $(date +%s) % 1000000 * 10 + 1000 ))  # job ids never repeat across restarts
cat > "$ETC/slurm.conf" <<EOF
ClusterName=trainlocal
SlurmctldHost=$(hostname -s)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$RUN/munge.sock,cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=3600
KillWait=5
FirstJobId=$first_job_id
MpiDefault=none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$RUN/munge.sock
NodeName=node1 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=4 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
cat > "$ETC/slurmdbd.conf" <<EOF
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
chmod 600 "$ETC/slurmdbd.conf"

# Clients find the config without SLURM_CONF; node names resolve (MASTER_ADDR is a node name).
if [ -e "$ETC_LINK" ] && [ ! -L "$ETC_LINK" ]; then
  log "warning: $ETC_LINK exists and is not ours; clients need SLURM_CONF=$SLURM_CONF"
else
  mkdir -p "$(dirname "$ETC_LINK")" && ln -sfn "$SLURM_CONF" "$ETC_LINK"
fi
grep -qF "$MARKER" /etc/hosts || echo "127.0.0.1 ${NODES[*]} $MARKER" >> /etc/hosts

# --- daemons -----------------------------------------------------------------------------
# slurmdbd has no socket option for MySQL: the client library reads MYSQL_UNIX_PORT.
MYSQL_UNIX_PORT="$RUN/mysql.sock" slurmdbd
wait_for slurmdbd 30 bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
slurmctld -i
wait_for slurmctld 30 scontrol ping
for node in "${NODES[@]}"; do
  unshare --uts bash -c "hostname $node; exec slurmd -N $node"
  wait_for "slurmd $node" 10 test -s "$RUN/slurmd-$node.pid"
  readlink "/proc/$(pid_of "slurmd-$node")/ns/uts" > "$RUN/ns-$node"
done
wait_for "idle nodes" 60 bash -c '[ "$(sinfo -h -N -o %T | grep -c idle)" -eq 2 ]'
wait_for sacct 30 sacct -n

printf '[cluster] up in %.1f s: %s (state, logs, sockets in %s)\n' \
  "$(awk "BEGIN{print $(date +%s.%N) - $started}")" "$(sinfo -h -N -o '%N:%T' | tr '\n' ' ')" "$D"
