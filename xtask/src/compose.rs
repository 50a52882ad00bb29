//! The deployment example `deploy/compose.yaml` (N sessiond replicas, one
//! PostgreSQL, envoy in front) must stay valid and true to the server's
//! real settings, though CI cannot run Docker Compose (no bridge networks
//! here): its tests parse it and `deploy/envoy.yaml` with a small parser of
//! the YAML subset they use (block maps and lists, flow lists of scalars,
//! quoted scalars, comments; no anchors, no multi-line scalars: anything
//! else is an error), then check every replica's environment against the
//! `SESSIOND_*` variables `sessiond serve` reads (its clap `env` names in
//! crates/sessiond-server/src/config.rs) and against each other.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub enum Yaml {
    Map(Vec<(String, Yaml)>),
    List(Vec<Yaml>),
    Str(String),
    Null,
}

impl Yaml {
    pub fn get(&self, key: &str) -> Option<&Yaml> {
        match self {
            Yaml::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn str(&self) -> Option<&str> {
        match self {
            Yaml::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn entries(&self) -> &[(String, Yaml)] {
        match self {
            Yaml::Map(e) => e,
            _ => &[],
        }
    }

    pub fn items(&self) -> &[Yaml] {
        match self {
            Yaml::List(l) => l,
            _ => &[],
        }
    }
}

struct Line {
    no: usize,
    indent: usize,
    text: String,
}

/// Parses the YAML subset described in the module docs.
pub fn parse(text: &str) -> Result<Yaml, String> {
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let no = i + 1;
        let body = strip_comment(raw);
        if body.trim().is_empty() {
            continue;
        }
        let indent = body.len() - body.trim_start_matches(' ').len();
        if body[indent..].starts_with('\t') {
            return Err(format!("line {no}: a tab in the indentation"));
        }
        let t = body.trim();
        if t.starts_with('&') || t.starts_with('*') || t.contains(": &") || t.contains(": *") {
            return Err(format!("line {no}: anchors and aliases are not used here"));
        }
        if t.ends_with('|') || t.ends_with('>') || t == "---" {
            return Err(format!(
                "line {no}: multi-line scalars and documents are not used here"
            ));
        }
        lines.push(Line {
            no,
            indent,
            text: t.to_owned(),
        });
    }
    if lines.is_empty() {
        return Ok(Yaml::Null);
    }
    let mut i = 0;
    let indent = lines[0].indent;
    let value = block(&mut lines, &mut i, indent)?;
    if let Some(l) = lines.get(i) {
        return Err(format!("line {}: unexpected indentation", l.no));
    }
    Ok(value)
}

/// Removes a comment: `#` at the start or after a space, outside quotes.
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev == ' ' => return &line[..i],
            _ => {}
        }
        prev = c;
    }
    line
}

fn is_item(text: &str) -> bool {
    text == "-" || text.starts_with("- ")
}

fn block(lines: &mut Vec<Line>, i: &mut usize, indent: usize) -> Result<Yaml, String> {
    if is_item(&lines[*i].text) {
        list(lines, i, indent)
    } else {
        map(lines, i, indent)
    }
}

fn list(lines: &mut Vec<Line>, i: &mut usize, indent: usize) -> Result<Yaml, String> {
    let mut items = Vec::new();
    while *i < lines.len() && lines[*i].indent == indent && is_item(&lines[*i].text) {
        let rest = lines[*i].text[1..].trim_start().to_owned();
        let no = lines[*i].no;
        if rest.is_empty() {
            *i += 1;
            match lines.get(*i) {
                Some(next) if next.indent > indent => {
                    let d = next.indent;
                    items.push(block(lines, i, d)?);
                }
                _ => items.push(Yaml::Null),
            }
        } else if split_key(&rest).is_some() {
            // `- key: value`: a map whose first entry shares the dash's line.
            let d = indent + (lines[*i].text.len() - rest.len());
            lines[*i] = Line {
                no,
                indent: d,
                text: rest,
            };
            items.push(map(lines, i, d)?);
        } else {
            items.push(scalar(&rest, no)?);
            *i += 1;
        }
    }
    Ok(Yaml::List(items))
}

