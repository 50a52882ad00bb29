//! Standard output, for the `println!` and `print!` of this binary.
//!
//! Output into a pipe whose reader left (`sessionctl messages ... | head`)
//! ends the process as SIGPIPE ends any Unix tool. SIGPIPE itself stays
//! ignored, as Rust starts programs: restored to its default, it also
//! killed the process, silently, when a connection to the server broke
//! under a write (`health --wait` exited 141 with nothing said), where the
//! call should report the error.

use std::io::{self, Write};

/// Writes `args` and a line end.
pub fn line(args: std::fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    let written = out.write_fmt(args).and_then(|()| out.write_all(b"\n"));
    ended(written);
}

/// Writes `args`.
pub fn text(args: std::fmt::Arguments<'_>) {
    ended(io::stdout().lock().write_fmt(args));
}

/// What a write to standard output did: a reader that left ends the
/// process by SIGPIPE; other errors are dropped, as `println!` drops none
/// of its own but a command's output is all it has to give.
pub fn ended(written: io::Result<()>) {
    if written.is_err_and(|e| e.kind() == io::ErrorKind::BrokenPipe) {
        die_of_sigpipe();
    }
}

#[allow(unsafe_code)]
fn die_of_sigpipe() -> ! {
    // SAFETY: the default disposition restored and the signal raised on
    // the calling thread; no handler of ours runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}
