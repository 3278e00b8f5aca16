//! A post-mortem aid, off by default: with `QUORUM_CHAOS_MONITOR=DIR` every
//! lock master's `MONITOR` stream is written to `DIR/m<i>.log`, each line
//! prefixed with the test's own time (`t+ms`, the journal's epoch), so a
//! failure's timeline can be read command by command on every master. A
//! connection that breaks (the master was killed) is opened again.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The recorders; they stop when dropped.
pub struct Monitors {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Monitors {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Starts one recorder per master in `addrs`, writing into `dir`.
pub fn start(addrs: &[String], dir: &Path, epoch: Instant) -> Monitors {
    std::fs::create_dir_all(dir).expect("monitor directory");
    let stop = Arc::new(AtomicBool::new(false));
    let threads = addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let (addr, stop) = (addr.clone(), stop.clone());
            let path = dir.join(format!("m{i}.log"));
            std::thread::spawn(move || record(&addr, &path, epoch, &stop))
        })
        .collect();
    Monitors { stop, threads }
}

fn record(addr: &str, path: &Path, epoch: Instant, stop: &AtomicBool) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("monitor log"));
    let t = || epoch.elapsed().as_secs_f64() * 1e3;
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut s) = TcpStream::connect(addr) else {
            // The master is down: try again shortly (a retry, not a wait
            // for an event).
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        if s.write_all(b"MONITOR\r\n").is_err() {
            continue;
        }
        let _ = writeln!(out, "t+{:.1} (monitor connected)", t());
        let mut r = BufReader::new(s);
        let mut line = String::new();
        while !stop.load(Ordering::SeqCst) {
            // A timeout may leave part of a line read: it stays in `line`.
            match r.read_line(&mut line) {
                Ok(0) => break,
                Ok(_) => {
                    let _ = write!(out, "t+{:.1} {line}", t());
                    line.clear();
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => break,
            }
        }
        let _ = writeln!(out, "t+{:.1} (monitor disconnected)", t());
    }
    let _ = out.flush();
}
