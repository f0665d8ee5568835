//! kxp's per-worker connection table.
//!
//! Each dataplane worker owns one [`ConnTable`] and calls it with `&mut self`: no locks,
//! no atomics, no I/O and no clock. Every method that needs time takes `now`, in
//! nanoseconds of the caller's monotonic clock, so the table is deterministic and its
//! tests run on a fake clock.
//!
//! # What an entry is
//! A flow is stored once, under both of its tuples: `orig` as the client sent it
//! (client:40000 -> VIP:80) and `reply` as the endpoint answers (endpoint:8080 ->
//! client:40000, or -> snat_ip:port when masqueraded). A lookup with either tuple finds
//! the entry and the packet's [`Direction`]; the pair of tuples is the NAT binding
//! ([`Entry::rewrite_to`]). Protocol state is tracked as far as timeouts need it
//! ([`tcp`], `track`), with timeouts from kube-proxy's configuration ([`Timeouts`]).
//!
//! # Eviction policy
//! Capacity is fixed at construction (`max(maxPerCore × cores, min)` split between the
//! workers is the caller's arithmetic). When an insertion finds the table full it frees
//! one slot:
//! 1. the oldest unassured flow, expired or still live ("early drop", as Linux's
//!    `early_drop`): TCP not yet ESTABLISHED with a reply, UDP not yet a stream, SCTP not
//!    yet heard both ways — the kind of entry a SYN or UDP flood creates; found in O(1);
//! 2. only if every flow is assured: an expired one within [`ConnTable::ROOM_SWEEP`] slots
//!    of the expiry clock hand.
//!
//! An assured flow is never evicted to make room: when every flow is assured the
//! insertion fails with [`InsertError::Full`] and the caller drops the packet, so a flood
//! of new flows can delay new connections but cannot cut established ones.
//!
//! # Expiry
//! Incremental, by [`ConnTable::expire`] with a budget (see `reclaim`); expired entries
//! not yet reached are treated as absent by lookups and removed then.
//!
//! # SNAT and ownership
//! Each table allocates masquerade ports that [`flow_owner`] maps back to its worker
//! ([`SnatPorts`]), so the owner of any packet can be computed from its headers.
//!
//! # Per-node state
//! What kube-proxy keeps once per node is shared by the workers' tables: ClientIP
//! affinity ([`AffinityTable`], sharded, bounded, expiring) and the flows per endpoint
//! ([`EndpointLoad`], for the least-connection schedulers).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod affinity;
mod direction;
mod entry;
mod frag;
mod index;
mod load;
pub mod persist;
mod reclaim;
mod snat;
mod table;
pub mod tcp;
mod timeouts;
mod track;

pub use affinity::{AffinityStats, AffinityTable};
pub use entry::{Direction, Entry, FlowState, State};
pub use frag::{FragStats, FragTable, FragVerdict};
pub use load::EndpointLoad;
pub use snat::{SnatPorts, SnatRangeError, flow_owner};
pub use table::{CapacityError, ConnTable, Counts, Hit, InsertError, Stats};
pub use tcp::TcpState;
pub use timeouts::Timeouts;
pub use track::Update;
pub use wire::{Protocol, Tuple};
