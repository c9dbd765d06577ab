# The cluster topology of scripts/stack, sourced by it (never run on its own):
#
#   scripts/stack up --topology cluster       start what is not running; returns once
#                                             every node answers
#   scripts/stack down --topology cluster     stop what `up --topology cluster` started
#   scripts/stack status --topology cluster   one line per node
#   scripts/stack kill NODE --topology cluster    crash one node (SIGKILL; Postgres:
#                                             immediate stop); `start NODE` starts it again
#
# On loopback, beside the single topology (its ports are never used here):
#
#   redis-1..3    127.0.0.1:7001-7003   Redis Cluster masters (slots split in three)
#   redis-4..6    127.0.0.1:7004-7006   one replica each (redis-4 of redis-1, ...)
#   kafka-1..3    127.0.0.1:19092-19094 three KRaft nodes, broker and controller each
#                 (controllers on 19192-19194); internal topics replicated 3 times,
#                 min.insync.replicas 2
#   pg-primary    127.0.0.1:15432       Postgres 15 primary (wal_level logical)
#   pg-replica    127.0.0.1:15433       its streaming hot standby (physical slot)
#
# No Connect worker: the cluster topology serves the domain-event path (the CDC path is
# tested on the single topology). State lives in $STACK/cluster (.stack/cluster); the
# connection settings go to .stack/cluster/env, as .stack/env for the single topology.
#
# The same logins as the single topology, with passwords of their own (made at random
# once, in .stack/cluster/secrets), all written to .stack/cluster/env:
#   redis     every node, replicas too: the single topology's ACL users (default user
#             off; freshline-api, -writer, -admin), and freshline-replication, which
#             may only replicate: replicas log in to their master with it
#   kafka     no PLAINTEXT listener: clients log in with SCRAM-SHA-512 as the single
#             topology's logins (freshline-consumer, -producer, -connect, -admin),
#             brokers to each other as freshline-broker; the controllers' listener
#             takes SASL/PLAIN as freshline-controller only (a controller cannot check
#             SCRAM, whose credentials live in the metadata it serves, and without a
#             login anyone could alter the brokers' configuration through it). The
#             StandardAuthorizer, as there: the broker, controller and admin logins
#             are super users, and `up` grants the others kafka_acls's list
#   postgres  the owner freshline is no superuser; freshline_api and freshline_consumer
#             as on the single topology (no freshline_cdc: no Debezium here); the
#             standby replicates as postgres over the 0700 local socket
#
# Sizing for a 2-core, 24 GiB machine: each broker gets a 384 MiB heap (serial GC), each
# Redis node a 256 MiB maxmemory, Postgres 128 MiB shared_buffers: about 2.5 GiB resident
# for the whole topology. CPU, not memory, is the bound.

CL="$STACK/cluster"
CL_REDIS_PORTS=(7001 7002 7003 7004 7005 7006)
CL_KAFKA_PORTS=(19092 19093 19094)
CL_CONTROLLER_PORTS=(19192 19193 19194)
CL_PG_PORT=15432
CL_PG_REPLICA_PORT=15433
CL_REDIS_REPLICATION_USER=freshline-replication
# The brokers' SCRAM logins are the single topology's (KAFKA_LOGINS); the controllers
# take this one PLAIN login.
CL_KAFKA_CONTROLLER_USER=freshline-controller
CL_KAFKA_SCRAM=SCRAM-SHA-512
CL_KAFKA_OPTS=(-Xms256m -Xmx384m -XX:+UseSerialGC -XX:+ExitOnOutOfMemoryError
  -XX:TieredStopAtLevel=1 -Djava.awt.headless=true
  -Dlog4j2.configurationFile="$STACK/conf/log4j2.properties")

# cluster_requested ARGS...: true when --topology cluster is among them; a usage error
# for any other topology but single.
cluster_requested() {
  local prev="" arg
  for arg in "$@"; do
    if [[ $prev == --topology ]]; then
      case $arg in
        cluster) return 0 ;;
        single) return 1 ;;
        *) echo "stack: error: unknown topology: $arg (single or cluster)" >&2; exit 2 ;;
      esac
    fi
    [[ $arg == --topology=cluster ]] && return 0
    prev=$arg
  done
  return 1
}

# ---------------------------------------------------------------- redis cluster

