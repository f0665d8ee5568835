//! What the IPv4 and IPv6 header readers share.

/// Identification, offset and more-fragments flag of an IPv4 fragment or of an IPv6
/// fragment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FragInfo {
    /// IPv4's 16-bit identification or IPv6's 32-bit one.
    pub id: u32,
    /// In units of 8 bytes.
    pub offset: u16,
    pub more: bool,
}
