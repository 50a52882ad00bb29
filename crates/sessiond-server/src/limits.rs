//! What a caller may make sessiond do: which hosts a remote session may
//! point sessiond at (`executors.remote.allowed_hosts`, against SSRF), and
//! how many watch streams are open at once (`limits.*`, globally and per
//! API token).

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use crate::error::ApiError;

/// Hosts remote agentctl URLs may name: host names (exact, or `*.suffix`
/// for any name under it) and IP networks (`10.0.0.0/8`, `::1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    names: Vec<String>,
    nets: Vec<(IpAddr, u8)>,
    /// As configured, for messages.
    listed: Vec<String>,
}

/// The default: loopback only (an agentctl on this machine, e.g. behind an
/// SSH tunnel). Other hosts must be listed by the operator.
pub const DEFAULT_ALLOWED_HOSTS: &[&str] = &["localhost", "127.0.0.0/8", "::1"];

fn normal_name(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

impl AllowedHosts {
    /// Parses the configured entries; an error names the entry's index.
    pub fn parse(entries: &[String]) -> Result<Self, (usize, String)> {
        let mut hosts = AllowedHosts::default();
        for (i, entry) in entries.iter().enumerate() {
            let e = entry.trim();
            if e.is_empty() {
                return Err((i, "must not be empty".into()));
            }
            if let Some((ip, bits)) = e.split_once('/') {
                let ip: IpAddr = ip
                    .parse()
                    .map_err(|_| (i, format!("{e:?} is not an IP network (address/bits)")))?;
                let max = if ip.is_ipv4() { 32 } else { 128 };
                let bits: u8 = bits
                    .parse()
                    .ok()
                    .filter(|b| *b <= max)
                    .ok_or_else(|| (i, format!("{e:?}: prefix length must be 0 to {max}")))?;
                if bits == 0 {
                    return Err((
                        i,
                        format!("{e:?} allows every address; list the networks agentctls run in"),
                    ));
                }
                // An IPv4-mapped IPv6 network (`::ffff:a.b.c.d/n`) is the
                // IPv4 network it maps: addresses are compared canonical.
                let (ip, bits) = match (ip, ip.to_canonical()) {
                    (IpAddr::V6(_), v4 @ IpAddr::V4(_)) if bits >= 96 => (v4, bits - 96),
                    (ip, _) => (ip, bits),
                };
                if bits == 0 {
                    return Err((
                        i,
                        format!(
                            "{e:?} allows every IPv4 address; list the networks agentctls run in"
                        ),
                    ));
                }
                hosts.nets.push((ip, bits));
            } else if let Ok(ip) = e.trim_matches(['[', ']']).parse::<IpAddr>() {
                let bits = if ip.to_canonical().is_ipv4() { 32 } else { 128 };
                hosts.nets.push((ip.to_canonical(), bits));
            } else {
                let name = normal_name(e);
                let label = name.strip_prefix("*.").unwrap_or(&name);
                if label.is_empty()
                    || label.contains('*')
                    || !label
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
                {
                    return Err((
                        i,
                        format!("{e:?} is not a host name, `*.domain`, address or network"),
                    ));
                }
                // `*.com` is every name under a top-level domain: as good as
                // `*` for SSRF. (Deeper public suffixes such as `*.co.uk`
                // are not known here; see docs/SECURITY.md.)
                if name.starts_with("*.") && !label.contains('.') {
                    return Err((
                        i,
                        format!(
                            "{e:?} allows every name under the top-level domain {label:?}; \
                             list the hosts, or a domain of yours (`*.agents.example.com`)"
                        ),
                    ));
                }
                hosts.names.push(name);
            }
            hosts.listed.push(e.to_owned());
        }
        // Several networks may together be `/0`: `0.0.0.0/1` and
        // `128.0.0.0/1` allow every IPv4 address as surely as `0.0.0.0/0`.
        for (family, last) in [(Family::V4, u128::from(u32::MAX)), (Family::V6, u128::MAX)] {
            let ranges: Vec<(u128, u128)> = hosts
                .nets
                .iter()
                .filter_map(|(ip, bits)| range(*ip, *bits).filter(|(f, ..)| *f == family))
                .map(|(_, start, end)| (start, end))
                .collect();
            if covers(ranges, last) {
                let (index, _) = entries
                    .iter()
                    .enumerate()
                    .rev()
                    .find(|(_, e)| e.contains('/') || e.trim().parse::<IpAddr>().is_ok())
                    .unwrap_or((entries.len().saturating_sub(1), &String::new()));
                return Err((
                    index,
                    format!(
                        "the networks listed ({}) together allow every {} address; list the \
                         networks agentctls run in",
                        hosts
                            .nets
                            .iter()
                            .filter(|(ip, _)| ip.is_ipv4() == (family == Family::V4))
                            .map(|(ip, bits)| format!("{ip}/{bits}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        if family == Family::V4 { "IPv4" } else { "IPv6" },
                    ),
                ));
            }
        }
        Ok(hosts)
    }

    fn allows_ip(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|(net, bits)| {
            match (
                range(*net, *bits),
                range(ip, if ip.is_ipv4() { 32 } else { 128 }),
            ) {
                (Some((f, start, end)), Some((g, a, _))) => f == g && start <= a && a <= end,
                _ => false,
            }
        })
    }

    fn allows_name(&self, name: &str) -> bool {
        let name = normal_name(name);
        self.names.iter().any(|n| match n.strip_prefix("*.") {
            Some(suffix) => name
                .strip_suffix(suffix)
                .is_some_and(|head| head.ends_with('.') && head.len() > 1),
            None => *n == name,
        })
    }

    /// Whether `url` (an `http(s)://` agentctl URL) names an allowed host.
    /// The message says what to change.
    pub fn check(&self, url: &str) -> Result<(), String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("remote_url: not a URL ({e})"))?;
        let authority = uri
            .authority()
            .ok_or_else(|| "remote_url: has no host".to_owned())?;
        if authority.as_str().contains('@') {
            return Err("remote_url: must not carry user information".into());
        }
        let host = authority.host().trim_matches(['[', ']']);
        let allowed = match host.parse::<IpAddr>() {
            Ok(ip) => self.allows_ip(ip),
            Err(_) => self.allows_name(host),
        };
        if allowed {
            Ok(())
        } else {
            Err(format!(
                "remote_url: host {host:?} is not in executors.remote.allowed_hosts ({}); \
                 an operator must list the agentctl's host or network",
                if self.listed.is_empty() {
                    "empty: remote sessions are off".to_owned()
                } else {
                    self.listed.join(", ")
                }
            ))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// The first and last address of `ip/bits`, as numbers; `None` for a
/// prefix longer than the family's.
fn range(ip: IpAddr, bits: u8) -> Option<(Family, u128, u128)> {
    match ip {
        IpAddr::V4(a) => {
            let host = u32::MAX.checked_shr(u32::from(bits)).unwrap_or(0);
            (bits <= 32).then(|| {
                let start = u32::from(a) & !host;
                (Family::V4, u128::from(start), u128::from(start | host))
            })
        }
        IpAddr::V6(a) => {
            let host = u128::MAX.checked_shr(u32::from(bits)).unwrap_or(0);
            (bits <= 128).then(|| {
                let start = u128::from(a) & !host;
                (Family::V6, start, start | host)
            })
        }
    }
}

/// Whether the inclusive `ranges` together cover `0..=last`.
fn covers(mut ranges: Vec<(u128, u128)>, last: u128) -> bool {
    ranges.sort_unstable();
    let mut next = 0u128;
    for (start, end) in ranges {
        if start > next {
            return false;
        }
        if end >= last {
            return true;
        }
        next = next.max(end + 1);
    }
    false
}

/// Who is calling: the index of the API token that authenticated the call
/// (0 for every call when authentication is off). Set by `auth.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Caller(pub usize);

/// Open watch streams, counted globally and per caller.
#[derive(Debug)]
pub struct WatchLimits {
    max: usize,
    max_per_token: usize,
    open: Mutex<(usize, HashMap<Caller, usize>)>,
}

/// One open stream; dropping it (the stream ends or the client goes away)
/// frees the slot.
#[derive(Debug)]
pub struct WatchPermit {
    limits: Arc<WatchLimits>,
    caller: Caller,
    count: usize,
}

impl WatchLimits {
    pub fn new(max: usize, max_per_token: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            max_per_token,
            open: Mutex::default(),
        })
    }

    pub fn acquire(self: &Arc<Self>, caller: Caller) -> Result<WatchPermit, ApiError> {
        self.acquire_n(caller, 1)
    }

    /// `n` streams at once (a WatchMany call's targets: each is a stream
    /// the server follows), all or none.
    pub fn acquire_n(self: &Arc<Self>, caller: Caller, n: usize) -> Result<WatchPermit, ApiError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let (total, per) = &mut *open;
        if *total + n > self.max {
            return Err(ApiError::LimitReached(format!(
                "watch streams: the limit of {} open streams (limits.max_watch_streams) is \
                 reached ({} open, {n} asked for); close a stream or retry later",
                self.max, *total
            )));
        }
        let mine = per.entry(caller).or_default();
        if *mine + n > self.max_per_token {
            let have = *mine;
            if have == 0 {
                per.remove(&caller);
            }
            return Err(ApiError::LimitReached(format!(
                "watch streams: this token has {have} open streams and asks for {n}, past the \
                 limit of {} (limits.max_watch_streams_per_token); close some first",
                self.max_per_token
            )));
        }
        *mine += n;
        *total += n;
        Ok(WatchPermit {
            limits: self.clone(),
            caller,
            count: n,
        })
    }
}

