// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * kxp steering program: redirect to the AF_XDP socket of the receive queue
 * only the packets kxp translates, and pass everything else (ARP, the node's
 * own traffic, other ports) to the kernel untouched.
 *
 * A packet is redirected when any of these holds (first match is counted):
 *  (a) (dst, dport, proto) is a Service frontend                  [frontends]
 *  (b) dst is a node address and dport is in the SNAT port range  [local_addrs, config]
 *      (replies of masqueraded flows)
 *  (c) (src, sport, proto) is an endpoint and dst is not a node address
 *      (replies of DNAT-only flows)                               [endpoints]
 *  (d) an ICMP/ICMPv6 error quoting a packet of a flow above
 *  (f) a later fragment (no ports) of a datagram whose first fragment a rule above
 *      took (kxp_frags), or to a Service address or from an endpoint
 *  (e) any other TCP/UDP/SCTP packet to a ClusterIP (any port) or to an
 *      address inside a Service CIDR: kxp rejects the first (no Service on
 *      that port) and drops the second (unallocated), as kube-proxy does
 *                                                 [cluster_ips, service_cidrs]
 * A reply rule -- (b), (c), (d) for a masqueraded or DNAT-only flow, (f) from an
 * endpoint -- yields to the kernel's conntrack: a packet of a flow the kernel tracks (it
 * forwarded or sent the other direction: traffic straight to a pod, Service traffic that
 * another node translated, the node's own connections) is passed, so that the kernel
 * keeps carrying its own connections, its conntrack sees both directions and its
 * firewall (ct state) holds [kernel_flow]. kxp's translated flows never pass the
 * kernel's path, so the kernel has no entry for them. Not on kxp's service device,
 * where everything was routed to kxp. A later fragment follows its first fragment's
 * choice (kernel_frags); kernels without the conntrack kfuncs keep the rules alone.
 * Rule (e)'s Service CIDRs are checked first, and only for a destination inside the
 * smallest prefix holding them all (config.cover4/cover6): most packets kxp takes go
 * to ClusterIPs, and on a node with many Services the frontends lookup is a cache
 * miss in a large hash table, where one compare (and, with several CIDRs of a family,
 * a small trie) is not; every other packet pays the compare only. A ClusterIP's
 * packets then count under (e).
 * If no socket sits on the queue, bpf_redirect_map falls back to XDP_PASS
 * (fail-open), or the packet is dropped with IF_HOLD (kxp restarting, see below).
 * One loaded program serves every interface kxp attaches to: the maps are shared, and
 * what differs per interface is in ifaces[ingress ifindex] -- its slot (its sockets are
 * xsks[slot * MAX_QUEUES + queue], its counters stats[slot]) and its
 * flags (service device, hold). An interface with no entry uses ifaces[0] if there is
 * one (a program run by BPF_PROG_TEST_RUN), else slot 0: counted, no socket.
 * Userspace (dataplane::xdp) mirrors every layout below.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define IPPROTO_ICMPV6_ 58
#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_DEST 60
#define MAX_V6_EXT 6 /* extension headers walked before giving up (PASS) */

/* 20 bytes, no implicit padding. addr: IPv6, or IPv4 as ::ffff:a.b.c.d;
 * port in network byte order; proto: 6, 17 or 132; pad: 0. */
struct steer_key {
	__u8 addr[16];
	__be16 port;
	__u8 proto;
	__u8 pad;
};

struct addr_key {
	__u8 addr[16];
};

/* LPM trie key: prefixlen in host byte order, then the address as in
 * addr_key; an IPv4 CIDR a.b.c.d/n is ::ffff:a.b.c.d/(n + 96). */
struct lpm_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* config[0]; host byte order. snat_hi == 0 disables rule (b). cover4/cover6: the
 * smallest prefix holding every Service CIDR of the family (cover6 as four words, most
 * significant first), of length cover4_len/cover6_len; COVER_NONE: the family has no
 * Service CIDR. cover_exact: COVER4_EXACT / COVER6_EXACT when the cover is itself one
 * of the CIDRs (one per family, the usual case): inside it is inside a CIDR, no trie
 * lookup. All zero (before kxp writes them): /0, not exact, every address is looked
 * up. */
struct steer_config {
	__u16 snat_lo;
	__u16 snat_hi;
	__u32 flags;
	__u32 cover4;
	__u8 cover4_len;
	__u8 cover6_len;
	__u8 cover_exact;
	__u8 pad;
	__u32 cover6[4];
};
#define COVER_NONE 0xff
#define COVER4_EXACT 1
#define COVER6_EXACT 2
#define CFG_STEER_VLAN (1u << 0) /* look inside one 802.1Q/802.1ad tag */

