//! Relative links in the repository's markdown lead somewhere.
//!
//! Every `[text](target)` and `[label]: target` in `README.md`,
//! `docs/**/*.md` and `crates/*/README.md` whose target is not a URL must
//! name a file or folder that exists, relative to the markdown file; a
//! `#fragment` into a markdown file (or into the file itself) must name one
//! of its headings, as GitHub makes anchors of them.

use std::collections::BTreeSet;
use std::path::Path;

/// Whether a tracked file is one whose links are checked.
pub fn checked(file: &str) -> bool {
    file == "README.md"
        || (file.starts_with("docs/") && file.ends_with(".md"))
        || (file.starts_with("crates/")
            && file.ends_with("/README.md")
            && file.matches('/').count() == 2)
}

/// The broken links of the markdown file `file` (relative to `root`).
pub fn check_file(root: &Path, file: &str, text: &str) -> Vec<String> {
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for (line, target) in links_in(text) {
        let (path, fragment) = match target.split_once('#') {
            Some((p, f)) => (p, Some(f)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            Path::new(file).to_path_buf()
        } else {
            normalize(&dir.join(path))
        };
        let full = root.join(&resolved);
        if !path.is_empty() && !full.exists() {
            problems.push(format!(
                "{file}:{line}: links to {target:?}, but {} does not exist",
                resolved.display()
            ));
            continue;
        }
        let Some(fragment) = fragment else { continue };
        if fragment.is_empty() || !resolved.to_string_lossy().ends_with(".md") {
            continue;
        }
        let target_text = if path.is_empty() {
            text.to_owned()
        } else {
            std::fs::read_to_string(&full).unwrap_or_default()
        };
        if !anchors(&target_text).contains(fragment) {
            problems.push(format!(
                "{file}:{line}: links to {target:?}, but {} has no heading with the anchor #{fragment}",
                resolved.display()
            ));
        }
    }
    problems
}

/// `a/./b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> std::path::PathBuf {
    let mut out = std::path::PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The relative link targets of a markdown text with their line numbers:
/// inline links and images, and reference definitions; code blocks and code
/// spans are not markdown, and URLs (`scheme:`) are not relative.
pub fn links_in(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(f) = fence {
            if trimmed.starts_with(f) {
                fence = None;
            }
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = Some(&trimmed[..3]);
            continue;
        }
        let line_no = i + 1;
        let code = without_code_spans(line);
        // A reference definition: `[label]: target`.
        if let Some(rest) = code.trim_start().strip_prefix('[')
            && let Some((_, def)) = rest.split_once("]:")
        {
            if let Some(target) = def.split_whitespace().next() {
                push_target(&mut out, line_no, target);
            }
            continue;
        }
        let mut rest = code.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = closing_paren(after) else {
                break;
            };
            let inner = after[..end].trim();
            // `<target with spaces>`, or a target followed by a "title".
            let target = match inner.strip_prefix('<') {
                Some(angled) => angled.split('>').next().unwrap_or_default(),
                None => inner.split_whitespace().next().unwrap_or_default(),
            };
            push_target(&mut out, line_no, target);
            rest = &after[end..];
        }
    }
    out
}

fn push_target(out: &mut Vec<(usize, String)>, line: usize, target: &str) {
    let is_url = target.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.')
    });
    if target.is_empty() || is_url {
        return;
    }
    out.push((line, target.to_owned()));
}

/// Where the link target's `)` is, counting nested parentheses.
fn closing_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(i),
            ')' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// A line with its code spans (`` `...` ``) blanked.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if in_code {
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// The anchors GitHub gives a markdown text's headings: lower case, spaces
/// to `-`, punctuation other than `-` and `_` dropped, a repeated heading
/// suffixed `-1`, `-2`, ...
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        if fence || !trimmed.starts_with('#') {
            continue;
        }
        let heading = trimmed.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut anchor = slug.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
        out.insert(anchor);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_read_outside_code_and_urls_are_left_alone() {
        let text = "\
See [the map](docs/ARCHITECTURE.md#crates) and ![shot](docs/console.png \"title\").
A [url](https://example.com) and [mail](mailto:a@b.c), `[not](a link)`.
```
[in](a/fence.md)
```
[ref]: ../decisions/README.md
[spaced](<a file.md>) [local](#same-file)
";
        assert_eq!(
            links_in(text),
            vec![
                (1, "docs/ARCHITECTURE.md#crates".to_owned()),
                (1, "docs/console.png".to_owned()),
                (6, "../decisions/README.md".to_owned()),
                (7, "a file.md".to_owned()),
                (7, "#same-file".to_owned()),
            ]
        );
    }

    #[test]
    fn anchors_follow_githubs_rules() {
        let text = "# Architecture\n## `sessiond-store`: SQL\n## Crates\n```\n# not a heading\n```\n## Crates\n#no-space\n";
        assert_eq!(
            anchors(text),
            BTreeSet::from([
                "architecture".to_owned(),
                "sessiond-store-sql".to_owned(),
                "crates".to_owned(),
                "crates-1".to_owned(),
            ])
        );
    }

    #[test]
    fn missing_files_and_headings_are_reported_with_their_line() {
        let root = std::env::temp_dir().join(format!("house-links-{}", std::process::id()));
        let docs = root.join("docs/decisions");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(docs.join("0001-x.md"), "# One\n## Why\n").unwrap();
        let text = "# Map\n[ok](decisions/0001-x.md#why) [dir](decisions/)\n[gone](decisions/0002-y.md)\n[bad](decisions/0001-x.md#how) [self](#map) [self-bad](#nope)\n[up](../README.md)\n";
        let problems = check_file(&root, "docs/ARCHITECTURE.md", text);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(
            problems,
            vec![
                "docs/ARCHITECTURE.md:3: links to \"decisions/0002-y.md\", but docs/decisions/0002-y.md does not exist".to_owned(),
                "docs/ARCHITECTURE.md:4: links to \"decisions/0001-x.md#how\", but docs/decisions/0001-x.md has no heading with the anchor #how".to_owned(),
                "docs/ARCHITECTURE.md:4: links to \"#nope\", but docs/ARCHITECTURE.md has no heading with the anchor #nope".to_owned(),
                "docs/ARCHITECTURE.md:5: links to \"../README.md\", but README.md does not exist".to_owned(),
            ]
        );
        assert!(checked("README.md") && checked("docs/decisions/0001-x.md"));
        assert!(checked("crates/agentctl/README.md") && !checked("web/README.md"));
    }
}
