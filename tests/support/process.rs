//! Child processes with bounded run times.

use std::io::{Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::show;

/// Runs `command` to completion with its output captured; kills it and
/// panics if it takes longer than `limit`. Blocking: async tests use
/// [`run_limited_async`].
pub fn run_limited(command: &mut Command, limit: Duration) -> Output {
    run_limited_with_input(command, None, limit)
}

/// [`run_limited`] with `input` written to the command's stdin (then
/// closed); without input stdin is empty.
pub fn run_limited_with_input(
    command: &mut Command,
    input: Option<&[u8]>,
    limit: Duration,
) -> Output {
    let what = format!("{command:?}");
    let stdin = if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let mut child = command
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    if let Some(bytes) = input {
        // Dropped at the end of this block: the command sees EOF.
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(bytes).expect("write stdin");
    }
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = out_reader.join().unwrap_or_default();
            let stderr = err_reader.join().unwrap_or_default();
            panic!(
                "{what} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                show(&stdout),
                show(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

/// [`run_limited_with_input`] on a blocking thread, so lockgate, which runs
/// on the test's own runtime, keeps serving the command meanwhile.
pub async fn run_limited_async(
    mut command: Command,
    input: Option<Vec<u8>>,
    limit: Duration,
) -> Output {
    tokio::task::spawn_blocking(move || {
        run_limited_with_input(&mut command, input.as_deref(), limit)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `tests/py/<script>` with `args` under `python3` (or `$PYTHON`),
/// for at most `limit`, and returns what it printed; fails the test with
/// its output unless it exits 0. A missing Python module is a failure,
/// never a skip (`scripts/setup.sh` installs `tests/py/requirements.txt`).
pub async fn python(script: &str, args: &[String], limit: Duration) -> String {
    let interpreter = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    driver(&interpreter, "tests/py", script, args, limit).await
}

/// Runs `tests/js/<script>` with `args` under `node`, as [`python`] does
/// (`scripts/setup.sh` installs `tests/js`'s packages).
pub async fn node(script: &str, args: &[String], limit: Duration) -> String {
    driver("node", "tests/js", script, args, limit).await
}

async fn driver(
    program: &str,
    dir: &str,
    script: &str,
    args: &[String],
    limit: Duration,
) -> String {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(dir)
        .join(script);
    let mut command = Command::new(program);
    command.arg(&path).args(args);
    let output = run_limited_async(command, None, limit).await;
    let (out, err) = (super::show(&output.stdout), super::show(&output.stderr));
    assert!(
        output.status.success(),
        "{script} failed with {}\nstdout:\n{out}\nstderr:\n{err}",
        output.status
    );
    out
}

/// Sends `sig` (`-STOP`, `-CONT`, …) to `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// The state letter of `pid` in `/proc/PID/stat` (`T` when stopped).
pub fn proc_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit(')')
        .next()
        .and_then(|rest| rest.trim_start().chars().next())
        .unwrap_or('?')
}

/// A redis-server stopped with SIGSTOP; SIGCONT when dropped, so a failing
/// test never leaves a stopped process behind.
pub struct Paused(pub u32);

impl Paused {
    /// Stops `pid` and waits until the kernel reports it stopped.
    pub async fn stop(pid: u32) -> Paused {
        signal(pid, "-STOP");
        let paused = Paused(pid);
        super::eventually("redis-server stopped", || proc_state(pid) == 'T').await;
        paused
    }

    /// Resumes it now.
    pub fn resume(self) {}
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}