/* ifaces[ifindex]: the interface's slot and IF_* flags (host byte order). */
struct iface {
	__u32 slot;
	__u32 flags;
};
#define MAX_QUEUES 256 /* receive queues per interface with a socket slot */
#define MAX_SLOTS 1024 /* interfaces one program serves (slot 0: none) */
/* kxp's service device: everything on it was routed there by the node for kxp; what
 * kxp does not take (no rule matched, or no socket) is dropped, never handed back to
 * the kernel, which would route it into the device again -- unless it is for a node
 * address, which the kernel delivers. */
#define IF_SERVICE_DEVICE (1u << 1)
/* Hold: a packet kxp must translate is dropped, not passed, when no socket sits on its
 * queue (kxp restarting: the peer retransmits and the new process translates it, instead
 * of the kernel answering an endpoint's segment with a RST) -- for the queues kxp
 * serves, the first (flags >> 16) of them; on the others the kernel's path (through
 * the service device) stays the fallback. */
#define IF_HOLD (1u << 2)
#define IF_HOLD_QUEUES(f) ((f) >> 16)

/* The kernel's conntrack, looked up from XDP (net/netfilter/nf_conntrack_bpf.c, 6.0+).
 * Weak: on a kernel without them the program loads all the same and does not ask. */
struct nf_conn {
	int unused;
};
struct bpf_ct_opts {
	__s32 netns_id;
	__s32 error;
	__u8 l4proto;
	__u8 dir;
	__u8 reserved[2];
};
#define BPF_F_CURRENT_NETNS_ (-1)
extern struct nf_conn *bpf_xdp_ct_lookup(struct xdp_md *xdp_ctx, struct bpf_sock_tuple *tuple,
					 __u32 tuple_len, struct bpf_ct_opts *opts,
					 __u32 opts_len) __ksym __weak;
extern void bpf_ct_release(struct nf_conn *ct) __ksym __weak;

/* stats indices (PERCPU_ARRAY of u64); seen == redirected + passed */
enum {
	ST_SEEN,
	ST_REDIRECTED,
	ST_PASSED,
	ST_NO_SOCKET, /* a rule matched but xsks[queue] was empty: passed */
	ST_FRONTEND, /* rule (a) */
	ST_MASQ_REPLY, /* rule (b) */
	ST_DNAT_REPLY, /* rule (c) */
	ST_ICMP_ERROR, /* rule (d) */
	ST_CLUSTER_IP, /* rule (e) */
	ST_UNPARSED, /* IPv4/IPv6 whose headers cannot be read (passed: the kernel drops it) */
	ST_VLAN, /* 802.1Q/802.1ad-tagged, not looked inside: off, cut short or QinQ (passed) */
	ST_KERNEL_FLOW, /* a reply rule matched, but the kernel tracks the flow (passed) */
	ST_FRAGMENT, /* rule (f): a later fragment of a datagram whose first was taken */
	ST_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, MAX_SLOTS * MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

/* The key sets that grow with the cluster (frontends, endpoints, ClusterIPs): each is
 * the one inner map of a one-slot array. kxp makes the inner map at the size the
 * cluster needs and, as it grows, fills a larger one and swaps it in (one update of the
 * slot: no packet sees a half-filled set), so no size is compiled in. The two
 * templates below give the inner maps' types only (their max_entries is not used: a
 * hash map's size is not part of its type). */
struct steer_set {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(key_size, sizeof(struct steer_key));
	__uint(value_size, 1);
};

struct addr_set {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(key_size, sizeof(struct addr_key));
	__uint(value_size, 1);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct steer_set);
} frontends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct steer_set);
} endpoints SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct addr_key);
	__type(value, __u8);
} local_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct addr_set);
} cluster_ips SEC(".maps");

/* Whether `key` is in the set `outer` holds (none yet: empty). */
static __always_inline int in_set(void *outer, const void *key)
{
	__u32 zero = 0;
	void *set = bpf_map_lookup_elem(outer, &zero);

	return set && bpf_map_lookup_elem(set, key);
}

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 256);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_key);
	__type(value, __u8);
} service_cidrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct steer_config);
} config SEC(".maps");

