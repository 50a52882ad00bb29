//! `boundary-probe`: run *inside* an agent's container (or beside a
//! standalone agent) by the boundary tests, it tries what a hostile agent
//! would and prints one `key=value` line per attempt:
//!
//! - `uid`, `gid`, `cap_eff`, `cap_prm`, `cap_bnd`, `no_new_privs` from
//!   `/proc/self/status`;
//! - `af_packet` / `raw_inet`: `opened` or `refused:<errno>` for an
//!   `AF_PACKET` socket (sniffing every frame of an interface) and a raw IPv4
//!   socket;
//! - `connect:<addr>`: `connected` or `failed:<error>` for each `--connect ADDR`
//!   (TCP) and `--connect-unix PATH` (a Unix socket);
//! - `read:<path>`: `readable` or `failed:<error>` for each `--read PATH`;
//! - `interfaces`: the network interfaces it can see (`/sys/class/net`);
//! - `env_keys`: the names of its environment variables.
//!
//! The tests decide what the answers must be; the probe only reports.

// The one libc call: opening sockets of families std has no API for.
#![allow(unsafe_code)]

use std::{io::Read, net::TcpStream, time::Duration};

/// `socket(domain, type, protocol)`: `opened` (and closed again) or
/// `refused:<error>`.
fn try_socket(domain: i32, kind: i32, protocol: i32) -> String {
    // SAFETY: socket(2) takes three integers and touches no memory of ours.
    let fd = unsafe { libc::socket(domain, kind, protocol) };
    if fd < 0 {
        return format!("refused:{}", std::io::Error::last_os_error());
    }
    // SAFETY: fd is a descriptor we just opened and own.
    unsafe { libc::close(fd) };
    "opened".to_owned()
}

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mut lines = vec![
        format!("uid={}", status_field(&status, "Uid:")),
        format!("gid={}", status_field(&status, "Gid:")),
        format!("cap_eff={}", status_field(&status, "CapEff:")),
        format!("cap_prm={}", status_field(&status, "CapPrm:")),
        format!("cap_bnd={}", status_field(&status, "CapBnd:")),
        format!("no_new_privs={}", status_field(&status, "NoNewPrivs:")),
    ];
    lines.push(format!(
        "af_packet={}",
        try_socket(
            libc::AF_PACKET,
            libc::SOCK_RAW,
            i32::from((libc::ETH_P_ALL as u16).to_be())
        )
    ));
    lines.push(format!(
        "raw_inet={}",
        try_socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP)
    ));
    let mut interfaces: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    interfaces.sort();
    lines.push(format!("interfaces={}", interfaces.join(" ")));
    let mut keys: Vec<String> = std::env::vars_os()
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .collect();
    keys.sort();
    lines.push(format!("env_keys={}", keys.join(" ")));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else { break };
        match flag.as_str() {
            "--connect" => {
                let outcome = match value.parse() {
                    Ok(addr) => match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                        Ok(_) => "connected".to_owned(),
                        Err(e) => format!("failed:{e}"),
                    },
                    Err(e) => format!("failed:bad address: {e}"),
                };
                lines.push(format!("connect:{value}={outcome}"));
            }
            "--connect-unix" => {
                let outcome = match std::os::unix::net::UnixStream::connect(value) {
                    Ok(_) => "connected".to_owned(),
                    Err(e) => format!("failed:{e}"),
                };
                lines.push(format!("connect:{value}={outcome}"));
            }
            "--read" => {
                let outcome = match std::fs::File::open(value)
                    .and_then(|mut f| f.read_to_end(&mut Vec::new()))
                {
                    Ok(_) => "readable".to_owned(),
                    Err(e) => format!("failed:{e}"),
                };
                lines.push(format!("read:{value}={outcome}"));
            }
            other => lines.push(format!("unknown_flag={other}")),
        }
    }
    let text = lines.join("\n");
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
}
