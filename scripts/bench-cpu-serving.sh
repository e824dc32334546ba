#!/bin/sh
# Serving on the CPU, end to end with `pdnode bench` (docs/benchmarks.md, "Serving on the CPU"):
#   pd-local    configs/local.toml: router + prefill-only + decode-only engine in one process,
#               KV moved in process
#   pd-split    etcd + configs/cpu-router.toml + cpu-prefill.toml + cpu-decode.toml, separate
#               processes, KV over UCX on loopback
#   colocated   configs/local.toml --set engine.colocated=true: one colocated engine (the baseline)
#   mock-router configs/local.toml with the mock engine (tiny timings): requests/s the router sustains
# Everything binds 127.0.0.1 on its own ports (PORT_BASE..PORT_BASE+20) and is stopped by PID.
#
#   compare     pd-local (A) and colocated (B) running side by side, `pdnode bench --compare`
#   colocated-x2 two colocated role-"all" replicas (engine.cpu_threads=1 each) registered in etcd
#               behind one separate router (colocated-x2-mock: the same with the mock engine)
#
# usage: scripts/bench-cpu-serving.sh [pd-local] [pd-split] [colocated] [colocated-x2]
#                                     [colocated-x2-mock] [compare] [mock-router]
#        (default: pd-local pd-split colocated mock-router)
# env:   PDNODE_BIN (default target/release/pdnode)  OUT_DIR (default target/bench-cpu-serving)
#        CONCURRENCY (1,4,8)  NUM_REQUESTS (24)  INPUT_LEN (128)  OUTPUT_LEN (32)  PORT_BASE (18200)
#        MOCK_CONCURRENCY (64)  MOCK_REQUESTS (3000)
set -eu
cd "$(dirname "$0")/.."
BIN=${PDNODE_BIN:-target/release/pdnode}
OUT_DIR=${OUT_DIR:-target/bench-cpu-serving}
CONCURRENCY=${CONCURRENCY:-1,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-24}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-32}
PORT_BASE=${PORT_BASE:-18200}
MOCK_CONCURRENCY=${MOCK_CONCURRENCY:-64}
MOCK_REQUESTS=${MOCK_REQUESTS:-3000}
WHICH=${*:-"pd-local pd-split colocated mock-router"}
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release -p pdnode" >&2; exit 1; }
mkdir -p "$OUT_DIR"

HTTP=$PORT_BASE
GRPC=$((PORT_BASE + 1))
ETCD_CLIENT=$((PORT_BASE + 2))
ETCD_PEER=$((PORT_BASE + 3))
PIDS=""

stop_all() { # the last started first (nodes before etcd)
  rev=""
  for p in $PIDS; do rev="$p $rev"; done
  for p in $rev; do
    kill "$p" 2>/dev/null || true
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
  done
  for p in $PIDS; do
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    kill -9 "$p" 2>/dev/null || true
  done
  PIDS=""
}
trap 'stop_all; rm -rf "$ETCD_DIR"' EXIT INT TERM

# wait_health URL SECONDS: until the router answers 200 on /health.
wait_health() {
  i=0
  while [ $i -lt $(($2 * 5)) ]; do
    if curl -fsS -o /dev/null "$1/health" 2>/dev/null; then return 0; fi
    sleep 0.2
    i=$((i + 1))
  done
  echo "no healthy router at $1 after $2 s; logs in $OUT_DIR" >&2
  return 1
}

start() { # name args...: starts pdnode in the background, logs to OUT_DIR/name.log
  name=$1
  shift
  "$BIN" start "$@" >"$OUT_DIR/$name.log" 2>&1 &
  PIDS="$PIDS $!"
}

bench() { # name url extra-args...
  name=$1
  url=$2
  shift 2
  echo "== $name ($(uptime | sed 's/.*load average/load average/'))" | tee -a "$OUT_DIR/summary.txt"
  "$BIN" bench --url "$url" --workload fixed --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --ignore-eos --seed 1 --no-progress --out "$OUT_DIR/$name.json" --plot "$OUT_DIR/$name.png" "$@" \
    2>&1 | tee -a "$OUT_DIR/summary.txt"
  echo "   after: $(uptime | sed 's/.*load average/load average/')" | tee -a "$OUT_DIR/summary.txt"
}

ETCD_DIR=$(mktemp -d)
start_etcd() { # a fresh single-member etcd on our ports
  rm -rf "$ETCD_DIR/data"
  etcd --name bench --data-dir "$ETCD_DIR/data" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "bench=http://127.0.0.1:$ETCD_PEER" >"$OUT_DIR/etcd.log" 2>&1 &
  PIDS="$PIDS $!"
  i=0
  until curl -fsS -o /dev/null "http://127.0.0.1:$ETCD_CLIENT/health" 2>/dev/null; do
    i=$((i + 1))
    [ $i -lt 150 ] || { echo "etcd did not start; see $OUT_DIR/etcd.log" >&2; return 1; }
    sleep 0.2
  done
}

local_router() { # the router frontends of a role-all node on our ports
  echo "--set router.http_listen=\"127.0.0.1:$HTTP\" --set router.grpc_listen=\"127.0.0.1:$GRPC\""
}

