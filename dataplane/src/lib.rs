//! kxp's dataplane: the system side of the packet path, which drives the pure per-packet
//! pipeline (the `engine` crate): in small modules of their own, the AF_XDP sockets, the
//! XDP steering program, the workers, the FIB mirror and the state files. This is the only crate
//! of kxp allowed `unsafe`, and only in the modules allowed it below (`afxdp`, `sys`, `xsk`,
//! `statefile`, `xdp::sys` and the XDP tests), each block with a `// SAFETY:` note.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod afxdp;
pub mod caps;
pub mod fib;
pub mod holder;
pub mod ifmatch;
pub mod logrl;
pub mod napi;
pub mod persistence;
pub mod plane;
pub mod priority;
pub mod servicedev;
#[allow(unsafe_code)]
pub mod statefile;
#[allow(unsafe_code)]
pub mod sys;
pub mod tool;
pub mod worker;
pub mod xdp;
#[allow(unsafe_code)]
pub mod xsk;
