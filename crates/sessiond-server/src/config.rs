//! Configuration, read once here and passed down as typed values.
//! Precedence: flags, then `SESSIOND_*` environment variables, then defaults.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, bail};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Directory for the embedded SQLite database and other state.
    /// Default: $XDG_DATA_HOME/sessiond, or ~/.local/share/sessiond.
    #[arg(long, env = "SESSIOND_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Database URL: `postgres://...` for production; default is the
    /// SQLite file `sessiond.sqlite3` in the data directory.
    #[arg(long, env = "SESSIOND_DATABASE_URL")]
    pub database_url: Option<String>,

    /// Address to serve gRPC on. Port 0 picks a free port (printed at start).
    #[arg(long, env = "SESSIOND_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "SESSIOND_LOG_JSON")]
    pub log_json: bool,
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub database_url: String,
    pub listen: SocketAddr,
    pub log_json: bool,
}

impl ServeArgs {
    pub fn resolve(self) -> anyhow::Result<Config> {
        let data_dir = match self.data_dir {
            Some(dir) => dir,
            None => default_data_dir().context(
                "data_dir: cannot derive a default (neither XDG_DATA_HOME nor HOME is set); \
                 pass --data-dir or set SESSIOND_DATA_DIR",
            )?,
        };
        let database_url = match self.database_url {
            Some(url) if url.trim().is_empty() => {
                bail!(
                    "database_url: must not be empty; unset it to use the embedded SQLite default"
                )
            }
            Some(url) => url,
            None => data_dir.join("sessiond.sqlite3").display().to_string(),
        };
        Ok(Config {
            data_dir,
            database_url,
            listen: self.listen,
            log_json: self.log_json,
        })
    }
}

fn default_data_dir() -> Option<PathBuf> {
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(xdg).join("sessiond"));
    }
    let home = std::env::var_os("HOME").filter(|v| !v.is_empty())?;
    Some(PathBuf::from(home).join(".local/share/sessiond"))
}
