//! The durable turn journal: what every agentctl process of one executor did
//! with each turn, so a relaunched agentctl can tell the backend whether a
//! prompt may have reached an agent (then it must never be run again
//! automatically) or provably did not (then it may be delivered now).
//!
//! One file of JSON lines in the executor's run directory, appended and
//! `fsync`ed before the step it records takes effect (`accepted` excepted,
//! see below):
//!
//! - `{"k":"start","instance":I}`: an agentctl process began using the file;
//! - `{"k":"accepted","turn":T,"message":M,"instance":I,"text":X}`: before
//!   Prompt returns, with the turn's text (so a later process can report
//!   the last turn its dead predecessor ran; compaction keeps it for the
//!   newest turn and turns that never ended), written but not `fsync`ed: a turn only accepted by a process
//!   now dead reached no agent, exactly as an unknown one, so losing the
//!   line to a power cut changes no answer; the `handed` line's `fsync`,
//!   always before the agent sees the turn, makes it durable with it;
//! - `{"k":"handed","turn":T,"instance":I}`: before the prompt is written to
//!   the agent's stdin;
//! - `{"k":"ended","turn":T,"instance":I,"cursor":C}`: after its `TurnEnded`
//!   got cursor `C` in instance `I`'s update log;
//! - `{"k":"agent","instance":I,"pid":P,"sid":S,"start_time":T,"marker":X}`:
//!   an agent process tree was started (for ending a previous generation's
//!   leftovers, see [`crate::tree::end`]).
//! - `{"k":"permission","instance":I,"turn":T,"request":R,"part":J}`: a
//!   permission request of policy `ask` (its part's JSON), before the
//!   backend is told about it;
//! - `{"k":"permission_resolved","instance":I,"request":R}`: after the
//!   agent was given its answer. A request still pending when a later
//!   process opens the file died with its agent: that process reports it
//!   cancelled (see [`crate::agent::AgentManager::with_journal`]).
//!
//! A torn last line (a crash mid-write) is ignored: its step had not taken
//! effect, since effects only follow a completed `fsync`. At open the file is
//! compacted to the remembered turns and rewritten atomically (temp file,
//! fsync, rename, fsync of the directory), and again whenever
//! [`COMPACT_AFTER`] bytes were appended since, so the file of an agentctl
//! that runs for weeks stays the size of what it must remember.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{Value, json};

use crate::error::{Error, Result};

/// How far a turn got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Recorded; not handed to any agent.
    Accepted,
    /// Handed to an agent: it may have run any part of it.
    Handed,
    /// Its `TurnEnded` is in the update log of the instance that ran it.
    Ended,
}

/// One remembered turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    /// The caller's turn id.
    pub turn_id: String,
    /// The id its reply chunks carry.
    pub message_id: String,
    /// The agentctl instance that accepted (and maybe ran) it.
    pub instance: String,
    /// How far it got.
    pub phase: Phase,
    /// With [`Phase::Ended`]: the cursor of its `TurnEnded`.
    pub end_cursor: u64,
    /// The turn's text, as read from the journal for the newest turn and
    /// for turns that never ended (empty otherwise, and for turns of this
    /// process).
    pub text: String,
}

/// An agent process tree some agentctl started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRecord {
    /// The agentctl instance that started it.
    pub instance: String,
    /// The agent's pid, which is also its session and process group id.
    pub pid: u32,
    /// Its start time (clock ticks after boot, `/proc/PID/stat` field 22).
    pub start_time: u64,
    /// A random value in the environment of every process of the tree.
    pub marker: String,
}

/// A permission request that was waiting for the backend's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionRecord {
    /// The agentctl instance that asked it.
    pub instance: String,
    pub turn_id: String,
    pub request_id: String,
    /// The pending part's JSON (`activity::permission_requested`).
    pub part: String,
}

/// What the file held when this process opened it.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Permission requests never resolved (their agentctl died waiting).
    pub permissions: Vec<PermissionRecord>,
    /// Remembered turns, oldest first.
    pub turns: VecDeque<TurnRecord>,
    /// Agent trees started by earlier instances (possibly still alive).
    pub agents: Vec<AgentRecord>,
    /// There was no journal: this process created it.
    pub fresh: bool,
}

