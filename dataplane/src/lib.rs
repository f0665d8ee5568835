//! kxp's dataplane: the per-packet pipeline ([`engine`], pure) and, in small modules of
//! their own, the AF_XDP sockets, XDP steering program and workers. This is the only crate
//! of kxp allowed `unsafe`, each block with a `// SAFETY:` note.

pub mod engine;
pub mod fib;
pub mod ifmatch;
pub mod lab;
pub mod logrl;
pub mod persistence;
pub mod plane;
pub mod servicedev;
pub mod statefile;
pub mod sys;
pub mod worker;
pub mod xdp;
pub mod xsk;
