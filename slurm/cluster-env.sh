# Sourced by cluster-up.sh and cluster-down.sh: where the local test cluster keeps everything.
# One directory holds configs, keys, sockets, pid files, logs, Slurm state and the MariaDB
# data; it lives under /tmp because unix socket paths are limited to 108 bytes.
TRAIN_SLURM_DIR="${TRAIN_SLURM_DIR:-/tmp/train-slurm}"
D="$TRAIN_SLURM_DIR"
ETC="$D/etc" RUN="$D/run" LOG="$D/log" STATE="$D/state"
export SLURM_CONF="$ETC/slurm.conf"
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live in /usr/sbin, not on every user's PATH
NODES=(node1 node2)
CTLD_PORT="${TRAIN_SLURM_PORT:-16817}"   # slurmctld; slurmd ports and slurmdbd follow it
DBD_PORT=$((CTLD_PORT + 3))
MARKER="# train-slurm local test cluster"  # tags the lines we add to /etc/hosts
ETC_LINK=/etc/slurm/slurm.conf              # where sbatch & co. look without SLURM_CONF

log() { printf '[cluster] %s\n' "$*"; }

# A pid that is gone or a zombie (exited daemons linger as zombies here: PID 1 reaps lazily).
alive() {
  local pid="$1"
  [ -n "$pid" ] && [ -e "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

pid_of() { [ -s "$RUN/$1.pid" ] && cat "$RUN/$1.pid"; }

# Stop a daemon by its pid file: TERM, then KILL after a few seconds.
stop_daemon() {
  local name="$1" pid
  pid="$(pid_of "$name")" || return 0
  alive "$pid" || { rm -f "$RUN/$name.pid"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
  if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
  rm -f "$RUN/$name.pid"
}