/* One entry per slot holding all its counters: one per-CPU allocation per slot when
 * the map is made (an entry per counter made 13,312 of them, ~1 s of the program's load
 * beside a busy CPU). */
struct slot_stats {
	__u64 c[ST_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct slot_stats);
} stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct iface);
} ifaces SEC(".maps");

/* A datagram whose first fragment was left to the kernel (its flow is the kernel's):
 * addresses as in addr_key, IPv4's 16-bit or IPv6's 32-bit identification, protocol. */
struct frag_key {
	__u8 src[16];
	__u8 dst[16];
	__u32 id;
	__u8 proto;
	__u8 pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct frag_key);
	__type(value, __u8);
} kernel_frags SEC(".maps");

/* A datagram whose first fragment a rule redirected to kxp: its later fragments, which
 * carry no ports (a NodePort's, a masqueraded reply's), follow it. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct frag_key);
	__type(value, __u8);
} kxp_frags SEC(".maps");

struct vlan_hdr {
	__be16 tci;
	__be16 encap_proto;
};

struct frag_hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off;
	__be32 identification;
};

/* One direction of a flow as two keys: src = (saddr, sport, proto) and
 * dst = (daddr, dport, proto), ready for the map lookups. */
struct tuple {
	struct steer_key src;
	struct steer_key dst;
	__u32 frag_id; /* fragment identification, when frag is set */
	__u8 frag; /* a fragment (first or later) */
};

static __always_inline void count(__u32 slot, __u32 idx)
{
	struct slot_stats *v = bpf_map_lookup_elem(&stats, &slot);

	if (v && idx < ST_MAX)
		v->c[idx] += 1;
}

static __always_inline int in_snat_range(const struct steer_config *cfg, __be16 port)
{
	__u16 p = bpf_ntohs(port);

	return cfg && cfg->snat_hi && p >= cfg->snat_lo && p <= cfg->snat_hi;
}

/* Whether addr (16 bytes, IPv4 mapped) is inside the cover of the Service CIDRs of its
 * family; without config, yes (look it up). */
static __always_inline int in_cover(const struct steer_config *cfg, const __u8 *addr, int v6)
{
	__u32 len, word, bits, mask;
	int i;

	if (!cfg)
		return 1;
	if (!v6) {
		len = cfg->cover4_len;
		if (len > 32)
			return 0;
		__builtin_memcpy(&word, addr + 12, 4);
		mask = len ? ~0u << (32 - len) : 0;
		return ((bpf_ntohl(word) ^ cfg->cover4) & mask) == 0;
	}
	len = cfg->cover6_len;
	if (len > 128)
		return 0;
#pragma unroll
	for (i = 0; i < 4; i++) {
		bits = len > 32 * i ? len - 32 * i : 0;
		if (bits > 32)
			bits = 32;
		mask = bits ? ~0u << (32 - bits) : 0;
		__builtin_memcpy(&word, addr + 4 * i, 4);
		if ((bpf_ntohl(word) ^ cfg->cover6[i]) & mask)
			return 0;
	}
	return 1;
}

static __always_inline void set_proto(struct tuple *t, __u8 proto)
{
	t->src.proto = proto;
	t->dst.proto = proto;
}

/* Returns the L4 header, or NULL: truncated, not IPv4, or a non-first fragment
 * when `later` is NULL. With `later`, a non-first fragment fills the addresses and
 * protocol of `t`, sets *later and returns where its payload starts. */
static __always_inline void *parse_ipv4(void *l3, void *end, struct tuple *t, int *later)
{
	struct iphdr *ip = l3;

	if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5)
		return NULL;
	if (ip->frag_off & bpf_htons(0x3fff)) {
		t->frag = 1;
		t->frag_id = bpf_ntohs(ip->id);
	}
	if (ip->frag_off & bpf_htons(0x1fff)) {
		if (!later)
			return NULL;
		*later = 1;
	}
	t->src.addr[10] = 0xff;
	t->src.addr[11] = 0xff;
	__builtin_memcpy(&t->src.addr[12], &ip->saddr, 4);
	t->dst.addr[10] = 0xff;
	t->dst.addr[11] = 0xff;
	__builtin_memcpy(&t->dst.addr[12], &ip->daddr, 4);
	set_proto(t, ip->protocol);
	return l3 + ip->ihl * 4;
}

/* Returns the upper-layer header after skipping hop-by-hop, routing and
 * destination options headers and a first-fragment header, or NULL:
 * truncated, not IPv6, non-first fragment, too many extension headers. */
