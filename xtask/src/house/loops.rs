//! Import loops between the files of a crate.
//!
//! Inside each crate's `src/`, every top-level module (a file `src/x.rs`, or
//! a folder `src/x/`) is a node; a reference to `crate::y` (or `super::y`
//! that reaches the crate root) in `x`, outside its `#[cfg(test)]` modules,
//! is an edge `x -> y`. A strongly connected component of more than two
//! modules is a loop a reader cannot take apart file by file. Loops known
//! today are listed in `xtask/house-allow-loops.txt`: the check fails on a
//! loop that is new or larger than its entry, and on an entry that no
//! longer matches what the code has (so the list only shrinks).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::Context;

/// The allowlist, relative to the workspace root.
pub const ALLOW_FILE: &str = "xtask/house-allow-loops.txt";

/// A crate's module graph: each top-level module and the top-level modules
/// it references.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The loop problems of every crate under `root` (`crates/*/src`, `xtask/src`),
/// each crate named by its folder (`crates/sessiond-store`).
pub fn check(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut found = BTreeMap::new();
    let mut dirs: Vec<_> = std::fs::read_dir(root.join("crates"))
        .context("read crates/")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    dirs.push(root.join("xtask"));
    dirs.sort();
    for dir in dirs {
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let name = dir
            .strip_prefix(root)
            .unwrap_or(&dir)
            .to_string_lossy()
            .into_owned();
        let graph = graph_of(&src)?;
        let loops: Vec<_> = loops_of(&graph)
            .into_iter()
            .map(|members| (members, graph.clone()))
            .collect();
        if !loops.is_empty() {
            found.insert(name, loops);
        }
    }
    let allow_text = std::fs::read_to_string(root.join(ALLOW_FILE)).unwrap_or_default();
    let allowed = parse_allowlist(&allow_text);
    Ok(compare(&found, &allowed))
}

/// Reads the module graph of one crate's `src/`.
fn graph_of(src: &Path) -> anyhow::Result<Graph> {
    let mut files = Vec::new();
    collect_rs(src, src, &mut files)?;
    let modules: BTreeSet<String> = files.iter().filter_map(|(m, _, _)| m.clone()).collect();
    let mut graph: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for (module, depth, path) in &files {
        let Some(module) = module else { continue };
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        let edges = graph.get_mut(module).expect("every module is a node");
        for target in references(&text, *depth) {
            if &target != module && modules.contains(&target) {
                edges.insert(target);
            }
        }
    }
    Ok(graph)
}

/// Every `.rs` file under `dir` with its top-level module (`None` for the
/// crate roots `lib.rs` / `main.rs`) and its depth below that module's
/// parent (`src/a.rs` and `src/a/mod.rs` 0, `src/a/b.rs` 1). `src/bin/`
/// holds other crates and is skipped.
#[allow(clippy::type_complexity)]
fn collect_rs(
    src: &Path,
    dir: &Path,
    out: &mut Vec<(Option<String>, usize, std::path::PathBuf)>,
) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| dir.display().to_string())? {
        let path = entry?.path();
        let rel = path.strip_prefix(src).expect("under src");
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if path.is_dir() {
            if parts.len() == 1 && parts[0] == "bin" {
                continue;
            }
            collect_rs(src, &path, out)?;
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let stem = |s: &str| s.trim_end_matches(".rs").to_owned();
        let (module, depth) = match parts.as_slice() {
            [one] if one == "lib.rs" || one == "main.rs" => (None, 0),
            [one] => (Some(stem(one)), 0),
            [first, rest @ ..] => {
                let last = rest.last().expect("non-empty");
                let depth = if last == "mod.rs" {
                    rest.len() - 1
                } else {
                    rest.len()
                };
                (Some(first.clone()), depth)
            }
            [] => continue,
        };
        out.push((module, depth, path));
    }
    Ok(())
}

/// The top-level modules a file references through `crate::` or through
/// `super::` chains that reach the crate root (`depth + 1` of them), with
/// comments and `#[cfg(test)]` modules left out. Names are returned as
/// written: the caller keeps those that are modules.
pub fn references(text: &str, depth: usize) -> BTreeSet<String> {
    let code = without_tests(&without_comments(text));
    let bytes = code.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !is_ident(bytes[i - 1]);
        if starts_word && bytes[i..].starts_with(b"crate::") {
            i += "crate::".len();
            i = names_at(&code, i, &mut out);
            continue;
        }
        if starts_word && bytes[i..].starts_with(b"super::") {
            let mut supers = 0;
            while bytes[i..].starts_with(b"super::") {
                supers += 1;
                i += "super::".len();
                i = skip_space(bytes, i);
            }
            if supers == depth + 1 {
                i = names_at(&code, i, &mut out);
            }
            continue;
        }
        i += 1;
    }
    out
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn skip_space(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && bytes[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Reads the path's next segment at `i` (a name, or a `{a, b::c}` group,
/// whose items' first names are taken) into `out`; returns where it ended.
fn names_at(code: &str, i: usize, out: &mut BTreeSet<String>) -> usize {
    let bytes = code.as_bytes();
    let i = skip_space(bytes, i);
    if i < bytes.len() && bytes[i] == b'{' {
        let mut depth = 0;
        let mut item_start = true;
        let mut j = i;
        while j < bytes.len() {
            match bytes[j] {
                b'{' => {
                    depth += 1;
                    if depth == 1 {
                        item_start = true;
                    }
                }
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return j + 1;
                    }
                }
                b',' if depth == 1 => item_start = true,
                b if depth == 1 && item_start && is_ident(b) => {
                    let end = ident_end(bytes, j);
                    out.insert(code[j..end].to_owned());
                    item_start = false;
                    j = end;
                    continue;
                }
                _ => {}
            }
            j += 1;
        }
        return j;
    }
    let end = ident_end(bytes, i);
    if end > i {
        out.insert(code[i..end].to_owned());
    }
    end
}

