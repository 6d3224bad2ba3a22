#!/usr/bin/env bash
# A 3-node Garage cluster on loopback, for running kvtier's S3 suite against a real
# distributed object store (outside CI: `cargo install garage@2.5.0 --locked`, ~10 min).
#
#   tools/garage/cluster.sh start     # 3 nodes, replication 3, bucket "kvtier", a key;
#                                     # prints the KVTIER_S3_* variables (also in $DIR/env)
#   tools/garage/cluster.sh kill N    # SIGKILL node N (1-3)
#   tools/garage/cluster.sh revive N  # start node N again
#   tools/garage/cluster.sh stop      # all nodes down, state removed
#
# Node 1's S3 API is the endpoint (127.0.0.1:3900); nodes 2 and 3 listen on 3910 and 3920.
# With replication_factor 3 and the default consistency, reads and writes need 2 of 3 nodes:
# killing node 2 or 3 mid-run must not fail requests; killing node 1 takes the endpoint down.
set -euo pipefail
DIR=${KVTIER_GARAGE_DIR:-/var/tmp/kvtier-garage}
GARAGE=${GARAGE:-$(command -v garage || echo "$HOME/.cargo/bin/garage")}

conf() { echo "$DIR/node$1/garage.toml"; }
port() { echo $((3900 + 10 * ($1 - 1) + $2)); }

start_node() {
  local n=$1
  "$GARAGE" -c "$(conf "$n")" server >"$DIR/node$n/log" 2>&1 &
  echo $! >"$DIR/node$n/pid"
}

wait_rpc() {
  for _ in $(seq 100); do
    "$GARAGE" -c "$(conf "$1")" node id -q >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "node $1 did not come up; see $DIR/node$1/log" >&2
  return 1
}

case "${1:-}" in
  start)
    rm -rf "$DIR"
    secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
    for n in 1 2 3; do
      mkdir -p "$DIR/node$n/meta" "$DIR/node$n/data"
      cat >"$(conf "$n")" <<TOML
metadata_dir = "$DIR/node$n/meta"
data_dir = "$DIR/node$n/data"
db_engine = "sqlite"
replication_factor = 3
rpc_bind_addr = "127.0.0.1:$(port "$n" 1)"
rpc_public_addr = "127.0.0.1:$(port "$n" 1)"
rpc_secret = "$secret"
[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$(port "$n" 0)"
root_domain = ".s3.garage.localhost"
TOML
      chmod 600 "$(conf "$n")"
      start_node "$n"
    done
    for n in 1 2 3; do wait_rpc "$n"; done
    g="$GARAGE -c $(conf 1)"
    for n in 2 3; do
      id=$("$GARAGE" -c "$(conf "$n")" node id -q)
      $g node connect "$id" >/dev/null
    done
    for n in 1 2 3; do
      id=$("$GARAGE" -c "$(conf "$n")" node id -q | cut -d@ -f1)
      $g layout assign -z dc1 -c 1G "$id" >/dev/null
    done
    $g layout apply --version 1 >/dev/null
    $g bucket create kvtier >/dev/null
    keyout=$($g key create kvtier-key)
    key_id=$(echo "$keyout" | sed -n 's/^Key ID: *//p' | head -1)
    key_secret=$(echo "$keyout" | sed -n 's/^Secret key: *//p' | head -1)
    [ -n "$key_id" ] && [ -n "$key_secret" ] || { echo "could not read the key: $keyout" >&2; exit 1; }
    $g bucket allow --read --write --owner kvtier --key kvtier-key >/dev/null
    cat >"$DIR/env" <<ENV
export KVTIER_S3_ENDPOINT=http://127.0.0.1:3900
export KVTIER_S3_BUCKET=kvtier
export KVTIER_S3_REGION=garage
export KVTIER_S3_ACCESS_KEY=$key_id
export KVTIER_S3_SECRET_KEY=$key_secret
ENV
    chmod 600 "$DIR/env"
    $g status
    echo "cluster up; source $DIR/env"
    ;;
  kill)
    kill -9 "$(cat "$DIR/node$2/pid")" 2>/dev/null || true
    ;;
  revive)
    start_node "$2"
    wait_rpc "$2"
    ;;
  stop)
    for n in 1 2 3; do
      [ -f "$DIR/node$n/pid" ] && kill -9 "$(cat "$DIR/node$n/pid")" 2>/dev/null || true
    done
    rm -rf "$DIR"
    ;;
  *)
    echo "usage: $0 start | kill N | revive N | stop" >&2
    exit 2
    ;;
esac