static __always_inline void *parse_ipv6(void *l3, void *end, struct tuple *t, int *later)
{
	struct ipv6hdr *ip6 = l3;
	void *cur = ip6 + 1;
	__u8 nh;

	if (cur > end || ip6->version != 6)
		return NULL;
	__builtin_memcpy(t->src.addr, &ip6->saddr, 16);
	__builtin_memcpy(t->dst.addr, &ip6->daddr, 16);
	nh = ip6->nexthdr;
	for (int i = 0; i < MAX_V6_EXT; i++) {
		if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST) {
			struct ipv6_opt_hdr *h = cur;

			if ((void *)(h + 1) > end)
				return NULL;
			nh = h->nexthdr;
			cur += (h->hdrlen + 1) * 8;
		} else if (nh == NEXTHDR_FRAGMENT) {
			struct frag_hdr *f = cur;

			if ((void *)(f + 1) > end)
				return NULL;
			t->frag = 1;
			t->frag_id = bpf_ntohl(f->identification);
			if (f->frag_off & bpf_htons(0xfff8)) {
				if (!later)
					return NULL;
				*later = 1;
				set_proto(t, f->nexthdr);
				return f + 1;
			}
			nh = f->nexthdr;
			cur = f + 1;
		} else {
			break;
		}
	}
	if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST ||
	    nh == NEXTHDR_FRAGMENT)
		return NULL;
	set_proto(t, nh);
	return cur;
}

static __always_inline int is_translated_proto(__u8 proto)
{
	return proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP;
}

/* TCP, UDP and SCTP all begin with source port, destination port. */
static __always_inline int parse_ports(void *l4, void *end, struct tuple *t)
{
	__be16 *p = l4;

	if ((void *)(p + 2) > end)
		return -1;
	t->src.port = p[0];
	t->dst.port = p[1];
	return 0;
}

/* Whether the kernel's conntrack has an entry, in either direction, for the TCP or UDP
 * flow src -> dst of t (only those two: the kfunc tracks no other). */
static __always_inline int kernel_tracks(struct xdp_md *ctx, const struct tuple *t, int v6)
{
	struct bpf_sock_tuple bt = {};
	struct bpf_ct_opts opts = { .netns_id = BPF_F_CURRENT_NETNS_ };
	struct nf_conn *ct;
	__u32 len;

	if (!bpf_ksym_exists(bpf_xdp_ct_lookup) || !bpf_ksym_exists(bpf_ct_release))
		return 0;
	if (t->src.proto != IPPROTO_TCP && t->src.proto != IPPROTO_UDP)
		return 0;
	opts.l4proto = t->src.proto;
	if (v6) {
		__builtin_memcpy(bt.ipv6.saddr, t->src.addr, 16);
		__builtin_memcpy(bt.ipv6.daddr, t->dst.addr, 16);
		bt.ipv6.sport = t->src.port;
		bt.ipv6.dport = t->dst.port;
		len = sizeof(bt.ipv6);
	} else {
		__builtin_memcpy(&bt.ipv4.saddr, &t->src.addr[12], 4);
		__builtin_memcpy(&bt.ipv4.daddr, &t->dst.addr[12], 4);
		bt.ipv4.sport = t->src.port;
		bt.ipv4.dport = t->dst.port;
		len = sizeof(bt.ipv4);
	}
	ct = bpf_xdp_ct_lookup(ctx, &bt, len, &opts, sizeof(opts));
	if (!ct)
		return 0;
	bpf_ct_release(ct);
	return 1;
}

static __always_inline void frag_key_of(struct frag_key *k, const struct tuple *t)
{
	__builtin_memcpy(k->src, t->src.addr, 16);
	__builtin_memcpy(k->dst, t->dst.addr, 16);
	k->id = t->frag_id;
	k->proto = t->src.proto;
}

/* Whether a reply rule's match is the kernel's flow instead (see the top): a first
 * fragment's datagram is then remembered for its later fragments. */
static __always_inline int leave_to_kernel(struct xdp_md *ctx, const struct tuple *t, int v6,
					   __u32 iflags)
{
	struct frag_key k = {};
	__u8 one = 1;

	if (iflags & IF_SERVICE_DEVICE)
		return 0;
	if (!kernel_tracks(ctx, t, v6))
		return 0;
	if (t->frag) {
		frag_key_of(&k, t);
		bpf_map_update_elem(&kernel_frags, &k, &one, BPF_ANY);
	}
	return 1;
}