/// Appended bytes after which the file is compacted again (each turn adds
/// its text and about 300 bytes).
pub const COMPACT_AFTER: u64 = 1 << 20;

/// The open journal (or none: then nothing is durable).
#[derive(Debug)]
pub struct Journal {
    file: Option<Mutex<Appender>>,
    path: Option<PathBuf>,
    /// What a compaction keeps and writes: the turns remembered, the
    /// instance that writes, and after how many appended bytes.
    keep: usize,
    instance: String,
    compact_after: u64,
}

/// The file appended to, and how much was appended since it was compacted.
#[derive(Debug)]
struct Appender {
    file: File,
    appended: u64,
}

fn record(v: &Value) -> Option<(&str, &str)> {
    Some((v.get("k")?.as_str()?, v.get("instance")?.as_str()?))
}

fn s(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn n(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Parses journal text (a torn or foreign line is skipped), keeping at most
/// `keep` turns.
pub fn parse(text: &str, keep: usize) -> Loaded {
    let mut loaded = Loaded::default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some((kind, instance)) = record(&v) else {
            continue;
        };
        let turn_id = s(&v, "turn");
        match kind {
            "accepted" => {
                // A re-accept (by a later instance) replaces the older entry.
                loaded.turns.retain(|t| t.turn_id != turn_id);
                loaded.turns.push_back(TurnRecord {
                    turn_id: turn_id.clone(),
                    message_id: s(&v, "message"),
                    instance: instance.to_owned(),
                    phase: Phase::Accepted,
                    end_cursor: 0,
                    text: s(&v, "text"),
                });
                while loaded.turns.len() > keep {
                    loaded.turns.pop_front();
                }
            }
            "handed" | "ended" => {
                if let Some(t) = loaded
                    .turns
                    .iter_mut()
                    .rev()
                    .find(|t| t.turn_id == turn_id && t.instance == instance)
                {
                    if kind == "handed" {
                        if t.phase == Phase::Accepted {
                            t.phase = Phase::Handed;
                        }
                    } else {
                        t.phase = Phase::Ended;
                        t.end_cursor = n(&v, "cursor");
                    }
                }
            }
            "permission" => loaded.permissions.push(PermissionRecord {
                instance: instance.to_owned(),
                turn_id,
                request_id: s(&v, "request"),
                part: s(&v, "part"),
            }),
            "permission_resolved" => {
                let request = s(&v, "request");
                loaded.permissions.retain(|p| p.request_id != request);
            }
            "agent" => loaded.agents.push(AgentRecord {
                instance: instance.to_owned(),
                pid: u32::try_from(n(&v, "pid")).unwrap_or(0),
                start_time: n(&v, "start_time"),
                marker: s(&v, "marker"),
            }),
            _ => {}
        }
    }
    // Texts are kept for the newest turn and for turns that never ended.
    let newest = loaded.turns.len().saturating_sub(1);
    for (i, t) in loaded.turns.iter_mut().enumerate() {
        if t.phase == Phase::Ended && i != newest {
            t.text = String::new();
        }
    }
    loaded
}

fn render(loaded: &Loaded) -> String {
    let mut out = String::new();
    for a in &loaded.agents {
        out.push_str(&agent_line(a).to_string());
        out.push('\n');
    }
    for p in &loaded.permissions {
        out.push_str(&permission_line(p).to_string());
        out.push('\n');
    }
    for t in &loaded.turns {
        let mut accepted =
            json!({"k":"accepted","turn":t.turn_id,"message":t.message_id,"instance":t.instance});
        if !t.text.is_empty() {
            accepted["text"] = Value::String(t.text.clone());
        }
        out.push_str(&accepted.to_string());
        out.push('\n');
        if t.phase != Phase::Accepted {
            out.push_str(&json!({"k":"handed","turn":t.turn_id,"instance":t.instance}).to_string());
            out.push('\n');
        }
        if t.phase == Phase::Ended {
            out.push_str(
                &json!({"k":"ended","turn":t.turn_id,"instance":t.instance,"cursor":t.end_cursor})
                    .to_string(),
            );
            out.push('\n');
        }
    }
    out
}

/// Writes `loaded` (and `instance`'s start) as the whole journal at `path`,
/// atomically: a temp file, `fsync`, rename, `fsync` of the directory; a
/// crash at any point leaves the old file or the new one. Returns the new
/// file open for appending.
fn rewrite(path: &Path, loaded: &Loaded, instance: &str) -> Result<File> {
    let mut compact = render(loaded);
    compact.push_str(&json!({"k":"start","instance":instance}).to_string());
    compact.push('\n');
    let tmp = path.with_extension("journal.tmp");
    {
        // The journal holds prompts: private to agentctl's user, like its run dir.
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io(format!("creating journal {}", tmp.display()), e))?;
        f.write_all(compact.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| io(format!("writing journal {}", tmp.display()), e))?;
    }
    std::fs::rename(&tmp, path)
        .map_err(|e| io(format!("renaming journal to {}", path.display()), e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(format!("syncing directory {}", dir.display()), e))?;
    }
    OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| io(format!("opening journal {}", path.display()), e))
}

