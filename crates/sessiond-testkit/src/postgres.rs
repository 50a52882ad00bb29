//! A throwaway PostgreSQL for tests, and a fresh database per test.
//!
//! [`test_database`] is what a test calls: it uses the server named by
//! `DATABASE_URL` when that is set, and otherwise starts one throwaway cluster
//! per test process (shared by the tests of that process), then creates a new,
//! empty database `t_<uuid>` on it. [`start_cluster`] starts a cluster on its
//! own; `cargo xtask ci` can call it once and hand its URL to every test
//! process as `DATABASE_URL`.
//!
//! If PostgreSQL cannot be started, these functions panic with the reason and
//! the server log: a test that needs Postgres fails, it never skips.
//!
//! A cluster never outlives the process that started it. `postgres` runs under
//! a small `sh` supervisor in its own process group that blocks reading a pipe
//! whose only writer is this process; when the pipe closes (on [`Cluster`]'s
//! drop, at normal exit, or when the process is killed, even by `SIGKILL`) the
//! supervisor stops postgres with `pg_ctl stop -m immediate` and removes the
//! cluster's directory.

use std::{
    env,
    ffi::OsStr,
    fmt, fs,
    io::{self, Read},
    net::TcpListener,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::OnceLock,
    thread,
    time::{Duration, Instant},
};

/// Where the PostgreSQL 15 server binaries live on these machines.
pub const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// Overrides [`DEFAULT_BIN_DIR`].
pub const BIN_DIR_ENV: &str = "SESSIOND_TEST_PG_BIN";

/// When set, tests use this server instead of starting a cluster.
pub const DATABASE_URL_ENV: &str = "DATABASE_URL";

const START_DEADLINE: Duration = Duration::from_secs(30);
const PORT_ATTEMPTS: usize = 5;

/// Stops postgres when stdin reaches end of file (the owner closed the pipe
/// or died), then removes the cluster directory. It ignores the signals a
/// terminal or a test runner sends to a process group; only the pipe counts.
const SUPERVISOR: &str = r#"
set -u
trap '' INT TERM HUP QUIT
dir=$1; bin=$2; port=$3
(
  $SESSIOND_PG_RUNAS "$bin/postgres" -D "$dir/data" -p "$port" \
    -c listen_addresses=127.0.0.1 \
    -c unix_socket_directories="$dir/sock" \
    -c fsync=off -c full_page_writes=off -c synchronous_commit=off \
    -c max_connections=200 -c shared_buffers=32MB \
    -c log_min_messages=warning \
    >"$dir/postgres.log" 2>&1
  echo "$?" >"$dir/exited"
) </dev/null &
cat >/dev/null
$SESSIOND_PG_RUNAS "$bin/pg_ctl" -D "$dir/data" stop -m immediate -w >/dev/null 2>&1
wait
rm -rf "$dir"
"#;

/// A running throwaway PostgreSQL cluster. Dropping it stops the server and
/// removes its files.
pub struct Cluster {
    url: String,
    port: u16,
    pid: u32,
    dir: PathBuf,
    supervisor: Child,
    stdin: Option<ChildStdin>,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("url", &self.url)
            .field("pid", &self.pid)
            .field("dir", &self.dir)
            .finish()
    }
}

impl Cluster {
    /// `postgres://postgres@127.0.0.1:PORT/postgres` (trust authentication).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Pid of the postmaster.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Creates a new empty database and returns its URL.
    pub fn create_database(&self) -> TestDatabase {
        TestDatabase::create(&self.url, false)
    }

