#!/usr/bin/env bash
# Tear down the local test cluster: cancel jobs, stop every daemon by its pid file, kill what
# jobs left behind (by the nodes' UTS namespaces, never by process name), and remove what
# cluster-up added to /etc. `--purge` also deletes the state directory (logs included).
set -uo pipefail
source "$(dirname "$0")/cluster-env.sh"

[ -d "$D" ] || { log "not running"; exit 0; }

if [ -n "$(pid_of slurmctld)" ] && alive "$(pid_of slurmctld)"; then
  scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
fi

# Every process of a node (slurmd, slurmstepd, job tasks) shares that node's UTS namespace.
namespaces=()
for node in "${NODES[@]}"; do
  [ -s "$RUN/ns-$node" ] && namespaces+=("$(cat "$RUN/ns-$node")")
done

for node in "${NODES[@]}"; do stop_daemon "slurmd-$node"; done
for ns in "${namespaces[@]}"; do
  for proc in /proc/[0-9]*; do
    [ "$(readlink "$proc/ns/uts" 2>/dev/null)" = "$ns" ] && kill -KILL "${proc#/proc/}" 2>/dev/null
  done
done
stop_daemon slurmctld
stop_daemon slurmdbd
stop_daemon mariadb
stop_daemon munged

# Only what cluster-up created: the /etc/hosts line and the config link.
if grep -qF "$MARKER" /etc/hosts 2>/dev/null; then
  grep -vF "$MARKER" /etc/hosts > "$RUN/hosts.tmp" && cat "$RUN/hosts.tmp" > /etc/hosts
fi
[ -L "$ETC_LINK" ] && [ "$(readlink "$ETC_LINK")" = "$SLURM_CONF" ] && rm -f "$ETC_LINK"
rm -f "$RUN"/ns-* "$RUN"/*.sock* 2>/dev/null

if [ "${1:-}" = "--purge" ]; then rm -rf "$D"; log "down; $D removed"; else log "down (logs kept in $LOG)"; fi
