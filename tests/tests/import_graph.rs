//! The workspace's import graph: which module of a crate uses which other module of the
//! same crate (through `crate::` and `super::` paths), and whether any of them form a
//! circle. A module's parent and its children are not edges (a parent declares its
//! children, a child may use its parent's items); test modules and test helpers are left
//! out (they look at everything). Circles make a crate one lump: nothing in them can be
//! understood, tested or moved alone.
//!
//! The check is a ratchet: no circle but those listed in `KNOWN` may exist, and every one
//! listed must still exist (a circle broken is taken off the list, so the list only
//! shrinks).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose library modules are checked: every member of the workspace (their
/// directories, as the root manifest's `members` names them).
fn crates() -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("the workspace's members");
    let list = &line[line.find('[').unwrap() + 1..line.rfind(']').unwrap()];
    let out: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect();
    assert!(out.len() >= 8, "members read from Cargo.toml: {out:?}");
    out
}

/// Circles that exist today, each as its sorted modules ("crate:path"), to be broken
/// (none: keep it so).
const KNOWN: &[&[&str]] = &[];

type Module = Vec<String>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Test code: test modules and helpers, which may use anything.
fn is_test_file(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "tests.rs"
        || name == "testutil.rs"
        || name.ends_with("_tests.rs")
        || name.starts_with("tests_")
        || path.components().any(|c| c.as_os_str() == "tests")
            && path.components().any(|c| c.as_os_str() == "src")
            && path
                .parent()
                .and_then(|p| p.file_name())
                .is_some_and(|p| p == "tests")
}

/// Every library source file of `krate` with its module path.
fn modules(krate: &str) -> Vec<(Module, PathBuf)> {
    let src = root().join(krate).join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let rel = path.strip_prefix(&src).unwrap().to_path_buf();
            if path.is_dir() {
                if rel != Path::new("bin") {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().and_then(|x| x.to_str()) != Some("rs")
                || rel == Path::new("main.rs")
                || is_test_file(&rel)
            {
                continue;
            }
            let mut parts: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|l| l == "mod" || l == "lib") {
                parts.pop();
            }
            out.push((parts, path));
        }
    }
    out
}

/// The text without comments (line comments and doc comments; block comments are not
/// used in this workspace's code paths) and without its inline test module (`#[cfg(test)]
/// mod NAME {`, by convention the file's last item).
fn code(text: &str) -> String {
    let mut end = text.len();
    let mut from = 0;
    while let Some(i) = text[from..].find("#[cfg(test)]") {
        let at = from + i;
        let after = text[at + "#[cfg(test)]".len()..].trim_start();
        if after.starts_with("mod ")
            && after
                .find(['{', ';'])
                .is_some_and(|j| after.as_bytes()[j] == b'{')
        {
            end = at;
            break;
        }
        from = at + 1;
    }
    text[..end]
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths after `crate::`, `super::` and `self::` in `text`, each as (its anchor,
/// its segments), braces expanded (`crate::{a::b, c}` gives `a::b` and `c`).
fn paths(text: &str) -> Vec<(&'static str, Vec<String>)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for anchor in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = text[from..].find(anchor) {
            let at = from + i;
            from = at + anchor.len();
            // Not the tail of a longer identifier (e.g. `my_crate::`).
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let name = &anchor[..anchor.len() - 2];
            // `super::super::x`: several anchors in a row.
            let mut ups = vec![name.to_string()];
            let mut rest = &text[from..];
            while let Some(r) = rest.strip_prefix("super::") {
                ups.push("super".into());
                rest = r;
            }
            for p in expand(rest) {
                let mut segs = ups.clone();
                segs.extend(p);
                let anchor: &'static str = match name {
                    "crate" => "crate",
                    "super" => "super",
                    _ => "self",
                };
                out.push((anchor, segs[1..].to_vec()));
                let _ = &segs[0];
            }
        }
    }
    out
}