    fn stop(&mut self) {
        // Closing the pipe is the stop signal.
        drop(self.stdin.take());
        let _ = self.supervisor.wait();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts a throwaway cluster, or panics with the reason and the server log.
pub fn start_cluster() -> Cluster {
    match try_start_cluster() {
        Ok(cluster) => cluster,
        Err(reason) => panic!(
            "postgres: cannot start a throwaway PostgreSQL cluster for the tests \
             (set {DATABASE_URL_ENV} to use an existing server instead): {reason}"
        ),
    }
}

/// Starts a throwaway cluster; the error explains what went wrong.
pub fn try_start_cluster() -> Result<Cluster, String> {
    let bin = bin_dir();
    for tool in ["initdb", "postgres", "pg_ctl"] {
        if !bin.join(tool).is_file() {
            return Err(format!(
                "{} not found (PostgreSQL 15 server binaries; set {BIN_DIR_ENV} to their directory)",
                bin.join(tool).display()
            ));
        }
    }
    let as_root = running_as_root();

    let mut last_error = String::new();
    for _ in 0..PORT_ATTEMPTS {
        let dir = tempfile::Builder::new()
            .prefix("sessiond-pg-")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?
            // The supervisor removes it, also when this process is killed.
            .keep();
        match start_in(&dir, &bin, as_root) {
            Ok(cluster) => {
                eprintln!(
                    "postgres: started throwaway cluster on 127.0.0.1:{} (pid {})",
                    cluster.port, cluster.pid
                );
                return Ok(cluster);
            }
            Err(StartError::PortTaken(log)) => last_error = log,
            Err(StartError::Fatal(reason)) => return Err(reason),
        }
    }
    Err(format!(
        "no free port after {PORT_ATTEMPTS} attempts; last server log:\n{last_error}"
    ))
}

enum StartError {
    PortTaken(String),
    Fatal(String),
}

fn start_in(dir: &Path, bin: &Path, as_root: bool) -> Result<Cluster, StartError> {
    let fatal = |msg: String| {
        let _ = fs::remove_dir_all(dir);
        StartError::Fatal(msg)
    };
    fs::create_dir(dir.join("sock")).map_err(|e| fatal(format!("mkdir sock: {e}")))?;
    if as_root {
        // initdb refuses to run as root; the cluster belongs to `postgres`.
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir))
        .map_err(&fatal)?;
    }