# cl_redis_cli PORT ARGS...: redis-cli on one node, as the admin.
cl_redis_cli() {
  env -u REDISCLI_AUTH redis-cli -h "$HOST" -p "$1" --user "$REDIS_ADMIN_USER" \
    --pass "$(secret redis-admin)" --no-auth-warning "${@:2}"
}

# cl_redis_acl_file DIR: a node's ACL users: the single topology's and the replication login.
cl_redis_acl_file() {
  redis_acl_file "$1/users.acl" \
    "user $CL_REDIS_REPLICATION_USER on >$(secret redis-replication) resetkeys resetchannels -@all +psync +replconf +ping"
}

cl_up_redis_node() {
  local port=$1 name=redis-$(($1 - 7000)) dir="$CL/redis/$1"
  if [[ -n "$(pid_of "$name")" ]]; then
    [[ -s $dir/security ]] ||
      fail "$name runs without ACL users: scripts/stack down --topology cluster, then up"
    # This script's current ACL rules, loaded into the running node.
    cl_redis_acl_file "$dir"
    cl_redis_cli "$port" ACL LOAD >/dev/null 2>&1 || fail "$name: could not load its ACL rules"
    return 0
  fi
  port_open "$port" && fail "$HOST:$port ($name) is taken by another process"
  mkdir -p "$dir"
  rm -f "$dir/security"
  cl_redis_acl_file "$dir"
  # No persistence: a node that restarts rejoins empty and resyncs from its master.
  # nodes.conf stays: it is the node's cluster identity, so a restarted node rejoins.
  # Mode 600: masterauth is a password.
  (umask 077 && rm -f "$dir/redis.conf" && cat >"$dir/redis.conf") <<EOF
bind $HOST
port $port
protected-mode yes
daemonize yes
pidfile $STACK/run/$name.pid
logfile $dir/redis.log
dir $dir
save ""
appendonly no
maxmemory 256mb
maxmemory-policy noeviction
cluster-enabled yes
cluster-config-file $dir/nodes.conf
cluster-node-timeout 2000
cluster-replica-validity-factor 0
cluster-require-full-coverage no
cluster-allow-reads-when-down no
aclfile $dir/users.acl
masteruser $CL_REDIS_REPLICATION_USER
masterauth $(secret redis-replication)
EOF
  redis-server "$dir/redis.conf" >"$dir/redis.out" 2>&1 || fail "$name did not start" "$dir/redis.log"
  echo acl >"$dir/security"
  wait_until "$name" "$dir/redis.log" "" cl_redis_ping "$port"
}

cl_redis_ping() { [[ "$(cl_redis_cli "$1" ping 2>/dev/null)" == PONG ]]; }