fn map(lines: &mut Vec<Line>, i: &mut usize, indent: usize) -> Result<Yaml, String> {
    let mut entries: Vec<(String, Yaml)> = Vec::new();
    while *i < lines.len() && lines[*i].indent == indent {
        let no = lines[*i].no;
        let text = lines[*i].text.clone();
        if is_item(&text) {
            return Err(format!("line {no}: a list item among map keys"));
        }
        let (key, value) =
            split_key(&text).ok_or_else(|| format!("line {no}: not `key: value`"))?;
        if entries.iter().any(|(k, _)| *k == key) {
            return Err(format!("line {no}: duplicate key {key:?}"));
        }
        *i += 1;
        let value = if value.is_empty() {
            match lines.get(*i) {
                Some(next) if next.indent > indent => {
                    let d = next.indent;
                    block(lines, i, d)?
                }
                // A list may sit at its key's indentation.
                Some(next) if next.indent == indent && is_item(&next.text) => {
                    list(lines, i, indent)?
                }
                _ => Yaml::Null,
            }
        } else {
            scalar(value, no)?
        };
        entries.push((key, value));
    }
    if let Some(l) = lines.get(*i)
        && l.indent > indent
    {
        return Err(format!("line {}: unexpected indentation", l.no));
    }
    Ok(Yaml::Map(entries))
}

/// `key: value` or `key:` (the key possibly quoted).
fn split_key(text: &str) -> Option<(String, &str)> {
    let (key, rest) = if let Some(q) = text.chars().next().filter(|c| *c == '"' || *c == '\'') {
        let end = text[1..].find(q)? + 1;
        (text[1..end].to_owned(), &text[end + 1..])
    } else {
        let at = text
            .find(": ")
            .or_else(|| text.ends_with(':').then(|| text.len() - 1))?;
        let key = &text[..at];
        if key.is_empty() || key.contains(['[', '{', '"', '\'']) {
            return None;
        }
        (key.to_owned(), &text[at..])
    };
    let rest = rest.strip_prefix(':')?;
    if !rest.is_empty() && !rest.starts_with(' ') {
        return None;
    }
    Some((key, rest.trim()))
}

fn scalar(text: &str, no: usize) -> Result<Yaml, String> {
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| format!("line {no}: an unclosed flow list"))?;
        let mut items = Vec::new();
        for part in split_flow(inner, no)? {
            items.push(scalar(&part, no)?);
        }
        return Ok(Yaml::List(items));
    }
    if text == "{}" {
        return Ok(Yaml::Map(Vec::new()));
    }
    if text.starts_with('{') {
        return Err(format!(
            "line {no}: flow maps other than {{}} are not used here"
        ));
    }
    for q in ['"', '\''] {
        if let Some(inner) = text.strip_prefix(q) {
            let inner = inner
                .strip_suffix(q)
                .ok_or_else(|| format!("line {no}: an unclosed quote"))?;
            return Ok(Yaml::Str(inner.to_owned()));
        }
    }
    if text.contains(": ") {
        return Err(format!("line {no}: a plain scalar with \": \" (quote it)"));
    }
    Ok(Yaml::Str(text.to_owned()))
}

fn split_flow(inner: &str, no: usize) -> Result<Vec<String>, String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    for c in inner.chars() {
        match (c, quote) {
            ('"' | '\'', None) => {
                quote = Some(c);
                cur.push(c);
            }
            (c, Some(q)) if c == q => {
                quote = None;
                cur.push(c);
            }
            (',', None) => parts.push(std::mem::take(&mut cur).trim().to_owned()),
            ('[' | '{', None) => return Err(format!("line {no}: nested flow collections")),
            _ => cur.push(c),
        }
    }
    if quote.is_some() {
        return Err(format!("line {no}: an unclosed quote"));
    }
    if !cur.trim().is_empty() {
        parts.push(cur.trim().to_owned());
    }
    Ok(parts)
}

