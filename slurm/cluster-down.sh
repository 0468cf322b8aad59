#!/usr/bin/env bash
# Tear down the local test cluster: cancel the jobs, stop every daemon by its pid file (TERM,
# then KILL), kill what jobs left behind - by the nodes' UTS namespaces, never by process name -
# and remove what cluster-up added to /etc. Logs stay in $TRAIN_SLURM_DIR/log (the next
# cluster-up starts fresh anyway); `--purge` deletes the whole state directory.
# A no-op when the cluster is down.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/cluster-env.sh"

purge=false
case "${1:-}" in
  --purge) purge=true ;;
  "") ;;
  *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -ne 0 ]; then
  echo "The local Slurm test cluster runs as root; stopping it needs root too." >&2
  exit 3
fi
take_lock
did=()

# 1. Jobs first: slurmstepd and job processes outlive the daemons. Remember where job ids got
#    to, so that the next cluster-up never hands out an id twice. (`timeout`: a hung slurmctld
#    must not hold up the tear-down.)
if daemon_pid slurmctld slurmctld >/dev/null && timeout 3 scontrol ping >/dev/null 2>&1; then
  timeout 5 scontrol show config 2>/dev/null | awk '$1 == "NEXT_JOB_ID" {print $3}' > "$D/next-job-id.new" &&
    [ -s "$D/next-job-id.new" ] && mv "$D/next-job-id.new" "$D/next-job-id"
  rm -f "$D/next-job-id.new"
  jobs=$(timeout 5 squeue -h -o %i 2>/dev/null)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    timeout 5 scancel $jobs 2>/dev/null; did+=("cancelled $(echo $jobs | wc -w) job(s)")
    deadline=$((SECONDS + 3))  # then whatever is left is killed below
    while [ "$SECONDS" -lt "$deadline" ] && [ -n "$(timeout 2 squeue -h -o %i 2>/dev/null)" ]; do
      sleep 0.1
    done
  fi
fi

# 2. The nodes. Every process of a node - slurmd, its slurmstepds, the job tasks, whatever they
#    spawned or daemonized - shares that node's UTS namespace, created by cluster-up. Take it
#    from the live slurmd, else from the recorded one if it was recorded during this boot
#    (namespace ids are reused after a restart); never the host's own namespace.
host_ns="$(readlink /proc/1/ns/uts)" self_ns="$(readlink /proc/self/ns/uts)"
boot_ok=false
[ "$(cat "$RUN/boot-id" 2>/dev/null)" = "$(cat /proc/sys/kernel/random/boot_id)" ] && boot_ok=true
namespaces=()
for node in "${NODES[@]}"; do
  ns=""
  if pid="$(daemon_pid "slurmd-$node" slurmd)"; then ns="$(readlink "/proc/$pid/ns/uts")"
  elif $boot_ok && [ -s "$RUN/ns-$node" ]; then ns="$(cat "$RUN/ns-$node")"
  fi
  [ -n "$ns" ] && [ "$ns" != "$host_ns" ] && [ "$ns" != "$self_ns" ] && namespaces+=("$ns")
done
in_our_namespaces() {  # the live pids in the nodes' namespaces (one find, not a readlink each)
  local pid
  [ ${#namespaces[@]} -eq 0 ] && return 0
  find /proc/[0-9]*/ns/uts -maxdepth 0 -printf '%l %p\n' 2>/dev/null |
    awk -v list="${namespaces[*]}" 'BEGIN { n = split(list, a, " "); for (i = 1; i <= n; i++) ns[a[i]] = 1 }
                                    ($1 in ns) { split($2, p, "/"); print p[3] }' |
    while read -r pid; do alive "$pid" && echo "$pid"; done
  return 0
}
for pair in "${DAEMONS[@]}"; do  # for the summary
  daemon_pid "${pair%%:*}" "${pair#*:}" >/dev/null && did+=("stopped ${pair%%:*}")
done
still=()
stop_daemons slurmd-node1:slurmd slurmd-node2:slurmd || still+=(slurmd)
leftovers=0
for _ in $(seq 30); do  # KILL, again, until nothing is left (a dying job may still fork)
  pids=$(in_our_namespaces)
  [ -z "$pids" ] && break
  leftovers=$((leftovers + $(echo $pids | wc -w)))
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null
  STOPPED+=($pids)
  sleep 0.1
done
[ "$leftovers" -gt 0 ] && did+=("killed $leftovers leftover job/step process(es)")

# 3. The control plane, all at once (each stops independently of the others).
stop_daemons slurmctld:slurmctld slurmdbd:slurmdbd mariadb:mariadbd munged:munged ||
  still+=("a control daemon")
rm -f "$RUN"/ns-* "$RUN"/boot-id "$RUN"/*.sock* 2>/dev/null

# 4. Only what cluster-up added to /etc: the marked /etc/hosts line and the link to our config.
if grep -qF "$MARKER" /etc/hosts 2>/dev/null; then
  tmp="$(mktemp)"
  grep -vF "$MARKER" /etc/hosts > "$tmp"
  cat "$tmp" > /etc/hosts  # in place: /etc/hosts may be a bind mount
  rm -f "$tmp"; did+=("/etc/hosts line removed")
fi
if [ -L "$ETC_LINK" ] && [ "$(readlink "$ETC_LINK")" = "$SLURM_CONF" ]; then
  rm -f "$ETC_LINK"; did+=("$ETC_LINK removed")
fi

# 5. Anything still alive is a bug: say so (and keep the state dir for a look at the logs).
pids=$(in_our_namespaces); [ -n "$pids" ] && still+=($pids)
if [ ${#still[@]} -gt 0 ]; then
  echo "cluster-down: still running: ${still[*]}" >&2
  exit 1
fi

# Exited processes stay zombies for a moment here (PID 1 reaps lazily); they are gone in all
# that matters, but pgrep and ps still list them: give PID 1 up to 5 s so that checks see none.
for _ in $(seq 50); do
  z=0; for pid in "${STOPPED[@]}"; do [ -e "/proc/$pid" ] && z=1 && break; done
  [ "$z" = 0 ] && break; sleep 0.1
done

if $purge; then rm -rf "$D"; did+=("$D removed"); fi
if [ ${#did[@]} -eq 0 ]; then log "not running"; else log "down: $(IFS=';'; echo "${did[*]}" | sed 's/;/; /g')"; fi