cl_redis_ok() { cl_redis_cli "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

cl_redis_replicas_linked() {
  # Every master has one connected replica.
  local n
  # (a node's own line reads "myself,slave" once a failover made it a replica)
  n="$(cl_redis_cli 7001 cluster nodes 2>/dev/null | grep -cE '[ ,]slave ' || true)"
  [[ $n -ge 3 ]] || return 1
  ! cl_redis_cli 7001 cluster nodes 2>/dev/null | grep -q 'fail\|handshake'
}

cl_up_redis() {
  local port addrs=()
  for port in "${CL_REDIS_PORTS[@]}"; do cl_up_redis_node "$port"; done
  if ! cl_redis_cli 7001 cluster info 2>/dev/null | grep -q '^cluster_known_nodes:6'; then
    say "redis cluster: creating 3 masters, 3 replicas"
    for port in "${CL_REDIS_PORTS[@]}"; do addrs+=("$HOST:$port"); done
    cl_redis_cli 7001 --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
      >"$CL/redis/create.log" 2>&1 || fail "redis-cli --cluster create failed" "$CL/redis/create.log"
  fi
  wait_until "redis cluster state" "$CL/redis/create.log" "" cl_redis_ok 7001
  wait_until "redis cluster replicas" "$CL/redis/create.log" "" cl_redis_replicas_linked
  echo acl >"$CL/redis/security"
  say "redis cluster up on $HOST:7001-7006"
}

# ---------------------------------------------------------------- kafka (3 nodes)

cl_kafka_voters() {
  local i out=""
  for i in 1 2 3; do out+="${out:+,}$i@$HOST:${CL_CONTROLLER_PORTS[$((i - 1))]}"; done
  echo "$out"
}

cl_kafka_bootstrap() {
  local p out=""
  for p in "${CL_KAFKA_PORTS[@]}"; do out+="${out:+,}$HOST:$p"; done
  echo "$out"
}

cl_up_kafka_node() {
  local i=$1 name=kafka-$1 dir="$CL/kafka/$1" cid
  local port=${CL_KAFKA_PORTS[$((i - 1))]} cport=${CL_CONTROLLER_PORTS[$((i - 1))]}
  if [[ -n "$(pid_of "$name")" ]]; then return 0; fi
  port_open "$port" && fail "$HOST:$port ($name) is taken by another process"
  mkdir -p "$dir/data"
  # Mode 600: the broker's own SCRAM password is in it.
  (umask 077 && rm -f "$dir/server.properties" && cat >"$dir/server.properties") <<EOF
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$(cl_kafka_voters)
listeners=SASL://$HOST:$port,CONTROLLER://$HOST:$cport
advertised.listeners=SASL://$HOST:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL
listener.security.protocol.map=SASL:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT
sasl.enabled.mechanisms=$CL_KAFKA_SCRAM
sasl.mechanism.inter.broker.protocol=$CL_KAFKA_SCRAM
listener.name.sasl.scram-sha-512.sasl.jaas.config=$(scram_jaas "$KAFKA_BROKER_USER" kafka-broker)
listener.name.controller.sasl.enabled.mechanisms=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="$CL_KAFKA_CONTROLLER_USER" password="$(secret kafka-controller)" user_$CL_KAFKA_CONTROLLER_USER="$(secret kafka-controller)";
$(kafka_authorizer_conf "$CL_KAFKA_CONTROLLER_USER")
log.dirs=$dir/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
auto.create.topics.enable=false
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
group.initial.rebalance.delay.ms=0
num.network.threads=1
num.io.threads=2
num.replica.fetchers=1
log.retention.hours=24
EOF
  if [[ ! -s $dir/data/meta.properties ]]; then
    kafka_format "$dir" "$(cat "$CL/kafka/cluster.id")" "$name"
  fi
  : >"$dir/kafka.log"
  setsid nohup java "${CL_KAFKA_OPTS[@]}" -Dfreshline.log="$dir/kafka.log" -cp "$LIB/*" \
    kafka.Kafka "$dir/server.properties" >"$dir/kafka.out" 2>&1 </dev/null &
  echo $! >"$STACK/run/$name.pid"
}

cl_kafka_brokers_registered() {
  kafka_tool "$CL/kafka" "$(cl_kafka_bootstrap)" "$CL/kafka/brokers.out" \
    org.apache.kafka.tools.BrokerApiVersionsCommand || return 1
  [[ "$(grep -c '^[^ ].*(id: [0-9]' "$CL/kafka/brokers.out")" -ge 3 ]]
}

cl_up_kafka() {
  local i
  # Storage formatted without this script's logins (before SCRAM, or with the one
  # client login the topology had before its ACLs) cannot gain them, and brokers
  # started from it run without the authorizer: the topology's data is disposable,
  # format it again.
  if [[ -s $CL/kafka/cluster.id ]] && ! kafka_has_logins "$CL/kafka"; then
    for i in 1 2 3; do
      [[ -z "$(pid_of "kafka-$i")" ]] ||
        fail "kafka-$i runs without the logins and ACLs: scripts/stack down --topology cluster, then up"
    done
    say "kafka cluster: storage made without the logins, formatting it again"
    rm -rf "$CL/kafka"
  fi
  mkdir -p "$CL/kafka"
  kafka_admin_properties "$CL/kafka"
  kafka_cluster_id "$CL/kafka/cluster.id" >/dev/null
  for i in 1 2 3; do cl_up_kafka_node "$i"; done
  echo "$KAFKA_LOGINS" >"$CL/kafka/logins"
  for i in 1 2 3; do
    wait_until "kafka-$i" "$CL/kafka/$i/kafka.log" "kafka-$i" port_open "${CL_KAFKA_PORTS[$((i - 1))]}"
  done
  wait_until "kafka brokers" "$CL/kafka/1/kafka.log" kafka-1 cl_kafka_brokers_registered
  kafka_acls "$CL/kafka" "$(cl_kafka_bootstrap)"
  say "kafka cluster up on $(cl_kafka_bootstrap)"
}

# ---------------------------------------------------------------- postgres + replica

cl_pg_socket() {
  local dir="$CL/pg/run"
  if ((${#dir} > 90)); then dir="/tmp/freshline-clpg-$(echo "$CL" | sha1sum | cut -c1-8)"; fi
  echo "$dir"
}

cl_pg_psql() {
  as_postgres "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$(cl_pg_socket)" -p "$1" -U postgres "${@:2}"
}

cl_pg_conf() {
  # cl_pg_conf DATA PORT: freshline.conf for a primary or a standby (the standby ignores
  # what it does not need; hot_standby lets it serve reads).
  cat >"$1/freshline.conf" <<EOF
listen_addresses = '$HOST'
port = $2
unix_socket_directories = '$(cl_pg_socket)'
wal_level = logical
max_replication_slots = 10
max_wal_senders = 10
max_connections = 100
shared_buffers = 128MB
fsync = off
full_page_writes = on
hot_standby = on
hot_standby_feedback = on
wal_keep_size = 256MB
password_encryption = scram-sha-256
EOF
  cat >"$1/pg_hba.conf" <<EOF
local   all          all                  trust
local   replication  all                  trust
host    all          all    $HOST/32  scram-sha-256
host    replication  all    $HOST/32  scram-sha-256
EOF
  if [[ $EUID -eq 0 ]]; then chown postgres:postgres "$1/freshline.conf" "$1/pg_hba.conf"; fi
}

cl_pg_start() {
  # cl_pg_start NAME DATA PORT
  local name=$1 data=$2 port=$3 log="$CL/pg/$1.log"
  : >"$log"
  if [[ $EUID -eq 0 ]]; then chown postgres:postgres "$log"; fi
  as_postgres "$PG_BIN/pg_ctl" -D "$data" -l "$log" -w -t "$TIMEOUT" start >/dev/null 2>&1 ||
    fail "$name did not start" "$log"
  head -n1 "$data/postmaster.pid" >"$STACK/run/$name.pid"
  wait_until "$name" "$log" "$name" "$PG_BIN/pg_isready" -q -h "$HOST" -p "$port"
}

cl_up_pg_primary() {
  local data="$CL/pg/primary"
  [[ -n "$(pid_of pg-primary)" ]] && return 0
  port_open "$CL_PG_PORT" && fail "$HOST:$CL_PG_PORT (pg-primary) is taken by another process"
  mkdir -p "$CL/pg" "$(cl_pg_socket)"
  if [[ $EUID -eq 0 ]]; then chown postgres:postgres "$CL/pg" "$(cl_pg_socket)"; fi
  chmod 700 "$(cl_pg_socket)"
  if [[ ! -s $data/PG_VERSION ]]; then
    mkdir -p "$data"
    if [[ $EUID -eq 0 ]]; then chown postgres:postgres "$data"; fi
    as_postgres "$PG_BIN/initdb" -D "$data" -U postgres -E UTF8 --locale=C \
      --auth-local=trust --auth-host=scram-sha-256 >"$CL/pg/initdb.log" 2>&1 ||
      fail "pg-primary initdb failed" "$CL/pg/initdb.log"
    echo "include 'freshline.conf'" >>"$data/postgresql.conf"
  fi
  cl_pg_conf "$data" "$CL_PG_PORT"
  cl_pg_start pg-primary "$data" "$CL_PG_PORT"
  cl_pg_psql "$CL_PG_PORT" -d postgres -v user="$PG_USER" -v db="$PG_DATABASE" \
    >/dev/null <<'EOF' || fail "pg-primary: could not create role/database"
SELECT format('CREATE ROLE %I', :'user')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'user') \gexec
SELECT format('ALTER ROLE %I SET search_path = public', :'user') \gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'user')
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db') \gexec
SELECT 'SELECT pg_create_physical_replication_slot(''freshline_replica'')'
 WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = 'freshline_replica') \gexec
EOF
  # The logins, as on the single topology (the standby gets them by replication).
  pg_login_roles "$CL/pg/pg-primary.log" cl_pg_psql "$CL_PG_PORT"
  echo "$PG_API_ROLE $PG_CONSUMER_ROLE" >"$CL/pg/roles"
}

cl_pg_streaming() {
  [[ "$(cl_pg_psql "$CL_PG_PORT" -d postgres -tAc \
    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'" 2>/dev/null)" -ge 1 ]]
}

cl_up_pg_replica() {
  local data="$CL/pg/replica"
  [[ -n "$(pid_of pg-replica)" ]] && return 0
  port_open "$CL_PG_REPLICA_PORT" &&
    fail "$HOST:$CL_PG_REPLICA_PORT (pg-replica) is taken by another process"
  if [[ ! -s $data/PG_VERSION ]]; then
    say "pg-replica: base backup from pg-primary"
    rm -rf "$data"
    as_postgres "$PG_BIN/pg_basebackup" -h "$(cl_pg_socket)" -p "$CL_PG_PORT" -U postgres \
      -D "$data" -X stream -S freshline_replica -R -c fast >"$CL/pg/basebackup.log" 2>&1 ||
      fail "pg_basebackup failed" "$CL/pg/basebackup.log"
  fi
  cl_pg_conf "$data" "$CL_PG_REPLICA_PORT"
  cl_pg_start pg-replica "$data" "$CL_PG_REPLICA_PORT"
  wait_until "pg-replica streaming" "$CL/pg/pg-replica.log" pg-replica cl_pg_streaming
}

cl_down_pg() {
  local name=$1 data=$2 pid
  pid="$(pid_of "$name")"
  [[ -n $pid ]] || { rm -f "$STACK/run/$name.pid"; return 0; }
  as_postgres "$PG_BIN/pg_ctl" -D "$data" -m fast -w -t 30 stop >/dev/null 2>&1 || true
  if alive "$pid"; then stop "$name" 10; else rm -f "$STACK/run/$name.pid"; fi
}

# ---------------------------------------------------------------- env + commands

cl_write_env() {
  local tmp p seeds=""
  for p in 7001 7002 7003; do seeds+="${seeds:+,}$HOST:$p"; done
  tmp="$(mktemp "$CL/.env.XXXXXX")"
  {
    echo "# The cluster topology's connection settings, written by"
    echo "# scripts/stack up --topology cluster. Load with: set -a; . .stack/cluster/env; set +a"
    env_postgres "$CL_PG_PORT" "$CL/pg/roles"
    # The standby serves the API's reads, as the API's role.
    if [[ -s $CL/pg/roles ]]; then
      env_line FRESHLINE_POSTGRES_REPLICA_URL \
        "postgresql+psycopg://$PG_API_ROLE:$(secret pg-api)@$HOST:$CL_PG_REPLICA_PORT/$PG_DATABASE"
    else
      env_line FRESHLINE_POSTGRES_REPLICA_URL \
        "postgresql+psycopg://$PG_USER:$(secret pg-owner)@$HOST:$CL_PG_REPLICA_PORT/$PG_DATABASE"
    fi
    env_redis 7001 "$CL/redis/security"
    env_line FRESHLINE_REDIS_CLUSTER "1"
    env_kafka "$(cl_kafka_bootstrap)" "$CL/kafka"
    env_line FRESHLINE_TOPIC_REPLICATION "3"
    env_line FRESHLINE_STACK_TOPOLOGY cluster
    env_line PGHOST "$HOST"
    env_line PGPORT "$CL_PG_PORT"
    env_line PGUSER "$PG_USER"
    env_line PGPASSWORD "$(secret pg-owner)"
    env_line PGDATABASE "$PG_DATABASE"
  } >"$tmp" || { rm -f "$tmp"; exit 1; }
  mv -f "$tmp" "$CL/env"
}

cl_nodes() {
  local p
  for p in "${CL_REDIS_PORTS[@]}"; do echo "redis-$((p - 7000)):$p"; done
  echo "kafka-1:19092"; echo "kafka-2:19093"; echo "kafka-3:19094"
  echo "pg-primary:$CL_PG_PORT"; echo "pg-replica:$CL_PG_REPLICA_PORT"
}

cl_cmd_up() {
  local t0=$SECONDS
  prepare
  mkdir -p "$CL"
  cl_write_env
  ensure_jars
  cl_up_pg_primary
  cl_up_pg_replica
  say "postgres primary $HOST:$CL_PG_PORT, streaming replica $HOST:$CL_PG_REPLICA_PORT"
  cl_up_redis
  cl_up_kafka
  cl_write_env
  say "cluster topology up in $((SECONDS - t0))s (settings in ${CL#"$ROOT"/}/env)"
}

cl_cmd_down() {
  local i pids=()
  # All brokers at once, 15 s each: one left without a controller quorum cannot shut
  # down cleanly and would only wait out its deadline (its logs recover at the next
  # start; the topology's data is disposable).
  for i in 3 2 1; do stop "kafka-$i" 15 & pids+=($!); done
  wait "${pids[@]}"
  for i in 6 5 4 3 2 1; do stop "redis-$i" 30; done
  cl_down_pg pg-replica "$CL/pg/replica"
  cl_down_pg pg-primary "$CL/pg/primary"
  say "cluster topology down"
}

cl_cmd_status() {
  local line
  for line in $(cl_nodes); do
    status_line "${line%%:*}" "$HOST:${line#*:}" port_open "${line#*:}"
  done
}

cl_node_arg() {
  local line
  for line in $(cl_nodes); do [[ ${line%%:*} == "${2:-}" ]] && return 0; done
  echo "usage: scripts/stack $1 NODE --topology cluster (NODE: redis-1..6, kafka-1..3," \
    "pg-primary, pg-replica)" >&2
  exit 2
}

cl_cmd_kill() {
  cl_node_arg kill "${1:-}"
  local name=$1 pid port deadline
  port="$(cl_nodes | sed -n "s/^$name://p")"
  pid="$(pid_of "$name")"
  [[ -n $pid ]] || fail "$name was not started by this script (no live pid in $STACK/run)"
  if [[ $name == pg-* ]]; then
    as_postgres "$PG_BIN/pg_ctl" -D "$CL/pg/${name#pg-}" -m immediate -w -t 30 stop \
      >/dev/null 2>&1 || true
  fi
  kill -KILL "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 30))
  while alive "$pid" || port_open "$port"; do
    ((SECONDS < deadline)) || fail "$name (pid $pid) survived SIGKILL"
    sleep 0.1
  done
  rm -f "$STACK/run/$name.pid"
  say "$name killed (pid $pid)"
}

cl_cmd_start() {
  cl_node_arg start "${1:-}"
  prepare
  case $1 in
    redis-*) cl_up_redis_node $((7000 + ${1#redis-})) ;;
    kafka-*)
      ensure_jars
      cl_up_kafka_node "${1#kafka-}"
      wait_until "$1" "$CL/kafka/${1#kafka-}/kafka.log" "$1" port_open \
        "${CL_KAFKA_PORTS[$((${1#kafka-} - 1))]}"
      ;;
    pg-primary) cl_up_pg_primary ;;
    pg-replica) cl_up_pg_replica ;;
  esac
  say "$1 started"
}

cl_cmd_stop() {
  cl_node_arg stop "${1:-}"
  case $1 in
    redis-*) stop "$1" 30 ;;
    kafka-*) stop "$1" 60 ;;
    pg-primary) cl_down_pg pg-primary "$CL/pg/primary" ;;
    pg-replica) cl_down_pg pg-replica "$CL/pg/replica" ;;
  esac
}

# cluster_main ARGS...: the command line of scripts/stack, --topology cluster among it.
cluster_main() {
  local args=() prev="" arg
  # Passwords of its own, never the single topology's.
  SECRETS="$CL/secrets"
  for arg in "$@"; do
    if [[ $arg == --topology ]]; then prev=$arg; continue; fi
    if [[ $prev == --topology || $arg == --topology=* ]]; then prev=""; continue; fi
    args+=("$arg")
  done
  set -- "${args[@]}"
  case "${1:-}" in
    up) cl_cmd_up ;;
    down) cl_cmd_down ;;
    status) cl_cmd_status ;;
    kill) cl_cmd_kill "${2:-}" ;;
    start) cl_cmd_start "${2:-}" ;;
    stop) cl_cmd_stop "${2:-}" ;;
    *)
      echo "usage: scripts/stack up|down|status|start NODE|stop NODE|kill NODE" \
        "--topology cluster" >&2
      exit 2
      ;;
  esac
}