/// The paths a `use` tail starting at `s` names: `a::b::c`, or `{a::b, c::{d, e}}`.
fn expand(s: &str) -> Vec<Vec<String>> {
    let ident = |s: &str| -> usize {
        s.char_indices()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
            .map_or(s.len(), |(i, _)| i)
    };
    let s = s.trim_start();
    if let Some(inner) = s.strip_prefix('{') {
        // Split at top-level commas up to the matching brace.
        let mut depth = 0;
        let mut parts = Vec::new();
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    parts.push(&inner[start..i]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return parts
            .into_iter()
            .flat_map(|p| expand(p.trim_start()))
            .collect();
    }
    let n = ident(s);
    if n == 0 {
        return vec![Vec::new()];
    }
    let head = s[..n].to_string();
    match s[n..].strip_prefix("::") {
        Some(rest) => expand(rest)
            .into_iter()
            .map(|mut p| {
                p.insert(0, head.clone());
                p
            })
            .collect(),
        None => vec![vec![head]],
    }
}

/// The module of `known` that `path` (absolute segments) names: its longest prefix that
/// is a module.
fn resolve(known: &BTreeSet<Module>, path: &[String]) -> Option<Module> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| known.contains(m))
}

fn is_prefix(a: &Module, b: &Module) -> bool {
    a.len() <= b.len() && b[..a.len()] == a[..]
}

/// The circles (strongly connected components of more than one module) of `edges`.
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<BTreeSet<Module>> {
    let nodes: Vec<&Module> = edges.keys().collect();
    let reach = |from: &Module| -> BTreeSet<Module> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for n in edges.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    stack.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Module, BTreeSet<Module>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<BTreeSet<Module>> = Vec::new();
    for &a in &nodes {
        if out.iter().any(|c| c.contains(a)) {
            continue;
        }
        let scc: BTreeSet<Module> = nodes
            .iter()
            .filter(|&&b| b == a || (reaches[a].contains(b) && reaches[b].contains(a)))
            .map(|b| (*b).clone())
            .collect();
        if scc.len() > 1 {
            out.push(scc);
        }
    }
    out
}

/// Every circle of the workspace, as sorted "crate:module::path" names.
fn workspace_circles() -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for krate in crates() {
        let krate = krate.as_str();
        let files = modules(krate);
        let known: BTreeSet<Module> = files.iter().map(|(m, _)| m.clone()).collect();
        let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for (m, path) in &files {
            let text = code(&std::fs::read_to_string(path).unwrap());
            let targets = edges.entry(m.clone()).or_default();
            for (anchor, segs) in paths(&text) {
                let absolute: Vec<String> = match anchor {
                    "crate" => segs,
                    "self" => m.iter().cloned().chain(segs).collect(),
                    _ => {
                        // `super::` once per leading "super" segment, plus this one.
                        let mut base = m.clone();
                        base.pop();
                        let mut rest = segs.as_slice();
                        while rest.first().is_some_and(|s| s == "super") {
                            base.pop();
                            rest = &rest[1..];
                        }
                        base.into_iter().chain(rest.iter().cloned()).collect()
                    }
                };
                let Some(t) = resolve(&known, &absolute) else {
                    continue;
                };
                if is_prefix(&t, m) || is_prefix(m, &t) {
                    continue;
                }
                targets.insert(t);
            }
        }
        for c in circles(&edges) {
            let mut names: Vec<String> = c
                .iter()
                .map(|m| format!("{krate}:{}", m.join("::")))
                .collect();
            names.sort();
            all.push(names);
        }
    }
    all
}

#[test]
fn the_parser_finds_use_paths_and_circles() {
    let p = paths("use crate::{a::b, c::{d, e}};\nuse super::x::Y; let z = self::q::r();");
    let got: Vec<(&str, String)> = p.iter().map(|(a, s)| (*a, s.join("::"))).collect();
    assert!(got.contains(&("crate", "a::b".into())), "{got:?}");
    assert!(got.contains(&("crate", "c::d".into())), "{got:?}");
    assert!(got.contains(&("crate", "c::e".into())), "{got:?}");
    assert!(got.contains(&("super", "x::Y".into())), "{got:?}");
    assert!(got.contains(&("self", "q::r".into())), "{got:?}");
    let m = |s: &str| s.split("::").map(String::from).collect::<Module>();
    let mut edges = BTreeMap::new();
    edges.insert(m("a"), BTreeSet::from([m("b")]));
    edges.insert(m("b"), BTreeSet::from([m("c")]));
    edges.insert(m("c"), BTreeSet::from([m("a")]));
    edges.insert(m("d"), BTreeSet::from([m("a")]));
    let c = circles(&edges);
    assert_eq!(c, vec![BTreeSet::from([m("a"), m("b"), m("c")])]);
}