/* Rules (a)-(c) and (e); returns the stats index of the rule, or 0. */
static __always_inline __u32 match_flow(struct xdp_md *ctx, struct tuple *t,
					const struct steer_config *cfg, __u32 iflags, int v6)
{
	struct lpm_key cidr = { .prefixlen = 128 };
	int dst_local;

	if (in_cover(cfg, t->dst.addr, v6)) {
		if (cfg && (cfg->cover_exact & (v6 ? COVER6_EXACT : COVER4_EXACT)))
			return ST_CLUSTER_IP;
		__builtin_memcpy(cidr.addr, t->dst.addr, 16);
		if (bpf_map_lookup_elem(&service_cidrs, &cidr))
			return ST_CLUSTER_IP;
	}
	if (in_set(&frontends, &t->dst))
		return ST_FRONTEND;
	dst_local = bpf_map_lookup_elem(&local_addrs, t->dst.addr) != NULL;
	if (dst_local && in_snat_range(cfg, t->dst.port))
		return leave_to_kernel(ctx, t, v6, iflags) ? ST_KERNEL_FLOW : ST_MASQ_REPLY;
	if (!dst_local && in_set(&endpoints, &t->src))
		return leave_to_kernel(ctx, t, v6, iflags) ? ST_KERNEL_FLOW : ST_DNAT_REPLY;
	if (in_set(&cluster_ips, t->dst.addr))
		return ST_CLUSTER_IP;
	return 0;
}

/* Rule (f): a fragment after the first of a datagram to a Service address or from an
 * endpoint (any destination: a masqueraded reply goes to the node), unless its first
 * fragment was left to the kernel. */
static __always_inline __u32 match_fragment(struct tuple *t)
{
	struct frag_key k = {};

	t->src.port = 0;
	t->dst.port = 0;
	frag_key_of(&k, t);
	if (bpf_map_lookup_elem(&kxp_frags, &k))
		return ST_FRAGMENT;
	if (in_set(&frontends, &t->dst))
		return ST_FRONTEND;
	if (in_set(&endpoints, &t->src)) {
		if (bpf_map_lookup_elem(&kernel_frags, &k))
			return ST_KERNEL_FLOW;
		return ST_DNAT_REPLY;
	}
	if (in_set(&cluster_ips, t->dst.addr))
		return ST_CLUSTER_IP;
	return 0;
}

/* Rule (d): an ICMP error whose quoted packet (IP header + 8 bytes) is of a
 * masqueraded flow, a DNAT-only flow, or a reply kxp sent from a frontend. */
static __always_inline __u32 match_icmp(struct xdp_md *ctx, void *l4, void *end, int v6,
					const struct steer_config *cfg, __u32 iflags)
{
	__u8 *icmp = l4;
	struct tuple in = {};
	void *inner_l4;
	__u8 type;

	if ((void *)(icmp + 8) > end)
		return 0;
	type = icmp[0];
	if (v6) {
		if (type < 1 || type > 4)
			return 0;
		inner_l4 = parse_ipv6(icmp + 8, end, &in, NULL);
	} else {
		if (type != 3 && type != 11 && type != 12)
			return 0;
		inner_l4 = parse_ipv4(icmp + 8, end, &in, NULL);
	}
	if (!inner_l4 || !is_translated_proto(in.src.proto) ||
	    parse_ports(inner_l4, end, &in))
		return 0;
	in.frag = 0;
	if ((bpf_map_lookup_elem(&local_addrs, in.src.addr) && in_snat_range(cfg, in.src.port)) ||
	    in_set(&endpoints, &in.dst))
		return leave_to_kernel(ctx, &in, v6, iflags) ? ST_KERNEL_FLOW : ST_ICMP_ERROR;
	if (in_set(&frontends, &in.src))
		return ST_ICMP_ERROR;
	return 0;
}

/* xdp.frags: the program accepts multi-buffer frames (jumbo MTUs; a veth refuses a
 * program without it when its peer's MTU passes a page). It reads only the headers,
 * which are in the first buffer. */
