#!/usr/bin/env bash
# Make sure a PostgreSQL server is available for llmgw's tests; print its DSN on stdout.
#
# If something already answers on 127.0.0.1:5432, print postgresql://postgres@127.0.0.1:5432/postgres
# and exit 0. Otherwise create a throwaway cluster (trust auth, 127.0.0.1 only) in a temporary
# directory owned by a non-root user, start it on a free port, wait until it accepts connections,
# and print its DSN. Only the DSN goes to stdout; progress goes to stderr. Usage:
#
#   export LLMGW_TEST_PG="$(scripts/ensure-postgres.sh)"
#
# Environment:
#   LLMGW_PG_FORCE_NEW=1   skip the check of port 5432 and always start a throwaway cluster
#   LLMGW_PG_USER=name     the non-root user that owns the throwaway cluster (when run as root;
#                          default: "postgres" if that user exists, else "nobody")
#   LLMGW_PG_WAIT_S=30     how long to wait for the new server to accept connections
set -euo pipefail

log() { echo "ensure-postgres: $*" >&2; }
die() { log "error: $*"; exit 1; }

DEFAULT_PORT=5432
WAIT_S="${LLMGW_PG_WAIT_S:-30}"

find_pg_bin() {  # find_pg_bin NAME -> path of the newest PostgreSQL's NAME, or nothing
    local name="$1" candidate
    if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
    for candidate in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$candidate/$name" ]]; then echo "$candidate/$name"; return; fi
    done
}

answers() {  # answers PORT -> success if a PostgreSQL server accepts connections on 127.0.0.1:PORT
    local port="$1" isready
    isready="$(find_pg_bin pg_isready)"
    if [[ -n "$isready" ]]; then
        "$isready" -q -h 127.0.0.1 -p "$port" -t 3
    else
        timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null
    fi
}

if [[ "${LLMGW_PG_FORCE_NEW:-0}" != 1 ]] && answers "$DEFAULT_PORT"; then
    log "a server already answers on 127.0.0.1:$DEFAULT_PORT"
    echo "postgresql://postgres@127.0.0.1:$DEFAULT_PORT/postgres"
    exit 0
fi

if [[ -z "$(find_pg_bin initdb)" ]]; then
    [[ "$(id -u)" == 0 ]] || die "PostgreSQL is not installed and this is not root: install the postgresql package"
    log "installing PostgreSQL with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
fi
INITDB="$(find_pg_bin initdb)"
[[ -n "$INITDB" ]] || die "initdb not found after installing PostgreSQL"
# The server tools from the same installation as initdb (never mix versions).
PG_BIN="$(dirname "$(readlink -f "$INITDB")")"
PG_CTL="$PG_BIN/pg_ctl"
PG_ISREADY="$PG_BIN/pg_isready"
[[ -x "$PG_CTL" && -x "$PG_ISREADY" ]] || die "pg_ctl or pg_isready missing next to $INITDB"

# PostgreSQL refuses to run as root: as root, run everything as an unprivileged user.
if [[ "$(id -u)" == 0 ]]; then
    if [[ -n "${LLMGW_PG_USER:-}" ]]; then RUN_USER="$LLMGW_PG_USER"
    elif id postgres >/dev/null 2>&1; then RUN_USER=postgres
    else RUN_USER=nobody
    fi
    as_user() { runuser -u "$RUN_USER" -- "$@"; }
else
    RUN_USER="$(id -un)"
    as_user() { "$@"; }
fi

DATA_ROOT="$(mktemp -d "${TMPDIR:-/tmp}/llmgw-pg.XXXXXX")"
chmod 700 "$DATA_ROOT"
if [[ "$(id -u)" == 0 ]]; then chown "$RUN_USER" "$DATA_ROOT"; fi
DATA="$DATA_ROOT/data"

# A free port: bind port 0 and read back what the kernel picked (a tiny race, fine for tests).
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

log "creating a throwaway cluster in $DATA as $RUN_USER"
as_user "$INITDB" -D "$DATA" -U postgres --auth=trust -E UTF8 --no-sync >"$DATA_ROOT/initdb.log" 2>&1 \
    || { cat "$DATA_ROOT/initdb.log" >&2; die "initdb failed"; }

log "starting it on 127.0.0.1:$PORT"
# fsync off: the data is disposable and tests run faster. The socket lives in the data root
# because /run/postgresql may not exist or be writable for this user.
as_user "$PG_CTL" -D "$DATA" -l "$DATA_ROOT/server.log" \
    -o "-h 127.0.0.1 -p $PORT -k $DATA_ROOT -c fsync=off -c max_connections=200" start >&2 \
    || { cat "$DATA_ROOT/server.log" >&2 || true; die "pg_ctl start failed"; }

deadline=$((SECONDS + WAIT_S))
until "$PG_ISREADY" -q -h 127.0.0.1 -p "$PORT" -t 2; do
    if ((SECONDS >= deadline)); then
        cat "$DATA_ROOT/server.log" >&2 || true
        die "the server on 127.0.0.1:$PORT did not accept connections within ${WAIT_S}s (log above)"
    fi
    sleep 0.2
done

log "ready; stop it with: $( [[ "$(id -u)" == 0 ]] && echo "runuser -u $RUN_USER -- ")$PG_CTL -D $DATA stop"
echo "postgresql://postgres@127.0.0.1:$PORT/postgres"
