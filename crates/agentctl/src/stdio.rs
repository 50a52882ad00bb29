//! The agent's output, read line by line with bounds: ACP messages from
//! stdout, log lines from stderr.
//!
//! An agent owns both pipes, so nothing it writes may cost agentctl
//! unbounded memory or log: a line longer than the bound is dropped (the
//! rest of it read and thrown away), and stdout lines that cannot be
//! JSON-RPC messages (a banner, `print` debugging, a runaway loop) are not
//! handed to the ACP connection. Handed on, each would be answered with a
//! parse error written to the agent's stdin, which an agent that does not
//! read piles up in memory; each would be logged, too.

use std::io;

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The longest ACP message taken from stdout: far above what agents send
/// in one message (a 70 MB reply chunk is taken, then cut to what sessiond
/// keeps), while a line that never ends cannot take all memory.
pub const MAX_MESSAGE_LINE: usize = 256 << 20;

/// The longest stderr line logged whole; a longer one is logged cut.
pub const MAX_LOG_LINE: usize = 16 << 10;

/// The line buffer kept between lines; a larger one (after a long line) is
/// given back.
const KEPT_BUFFER: usize = 1 << 20;

/// One line as read: its text, what of it was not UTF-8 (replaced), or
/// how long it was when over the bound (`head` is its first bytes).
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A line of UTF-8 text, without its line ending.
    Text(String),
    /// Not UTF-8: the line with invalid sequences replaced.
    NotUtf8(String),
    /// Longer than the bound: its length and its first bytes (lossy).
    TooLong {
        /// The line's whole length in bytes.
        len: usize,
        /// Its first `max` bytes, invalid UTF-8 replaced.
        head: String,
    },
}

impl Line {
    /// The text as far as it is kept, for a log.
    pub fn shown(&self) -> &str {
        match self {
            Line::Text(t) | Line::NotUtf8(t) => t,
            Line::TooLong { head, .. } => head,
        }
    }
}

/// Reads the next line of `r`, keeping at most `max` bytes of it; `None`
/// at the end of the stream. `buf` is the caller's, reused between calls.
pub async fn next_line<R: AsyncBufRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<Option<Line>> {
    buf.clear();
    // One long line must not keep its buffer for the agent's whole life.
    if buf.capacity() > KEPT_BUFFER {
        *buf = Vec::new();
    }
    let mut len = 0usize;
    let mut ended = false;
    loop {
        let available = r.fill_buf().await?;
        if available.is_empty() {
            break;
        }
        let (part, used) = match available.iter().position(|b| *b == b'\n') {
            Some(i) => {
                ended = true;
                (&available[..i], i + 1)
            }
            None => (available, available.len()),
        };
        let room = max.saturating_sub(buf.len());
        buf.extend_from_slice(&part[..part.len().min(room)]);
        len += part.len();
        r.consume(used);
        if ended {
            break;
        }
    }
    if !ended && len == 0 {
        return Ok(None);
    }
    if len > max {
        return Ok(Some(Line::TooLong {
            len,
            head: String::from_utf8_lossy(buf).into_owned(),
        }));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(match std::str::from_utf8(buf) {
        Ok(text) => Line::Text(text.to_owned()),
        Err(_) => Line::NotUtf8(String::from_utf8_lossy(buf).into_owned()),
    }))
}

/// Whether `line` may be a JSON-RPC message: one JSON object (or a batch)
/// on its own line, as ACP's stdio transport writes them.
pub fn may_be_message(line: &str) -> bool {
    let t = line.trim();
    (t.starts_with('{') && t.ends_with('}')) || (t.starts_with('[') && t.ends_with(']'))
}

