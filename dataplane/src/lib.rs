//! kxp's AF_XDP dataplane (issue 3): the only crate of kxp allowed `unsafe`, each block in
//! a small module with a `// SAFETY:` note.
