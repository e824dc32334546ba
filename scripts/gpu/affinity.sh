#!/usr/bin/env bash
# engine.cpu_affinity = "auto" on a GPU host: for each GPU, the node process started with
# `cpu_affinity = "auto"` on that GPU logs the NUMA node and cores it pinned to; compared with
# what sysfs and `nvidia-smi topo -m` say. The bundle's etcd runs on 127.0.0.1:23790 (`pdnode
# start` reaches the registry first; the node pins itself next, before its engine); each node is
# stopped by PID once it logged its choice (or after 60 s), etcd at the end.
# Needs the bundle's pdnode in $PD (scripts/gpu/pack.sh). A table last.
set -u
PD=${PD:-/tmp/pd}
OUT=${OUT:-/tmp/pdnode-gpu/affinity}
mkdir -p "$OUT"
n=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
echo "== nvidia-smi topo -m"
nvidia-smi topo -m 2>&1 | head -20
rm -rf /tmp/aff-etcd
"$PD/etcd" --data-dir /tmp/aff-etcd --listen-client-urls http://127.0.0.1:23790 \
    --advertise-client-urls http://127.0.0.1:23790 --listen-peer-urls http://127.0.0.1:23800 \
    --log-level warn > "$OUT/etcd.log" 2>&1 &
etcd_pid=$!
trap 'kill "$etcd_pid" 2>/dev/null' EXIT
sleep 2
rows=()
for g in $(seq 0 $((n - 1))); do
    bus=$(nvidia-smi -i "$g" --query-gpu=pci.bus_id --format=csv,noheader | tr 'A-F' 'a-f' | sed 's/^0000//')
    sys=$(ls -d /sys/bus/pci/devices/*"$bus" 2>/dev/null | head -1)
    node=$(cat "$sys/numa_node" 2>/dev/null || echo "?")
    list=$( [ "$node" != "?" ] && [ "$node" -ge 0 ] 2>/dev/null && cat /sys/devices/system/node/node"$node"/cpulist || echo "-")
    cat > "$OUT/g$g.toml" <<TOML
[node]
role = "prefill"
id = "aff-$g"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
[registry]
kind = "etcd"
endpoints = ["http://127.0.0.1:23790"]
[model]
path = ""
format = "dummy"
preset = "smollm2-135m"
[engine]
backend = "cuda"
gpus = [$g]
cpu_affinity = "auto"
[transfer]
kind = "ucx"
[log]
format = "human"
filter = "info"
TOML
    "$PD/pdnode" start --config "$OUT/g$g.toml" > "$OUT/g$g.log" 2>&1 &
    node_pid=$!
    for _ in $(seq 120); do
        grep -q 'engine.cpu_affinity' "$OUT/g$g.log" && break
        kill -0 "$node_pid" 2>/dev/null || break
        sleep 0.5
    done
    sleep 1
    kill "$node_pid" 2>/dev/null; wait "$node_pid" 2>/dev/null
    rc=$?
    line=$(grep -m1 'engine.cpu_affinity' "$OUT/g$g.log" | sed 's/\x1b\[[0-9;]*m//g')
    pinned=$(grep -m1 'pinned the process' "$OUT/g$g.log" | sed 's/\x1b\[[0-9;]*m//g' | grep -o 'threads=[0-9]*' || true)
    echo "== GPU $g: exit $rc"
    echo "$line"
    grep -m1 'pinned the process' "$OUT/g$g.log" | sed 's/\x1b\[[0-9;]*m//g'
    rows+=("| $g | $bus | $node | $list | $(echo "$line" | grep -o 'numa_nodes=[^ ]*' || echo "$line" | grep -o 'report no NUMA node' || echo '?') | $(echo "$line" | grep -o 'cores=[0-9]*' || echo -) | ${pinned:--} |")
done
echo
echo "| GPU | PCI | sysfs numa_node | node cpulist | pdnode picked | cores | pinned |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
