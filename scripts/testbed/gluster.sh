#!/usr/bin/env bash
# A local 3-brick distributed GlusterFS volume standing in for a parallel filesystem.
#
#   scripts/testbed/gluster.sh up [--delay-ms MS]   start glusterd, create/start the volume, mount it
#   scripts/testbed/gluster.sh down                 unmount, stop and delete the volume, stop glusterd
#   scripts/testbed/gluster.sh status
#   scripts/testbed/gluster.sh exists               exit 0 if the volume is there
#
# The volume, its bricks' folder and its mount point are FUSEFS_GLUSTER_VOL, _BRICKS and
# _MNT (testkit/gluster.py reads the same). Nothing else of the machine's GlusterFS is
# touched: `down` stops this volume, and glusterd only if this script started it.
#
# Idempotent: `up` twice is one volume. --delay-ms adds MS milliseconds to every lookup,
# stat, open and read on the bricks with the debug translator delay-gen. Options like it
# are loaded only when the bricks start, so a change of delay stops and starts the
# volume. Without --delay-ms the delay is removed. Needs root and glusterfs-server.
set -euo pipefail

VOL=${FUSEFS_GLUSTER_VOL:-fusefsvol}
BRICKS=${FUSEFS_GLUSTER_BRICKS:-/srv/fusefs-gluster}
MNT=${FUSEFS_GLUSTER_MNT:-/mnt/fusefs-gluster}
HOST=$(hostname)
G="gluster --mode=script"
# What this script started, so that `down` stops that and nothing else: the pid of a
# glusterd it started (none is recorded when one was already running: the machine's).
STATE=/run/fusefs-testbed
GLUSTERD_PID="$STATE/$VOL.glusterd.pid"

# A process of that name that is not a zombie. A killed daemon stays a zombie until PID 1
# reaps it, which in a container can take seconds: seen here, right after `pkill -9`.
running() { ps -C "$1" -o stat= | grep -v '^Z' >/dev/null; }

ensure_glusterd() {
    if ! running glusterd; then
        install -d -m 0700 "$STATE"
        glusterd --log-level=WARNING -p "$GLUSTERD_PID.new"
        for _ in $(seq 50); do
            if $G pool list >/dev/null 2>&1; then
                mv -f "$GLUSTERD_PID.new" "$GLUSTERD_PID"
                return 0
            fi
            sleep 0.2
        done
        echo "gluster.sh: glusterd did not start" >&2; exit 1
    fi
}
# The pid recorded for the glusterd this script started, if that process still runs.
our_glusterd() {
    local pid
    [ -f "$GLUSTERD_PID" ] || return 1
    pid=$(cat "$GLUSTERD_PID")
    [ -n "$pid" ] && [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = glusterd ] && echo "$pid"
}

vol_exists() { $G volume info "$VOL" >/dev/null 2>&1; }
# In /proc/mounts, even when stale: a client killed without unmounting leaves a mount
# whose every access fails with ENOTCONN, which `mountpoint` cannot tell from none.
in_mount_table() { awk -v m="$MNT" '$2 == m {f=1} END {exit !f}' /proc/mounts; }
mount_alive() { in_mount_table && stat -t "$MNT" >/dev/null 2>&1; }
drop_mount() {
    in_mount_table || return 0
    umount "$MNT" 2>/dev/null || umount -l "$MNT"
}
bricks_present() {
    local b
    for b in b1 b2 b3; do
        getfattr -n trusted.glusterfs.volume-id "$BRICKS/$b" >/dev/null 2>&1 || return 1
    done
}
# All three bricks online with a port: glusterd answers `volume start` as soon as it has
# spawned the brick processes, and a client mounted before they listen fails its first
# lookup (seen here right after the bricks were killed and restarted).
bricks_online() {
    [ "$($G volume status "$VOL" 2>/dev/null | awk '$1 == "Brick" && $3 ~ /^[1-9][0-9]*$/ && $5 == "Y"' | wc -l)" -eq 3 ]
}
# `start force` until the bricks are online. It is a no-op for running bricks and restarts
# dead ones, but a brick killed a moment ago is a zombie until PID 1 reaps it, and glusterd
# takes its pid for a running brick: so ask again every 2 s (seen here: bricks stayed down
# after one `start force`).
start_bricks() {
    local err=""
    for _ in $(seq 60); do
        err=$($G volume start "$VOL" force 2>&1 >/dev/null) || true
        for _ in $(seq 10); do bricks_online && return 0; sleep 0.2; done
    done
    echo "gluster.sh: the bricks of $VOL did not come online within 2 min ${err}" >&2; exit 1
}
# Mount, and try again (up to 5 times) if the client gives up before it reaches the bricks.
mount_volume() {
    local i
    for i in 1 2 3 4 5; do
        mount -t glusterfs "$HOST:/$VOL" "$MNT" && mount_alive && return 0
        drop_mount
        sleep 1
    done
    echo "gluster.sh: cannot mount $HOST:/$VOL at $MNT (see /var/log/glusterfs/)" >&2; exit 1
}
# The client mount connected to every brick. A brick restarted under a live mount is
# reconnected by the client a few seconds later, and a directory made before that gets a
# DHT layout without that brick (seen here: `up` right after a brick was killed, then 24
# new files all went to the other two bricks).
clients_connected() {
    [ "$($G volume status "$VOL" clients 2>/dev/null | awk '/^Clients connected :/ && $4 >= 1' | wc -l)" -eq 3 ]
}
wait_clients() {
    for _ in $(seq 60); do clients_connected && return 0; sleep 0.5; done
    echo "gluster.sh: the client at $MNT did not connect to every brick of $VOL within 30 s" >&2; exit 1
}
vol_started() { $G volume info "$VOL" 2>/dev/null | grep -q '^Status: Started'; }
current_delay_us() {
    $G volume info "$VOL" 2>/dev/null | awk '/^debug.delay-gen:/ {on=1} /^delay-gen.delay-duration:/ {d=$2} END {print (on ? d : 0)}'
}

