#!/usr/bin/env bash
# Installs the system packages kxp's build, tests and demo need (Debian/Ubuntu, as root).
# Safe to run again: packages already present are left alone.
set -euo pipefail

PACKAGES=(
  # libbpf-sys builds libbpf from source; build.rs compiles the steering program (clang)
  clang llvm libelf-dev zlib1g-dev pkg-config m4 libpcap-dev
  # network namespaces, veth, the kernel's NAT for comparisons, traffic generation
  iproute2 iputils-ping nftables iptables ethtool netsniff-ng
  # captures with their 802.1Q tags (the VLAN trunk test)
  tcpdump
  # libFuzzer (C++), which the fuzz targets link (fuzz/run)
  g++
  # systemd-analyze, which checks deploy/kxp.service
  systemd
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: need root to install: ${missing[*]}" >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# kxp pins its steering program and maps in bpffs.
if [[ $(id -u) -eq 0 ]] && ! mountpoint -q /sys/fs/bpf 2>/dev/null; then
  mount -t bpf bpf /sys/fs/bpf 2>/dev/null || echo "install-deps: could not mount bpffs at /sys/fs/bpf" >&2
fi

for c in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" || true
done