/// A message written right after text that did not end its line (a banner
/// printed with no newline, a stray write): the JSON object that ends the
/// line, and the text before it. `None` when the line does not end with a
/// whole JSON object.
pub fn message_after_noise(line: &str) -> Option<(&str, &str)> {
    /// Openings tried, from the left: enough for any banner.
    const TRIES: usize = 16;
    if !line.trim_end().ends_with('}') {
        return None;
    }
    line.match_indices('{')
        .take(TRIES)
        .map(|(at, _)| at)
        .find(|&at| serde_json::from_str::<serde::de::IgnoredAny>(&line[at..]).is_ok())
        .map(|at| (&line[..at], &line[at..]))
}

/// Counts the stdout lines an agent wrote that are not ACP messages, and
/// says so in the log without letting a flood fill it: the first few with
/// an excerpt, then one line at each power of two.
#[derive(Debug, Default)]
pub struct Noise {
    lines: u64,
}

/// Lines of noise logged with their text before only counts are.
const NOISE_SHOWN: u64 = 5;

/// How much of a noise line the log shows.
const NOISE_EXCERPT: usize = 200;

impl Noise {
    /// Notes one line that is not a message; `pid` is the agent's.
    pub fn note(&mut self, pid: u32, line: &Line) {
        self.lines += 1;
        let n = self.lines;
        if n <= NOISE_SHOWN {
            let excerpt = excerpt(line.shown(), NOISE_EXCERPT);
            let what = match line {
                Line::Text(_) => "a line that is not a JSON-RPC message".to_owned(),
                Line::NotUtf8(_) => "a line that is not UTF-8".to_owned(),
                Line::TooLong { len, .. } => format!("a {len}-byte line (over the bound)"),
            };
            tracing::warn!(
                pid,
                lines = n,
                "the agent wrote {what} to stdout, which ACP keeps for \
                its JSON-RPC messages (logs belong on stderr); dropped: {excerpt:?}"
            );
        } else if n.is_power_of_two() {
            tracing::warn!(
                pid,
                lines = n,
                "the agent keeps writing lines that are not ACP \
                messages to stdout; dropped so far"
            );
        }
    }
}

/// How many stderr lines of an agent are logged per second; the rest are
/// counted, and the count logged when logging resumes.
pub const STDERR_LINES_PER_SECOND: u32 = 200;

/// How many bytes of an agent's stderr are logged per second (64 KiB):
/// with lines of up to [`MAX_LOG_LINE`], the line count alone let a
/// flood write megabytes a second (helper-39 11).
pub const STDERR_BYTES_PER_SECOND: usize = 64 << 10;

/// Keeps an agent's stderr from filling the log: at most
/// [`STDERR_LINES_PER_SECOND`] lines and [`STDERR_BYTES_PER_SECOND`] bytes
/// a second are logged (the first line of a second always is).
#[derive(Debug)]
pub struct LogBudget {
    window: std::time::Instant,
    logged: u32,
    logged_bytes: usize,
    skipped: u64,
}

impl Default for LogBudget {
    fn default() -> Self {
        Self {
            window: std::time::Instant::now(),
            logged: 0,
            logged_bytes: 0,
            skipped: 0,
        }
    }
}

impl LogBudget {
    /// Whether the next line (`bytes` long as logged) is logged, and how
    /// many lines were skipped before it (to say so first) when a new
    /// second began.
    pub fn admit(&mut self, bytes: usize) -> (bool, u64) {
        let now = std::time::Instant::now();
        let mut skipped = 0;
        if now.duration_since(self.window) >= std::time::Duration::from_secs(1) {
            self.window = now;
            self.logged = 0;
            self.logged_bytes = 0;
            skipped = std::mem::take(&mut self.skipped);
        }
        let fits = self.logged == 0
            || (self.logged < STDERR_LINES_PER_SECOND
                && self.logged_bytes.saturating_add(bytes) <= STDERR_BYTES_PER_SECOND);
        if fits {
            self.logged += 1;
            self.logged_bytes = self.logged_bytes.saturating_add(bytes);
            (true, skipped)
        } else {
            self.skipped += 1;
            (false, skipped)
        }
    }
}

