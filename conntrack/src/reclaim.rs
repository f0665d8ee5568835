//! Getting entries out of the table: incremental expiry, making room when full, and the
//! control plane's scans for flows whose endpoint went away.
//!
//! Expiry is a clock hand over the slab rather than a scan of everything or a timer per
//! entry: each call looks at a fixed number of slots from where the last one stopped, so a
//! worker can spend a small, bounded slice of every poll loop on it and never pauses. An
//! expired entry that the hand has not reached yet is still dead: lookups treat it as
//! absent and remove it, and insertion reclaims it when its tuple is needed.

use std::net::IpAddr;

use wire::Protocol;

use crate::entry::{Entry, NIL};
use crate::table::ConnTable;

impl ConnTable {
    /// Slots the clock hand sweeps when an insertion finds the table full, before it
    /// evicts a live flow.
    pub const ROOM_SWEEP: usize = 64;

    /// Advances the expiry clock hand over at most `budget` slots (free ones included,
    /// and no slot twice in one call), removing the flows expired at `now`. Returns how
    /// many were removed. Calls whose budgets add up to the slab's length visit every slot.
    pub fn expire(&mut self, now: u64, budget: usize) -> usize {
        let n = self.slots.len();
        let mut removed = 0;
        for _ in 0..budget.min(n) {
            if self.hand >= n {
                self.hand = 0;
            }
            let slot = self.hand;
            self.hand += 1;
            let e = &self.slots[slot];
            if e.is_live() && e.is_expired(now) {
                self.remove_slot(slot);
                removed += 1;
            }
        }
        self.stats.expired += removed as u64;
        removed
    }

    /// The clock hand at a pace rather than a fixed step: over any `period` ns of calls it
    /// visits every slot in use once (at most `max` per call, the rest owed to the next
    /// calls), whatever the rate of calls. A poll loop calls it every round: a fixed step
    /// per round would sweep a large table hundreds of times a second while the loop spins
    /// idle, and once per few hundred milliseconds under a flood of new flows that all
    /// outlive it, streaming the slab through the cache for nothing. Expiry does not need
    /// more: an expired flow is already absent to lookups and to the SNAT port choice.
    /// Returns how many flows were removed.
    pub fn expire_paced(&mut self, now: u64, period: u64, max: usize) -> usize {
        let period = period.max(1);
        let elapsed = if self.paced_at == 0 {
            0
        } else {
            now.saturating_sub(self.paced_at).min(period)
        };
        self.paced_at = now;
        let slots = self.slots.len() as u64;
        // Owed at most one sweep: a table that went unswept for long catches up once.
        self.paced_credit = self
            .paced_credit
            .saturating_add(slots.saturating_mul(elapsed))
            .min(slots.saturating_mul(period));
        let budget = (self.paced_credit / period).min(max as u64);
        if budget == 0 {
            return 0;
        }
        self.paced_credit -= budget * period;
        self.expire(now, budget as usize)
    }

    /// Frees one slot in a full table, or returns false. The oldest unassured flow goes
    /// first, expired or not (early drop): under a flood of new flows it is always there,
    /// and finding it is O(1). Only when every flow is assured does it look for expired
    /// ones, within [`ConnTable::ROOM_SWEEP`] slots of the clock hand. An assured flow
    /// that is still live is never evicted.
    pub(crate) fn make_room(&mut self, now: u64) -> bool {
        let head = self.unassured_head;
        if head != NIL {
            if self.slots[head as usize].is_expired(now) {
                self.stats.expired += 1;
            } else {
                self.stats.evictions += 1;
            }
            self.remove_slot(head as usize);
            self.look_ahead();
            return true;
        }
        self.expire(now, ConnTable::ROOM_SWEEP) > 0
    }

    /// Removes every UDP flow whose endpoint is `ip:port`, so that clients of a removed
    /// endpoint (a DNS server, typically) stop being sent to it: kube-proxy's stale UDP
    /// conntrack cleanup. Counted in [`crate::Stats::removed_stale`].
    ///
    /// Scans the whole slab: call it from the control path when an endpoint goes, not
    /// per packet.
    pub fn remove_udp_to_endpoint(&mut self, ip: IpAddr, port: u16) -> usize {
        let n = self.remove_scan(|e| {
            e.reply.proto == Protocol::Udp && e.reply.src == ip && e.reply.sport == port
        });
        self.stats.removed_stale += n as u64;
        n
    }

    /// Removes every flow, of any protocol and port, whose endpoint address is `ip` (a
    /// pod that is gone). Counted in [`crate::Stats::removed_stale`]. Scans the whole slab.
    pub fn remove_to_endpoint_ip(&mut self, ip: IpAddr) -> usize {
        let n = self.remove_scan(|e| e.reply.src == ip);
        self.stats.removed_stale += n as u64;
        n
    }

    /// Removes every live flow for which `pred` is true (e.g. all flows of a deleted
    /// Service, by tag). Counted in [`crate::Stats::removed`]. Scans the whole slab.
    pub fn remove_if(&mut self, pred: impl FnMut(&Entry) -> bool) -> usize {
        let n = self.remove_scan(pred);
        self.stats.removed += n as u64;
        n
    }

    fn remove_scan(&mut self, mut pred: impl FnMut(&Entry) -> bool) -> usize {
        let mut removed = 0;
        for slot in 0..self.slots.len() {
            let e = &self.slots[slot];
            if e.is_live() && pred(e) {
                self.remove_slot(slot);
                removed += 1;
            }
        }
        removed
    }
}