sweep() { # name url
  bench "$1" "$2" --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" --warmup 2
}

for w in $WHICH; do
  case $w in
    pd-local | colocated)
      extra=""
      [ "$w" = colocated ] && extra="--set engine.colocated=true"
      # shellcheck disable=SC2046
      start "$w" --config configs/local.toml $(local_router) $extra
      wait_health "http://127.0.0.1:$HTTP" 120
      sweep "$w" "http://127.0.0.1:$HTTP"
      stop_all
      ;;
    pd-split)
      start_etcd
      reg="--set registry.endpoints=[\"http://127.0.0.1:$ETCD_CLIENT\"] --set node.cluster=\"bench-$PORT_BASE\""
      # shellcheck disable=SC2086
      start prefill --config configs/cpu-prefill.toml $reg \
        --set node.listen=\"127.0.0.1:$((PORT_BASE + 4))\" --set node.http_listen=\"127.0.0.1:$((PORT_BASE + 5))\"
      # shellcheck disable=SC2086
      start decode --config configs/cpu-decode.toml $reg \
        --set node.listen=\"127.0.0.1:$((PORT_BASE + 6))\" --set node.http_listen=\"127.0.0.1:$((PORT_BASE + 7))\"
      # shellcheck disable=SC2086
      start router --config configs/cpu-router.toml $reg --set node.listen=\"127.0.0.1:$((PORT_BASE + 8))\" \
        $(local_router)
      wait_health "http://127.0.0.1:$HTTP" 120
      sweep pd-split "http://127.0.0.1:$HTTP"
      stop_all
      ;;
    colocated-x2 | colocated-x2-mock)
      # Two colocated role-"all" replicas registered in etcd behind one separate router (node gRPC).
      start_etcd
      reg="--set registry.kind=\"etcd\" --set registry.endpoints=[\"http://127.0.0.1:$ETCD_CLIENT\"] --set node.cluster=\"bench-$PORT_BASE\""
      eng="--set engine.colocated=true --set engine.cpu_threads=1"
      [ "$w" = colocated-x2-mock ] && eng="$eng --set engine.backend=\"mock\""
      for i in 0 1; do
        # shellcheck disable=SC2086
        start "colocated-$i" --config configs/local.toml $reg $eng --set node.id=\"colocated-$i\" \
          --set node.listen=\"127.0.0.1:$((PORT_BASE + 10 + i))\" \
          --set router.http_listen=\"127.0.0.1:$((PORT_BASE + 12 + i))\" \
          --set router.grpc_listen=\"127.0.0.1:$((PORT_BASE + 14 + i))\"
      done
      wait_health "http://127.0.0.1:$((PORT_BASE + 12))" 120
      wait_health "http://127.0.0.1:$((PORT_BASE + 13))" 120
      rt=""
      [ "$w" = colocated-x2-mock ] && rt="--set engine.backend=\"mock\""
      # shellcheck disable=SC2086
      start router --config configs/cpu-router.toml $reg $rt --set node.listen=\"127.0.0.1:$((PORT_BASE + 8))\" \
        $(local_router)
      wait_health "http://127.0.0.1:$HTTP" 60
      sweep "$w" "http://127.0.0.1:$HTTP"
      stop_all
      ;;
    compare)
      # pd-local (A) and colocated (B) side by side, the same workload in alternation (B / A ratios).
      # shellcheck disable=SC2046
      start pd-local-a --config configs/local.toml $(local_router)
      start colocated-b --config configs/local.toml --set engine.colocated=true --set node.id=\"colocated-b\" \
        --set router.http_listen=\"127.0.0.1:$((PORT_BASE + 16))\" \
        --set router.grpc_listen=\"127.0.0.1:$((PORT_BASE + 17))\"
      wait_health "http://127.0.0.1:$HTTP" 120
      wait_health "http://127.0.0.1:$((PORT_BASE + 16))" 120
      bench compare "http://127.0.0.1:$HTTP" --compare "http://127.0.0.1:$((PORT_BASE + 16))" \
        --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" --warmup 2
      stop_all
      ;;
    mock-router)
      # shellcheck disable=SC2046
      start mock-router --config configs/local.toml $(local_router) --set engine.backend=\"mock\" \
        --set engine.mock.vocab_size=1000 --set engine.mock.prefill_us_per_token=1 \
        --set engine.mock.decode_us_per_token=10 --set engine.mock.output_len=16 \
        --set engine.max_running_requests=128 --set router.max_inflight_requests=1024 \
        --set log.filter=\"warn\"
      wait_health "http://127.0.0.1:$HTTP" 60
      saved="$INPUT_LEN $OUTPUT_LEN"
      INPUT_LEN=32
      OUTPUT_LEN=16
      bench mock-router "http://127.0.0.1:$HTTP" \
        --concurrency "$MOCK_CONCURRENCY" --num-requests "$MOCK_REQUESTS" --warmup 16
      set -- $saved
      INPUT_LEN=$1
      OUTPUT_LEN=$2
      stop_all
      ;;
    *)
      echo "unknown run $w" >&2
      exit 2
      ;;
  esac
done
echo "results: $OUT_DIR/summary.txt, $OUT_DIR/*.json, $OUT_DIR/*.png"
