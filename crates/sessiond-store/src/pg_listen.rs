//! A libpq connection that waits on its socket for `NOTIFY`s: the one
//! place the store calls libpq itself, because diesel's connection can only
//! be polled for notifications, not waited on.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::time::Duration;

/// A libpq connection that `LISTEN`s on one channel and blocks on its
/// socket until notifications arrive.
pub(crate) struct Listener {
    conn: *mut pq_sys::PGconn,
}

// SAFETY: a PGconn may move between threads; it is used by one at a time
// (the listener's), never shared.
unsafe impl Send for Listener {}

impl Listener {
    fn error(&self) -> String {
        // SAFETY: `conn` is a live connection; libpq returns a
        // NUL-terminated string it owns, copied before any other call.
        unsafe { CStr::from_ptr(pq_sys::PQerrorMessage(self.conn)) }
            .to_string_lossy()
            .trim()
            .to_owned()
    }

    pub(crate) fn connect(target: &str, channel: &str) -> Result<Self, String> {
        let info =
            CString::new(target).map_err(|_| "the database URL holds a NUL byte".to_owned())?;
        // SAFETY: `info` is a valid C string; a null result is handled and
        // any other result is owned by the returned Listener (freed on drop).
        let conn = unsafe { pq_sys::PQconnectdb(info.as_ptr()) };
        if conn.is_null() {
            return Err("libpq could not allocate a connection".into());
        }
        let me = Self { conn };
        // SAFETY: `conn` is non-null and owned by `me`.
        if unsafe { pq_sys::PQstatus(me.conn) } != pq_sys::ConnStatusType::CONNECTION_OK {
            return Err(me.error());
        }
        let query = CString::new(format!("LISTEN {channel}")).map_err(|e| e.to_string())?;
        // SAFETY: `conn` is connected; the result is cleared right away.
        let ok = unsafe {
            let res = pq_sys::PQexec(me.conn, query.as_ptr());
            let status = pq_sys::PQresultStatus(res);
            pq_sys::PQclear(res);
            status == pq_sys::ExecStatusType::PGRES_COMMAND_OK
        };
        if !ok {
            return Err(me.error());
        }
        Ok(me)
    }

    /// The payloads of the notifications that arrived, waiting up to
    /// `timeout` for the first; an error once the connection is broken.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<Vec<String>, String> {
        let mut out = self.take()?;
        if !out.is_empty() {
            return Ok(out);
        }
        // SAFETY: `conn` is live; a negative fd means no connection.
        let fd = unsafe { pq_sys::PQsocket(self.conn) };
        if fd < 0 {
            return Err(self.error());
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the call's duration.
        let ready = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(out);
            }
            return Err(e.to_string());
        }
        if ready > 0 {
            // SAFETY: `conn` is live.
            if unsafe { pq_sys::PQconsumeInput(self.conn) } == 0 {
                return Err(self.error());
            }
            out = self.take()?;
        }
        Ok(out)
    }

    /// Notifications libpq has already read.
    fn take(&mut self) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        loop {
            // SAFETY: `conn` is live; each notification is copied, then
            // freed with PQfreemem as libpq requires.
            let n = unsafe { pq_sys::PQnotifies(self.conn) };
            if n.is_null() {
                break;
            }
            let payload = unsafe { CStr::from_ptr((*n).extra) }
                .to_string_lossy()
                .into_owned();
            unsafe { pq_sys::PQfreemem(n.cast()) };
            out.push(payload);
        }
        // SAFETY: `conn` is live.
        if unsafe { pq_sys::PQstatus(self.conn) } != pq_sys::ConnStatusType::CONNECTION_OK {
            return Err(self.error());
        }
        Ok(out)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: `conn` came from PQconnectdb and is finished once.
        unsafe { pq_sys::PQfinish(self.conn) };
    }
}