fn agent_line(a: &AgentRecord) -> Value {
    json!({"k":"agent","instance":a.instance,"pid":a.pid,"start_time":a.start_time,"marker":a.marker})
}

fn permission_line(p: &PermissionRecord) -> Value {
    json!({"k":"permission","instance":p.instance,"turn":p.turn_id,"request":p.request_id,"part":p.part})
}

fn io(context: String, e: std::io::Error) -> Error {
    Error::io(context, e)
}

impl Journal {
    /// No journal: nothing outlives this process.
    pub fn none() -> Self {
        Self {
            file: None,
            path: None,
            keep: 0,
            instance: String::new(),
            compact_after: COMPACT_AFTER,
        }
    }

    /// Opens (creating) the journal at `path` for `instance`, keeping at
    /// most `keep` turns; returns what earlier instances recorded.
    /// `still_alive` filters the agent records worth keeping.
    pub fn open(
        path: &Path,
        instance: &str,
        keep: usize,
        still_alive: impl Fn(&AgentRecord) -> bool,
    ) -> Result<(Self, Loaded)> {
        Self::open_compacting_after(path, instance, keep, still_alive, COMPACT_AFTER)
    }

    /// [`Self::open`], compacting again after `compact_after` appended bytes.
    pub fn open_compacting_after(
        path: &Path,
        instance: &str,
        keep: usize,
        still_alive: impl Fn(&AgentRecord) -> bool,
        compact_after: u64,
    ) -> Result<(Self, Loaded)> {
        let (text, fresh) = match std::fs::read(path) {
            Ok(b) => (String::from_utf8_lossy(&b).into_owned(), false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (String::new(), true),
            Err(e) => return Err(io(format!("reading journal {}", path.display()), e)),
        };
        let mut loaded = parse(&text, keep);
        loaded.fresh = fresh;
        loaded.agents.retain(|a| still_alive(a));
        let file = rewrite(path, &loaded, instance)?;
        Ok((
            Self {
                file: Some(Mutex::new(Appender { file, appended: 0 })),
                path: Some(path.to_owned()),
                keep,
                instance: instance.to_owned(),
                compact_after,
            },
            loaded,
        ))
    }

    /// True when records are durable.
    pub fn is_durable(&self) -> bool {
        self.file.is_some()
    }

    fn append(&self, v: &Value) -> Result<()> {
        self.write(v, true)
    }

    /// Appends `v`, then `fsync`s the file when `durable` (which makes every
    /// line written before it durable too). A durable write past
    /// `compact_after` appended bytes compacts the file (see [`rewrite`]).
    fn write(&self, v: &Value, durable: bool) -> Result<()> {
        let (Some(file), Some(path)) = (&self.file, &self.path) else {
            return Ok(());
        };
        let mut line = v.to_string();
        line.push('\n');
        let mut f = file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.file
            .write_all(line.as_bytes())
            .and_then(|()| if durable { f.file.sync_data() } else { Ok(()) })
            .map_err(|e| io(format!("writing journal {}", path.display()), e))?;
        f.appended += line.len() as u64;
        if durable && f.appended >= self.compact_after {
            // The line is durable already: a compaction that fails leaves
            // the file whole, to be compacted at the next try or open.
            match self.compact(path) {
                Ok(compacted) => {
                    *f = Appender {
                        file: compacted,
                        appended: 0,
                    };
                }
                Err(e) => tracing::warn!(error = %e, "the turn journal could not be compacted"),
            }
        }
        Ok(())
    }

    /// The file as it would be reopened: read, parsed to the remembered
    /// turns (ended turns' texts dropped, resolved requests gone) and
    /// rewritten atomically. Called with the appender locked, so no line
    /// is appended to the old file meanwhile.
    fn compact(&self, path: &Path) -> Result<File> {
        let text = std::fs::read(path)
            .map_err(|e| io(format!("reading journal {}", path.display()), e))?;
        let loaded = parse(&String::from_utf8_lossy(&text), self.keep);
        rewrite(path, &loaded, &self.instance)
    }

    /// Records `turn` (its `text`) accepted by `instance`; not `fsync`ed
    /// (see the module docs): [`Self::handed`] makes it durable before the
    /// agent sees it.
    pub fn accepted(&self, turn: &str, message: &str, instance: &str, text: &str) -> Result<()> {
        self.write(
            &json!({"k":"accepted","turn":turn,"message":message,"instance":instance,"text":text}),
            false,
        )
    }

    /// Records `turn` handed to the agent.
    pub fn handed(&self, turn: &str, instance: &str) -> Result<()> {
        self.append(&json!({"k":"handed","turn":turn,"instance":instance}))
    }

    /// Records `turn` ended at `cursor`.
    pub fn ended(&self, turn: &str, instance: &str, cursor: u64) -> Result<()> {
        self.append(&json!({"k":"ended","turn":turn,"instance":instance,"cursor":cursor}))
    }

    /// Records a permission request waiting for the backend's answer.
    pub fn permission(&self, p: &PermissionRecord) -> Result<()> {
        self.append(&permission_line(p))
    }

    /// Records that a permission request no longer waits.
    pub fn permission_resolved(&self, request: &str, instance: &str) -> Result<()> {
        self.append(&json!({"k":"permission_resolved","request":request,"instance":instance}))
    }

    /// Records an agent process tree.
    pub fn agent(&self, a: &AgentRecord) -> Result<()> {
        self.append(&agent_line(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each remembered turn's id, phase and end cursor.
    fn phases(loaded: &Loaded) -> Vec<(&str, Phase, u64)> {
        loaded
            .turns
            .iter()
            .map(|t| (t.turn_id.as_str(), t.phase, t.end_cursor))
            .collect()
    }

    fn agent_tree() -> AgentRecord {
        AgentRecord {
            instance: "i1".into(),
            pid: 42,
            start_time: 9,
            marker: "mk".into(),
        }
    }

    #[test]
    fn phases_reaccept_torn_line_and_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.journal");
        let (j, loaded) = Journal::open(&path, "i1", 3, |_| true).unwrap();
        assert!(loaded.turns.is_empty());
        assert!(loaded.fresh);
        j.accepted("t1", "m1", "i1", "one").unwrap();
        j.handed("t1", "i1").unwrap();
        j.ended("t1", "i1", 7).unwrap();
        j.accepted("t2", "m2", "i1", "two\n\"quoted\"").unwrap();
        j.handed("t2", "i1").unwrap();
        j.accepted("t3", "m3", "i1", "").unwrap();
        j.agent(&agent_tree()).unwrap();
        drop(j);
        // A crash mid-write leaves a torn line: ignored.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"k":"ended","turn":"t2","inst"#).unwrap();
        drop(f);

        let (j, loaded) = Journal::open(&path, "i2", 3, |_| true).unwrap();
        assert!(!loaded.fresh);
        assert_eq!(
            phases(&loaded),
            [
                ("t1", Phase::Ended, 7),
                ("t2", Phase::Handed, 0),
                ("t3", Phase::Accepted, 0)
            ]
        );
        // A turn's text is kept while it has not ended.
        let texts: Vec<_> = loaded.turns.iter().map(|t| t.text.as_str()).collect();
        assert_eq!(texts, ["", "two\n\"quoted\"", ""]);
        assert_eq!(loaded.agents.len(), 1);
        // t3 never reached an agent: the new instance takes it over.
        j.accepted("t3", "m3b", "i2", "").unwrap();
        j.accepted("t4", "m4", "i2", "").unwrap();
        drop(j);
        let (_j, loaded) = Journal::open(&path, "i3", 3, |_| false).unwrap();
        let kept: Vec<_> = loaded
            .turns
            .iter()
            .map(|t| (t.turn_id.as_str(), t.instance.as_str()))
            .collect();
        assert_eq!(kept, [("t2", "i1"), ("t3", "i2"), ("t4", "i2")]);
        assert_eq!(
            loaded.turns[0].text, "two\n\"quoted\"",
            "through the compaction"
        );
        assert!(loaded.agents.is_empty(), "filtered by still_alive");
    }

    /// A long-lived agentctl's journal is compacted as it goes: it stays
    /// the size of what it must remember, and what it must remember (the
    /// last turns and their phases, the newest turn's text, requests still
    /// waiting, agent trees) comes back whole at the next open.
    #[test]
    fn a_long_lived_journal_is_compacted_as_it_grows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.journal");
        let after = 4_000;
        let (j, _) = Journal::open_compacting_after(&path, "i1", 3, |_| true, after).unwrap();
        let waiting = PermissionRecord {
            instance: "i1".into(),
            turn_id: "t0".into(),
            request_id: "r0".into(),
            part: r#"{"requestId":"r0"}"#.into(),
        };
        j.permission(&waiting).unwrap();
        j.agent(&agent_tree()).unwrap();
        let text = "x".repeat(200);
        let mut largest = 0;
        for i in 1..=500u64 {
            let turn = format!("t{i}");
            j.accepted(&turn, &format!("m{i}"), "i1", &format!("{i} {text}"))
                .unwrap();
            j.handed(&turn, "i1").unwrap();
            if i < 500 {
                j.ended(&turn, "i1", i * 10).unwrap();
            }
            largest = largest.max(std::fs::metadata(&path).unwrap().len());
        }
        // 500 turns appended ~250 KB; the file never held much more than
        // one compaction's worth.
        assert!(largest < 2 * after, "the journal grew to {largest} bytes");
        drop(j);
        let (_j, loaded) = Journal::open(&path, "i2", 3, |_| true).unwrap();
        assert_eq!(
            phases(&loaded),
            [
                ("t498", Phase::Ended, 4980),
                ("t499", Phase::Ended, 4990),
                ("t500", Phase::Handed, 0)
            ]
        );
        assert_eq!(loaded.turns[2].text, format!("500 {text}"));
        assert_eq!(loaded.permissions, [waiting], "still waiting");
        assert_eq!(loaded.agents.len(), 1);
    }

    #[test]
    fn pending_permission_requests_survive_until_resolved() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.journal");
        let (j, _) = Journal::open(&path, "i1", 8, |_| true).unwrap();
        let rec = |r: &str| PermissionRecord {
            instance: "i1".into(),
            turn_id: "t1".into(),
            request_id: r.into(),
            part: format!(r#"{{"requestId":"{r}"}}"#),
        };
        j.permission(&rec("r1")).unwrap();
        j.permission(&rec("r2")).unwrap();
        j.permission_resolved("r1", "i1").unwrap();
        drop(j);
        let (j, loaded) = Journal::open(&path, "i2", 8, |_| true).unwrap();
        assert_eq!(loaded.permissions, [rec("r2")], "r1 was resolved");
        // Kept through the compaction until a process resolves it.
        drop(j);
        let (j, loaded) = Journal::open(&path, "i3", 8, |_| true).unwrap();
        assert_eq!(loaded.permissions, [rec("r2")]);
        j.permission_resolved("r2", "i3").unwrap();
        drop(j);
        let (_j, loaded) = Journal::open(&path, "i4", 8, |_| true).unwrap();
        assert!(loaded.permissions.is_empty());
    }
}