impl WatchPermit {
    /// One permit per stream it counts, each freeing its own slot when
    /// dropped: a WatchMany target that ended gives its slot back while
    /// the call goes on.
    pub fn split(mut self) -> Vec<WatchPermit> {
        let count = std::mem::take(&mut self.count);
        (0..count)
            .map(|_| WatchPermit {
                limits: self.limits.clone(),
                caller: self.caller,
                count: 1,
            })
            .collect()
    }
}

impl Drop for WatchPermit {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().unwrap_or_else(|e| e.into_inner());
        let (total, per) = &mut *open;
        *total = total.saturating_sub(self.count);
        if let Some(n) = per.get_mut(&self.caller) {
            *n = n.saturating_sub(self.count);
            if *n == 0 {
                per.remove(&self.caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(entries: &[&str]) -> AllowedHosts {
        AllowedHosts::parse(&entries.iter().map(|e| (*e).to_owned()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn default_allows_loopback_only() {
        let h = hosts(DEFAULT_ALLOWED_HOSTS);
        for ok in [
            "http://127.0.0.1:7000",
            "https://127.9.9.9:1",
            "http://[::1]:7000",
            "http://localhost:1",
            "http://LOCALHOST.:1",
            "http://[::ffff:127.0.0.1]:1",
        ] {
            assert!(h.check(ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://169.254.169.254/",
            "http://10.0.0.1:7000",
            "http://evil.example:80",
            "http://2130706433:80",
            "http://localhost.evil.example:1",
            "http://user@127.0.0.1:1",
            "http://[::2]:1",
        ] {
            let err = h.check(bad).unwrap_err();
            assert!(err.starts_with("remote_url:"), "{bad}: {err}");
        }
    }

    #[test]
    fn names_wildcards_and_networks() {
        let h = hosts(&[
            "agents.example.com",
            "*.build.example",
            "10.1.0.0/16",
            "fd00::/8",
        ]);
        assert!(h.check("https://agents.example.com:443").is_ok());
        assert!(h.check("https://a.b.build.example:1").is_ok());
        assert!(h.check("https://build.example:1").is_err());
        assert!(h.check("https://xbuild.example:1").is_err());
        assert!(h.check("http://10.1.200.3:1").is_ok());
        assert!(h.check("http://10.2.0.1:1").is_err());
        assert!(h.check("http://[fd12::1]:1").is_ok());
        assert!(h.check("http://[fe80::1]:1").is_err());
        for bad in ["", "0.0.0.0/0", "10.0.0.0/33", "a*b", "*.", "x y"] {
            assert!(AllowedHosts::parse(&[bad.to_owned()]).is_err(), "{bad:?}");
        }
        let none = hosts(&[]);
        assert!(
            none.check("http://127.0.0.1:1")
                .unwrap_err()
                .contains("off")
        );
    }

    /// Allow-lists that amount to "anywhere" are refused however they are
    /// spelled: networks that together cover a family, an IPv4-mapped
    /// `/96`, a wildcard of a top-level domain.
    #[test]
    fn lists_that_allow_everything_are_refused() {
        for (list, index, says) in [
            (&["0.0.0.0/1", "128.0.0.0/1"][..], 1, "every IPv4 address"),
            (
                &["10.0.0.0/8", "0.0.0.0/2", "64.0.0.0/2", "128.0.0.0/1"][..],
                3,
                "every IPv4",
            ),
            (&["::/1", "8000::/1"][..], 1, "every IPv6 address"),
            (&["::ffff:0.0.0.0/96"][..], 0, "every IPv4 address"),
            (
                &["::ffff:0.0.0.0/97", "128.0.0.0/1"][..],
                1,
                "every IPv4 address",
            ),
            (&["*.com"][..], 0, "top-level domain"),
            (&["localhost", "*.internal"][..], 1, "top-level domain"),
        ] {
            let entries: Vec<String> = list.iter().map(|e| (*e).to_owned()).collect();
            let (i, message) = AllowedHosts::parse(&entries).unwrap_err();
            assert_eq!(i, index, "{list:?}: {message}");
            assert!(message.contains(says), "{list:?}: {message}");
        }
        // Close to everything, not everything: accepted and exact.
        let h = hosts(&[
            "0.0.0.0/1",
            "128.0.0.0/2",
            "*.example.com",
            "::ffff:10.0.0.0/104",
        ]);
        assert!(h.check("http://127.255.255.255:1").is_ok());
        assert!(h.check("http://191.255.255.255:1").is_ok());
        assert!(h.check("http://192.0.0.1:1").is_err());
        assert!(h.check("http://10.1.2.3:1").is_ok());
        assert!(h.check("http://[::ffff:10.9.9.9]:1").is_ok());
        assert!(h.check("https://a.example.com:1").is_ok());
    }

    #[test]
    fn watch_limits_global_and_per_caller() {
        let l = WatchLimits::new(3, 2);
        let a1 = l.acquire(Caller(1)).unwrap();
        let _a2 = l.acquire(Caller(1)).unwrap();
        let e = l.acquire(Caller(1)).unwrap_err();
        assert!(
            matches!(&e, ApiError::LimitReached(m) if m.contains("max_watch_streams_per_token"))
        );
        let _b1 = l.acquire(Caller(2)).unwrap();
        let e = l.acquire(Caller(3)).unwrap_err();
        assert!(
            matches!(&e, ApiError::LimitReached(m) if m.contains("(limits.max_watch_streams)"))
        );
        drop(a1);
        let _c = l.acquire(Caller(3)).unwrap();
    }

    /// A WatchMany call takes a slot per target, all or none, and gives
    /// them all back.
    #[test]
    fn watch_limits_count_each_target() {
        let l = WatchLimits::new(10, 4);
        let e = l.acquire_n(Caller(1), 5).unwrap_err();
        assert!(
            matches!(&e, ApiError::LimitReached(m) if m.contains("asks for 5")),
            "{e:?}"
        );
        let many = l.acquire_n(Caller(1), 4).unwrap();
        assert!(l.acquire(Caller(1)).is_err());
        let _other = l.acquire_n(Caller(2), 4).unwrap();
        let e = l.acquire_n(Caller(3), 3).unwrap_err();
        assert!(
            matches!(&e, ApiError::LimitReached(m) if m.contains("(limits.max_watch_streams)"))
        );
        drop(many);
        let _again = l.acquire_n(Caller(1), 4).unwrap();
    }
}