#[test]
fn no_import_circle_but_the_known_ones_and_each_known_one_still_there() {
    let found = workspace_circles();
    let known: Vec<Vec<String>> = KNOWN
        .iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect();
    let new: Vec<&Vec<String>> = found.iter().filter(|c| !known.contains(c)).collect();
    let gone: Vec<&Vec<String>> = known.iter().filter(|c| !found.contains(c)).collect();
    assert!(
        new.is_empty() && gone.is_empty(),
        "import circles not in KNOWN: {new:#?}\nKNOWN circles no longer there (take them off): {gone:#?}"
    );
}

/// A member's package name and the workspace packages its `[dependencies]` name.
fn manifest_deps(dir: &str) -> (String, BTreeSet<String>) {
    let text = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
    let mut name = String::new();
    let mut deps = BTreeSet::new();
    let mut section = "";
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = if line == "[dependencies]" {
                "deps"
            } else if line == "[package]" {
                "package"
            } else {
                ""
            };
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let key = line.split(['=', '.']).next().unwrap_or("").trim();
        match section {
            "package" if key == "name" => {
                name = line.split('"').nth(1).unwrap_or("").to_string();
            }
            "deps" => {
                deps.insert(key.to_string());
            }
            _ => {}
        }
    }
    (name, deps)
}

/// The README's list of crates and what each uses (`dir -> dir, dir`), as written.
fn readme_crates() -> BTreeMap<String, BTreeSet<String>> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme
        .find("The crates, each using only those after its arrow")
        .expect("the README's list of crates");
    let block = readme[start..].split("```").nth(1).expect("its code block");
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (krate, uses) = l.split_once("->").unwrap_or((l, ""));
            let uses = uses
                .split(',')
                .map(|u| u.trim().to_string())
                .filter(|u| !u.is_empty())
                .collect();
            (krate.trim().to_string(), uses)
        })
        .collect()
}

#[test]
fn the_readmes_picture_of_the_crates_is_the_manifests() {
    // Every member but the harnesses around them (benchmarks, end-to-end tests, fuzz).
    let members: Vec<String> = crates()
        .into_iter()
        .filter(|c| !["bench", "tests", "fuzz"].contains(&c.as_str()))
        .collect();
    let by_name: BTreeMap<String, String> = members
        .iter()
        .map(|dir| (manifest_deps(dir).0, dir.clone()))
        .collect();
    let actual: BTreeMap<String, BTreeSet<String>> = members
        .iter()
        .map(|dir| {
            let uses = manifest_deps(dir)
                .1
                .into_iter()
                .filter_map(|d| by_name.get(&d).cloned())
                .collect();
            (dir.clone(), uses)
        })
        .collect();
    assert_eq!(
        readme_crates(),
        actual,
        "README.md's list of crates (left) against the manifests (right)"
    );
}

/// Functions of `text` (code, as [`code`] leaves it) longer than `max` lines, from their
/// `fn` line to the closing brace at its indentation, as (name, lines).
fn long_functions(text: &str, max: usize) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let mut rest = trimmed;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(sig) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = sig
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            let len = end + 2;
            if len > max {
                out.push((name, len));
            }
        }
    }
    out
}

#[test]
fn no_production_function_is_over_a_hundred_lines() {
    // The crates the product is built from (the harnesses around them are left out).
    let mut long = Vec::new();
    for krate in crates() {
        if ["bench", "tests", "fuzz"].contains(&krate.as_str()) {
            continue;
        }
        for (module, path) in modules(&krate) {
            let text = code(&std::fs::read_to_string(&path).unwrap());
            for (name, len) in long_functions(&text, 100) {
                long.push(format!(
                    "{krate}:{}::{name} ({len} lines)",
                    module.join("::")
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over 100 lines: split them into named steps: {long:#?}"
    );
}

#[test]
fn a_long_function_is_found() {
    let body = "    let x = 1;\n".repeat(120);
    let text = format!("fn short() {{\n}}\n\nimpl A {{\n    pub fn long() {{\n{body}    }}\n}}\n");
    assert_eq!(long_functions(&text, 100), vec![("long".to_string(), 122)]);
}
