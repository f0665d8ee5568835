//! Writes the seed corpora to `fuzz/corpus/<target>/` (see `kxp_fuzz::seeds`).

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, name, data) in kxp_fuzz::seeds::all() {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).expect("corpus directory");
        std::fs::write(dir.join(&name), data).expect("seed written");
    }
    println!("seeds written to {}", root.display());
}