SEC("xdp.frags")
int kxp_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	const struct steer_config *cfg;
	const struct iface *ifc;
	struct tuple t = {};
	__u32 zero = 0, reason, base = 0, iflags = 0, ifindex = ctx->ingress_ifindex;
	__be16 h_proto;
	void *l3, *l4;
	int v6, later = 0;
	long act;

	/* Read into scalars at once: the rest of the program carries no pointer that may
	 * be null (fewer states for the verifier to walk). base 0: no slot. */
	ifc = bpf_map_lookup_elem(&ifaces, &ifindex);
	/* Key 0: the first handle's slot, for BPF_PROG_TEST_RUN (whose packets come from
	 * loopback, where kxp never attaches). A packet from any other interface without a
	 * slot (one the program reaches without kxp attaching there: a bond's port when
	 * the program is on the bond) has no socket of its own: passed, never redirected to
	 * another interface's sockets, which would drop it. */
	if (!ifc && ifindex == 1)
		ifc = bpf_map_lookup_elem(&ifaces, &zero);
	if (ifc && ifc->slot < MAX_SLOTS) {
		base = ifc->slot;
		iflags = ifc->flags;
	}
	count(base, ST_SEEN);
	cfg = bpf_map_lookup_elem(&config, &zero);
	if ((void *)(eth + 1) > end)
		goto pass;
	h_proto = eth->h_proto;
	l3 = eth + 1;
	if (h_proto == bpf_htons(ETH_P_8021Q) || h_proto == bpf_htons(ETH_P_8021AD)) {
		struct vlan_hdr *vh = l3;

		if (!cfg || !(cfg->flags & CFG_STEER_VLAN) || (void *)(vh + 1) > end) {
			count(base, ST_VLAN);
			goto pass;
		}
		h_proto = vh->encap_proto;
		l3 = vh + 1;
		if (h_proto == bpf_htons(ETH_P_8021Q) || h_proto == bpf_htons(ETH_P_8021AD)) {
			count(base, ST_VLAN); /* two tags (QinQ): not looked into */
			goto pass;
		}
	}

	if (h_proto == bpf_htons(ETH_P_IP)) {
		v6 = 0;
		l4 = parse_ipv4(l3, end, &t, &later);
	} else if (h_proto == bpf_htons(ETH_P_IPV6)) {
		v6 = 1;
		l4 = parse_ipv6(l3, end, &t, &later);
	} else {
		goto pass; /* ARP, LLDP, ... */
	}
	if (!l4) {
		count(base, ST_UNPARSED);
		goto pass;
	}

	if (later) {
		/* A fragment after the first: no ports. Ports 0 stand for "any" in the
		 * frontends and endpoints maps (kxp puts the Service's addresses there). */
		if (t.src.proto != IPPROTO_TCP && t.src.proto != IPPROTO_UDP)
			goto pass;
		reason = match_fragment(&t);
	} else if (is_translated_proto(t.src.proto)) {
		if (parse_ports(l4, end, &t)) {
			count(base, ST_UNPARSED);
			goto pass;
		}
		reason = match_flow(ctx, &t, cfg, iflags, v6);
	} else if ((!v6 && t.src.proto == IPPROTO_ICMP) ||
		   (v6 && t.src.proto == IPPROTO_ICMPV6_)) {
		reason = match_icmp(ctx, l4, end, v6, cfg, iflags);
	} else {
		goto pass;
	}
	if (!reason)
		goto pass;
	if (reason == ST_KERNEL_FLOW) {
		count(base, reason);
		goto pass;
	}
	if (t.frag && !later) {
		/* A first fragment taken: its later fragments follow (rule (f)). */
		struct frag_key k = {};
		__u8 one = 1;

		frag_key_of(&k, &t);
		bpf_map_update_elem(&kxp_frags, &k, &one, BPF_ANY);
	}

	count(base, reason);
	act = XDP_PASS;
	if (base && ctx->rx_queue_index < MAX_QUEUES)
		act = bpf_redirect_map(&xsks, base * MAX_QUEUES + ctx->rx_queue_index,
				       XDP_PASS);
	if (act == XDP_REDIRECT) {
		count(base, ST_REDIRECTED);
		return XDP_REDIRECT;
	}
	count(base, ST_NO_SOCKET);
	if ((iflags & IF_HOLD) && ctx->rx_queue_index < IF_HOLD_QUEUES(iflags))
		return XDP_DROP;
pass:
	/* On the service device only a packet for a node address goes to the kernel (the
	 * node's own connection to a port of its own that is no NodePort: delivered
	 * locally); the rest would be routed back into the device. */
	if ((iflags & IF_SERVICE_DEVICE) &&
	    !bpf_map_lookup_elem(&local_addrs, t.dst.addr))
		return XDP_DROP;
	count(base, ST_PASSED);
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
