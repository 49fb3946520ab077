#!/usr/bin/env bash
# A redis-server for kvkeep's remote-tier tests, on 127.0.0.1 only.
#
#   scripts/redis-test-server.sh install        apt-get install redis-server if it is missing
#   scripts/redis-test-server.sh start [PORT]   start one (default port 6399) in .cache/redis,
#                                               maxmemory 256mb + allkeys-lru, no persistence;
#                                               prints its URL
#   scripts/redis-test-server.sh stop           stop the one `start` started (by its PID file)
#
# The tests start their own private servers (they stop and pause them on purpose); they need
# only `install`. `start`/`stop` are for benchmarks and trying kvkeep --remote by hand.
# Debian 12 ships redis-server 7.0 and no valkey package; the protocol is the same.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=.cache/redis
PIDFILE=$STATE/redis.pid

install() {
    if command -v redis-server >/dev/null || [ -x /usr/bin/redis-server ]; then
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -q
    # policy-rc.d may forbid starting the packaged service; we never use it anyway.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q redis-server
    # The package starts a system-wide server where init allows; the tests do not use it.
    redis-server --version
}

start() {
    local port=${1:-6399}
    install
    mkdir -p "$STATE"
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        echo "already running (pid $(cat "$PIDFILE"))" >&2
    else
        redis-server --bind 127.0.0.1 --port "$port" --dir "$PWD/$STATE" --save "" \
            --appendonly no --maxmemory 256mb --maxmemory-policy allkeys-lru \
            --daemonize yes --pidfile "$PWD/$PIDFILE" --logfile "$PWD/$STATE/redis.log"
        for _ in $(seq 100); do
            redis-cli -p "$port" ping >/dev/null 2>&1 && break
            sleep 0.05
        done
    fi
    echo "redis://127.0.0.1:$port"
}

stop() {
    [ -f "$PIDFILE" ] || return 0
    local pid
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
    fi
    rm -f "$PIDFILE"
}

case "${1:-}" in
    install) install ;;
    start) start "${2:-}" ;;
    stop) stop ;;
    *) echo "usage: $0 install | start [PORT] | stop" >&2; exit 2 ;;
esac