/// The first `max` bytes of `s` (on a character boundary), marked when cut.
pub fn excerpt(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines_of(input: &[u8], max: usize) -> Vec<Line> {
        let mut r = tokio::io::BufReader::with_capacity(4, input);
        let mut buf = Vec::new();
        let mut out = Vec::new();
        while let Some(l) = next_line(&mut r, &mut buf, max).await.unwrap() {
            out.push(l);
        }
        out
    }

    #[tokio::test]
    async fn lines_are_bounded_and_an_overlong_one_does_not_eat_the_next() {
        let got = lines_of(b"{\"a\":1}\r\nabcdefghij\nok\n\xff\xfe\nlast", 8).await;
        assert_eq!(
            got,
            vec![
                Line::Text("{\"a\":1}".into()),
                Line::TooLong {
                    len: 10,
                    head: "abcdefgh".into()
                },
                Line::Text("ok".into()),
                Line::NotUtf8("\u{fffd}\u{fffd}".into()),
                Line::Text("last".into()),
            ]
        );
        assert_eq!(lines_of(b"", 8).await, vec![]);
        assert_eq!(lines_of(b"\n", 8).await, vec![Line::Text(String::new())]);
    }

    #[test]
    fn only_json_shaped_lines_may_be_messages() {
        assert!(may_be_message(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#));
        assert!(may_be_message("  {\"x\":[1]}  "));
        assert!(!may_be_message("garbage"));
        assert!(!may_be_message("Loading... {"));
        assert!(!may_be_message(""));
    }

    #[test]
    fn a_message_glued_to_noise_is_found() {
        let msg = r#"{"jsonrpc":"2.0","id":1,"result":{"a":{}}}"#;
        let line = format!("Loading agent... {msg}");
        assert_eq!(message_after_noise(&line), Some(("Loading agent... ", msg)));
        assert_eq!(message_after_noise("noise {not json}"), None);
        assert_eq!(message_after_noise("no braces"), None);
        assert_eq!(message_after_noise("{\"a\":1} trailing"), None);
    }

    #[tokio::test]
    async fn a_long_line_does_not_keep_its_buffer() {
        let mut input = vec![b'a'; 3 << 20];
        input.extend_from_slice(b"\nok\n");
        let mut r = tokio::io::BufReader::new(&input[..]);
        let mut buf = Vec::new();
        next_line(&mut r, &mut buf, 8 << 20).await.unwrap();
        assert!(buf.capacity() >= 3 << 20);
        next_line(&mut r, &mut buf, 8 << 20).await.unwrap();
        assert!(buf.capacity() < KEPT_BUFFER, "{}", buf.capacity());
    }

    #[test]
    fn a_flood_of_long_lines_is_logged_at_a_bounded_byte_rate() {
        let mut budget = LogBudget::default();
        let admitted = (0..1_000).filter(|_| budget.admit(MAX_LOG_LINE).0).count();
        assert!(admitted * MAX_LOG_LINE <= STDERR_BYTES_PER_SECOND.max(MAX_LOG_LINE));
        assert!(admitted >= 1, "the first line of a second is logged");
    }

    #[test]
    fn a_stderr_flood_is_logged_at_a_bounded_rate() {
        let mut budget = LogBudget::default();
        let admitted = (0..10_000).filter(|_| budget.admit(10).0).count();
        assert_eq!(admitted, STDERR_LINES_PER_SECOND as usize);
        budget.window -= std::time::Duration::from_secs(1);
        assert_eq!(
            budget.admit(10),
            (true, 10_000 - u64::from(STDERR_LINES_PER_SECOND))
        );
    }

    #[test]
    fn an_excerpt_cuts_on_a_character_boundary() {
        assert_eq!(excerpt("héllo", 2), "h…");
        assert_eq!(excerpt("abc", 5), "abc");
    }
}
