#!/usr/bin/env python3
"""Classifies a `perf report --sort cpu,sym` of the macro benchmark's kxp case: where
CPU0 (generator + the router veth's NAPI) and CPU1 (kxp's worker) spend their time.

Usage: bash bench/scripts/profile (runs the benchmark and perf), or by hand:
  perf report -i perf.data --no-children --sort cpu,comm,sym -g none --stdio \
         | python3 bench/scripts/profile-classify.py
"""
import re
import sys

# (category, regex on the symbol); the first match wins.
CATEGORIES = [
    ("kxp XDP program", r"bpf_prog_.*kxp"),
    ("AF_XDP copy-mode receive (XDP, copy into the UMEM)", r"xsk_rcv|__xsk_rcv|xsk_generic_rcv|xdp_do_redirect|xsk_map|bpf_xdp|veth_xdp|xdp_|__xsk_map|xsk_flush|xp_|veth_poll|veth_convert|napi_|__napi"),
    ("AF_XDP copy-mode transmit (an skb per frame, copied)", r"xsk_generic_xmit|__xsk_generic_xmit|xsk_build_skb|xsk_destruct|sock_alloc_send|sock_wfree|xsk_sendmsg|__dev_direct_xmit|xsk_cq|xskq_|alloc_skb|kmem_cache|kmalloc|skb_put|memcpy|skb_set_owner|validate_xmit|netif_skb_features|skb_release|kfree|skb_free|consume_skb|skb_defer|__slab|slab_|page_frag|__build_skb|skb_clone|napi_skb_cache"),
    ("veth transmit and the backend's receive (nft counter, drop; its RPS hash with --backend-rps)", r"veth_xmit|__dev_forward_skb|dev_forward|eth_type_trans|netif_rx|enqueue_to_backlog|get_rps_cpu|flow_dissect|siphash|skb_get_hash|process_backlog|__netif_receive|netif_receive|nft_|nf_hook|sk_skb_reason_drop|kfree_skb|ingress|tcf_|sch_handle"),
    ("system calls, softirq and scheduling", r"entry_SYSCALL|syscall|do_syscall|__x64|sendto|__sys|sock_sendmsg|softirq|net_rx_action|local_bh|raw_spin|_raw_|rcu|irq|schedule|__schedule|finish_task|pick_next|update_|native_|poll|sock_poll|xsk_poll|fput|fdget|__fget|select|ktime|clock|hrtimer|tick|apic|asm_|sysvec|x86_|arch_|cpuidle|default_idle|do_idle|lock_|mutex|find_next_bit|_find_next"),
]


def main():
    rows = {}
    for line in sys.stdin:
        m = re.match(r"\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+(\[.\].*)$", line)
        if not m:
            continue
        pct, cpu, comm, sym = float(m.group(1)), int(m.group(2)), m.group(3), m.group(4).strip()
        if sym.startswith("[.]"):
            cat = "kxp (userspace)" if comm.startswith("kxp") else f"{comm} (userspace)"
        else:
            cat = "other kernel"
            for name, rx in CATEGORIES:
                if re.search(rx, sym):
                    cat = name
                    break
        rows.setdefault(cpu, {}).setdefault(cat, 0.0)
        rows[cpu][cat] += pct
    for cpu in sorted(rows):
        total = sum(rows[cpu].values())
        print(f"CPU{cpu}: {total:.1f}% of all samples")
        for cat, pct in sorted(rows[cpu].items(), key=lambda kv: -kv[1]):
            print(f"  {100 * pct / total:5.1f}%  {cat}")


if __name__ == "__main__":
    main()