    let mut initdb = as_postgres(as_root, &bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(dir.join("data"))
        .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C"])
        .args(["--no-sync", "--no-instructions"]);
    run(&mut initdb).map_err(|e| fatal(format!("initdb failed: {e}")))?;

    let port = free_port().map_err(|e| fatal(format!("cannot find a free port: {e}")))?;
    let runas = if as_root {
        "runuser -u postgres --"
    } else {
        ""
    };
    let mut supervisor = Command::new("sh")
        .arg("-c")
        .arg(SUPERVISOR)
        .arg("sessiond-pg-supervisor")
        .arg(dir)
        .arg(bin)
        .arg(port.to_string())
        .env("SESSIOND_PG_RUNAS", runas)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        // Not in the test's process group: a Ctrl-C or a runner's group kill
        // must not skip the cleanup.
        .process_group(0)
        .spawn()
        .map_err(|e| fatal(format!("cannot spawn sh: {e}")))?;
    let stdin = supervisor.stdin.take();
    let mut cluster = Cluster {
        url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        port,
        pid: 0,
        dir: dir.to_owned(),
        supervisor,
        stdin,
    };

    let deadline = Instant::now() + START_DEADLINE;
    loop {
        if let Some(pid) = ready_pid(&dir.join("data"), port) {
            cluster.pid = pid;
            return Ok(cluster);
        }
        if dir.join("exited").exists() || Instant::now() > deadline {
            let log = fs::read_to_string(dir.join("postgres.log")).unwrap_or_default();
            let port_taken = log.contains("could not bind") || log.contains("already in use");
            cluster.stop();
            return Err(if port_taken {
                StartError::PortTaken(log)
            } else if Instant::now() > deadline {
                StartError::Fatal(format!(
                    "postgres was not ready after {START_DEADLINE:?}; log:\n{log}"
                ))
            } else {
                StartError::Fatal(format!("postgres exited during start; log:\n{log}"))
            });
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The postmaster's pid once `postmaster.pid` says it listens on `port` and
/// is ready to accept connections.
fn ready_pid(data: &Path, port: u16) -> Option<u32> {
    let text = fs::read_to_string(data.join("postmaster.pid")).ok()?;
    let lines: Vec<&str> = text.lines().collect();
    let pid = lines.first()?.trim().parse().ok()?;
    let listens = lines.get(3)?.trim() == port.to_string();
    let ready = lines.get(7)?.trim() == "ready";
    (listens && ready).then_some(pid)
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn as_postgres(as_root: bool, program: &Path) -> Command {
    if as_root {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{:?} {:?} exited with {}: {}{}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<&OsStr>>(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn running_as_root() -> bool {
    let mut status = String::new();
    let read = fs::File::open("/proc/self/status").and_then(|mut f| f.read_to_string(&mut status));
    if read.is_err() {
        return false;
    }
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().nth(1)) // effective uid
        .is_some_and(|euid| euid == "0")
}

fn bin_dir() -> PathBuf {
    env::var_os(BIN_DIR_ENV).map_or_else(|| PathBuf::from(DEFAULT_BIN_DIR), PathBuf::from)
}

fn psql() -> PathBuf {
    let bundled = bin_dir().join("psql");
    if bundled.is_file() {
        bundled
    } else {
        PathBuf::from("psql")
    }
}

/// The server tests use: `DATABASE_URL` when set, otherwise a cluster started
/// once for this process (stopped when the process exits).
pub fn server_url() -> String {
    if let Some(url) = env::var(DATABASE_URL_ENV).ok().filter(|u| !u.is_empty()) {
        return url;
    }
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(start_cluster).url().to_owned()
}

/// A fresh database for one test, on [`server_url`].
pub fn test_database() -> TestDatabase {
    let external = env::var(DATABASE_URL_ENV).is_ok_and(|u| !u.is_empty());
    TestDatabase::create(&server_url(), external)
}

/// A database created for one test. On a server the test did not start
/// (`DATABASE_URL`), it is dropped again when this value is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    url: String,
    server_url: String,
    drop_on_drop: bool,
}

impl TestDatabase {
    fn create(server_url: &str, drop_on_drop: bool) -> TestDatabase {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        if let Err(e) = psql_command(server_url, &format!("CREATE DATABASE \"{name}\"")) {
            panic!("postgres: cannot create test database {name} on {server_url}: {e}");
        }
        TestDatabase {
            url: with_database(server_url, &name),
            name,
            server_url: server_url.to_owned(),
            drop_on_drop,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if self.drop_on_drop {
            let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
            if let Err(e) = psql_command(&self.server_url, &sql) {
                eprintln!("postgres: cannot drop test database {}: {e}", self.name);
            }
        }
    }
}

/// Runs one SQL command through `psql`.
pub fn psql_command(url: &str, sql: &str) -> Result<String, String> {
    run(Command::new(psql())
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            url,
            "-c",
            sql,
        ])
        .env("PGCONNECT_TIMEOUT", "10"))
}

/// `url` with its database name replaced by `database`.
pub fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("postgres", url));
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    let mut out = format!("{scheme}://{authority}/{database}");
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_database_of_a_url() {
        assert_eq!(
            with_database("postgres://u:p@h:5/db?sslmode=disable", "t_1"),
            "postgres://u:p@h:5/t_1?sslmode=disable"
        );
        assert_eq!(with_database("postgresql://h", "x"), "postgresql://h/x");
    }

    #[test]
    fn cluster_starts_serves_and_stops() {
        let cluster = start_cluster();
        let dir = cluster.dir.clone();
        let db = cluster.create_database();
        let out = psql_command(db.url(), "SELECT 40 + 2").expect("query");
        assert_eq!(out.trim(), "42");
        drop(db);
        drop(cluster);
        assert!(
            !dir.exists(),
            "the supervisor removes the cluster directory"
        );
    }

    const CHILD_ENV: &str = "SESSIOND_TESTKIT_CLUSTER_REPORT";

    /// Run by `killed_owner_leaves_nothing_behind` in a child process: starts
    /// a cluster, reports it, and waits to be killed.
    #[test]
    fn child_holds_a_cluster() {
        let Some(report) = env::var_os(CHILD_ENV) else {
            return;
        };
        let cluster = start_cluster();
        let line = format!("{} {}", cluster.pid(), cluster.dir.display());
        fs::write(&report, line).expect("report");
        thread::sleep(Duration::from_secs(60));
    }

    #[test]
    fn killed_owner_leaves_nothing_behind() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let report = scratch.path().join("report");
        let mut child = Command::new(env::current_exe().expect("current_exe"))
            .args([
                "--exact",
                "postgres::tests::child_holds_a_cluster",
                "--nocapture",
            ])
            .env(CHILD_ENV, &report)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn child test");
        let deadline = Instant::now() + START_DEADLINE;
        let text = loop {
            if let Some(text) = fs::read_to_string(&report).ok().filter(|t| !t.is_empty()) {
                break text;
            }
            assert!(
                Instant::now() < deadline,
                "the child did not start a cluster"
            );
            thread::sleep(Duration::from_millis(20));
        };
        let (pid, dir) = text.split_once(' ').expect("report format");
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        assert!(proc_dir.exists(), "postgres runs while its owner lives");

        child.kill().expect("SIGKILL the owner"); // SIGKILL: no destructor runs
        child.wait().expect("reap");

        let deadline = Instant::now() + Duration::from_secs(10);
        while proc_dir.exists() || Path::new(dir).exists() {
            assert!(
                Instant::now() < deadline,
                "postgres (pid {pid}) or {dir} survived its killed owner"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}
