#!/usr/bin/env bash
# A slow network on one machine: step time of 2-node data parallelism with and without gradient compression.
#
#   sudo benchmarks/slow_link.sh                       # 20 and 200 Mbit/s, every compression scheme
#   RATES="50" SCHEMES="none powersgd" STEPS=6 sudo -E benchmarks/slow_link.sh
#
# Needs root and iproute2 (ip netns, tc). Two network namespaces are joined by a veth pair whose
# egress is shaped with tc's token bucket filter (tbf) on both ends; this kernel has no netem, so
# there is no added latency, only a bandwidth limit. Node 0 (namespace A, 10.231.9.1) hosts the c10d
# rendezvous (launch.py sets is_host on node 0, since its hostname resolves to neither address);
# node 1 runs in namespace B. Each `plait train` is one process per node (parallel.dp = 2): an MLP
# on digits with about 1.1 M parameters (4.4 MB of fp32 gradient per step), so the all-reduce
# dominates at 20 Mbit/s. The baseline each row is compared with is compression = none at the same
# rate, measured in the same run. Every run is bounded by `timeout`; the namespaces are deleted on
# exit, also on failure or Ctrl-C.
set -euo pipefail

RATES=${RATES:-"20 200"}                           # Mbit/s
SCHEMES=${SCHEMES:-"none fp16 bf16 int8 topk powersgd"}
STEPS=${STEPS:-8}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}                    # seconds per training run
WIDTH=${WIDTH:-1024}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/plait-slow-link.XXXXXX)}
TAG=$(printf '%04x' $((RANDOM % 65536)))
NS_A=plait-sl-a-$TAG NS_B=plait-sl-b-$TAG DEV_A=sla$TAG DEV_B=slb$TAG
ADDR_A=10.231.9.1 ADDR_B=10.231.9.2

if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "slow_link.sh needs root and iproute2 (ip, tc)" >&2
    exit 2
fi

cleanup() {
    for pid in $(jobs -p); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns pids "$NS_A" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns pids "$NS_B" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$NS_A" 2>/dev/null || true
    ip netns del "$NS_B" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip netns add "$NS_A"
ip netns add "$NS_B"
ip link add "$DEV_A" type veth peer name "$DEV_B"
ip link set "$DEV_A" netns "$NS_A"
ip link set "$DEV_B" netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/24" dev "$DEV_A"
ip -n "$NS_B" addr add "$ADDR_B/24" dev "$DEV_B"
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
ip -n "$NS_A" link set "$DEV_A" up
ip -n "$NS_B" link set "$DEV_B" up

shape() {  # $1 = Mbit/s, on the egress of both ends of the link
    ip netns exec "$NS_A" tc qdisc replace dev "$DEV_A" root tbf rate "${1}mbit" burst 64kb latency 400ms
    ip netns exec "$NS_B" tc qdisc replace dev "$DEV_B" root tbf rate "${1}mbit" burst 64kb latency 400ms
}

run() {  # $1 = rate, $2 = scheme; prints the run dir's median step time (steps 3..)
    local rate=$1 scheme=$2 port=$((29600 + RANDOM % 300)) dir="$OUT/${rate}mbit-$2"
    local common=(-m plait train --out "$dir" --set "model.name='mlp'" --set "data.name='digits'"
        --set "model.width=$WIDTH" --set "parallel.dp=2" --set "launch.nnodes=2" --set "train.steps=$STEPS"
        --set "launch.rdzv_endpoint=$ADDR_A:$port" --set "parallel.compression='$scheme'" --set "log.every=1"
        --set "log.progress=false" --set "log.report=false" --set "checkpoint.every=0" --set "train.eval_samples=16"
        --set "optim.warmup_steps=2" --set "launch.timeout_s=120")
    env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME="$DEV_B" timeout -k 15 "$RUN_TIMEOUT" \
        ip netns exec "$NS_B" "$PY" "${common[@]}" --set launch.node_rank=1 >"$dir.node1.log" 2>&1 &
    local node1=$!
    if ! env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME="$DEV_A" timeout -k 15 "$RUN_TIMEOUT" \
        ip netns exec "$NS_A" "$PY" "${common[@]}" --set launch.node_rank=0 >"$dir.node0.log" 2>&1; then
        kill -9 "$node1" 2>/dev/null || true
        echo "failed"
        return
    fi
    wait "$node1" || true
    "$PY" - "$dir/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"step_time_s"' in line]
steady = [r for r in rows if r["step"] >= 3] or rows
t = statistics.median(r["step_time_s"] for r in steady)
ratio = statistics.median(r.get("compression_ratio") or 1.0 for r in steady)
print(f"{t:.4f} {statistics.median(r['comm_bytes'] for r in steady):.0f} {ratio:.1f}")
EOF
}

echo "plait slow link: 2 nodes (network namespaces) x 1 process, MLP width $WIDTH on digits, $STEPS steps per run"
echo "runs in $OUT"
printf '%-10s %-10s %14s %16s %10s %12s\n' "link" "compress" "step time (s)" "bytes/step/rank" "ratio" "vs none"
for rate in $RATES; do
    shape "$rate"
    base=""
    for scheme in $SCHEMES; do
        read -r t bytes ratio <<<"$(run "$rate" "$scheme")" || true
        if [ "${t:-failed}" = failed ] || [ -z "${t:-}" ]; then
            printf '%-10s %-10s %14s   (see %s.node0.log)\n' "${rate}Mbit" "$scheme" "failed" "$OUT/${rate}mbit-$scheme"
            continue
        fi
        [ "$scheme" = none ] && base=$t
        speedup=$([ -n "$base" ] && "$PY" -c "print(f'{$base / $t:.2f}x')" || echo "-")
        printf '%-10s %-10s %14s %16s %10s %12s\n' "${rate}Mbit" "$scheme" "$t" "$bytes" "$ratio" "$speedup"
    done
done
