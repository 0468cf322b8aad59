# Sourced by cluster-up.sh and cluster-down.sh (and usable by hand: `source slurm/cluster-env.sh`)
# - where the local test cluster keeps everything, and the helpers both scripts share.
# One directory holds configs, the munge key, sockets, pid files, logs, Slurm state and the
# MariaDB data; it lives under /tmp because unix socket paths are limited to 108 bytes.
TRAIN_SLURM_DIR="${TRAIN_SLURM_DIR:-/tmp/train-slurm}"
D="${TRAIN_SLURM_DIR%/}"
case "$D" in /?*) ;; *) echo "TRAIN_SLURM_DIR must be an absolute path, not '$D'" >&2; exit 2 ;; esac
ETC="$D/etc" RUN="$D/run" LOG="$D/log" STATE="$D/state"
export SLURM_CONF="$ETC/slurm.conf"   # clients also find it via /etc/slurm/slurm.conf (a link)
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live in /usr/sbin
NODES=(node1 node2)
GPUS_PER_NODE=4                             # fake GPUs (Slurm GRES on mknod device files), see cluster-up
CTLD_PORT="${TRAIN_SLURM_PORT:-16817}"  # slurmctld; slurmd ports and slurmdbd follow it
DBD_PORT=$((CTLD_PORT + 3))
MARKER="# train-slurm local test cluster"  # tags the line we add to /etc/hosts
ETC_LINK=/etc/slurm/slurm.conf              # where sbatch & co. look without SLURM_CONF
LOCK="$D.lock"                              # outside $D: `--purge` deletes $D

log() { printf '[cluster] %s\n' "$*"; }

# Serialise cluster-up/cluster-down (tests and people may call them at once). cluster-up runs
# cluster-down while holding the lock, so the child skips it. Daemons must not inherit fd 9
# (they would hold the lock forever): every daemon is started with `9>&-`.
take_lock() {
  [ -n "${TRAIN_SLURM_LOCKED:-}" ] && return 0
  exec 9>>"$LOCK"
  flock -w 300 9 || { echo "cluster: could not lock $LOCK within 300 s" >&2; exit 1; }
  export TRAIN_SLURM_LOCKED=1
}

# A pid that runs and is no zombie (exited daemons linger as zombies here: PID 1 reaps lazily,
# and `kill -0` succeeds on a zombie).
alive() {
  local pid="$1"
  [ -n "$pid" ] && [ -e "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

# The pid in run/<name>.pid, only if that process is alive AND is the program we started
# (after a machine restart an old pid file may name an unrelated process).
daemon_pid() {  # daemon_pid <pid-file name> <program>
  local pid
  [ -s "$RUN/$1.pid" ] || return 1
  pid="$(tr -dc 0-9 < "$RUN/$1.pid")"
  alive "$pid" || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}

# The daemons: pid-file name -> program name (the comm of the process).
DAEMONS=(munged:munged mariadb:mariadbd slurmdbd:slurmdbd slurmctld:slurmctld
         slurmd-node1:slurmd slurmd-node2:slurmd)

any_alive() { local p; for p in "$@"; do alive "$p" && return 0; done; return 1; }
wait_gone() {  # wait_gone <seconds> <pid>...: 0 once none is alive
  local secs="$1"; shift
  for _ in $(seq $((secs * 10))); do any_alive "$@" || return 0; sleep 0.1; done
  ! any_alive "$@"
}

# Stop daemons by their pid files, all at once: TERM, then KILL after 5 s (slurmd at times
# ignores TERM). Their pids are added to STOPPED.
STOPPED=()
stop_daemons() {  # stop_daemons <pid-file name>:<program> ...
  local pair pid pids=()
  for pair in "$@"; do
    if pid="$(daemon_pid "${pair%%:*}" "${pair#*:}")"; then
      pids+=("$pid"); STOPPED+=("$pid"); kill -TERM "$pid" 2>/dev/null || true
    fi
    rm -f "$RUN/${pair%%:*}.pid"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  wait_gone 5 "${pids[@]}" && return 0
  for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null; done
  wait_gone 3 "${pids[@]}"
}