fn ident_end(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && is_ident(bytes[i]) {
        i += 1;
    }
    i
}

/// `text` with `//` and `/* */` comments blanked (doc comments included;
/// string literals are kept as they are, a `//` inside one cuts the line,
/// which only loses text).
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let line_c = rest.find("//");
        let block_c = rest.find("/*");
        match (line_c, block_c) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                let end = rest.find('\n').unwrap_or(rest.len());
                rest = &rest[end..];
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                rest = &rest[b + 2..];
                let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
                rest = &rest[end..];
            }
            _ => {
                out.push_str(rest);
                rest = "";
            }
        }
    }
    out
}

/// `code` without the bodies of `#[cfg(test)] mod name { ... }`: tests may
/// reach anywhere in their crate.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_mod = trimmed.starts_with("mod ") || trimmed.starts_with("pub mod ");
        let open = trimmed.find(['{', ';']);
        match open {
            Some(o) if is_mod && trimmed.as_bytes()[o] == b'{' => {
                let body = &trimmed[o..];
                let mut depth = 0usize;
                let mut end = body.len();
                for (k, c) in body.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                rest = &body[end..];
            }
            _ => rest = after,
        }
    }
    out.push_str(rest);
    out
}

/// The strongly connected components of `graph` that hold a cycle through
/// more than two modules, each sorted, in a stable order (Tarjan's
/// algorithm). A module that only pairs up with others (`a <-> b`,
/// `a <-> c`) makes a component of three with no such cycle.
pub fn loops_of(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct Tarjan<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<BTreeSet<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.graph.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = BTreeSet::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.insert(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 2 && has_long_cycle(self.graph, &component) {
                    self.out.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

/// Whether a simple cycle of more than two modules runs inside `members`.
fn has_long_cycle(graph: &Graph, members: &BTreeSet<String>) -> bool {
    fn back_to<'a>(
        graph: &'a Graph,
        members: &BTreeSet<String>,
        start: &str,
        at: &'a str,
        path: &mut Vec<&'a str>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == start && path.len() > 2 {
                return true;
            }
            if members.contains(next) && next != start && !path.contains(&next.as_str()) {
                path.push(next);
                if back_to(graph, members, start, next, path) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    members
        .iter()
        .any(|s| back_to(graph, members, s, s, &mut vec![s.as_str()]))
}

/// The allowlist's entries: `crate: module module ...` per line, `#`
/// comments and blank lines ignored.
pub fn parse_allowlist(text: &str) -> BTreeMap<String, Vec<BTreeSet<String>>> {
    let mut out: BTreeMap<String, Vec<BTreeSet<String>>> = BTreeMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default().trim();
        let Some((krate, modules)) = line.split_once(':') else {
            continue;
        };
        out.entry(krate.trim().to_owned())
            .or_default()
            .push(modules.split_whitespace().map(str::to_owned).collect());
    }
    out
}

/// The allowlist line for a loop.
fn entry(krate: &str, members: &BTreeSet<String>) -> String {
    format!(
        "{krate}: {}",
        members.iter().cloned().collect::<Vec<_>>().join(" ")
    )
}

/// How the loop's members reference each other, for the message.
fn edges_within(graph: &Graph, members: &BTreeSet<String>) -> String {
    members
        .iter()
        .map(|m| {
            let to: Vec<&str> = graph
                .get(m)
                .into_iter()
                .flatten()
                .filter(|t| members.contains(*t))
                .map(String::as_str)
                .collect();
            format!("{m}.rs -> {}", to.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Compares the loops found (per crate, with the crate's graph) with the
/// allowlist: a loop must equal an entry; a loop inside an entry means the
/// entry must shrink; an entry that matches no loop must go.
#[allow(clippy::type_complexity)]
pub fn compare(
    found: &BTreeMap<String, Vec<(BTreeSet<String>, Graph)>>,
    allowed: &BTreeMap<String, Vec<BTreeSet<String>>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut used: BTreeSet<String> = BTreeSet::new();
    for (krate, loops) in found {
        let entries = allowed.get(krate).cloned().unwrap_or_default();
        for (members, graph) in loops {
            let line = entry(krate, members);
            if entries.contains(members) {
                used.insert(line);
                continue;
            }
            if let Some(wider) = entries.iter().find(|e| members.is_subset(e)) {
                used.insert(entry(krate, wider));
                problems.push(format!(
                    "import loop in {krate}/src shrank to {} files: replace the line `{}` in {ALLOW_FILE} with `{line}`",
                    members.len(),
                    entry(krate, wider),
                ));
                continue;
            }
            let grown = entries.iter().find(|e| !e.is_disjoint(members));
            problems.push(format!(
                "import loop of {} files in {krate}/src ({}){}: break it (a module may use a sibling that does not use it back), do not list it",
                members.len(),
                edges_within(graph, members),
                match grown {
                    Some(e) => format!(", larger than the known loop `{}`", entry(krate, e)),
                    None => String::new(),
                },
            ));
            if let Some(e) = grown {
                used.insert(entry(krate, e));
            }
        }
    }
    for (krate, entries) in allowed {
        for e in entries {
            let line = entry(krate, e);
            if !used.contains(&line) {
                problems.push(format!(
                    "{ALLOW_FILE} lists `{line}`, a loop the code no longer has: remove the line"
                ));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(from, to)| {
                (
                    (*from).to_owned(),
                    to.iter().map(|t| (*t).to_owned()).collect(),
                )
            })
            .collect()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn loops_of_more_than_two_modules_are_found_and_pairs_are_not() {
        let g = graph(&[
            ("a", &["b"]),
            ("b", &["c"]),
            ("c", &["a", "d"]),
            ("d", &["e"]),
            ("e", &["d"]),
            ("f", &["a"]),
        ]);
        assert_eq!(loops_of(&g), vec![set(&["a", "b", "c"])]);
        let pairs_only = graph(&[("a", &["b"]), ("b", &["a"]), ("c", &["a"])]);
        assert!(loops_of(&pairs_only).is_empty());
        // A star of pairs is one component of three with no loop through three.
        let star = graph(&[("hub", &["a", "b"]), ("a", &["hub"]), ("b", &["hub"])]);
        assert!(loops_of(&star).is_empty());
        // ... until one spoke uses another.
        let star = graph(&[("hub", &["a", "b"]), ("a", &["hub", "b"]), ("b", &["hub"])]);
        assert_eq!(loops_of(&star), vec![set(&["a", "b", "hub"])]);
        let chain = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &[])]);
        assert!(loops_of(&chain).is_empty());
    }

    #[test]
    fn references_read_paths_groups_and_supers_but_not_comments_or_tests() {
        let text = "\
use crate::{manager::Inner, pump::{Pump, x}, error::Result};
use crate::queue::Queue;
// use crate::commented::Out;
/// [`crate::docs`] are comments too
fn f() { crate::ops::run(); let s = my_crate::other; }
use super::sibling::Thing;
use super::super::root_only;
#[cfg(test)]
mod tests {
    use crate::only_in_tests::X;
    fn g() { let _ = {}; }
}
use crate::after_tests;
";
        assert_eq!(
            references(text, 0),
            set(&[
                "after_tests",
                "error",
                "manager",
                "ops",
                "pump",
                "queue",
                "sibling"
            ])
        );
        // One folder down, `super::` is the own module and `super::super::` the root.
        assert_eq!(
            references("use super::own; use super::super::root::X;", 1),
            set(&["root"])
        );
    }

    #[test]
    fn the_allowlist_is_a_ratchet() {
        let g = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"])]);
        let found =
            |members: &[&str]| BTreeMap::from([("k".to_owned(), vec![(set(members), g.clone())])]);
        let allowed = parse_allowlist("# known\nk: a b c\n\n");
        assert_eq!(allowed["k"], vec![set(&["a", "b", "c"])]);

        // The listed loop as it is: fine.
        assert!(compare(&found(&["a", "b", "c"]), &allowed).is_empty());

        // Grown: reported with its edges, the entry counts as used.
        let problems = compare(&found(&["a", "b", "c", "d"]), &allowed);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].contains("import loop of 4 files in k/src")
                && problems[0].contains("a.rs -> b")
                && problems[0].contains("larger than the known loop `k: a b c`"),
            "{problems:#?}"
        );

        // New, in a crate with no entry.
        let problems = compare(
            &BTreeMap::from([("other".to_owned(), vec![(set(&["a", "b", "c"]), g.clone())])]),
            &allowed,
        );
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(problems[0].contains("other/src"), "{problems:#?}");
        assert!(
            problems[1].contains("lists `k: a b c`, a loop the code no longer has"),
            "{problems:#?}"
        );

        // Shrunk: the entry must shrink with it.
        let allowed = parse_allowlist("k: a b c d\n");
        let problems = compare(&found(&["a", "b", "c"]), &allowed);
        assert_eq!(
            problems,
            vec![format!(
                "import loop in k/src shrank to 3 files: replace the line `k: a b c d` in {ALLOW_FILE} with `k: a b c`"
            )]
        );
    }
}