up() {
    local delay_ms=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --delay-ms) delay_ms=$2; shift 2 ;;
            *) echo "gluster.sh: unknown option $1" >&2; exit 2 ;;
        esac
    done
    local want_us
    want_us=$(awk -v ms="$delay_ms" 'BEGIN {printf "%d", ms * 1000}')
    ensure_glusterd
    # Leftovers of a run that was killed: a stale client mount, or a volume whose brick
    # folders are gone (glusterd keeps its state in /var/lib/glusterd). Start clean.
    mount_alive || drop_mount
    if vol_exists && ! bricks_present; then
        echo "gluster.sh: volume $VOL has lost its brick folders; recreating it" >&2
        $G volume stop "$VOL" force >/dev/null 2>&1 || true
        $G volume delete "$VOL" >/dev/null
    fi
    if ! vol_exists; then
        mkdir -p "$BRICKS"/b1 "$BRICKS"/b2 "$BRICKS"/b3
        $G volume create "$VOL" "$HOST:$BRICKS/b1" "$HOST:$BRICKS/b2" "$HOST:$BRICKS/b3" force >/dev/null
    fi
    if [ "$(current_delay_us)" != "$want_us" ]; then
        if vol_started; then
            drop_mount
            $G volume stop "$VOL" >/dev/null
        fi
        if [ "$want_us" -gt 0 ]; then
            $G volume set "$VOL" debug.delay-gen posix >/dev/null
            $G volume set "$VOL" delay-gen.delay-percentage 100 >/dev/null
            $G volume set "$VOL" delay-gen.delay-duration "$want_us" >/dev/null
            $G volume set "$VOL" delay-gen.enable lookup,stat,fstat,open,read >/dev/null
        else
            $G volume reset "$VOL" debug.delay-gen >/dev/null 2>&1 || true
            $G volume reset "$VOL" delay-gen.delay-duration >/dev/null 2>&1 || true
            $G volume reset "$VOL" delay-gen.delay-percentage >/dev/null 2>&1 || true
            $G volume reset "$VOL" delay-gen.enable >/dev/null 2>&1 || true
        fi
    fi
    start_bricks
    mkdir -p "$MNT"
    if ! mount_alive; then
        drop_mount
        mount_volume
    fi
    wait_clients
    # Large sequential reads (chunk files) need more than the default 128 KiB readahead.
    local bdi="/sys/class/bdi/$(mountpoint -d "$MNT")/read_ahead_kb"
    [ -w "$bdi" ] && echo "${READ_AHEAD_KB:-1024}" > "$bdi" || true
    warn_free_space
    echo "gluster.sh: $VOL mounted at $MNT (3 bricks under $BRICKS, delay ${delay_ms} ms per op)"
}

# A brick with less free space than cluster.min-free-disk (10% by default, as GlusterFS
# counts it: available blocks of all blocks) gets no new file of its own: GlusterFS puts
# it elsewhere, and when every brick is short (they share one disk here) all on one, so
# tests and benchmarks that count on the spread over three bricks fail or slow down.
warn_free_space() {
    local pct
    pct=$(stat -f -c '%a %b' "$BRICKS/b1" | awk '{printf "%d", 100 * $1 / $2}')
    if [ "$pct" -lt 10 ]; then
        echo "gluster.sh: warning: the bricks' disk has ${pct}% free, under GlusterFS's" \
             "cluster.min-free-disk (10%): every new file will go to one brick" >&2
    fi
}

# Unmount, stop and delete this volume (its brick processes stop with it; its client
# with the unmount), and stop glusterd only if this script started it and no other volume
# is left: no process is stopped by its name, so another volume of the machine's, and its
# mounts, go on.
down() {
    drop_mount
    if command -v glusterd >/dev/null; then
        # Started if need be, so that a volume left by a killed run is deleted too.
        ensure_glusterd
        if vol_exists; then
            $G volume stop "$VOL" force >/dev/null 2>&1 || true
            $G volume delete "$VOL" >/dev/null || true
        fi
        local pid
        if pid=$(our_glusterd) && [ -z "$($G volume list 2>/dev/null | grep -v '^No volumes present')" ]; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 100); do [ -d /proc/"$pid" ] && ! grep -q '^State:.*Z' /proc/"$pid"/status 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$GLUSTERD_PID"
        rmdir "$STATE" 2>/dev/null || true  # (once no volume of the test bed's has a record in it)
    fi
    rm -rf "$BRICKS"
    rmdir "$MNT" 2>/dev/null || true  # (the mount point `up` made, if empty)
    echo "gluster.sh: $VOL removed"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) down ;;
    status) ensure_glusterd; $G volume info "$VOL"; mount_alive && echo "$MNT: mounted" || echo "$MNT: not mounted" ;;
    # exit 0 if the volume exists (without starting glusterd: a machine without one has none)
    exists) running glusterd && vol_exists ;;
    *) echo "usage: $0 up [--delay-ms MS] | down | status | exists" >&2; exit 2 ;;
esac
