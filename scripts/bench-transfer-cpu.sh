#!/bin/sh
# KV hand-off on a CPU host: `pdnode bench-transfer --local` (reserve, gather into registered
# staging, one UCX put per layer, flush, KvDone, scatter, verify) against raw `ucx_perftest -t
# ucp_put_bw` per UCX transport, at two sizes: the put size (one put = one layer of one request;
# perftest rewrites one buffer, so below the L3 size its figure is cache-hot) and the whole
# request (out of cache, like a real KV hand-off of fresh blocks). Loopback only
# (UCX_NET_DEVICES=lo).
#
# usage: scripts/bench-transfer-cpu.sh [TLS...]            (default: tcp sm)
# env:   PDNODE_BIN   pdnode binary (default target/release/pdnode; if missing, the transfer
#                     bench crate's target/release/pdnode-transfer-peer is used with the same options)
#        LAYERS BLOCKS SIZES REQUESTS PERFTEST_ITERS UCX_LIB
set -eu
cd "$(dirname "$0")/.."
LAYERS=${LAYERS:-32}
BLOCKS=${BLOCKS:-4}
SIZES=${SIZES:-"16K 64K 256K 1M"}
REQUESTS=${REQUESTS:-10}
PERFTEST_ITERS=${PERFTEST_ITERS:-200}
PDNODE_BIN=${PDNODE_BIN:-target/release/pdnode}
PEER_BIN=target/release/pdnode-transfer-peer
TLS_LIST=${*:-"tcp sm"}
export UCX_NET_DEVICES=lo

bytes() { # 16K -> 16384
  case $1 in
    *K) echo $(( ${1%K} * 1024 )) ;;
    *M) echo $(( ${1%M} * 1048576 )) ;;
    *) echo "$1" ;;
  esac
}

run_bench() { # $1 = tls; prints RESULT lines (and the table on stderr)
  sizes_csv=$(echo "$SIZES" | tr ' ' ',')
  if [ -x "$PDNODE_BIN" ]; then
    "$PDNODE_BIN" bench-transfer --local --tls "$1" --layers "$LAYERS" --blocks-per-request "$BLOCKS" \
      --block-bytes "$sizes_csv" --requests "$REQUESTS" ${UCX_LIB:+--ucx-lib "$UCX_LIB"}
  else
    [ -x "$PEER_BIN" ] || cargo build --release -p pdnode-transfer-bench --bin pdnode-transfer-peer >&2
    list=""
    for s in $SIZES; do list="$list${list:+,}$(bytes "$s")"; done
    lib=null
    [ -n "${UCX_LIB:-}" ] && lib="\"$UCX_LIB\""
    "$PEER_BIN" local "{\"layers\":$LAYERS,\"blocks_per_request\":$BLOCKS,\"block_bytes\":[$list],\"requests\":$REQUESTS,\"tls\":\"$1\",\"ucx_lib\":$lib}"
  fi
}

perftest() { # $1 = tls, $2 = message bytes; prints overall MB/s (2^20 bytes) of ucp_put_bw
  port=$(( 20000 + $$ % 20000 ))
  UCX_TLS=$1 ucx_perftest -p "$port" -t ucp_put_bw -s "$2" -n "$PERFTEST_ITERS" >/dev/null 2>&1 &
  srv=$!
  out=""
  i=0
  while [ $i -lt 50 ]; do # the server needs a moment to listen
    if out=$(UCX_TLS=$1 timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw -s "$2" \
      -n "$PERFTEST_ITERS" 2>/dev/null); then break; fi
    i=$((i + 1)); sleep 0.1
  done
  kill "$srv" 2>/dev/null || true
  wait "$srv" 2>/dev/null || true
  echo "$out" | awk '/Final:/ { print $7 }'
}

summary=""
for tls in $TLS_LIST; do
  echo "== UCX_TLS=$tls: pdnode bench-transfer --local" >&2
  results=$(run_bench "$tls" | tee /dev/stderr | grep '^RESULT ')
  for s in $SIZES; do
    b=$(bytes "$s")
    line=$(echo "$results" | grep "\"block_bytes\":$b,")
    push=$(echo "$line" | sed 's/.*"push_gbps":\([0-9.e-]*\).*/\1/')
    e2e=$(echo "$line" | sed 's/.*"e2e_gbps":\([0-9.e-]*\).*/\1/')
    span=$((b * BLOCKS))
    req=$((span * LAYERS))
    mbs=$(perftest "$tls" "$span")
    mbr=$(perftest "$tls" "$req")
    row=$(awk -v tls="$tls" -v s="$s" -v span="$span" -v req="$req" -v push="$push" -v e2e="$e2e" \
      -v mbs="${mbs:-0}" -v mbr="${mbr:-0}" 'BEGIN {
      pt = mbs * 1048576 / 1e9; pr = mbr * 1048576 / 1e9
      printf "%-6s %8s %10d %10d %10.3f %10.3f %11.3f %11.3f %8.2f %8.2f\n", tls, s, span, req, push, e2e,
        pt, pr, (pt > 0 ? push / pt : 0), (pr > 0 ? push / pr : 0) }')
    summary="$summary$row
"
  done
done
echo
echo "layers=$LAYERS blocks/request=$BLOCKS requests=$REQUESTS perftest iters=$PERFTEST_ITERS (UCX_NET_DEVICES=lo)"
printf "%-6s %8s %10s %10s %10s %10s %11s %11s %8s %8s\n" tls layer-blk put-bytes req-bytes push-GB/s \
  e2e-GB/s pt@put-GB/s pt@req-GB/s push/pt push/ptr
printf "%s" "$summary"
