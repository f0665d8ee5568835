#!/bin/bash
# Time from `kxp run` to a healthy /healthz on a node with N idle pods' veths:
#   sudo bench/startup.sh N [path/to/kxp]      (default: target/release/kxp)
# Makes its own namespaces (kxpst-*-PID: the node, and one for the pods' peers), an
# uplink and N veths (kernel defaults, up, no traffic), runs kxp with --interface up0
# --interface 'vp*', prints the seconds to healthy and the log's start-up lines, and
# removes everything it made. Then it adds three more veths one at a time while kxp runs
# and prints how long after its creation each was attached.
set -euo pipefail
N=${1:?usage: startup.sh N [kxp]}
KXP=${2:-$(dirname "$0")/../target/release/kxp}
NS=kxpst-node-$$
PODS=kxpst-pods-$$
DIR=$(mktemp -d)
PID=
cleanup() {
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
    ip netns del "$NS" 2>/dev/null || true
    ip netns del "$PODS" 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT
ip netns add "$NS"
ip netns add "$PODS"
ip -n "$NS" link set lo up
ip -n "$NS" link add up0 type veth peer name up1 netns "$PODS"
ip -n "$NS" addr add 198.18.1.1/24 dev up0
ip -n "$NS" link set up0 up
for i in $(seq 0 $((N - 1))); do
    echo "link add vp$i type veth peer name e$i netns $PODS"
    echo "link set vp$i up"
done > "$DIR/veths"
ip -n "$NS" -batch "$DIR/veths"
cat > "$DIR/state.yaml" <<EOT
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 198.18.3.10
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
EOT
start=$(date +%s.%N)
ip netns exec "$NS" "$KXP" run --interface up0 --interface 'vp*' --interface 'vn*' \
    --state-file "$DIR/state.yaml" --node-ip 198.18.1.1 \
    --healthz-bind-address 127.0.0.1:10256 --workers 1 > "$DIR/kxp.log" 2>&1 &
PID=$!
for _ in $(seq 1 1500); do
    ip netns exec "$NS" curl -sf -o /dev/null -m 1 http://127.0.0.1:10256/healthz && break
    sleep 0.02
done
end=$(date +%s.%N)
echo "$N pod veths: healthy after $(awk "BEGIN { printf \"%.2f\", $end - $start }") s"
grep -E "start-up:|attached interface=(up0|vp0|vp$((N - 1))) " "$DIR/kxp.log" | cut -c1-420
# One more pod's veth while kxp runs: from its creation to kxp's "attached" line.
for k in 1 2 3; do
    t0=$(date +%s.%N)
    ip -n "$NS" link add "vn$k" type veth peer name "f$k" netns "$PODS"
    ip -n "$NS" link set "vn$k" up
    ip -n "$PODS" link set "f$k" up
    for _ in $(seq 1 500); do
        grep -q "attached interface=vn$k " "$DIR/kxp.log" && break
        sleep 0.005
    done
    at=$(grep "attached interface=vn$k " "$DIR/kxp.log" | cut -d' ' -f1)
    t1=$(date -d "$at" +%s.%N)
    echo "a new pod's veth: attached $(awk "BEGIN { printf \"%.0f\", ($t1 - $t0) * 1000 }") ms after it was created"
done
