//! Which way a packet of a flow travels: the one word the entry and the TCP state
//! machine share.

/// Which way a packet travels relative to the flow's first packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Direction {
    /// From the client, as the first packet (matches [`Entry::orig`]).
    Original = 0,
    /// From the endpoint back to the client (matches [`Entry::reply`]).
    Reply = 1,
}

impl Direction {
    pub(crate) const fn from_bit(bit: u32) -> Direction {
        if bit & 1 == 0 {
            Direction::Original
        } else {
            Direction::Reply
        }
    }
}