/// The `SESSIOND_*` variables `sessiond serve` reads: the clap `env = "..."`
/// names in its configuration source.
pub fn server_env_names(config_rs: &str) -> Vec<String> {
    config_rs
        .split("env = \"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .filter(|name| name.starts_with("SESSIOND_"))
        .map(str::to_owned)
        .collect()
}

/// Everything wrong with the compose file (empty: it is consistent).
pub fn check(compose: &Yaml, envoy: &Yaml, env_names: &[String]) -> Vec<String> {
    let mut bad = Vec::new();
    let services = compose.get("services").map(Yaml::entries).unwrap_or(&[]);
    let Some(pg) = compose.get("services").and_then(|s| s.get("postgres")) else {
        return vec!["no `postgres` service".into()];
    };
    let pg_env = |k: &str| {
        pg.get("environment")
            .and_then(|e| e.get(k))
            .and_then(Yaml::str)
            .unwrap_or_default()
            .to_owned()
    };
    let want_db = format!(
        "postgres://{}:{}@postgres:5432/{}",
        pg_env("POSTGRES_USER"),
        pg_env("POSTGRES_PASSWORD"),
        pg_env("POSTGRES_DB")
    );
    let replicas: Vec<&(String, Yaml)> = services
        .iter()
        .filter(|(name, _)| name.starts_with("sessiond-"))
        .collect();
    if replicas.len() < 2 {
        bad.push(format!(
            "{} sessiond replicas; the example runs several",
            replicas.len()
        ));
    }
    let mut ttls = BTreeMap::new();
    let mut data_volumes = BTreeMap::new();
    let mut addresses = Vec::new();
    for (name, svc) in &replicas {
        let env = svc.get("environment").map(Yaml::entries).unwrap_or(&[]);
        let var = |k: &str| {
            env.iter()
                .find(|(key, _)| key == k)
                .and_then(|(_, v)| v.str())
                .map(str::to_owned)
        };
        for (key, value) in env {
            if !env_names.contains(key) {
                bad.push(format!(
                    "{name}: {key} is not a sessiond setting (sessiond serve --help)"
                ));
            }
            if value.str().is_none() {
                bad.push(format!("{name}: {key} has no string value"));
            }
        }
        for required in [
            "SESSIOND_DATABASE_URL",
            "SESSIOND_LISTEN",
            "SESSIOND_REPLICA_ID",
            "SESSIOND_ADVERTISE_ADDRESS",
            "SESSIOND_LEASE_TTL",
            "SESSIOND_API_TOKENS",
            "SESSIOND_DATA_DIR",
        ] {
            if var(required).is_none() {
                bad.push(format!("{name}: {required} is not set"));
            }
        }
        if var("SESSIOND_REPLICA_ID").as_deref() != Some(name.as_str()) {
            bad.push(format!(
                "{name}: SESSIOND_REPLICA_ID should be the service name (unique, stable)"
            ));
        }
        let port = var("SESSIOND_LISTEN")
            .and_then(|l| l.rsplit_once(':').map(|(_, p)| p.to_owned()))
            .unwrap_or_default();
        let advertised = format!("{name}:{port}");
        if var("SESSIOND_ADVERTISE_ADDRESS").as_deref() != Some(advertised.as_str()) {
            bad.push(format!(
                "{name}: SESSIOND_ADVERTISE_ADDRESS should be {advertised} (where other \
                 replicas and clients reach it)"
            ));
        }
        addresses.push(advertised);
        if var("SESSIOND_DATABASE_URL").as_deref() != Some(want_db.as_str()) {
            bad.push(format!(
                "{name}: SESSIOND_DATABASE_URL should be {want_db} (the postgres service)"
            ));
        }
        match var("SESSIOND_LEASE_TTL") {
            Some(ttl) if is_duration(&ttl) => {
                ttls.insert(name.clone(), ttl);
            }
            other => bad.push(format!(
                "{name}: SESSIOND_LEASE_TTL {other:?} is not a duration"
            )),
        }
        if let Some(dir) = var("SESSIOND_DATA_DIR") {
            let mounted = svc
                .get("volumes")
                .map(Yaml::items)
                .unwrap_or(&[])
                .iter()
                .filter_map(Yaml::str)
                .find_map(|v| {
                    let (src, rest) = v.split_once(':')?;
                    (rest.split(':').next() == Some(dir.as_str())).then(|| src.to_owned())
                });
            match mounted {
                Some(src) => {
                    if let Some(other) = data_volumes.insert(src.clone(), name.clone()) {
                        bad.push(format!(
                            "{name} and {other} share the data volume {src}; each replica needs its own"
                        ));
                    }
                }
                None => bad.push(format!("{name}: no volume on its data_dir {dir}")),
            }
        }
        let depends = svc.get("depends_on");
        let on_pg = match depends {
            Some(Yaml::List(l)) => l.iter().any(|x| x.str() == Some("postgres")),
            Some(m @ Yaml::Map(_)) => m.get("postgres").is_some(),
            _ => false,
        };
        if !on_pg {
            bad.push(format!("{name}: does not depend on postgres"));
        }
    }
    let distinct: std::collections::BTreeSet<&String> = ttls.values().collect();
    if distinct.len() > 1 {
        bad.push(format!("replicas disagree on the lease TTL: {ttls:?}"));
    }
    // The balancer sends calls to every replica, and only to them.
    let mut endpoints = Vec::new();
    for cluster in envoy
        .get("static_resources")
        .and_then(|s| s.get("clusters"))
        .map(Yaml::items)
        .unwrap_or(&[])
    {
        for group in cluster
            .get("load_assignment")
            .and_then(|l| l.get("endpoints"))
            .map(Yaml::items)
            .unwrap_or(&[])
        {
            for ep in group.get("lb_endpoints").map(Yaml::items).unwrap_or(&[]) {
                let sa = ep
                    .get("endpoint")
                    .and_then(|e| e.get("address"))
                    .and_then(|a| a.get("socket_address"));
                let host = sa.and_then(|s| s.get("address")).and_then(Yaml::str);
                let port = sa.and_then(|s| s.get("port_value")).and_then(Yaml::str);
                if let (Some(h), Some(p)) = (host, port) {
                    endpoints.push(format!("{h}:{p}"));
                }
            }
        }
    }
    endpoints.sort();
    addresses.sort();
    if endpoints != addresses {
        bad.push(format!(
            "envoy.yaml balances over {endpoints:?}, the replicas are {addresses:?}"
        ));
    }
    bad
}

/// sessiond's duration syntax: a number and ms, s, m or h.
fn is_duration(s: &str) -> bool {
    ["ms", "s", "m", "h"].iter().any(|unit| {
        s.strip_suffix(unit)
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf()
    }

    fn read(rel: &str) -> String {
        std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
    }

    #[test]
    fn the_compose_example_is_valid_and_matches_the_server_settings() {
        let compose = parse(&read("deploy/compose.yaml")).expect("deploy/compose.yaml");
        let envoy = parse(&read("deploy/envoy.yaml")).expect("deploy/envoy.yaml");
        let names = server_env_names(&read("crates/sessiond-server/src/config.rs"));
        for n in [
            "SESSIOND_REPLICA_ID",
            "SESSIOND_ADVERTISE_ADDRESS",
            "SESSIOND_LEASE_TTL",
            "SESSIOND_DATABASE_URL",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} not found in config.rs");
        }
        let bad = check(&compose, &envoy, &names);
        assert!(bad.is_empty(), "deploy/compose.yaml:\n{}", bad.join("\n"));
        // Files the services mount from deploy/.
        for svc in compose.get("services").unwrap().entries() {
            for v in svc.1.get("volumes").map(Yaml::items).unwrap_or(&[]) {
                if let Some(local) = v.str().and_then(|v| v.strip_prefix("./")) {
                    let file = local.split(':').next().unwrap();
                    assert!(
                        root().join("deploy").join(file).is_file(),
                        "{}: mounts deploy/{file}, which does not exist",
                        svc.0
                    );
                }
            }
        }
    }

    #[test]
    fn the_check_finds_what_is_wrong() {
        let names = vec![
            "SESSIOND_DATABASE_URL".to_owned(),
            "SESSIOND_LISTEN".to_owned(),
            "SESSIOND_REPLICA_ID".to_owned(),
            "SESSIOND_ADVERTISE_ADDRESS".to_owned(),
            "SESSIOND_LEASE_TTL".to_owned(),
            "SESSIOND_API_TOKENS".to_owned(),
            "SESSIOND_DATA_DIR".to_owned(),
        ];
        let compose = parse(
            "services:\n  postgres:\n    environment:\n      POSTGRES_USER: u\n      \
             POSTGRES_PASSWORD: p\n      POSTGRES_DB: d\n  sessiond-1:\n    environment:\n      \
             SESSIOND_DATABASE_URL: postgres://u:p@postgres:5432/d\n      \
             SESSIOND_LISTEN: 0.0.0.0:1\n      SESSIOND_REPLICA_ID: sessiond-1\n      \
             SESSIOND_ADVERTISE_ADDRESS: sessiond-1:1\n      SESSIOND_LEASE_TTL: 5s\n      \
             SESSIOND_API_TOKENS: t\n      SESSIOND_DATA_DIR: /d\n    volumes:\n      - a:/d\n    \
             depends_on: [postgres]\n  sessiond-2:\n    environment:\n      \
             SESSIOND_DATABASE_URL: postgres://u:p@db:5432/d\n      SESSIOND_LISTEN: 0.0.0.0:1\n      \
             SESSIOND_REPLICA_ID: sessiond-1\n      SESSIOND_ADVERTISE_ADDRESS: localhost:1\n      \
             SESSIOND_LEASE_TTL: soon\n      SESSIOND_LEASE_TIME: 5s\n      SESSIOND_DATA_DIR: /d\n    \
             volumes:\n      - a:/d\n",
        )
        .unwrap();
        let envoy = parse(
            "static_resources:\n  clusters:\n    - name: x\n      load_assignment:\n        \
             endpoints:\n          - lb_endpoints:\n              - endpoint:\n                  \
             address:\n                    socket_address:\n                      \
             address: sessiond-1\n                      port_value: 1\n",
        )
        .unwrap();
        let bad = check(&compose, &envoy, &names).join("\n");
        for want in [
            "sessiond-2: SESSIOND_LEASE_TIME is not a sessiond setting",
            "sessiond-2: SESSIOND_API_TOKENS is not set",
            "sessiond-2: SESSIOND_REPLICA_ID should be the service name",
            "sessiond-2: SESSIOND_ADVERTISE_ADDRESS should be sessiond-2:1",
            "sessiond-2: SESSIOND_DATABASE_URL should be postgres://u:p@postgres:5432/d",
            "sessiond-2: SESSIOND_LEASE_TTL Some(\"soon\") is not a duration",
            "share the data volume a",
            "sessiond-2: does not depend on postgres",
            "envoy.yaml balances over [\"sessiond-1:1\"]",
        ] {
            assert!(bad.contains(want), "missing {want:?} in:\n{bad}");
        }
    }

    #[test]
    fn the_parser_reads_the_subset_and_refuses_the_rest() {
        let y = parse(
            "# c\na:\n  b: \"x # not a comment\" # a comment\n  c: [\"1\", two]\n  d:\n  - e: 1\n    \
             f: 2\n  - plain\n  g: {}\n'h': ''\n",
        )
        .unwrap();
        assert_eq!(
            y.get("a").unwrap().get("b").unwrap().str(),
            Some("x # not a comment")
        );
        assert_eq!(
            y.get("a").unwrap().get("c").unwrap(),
            &Yaml::List(vec![Yaml::Str("1".into()), Yaml::Str("two".into())])
        );
        let d = y.get("a").unwrap().get("d").unwrap().items();
        assert_eq!(d[0].get("f").unwrap().str(), Some("2"));
        assert_eq!(d[1].str(), Some("plain"));
        assert_eq!(y.get("a").unwrap().get("g"), Some(&Yaml::Map(vec![])));
        assert_eq!(y.get("h").unwrap().str(), Some(""));
        for bad in [
            "a: 1\na: 2\n",
            "a:\n\t b: 1\n",
            "a: &x 1\n",
            "a: |\n  text\n",
            "a:\n    b: 1\n  c: 2\n",
            "a: [1, [2]]\n",
            "a: \"open\n",
            "just text\n",
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }
}
