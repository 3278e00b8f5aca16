//! A redis-server whose wall clock a test can step while it runs:
//! libfaketime preloaded, reading its offset from a file on every clock
//! call. Only the wall clock is faked (Redis expires keys by it); the
//! monotonic clock stays real, as after an NTP step.

use std::path::PathBuf;

use crate::support::RedisServer;

/// Where Debian's `libfaketime` package puts the library.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
/// Preloaded before libfaketime: Redis's jemalloc otherwise hangs at start
/// under libfaketime (it calls the clock before it can allocate).
const MALLOC_DEBUG: &str = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0";

/// The offset file of one faked clock; the directory goes with it.
pub struct FakeClock {
    dir: tempfile::TempDir,
}

impl FakeClock {
    /// A clock at real time (offset `+0`).
    pub fn new() -> FakeClock {
        let clock = FakeClock {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        clock.set_offset_secs(0);
        clock
    }

    /// True when libfaketime is installed (the tests that need it say so
    /// and fail rather than pass vacuously).
    pub fn available() -> bool {
        std::path::Path::new(LIBFAKETIME).exists() && std::path::Path::new(MALLOC_DEBUG).exists()
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("faketime.rc")
    }

    /// Sets the clock to real time plus `secs` (a step, seen by the next
    /// clock call of the process).
    pub fn set_offset_secs(&self, secs: i64) {
        // Written whole and renamed, so the process never reads half a line.
        let tmp = self.dir.path().join("faketime.rc.tmp");
        std::fs::write(&tmp, format!("{secs:+}\n")).expect("write faketime file");
        std::fs::rename(&tmp, self.file()).expect("rename faketime file");
    }

    /// A redis-server with this clock.
    pub fn start_redis(&self) -> RedisServer {
        assert!(
            FakeClock::available(),
            "libfaketime is needed ({LIBFAKETIME}, {MALLOC_DEBUG}): apt-get install faketime"
        );
        let env = [
            ("LD_PRELOAD", format!("{MALLOC_DEBUG} {LIBFAKETIME}")),
            ("FAKETIME_TIMESTAMP_FILE", self.file().display().to_string()),
            ("FAKETIME_NO_CACHE", "1".to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v));
        // jemalloc's background thread also hangs under libfaketime.
        RedisServer::start_with_env(&["--jemalloc-bg-thread", "no"], &env)
    }
}
