//! Headless Chromium for the status page: a one-shot `--dump-dom`, and a
//! live page driven over `--remote-debugging-pipe` (CDP through two FIFOs).
//! Every browser runs in its own process group, killed by PID on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's chromium package puts the browser.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// Fails the test with how to install Chromium when it is missing.
pub fn require_chromium() {
    if !Path::new(CHROMIUM).exists() {
        panic!(
            "{CHROMIUM} is missing: the status page test needs headless Chromium \
             (`apt-get install -y chromium`; scripts/test.sh installs it)"
        );
    }
}

/// The flags every headless run here uses.
pub const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
];

/// Runs `chromium … --virtual-time-budget=3000 --dump-dom url` (bounded;
/// its whole process group is killed if it overruns) and returns the DOM.
pub async fn dump_dom(url: &str) -> String {
    require_chromium();
    let url = url.to_string();
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("tempdir");
        let out_path = dir.path().join("dom.html");
        let err_path = dir.path().join("stderr.txt");
        let mut command = Command::new(CHROMIUM);
        command
            .args(CHROMIUM_FLAGS)
            .arg(format!(
                "--user-data-dir={}",
                dir.path().join("profile").display()
            ))
            .args(["--virtual-time-budget=3000", "--dump-dom", &url])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_path).expect("dom file"))
            .stderr(std::fs::File::create(&err_path).expect("stderr file"));
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command.spawn().expect("spawn chromium");
        let limit = Duration::from_secs(60);
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                kill_group(&mut child);
                panic!(
                    "chromium --dump-dom did not finish within {limit:?}; stderr:\n{}",
                    std::fs::read_to_string(&err_path).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let dom = std::fs::read_to_string(&out_path).unwrap_or_default();
        assert!(
            status.success() && dom.contains("</html>"),
            "chromium --dump-dom {url} failed ({status}); stderr:\n{}",
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        dom
    })
    .await
    .expect("dump-dom task")
}

/// Kills `child`'s whole process group (it was started as its leader) and
/// reaps it.
fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// A headless Chromium driven over the DevTools protocol on
/// `--remote-debugging-pipe` (fd 3 in, fd 4 out, NUL-separated JSON), here
/// through two FIFOs. The test reads the live page's DOM whenever it wants,
/// in real time (no reload, no virtual time).
pub struct Browser {
    child: Option<Child>,
    to_browser: std::fs::File,
    from_browser: tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
    session: String,
    next_id: u64,
    dir: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium and opens `url` in a new page.
    pub async fn open(url: &str) -> Browser {
        require_chromium();
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo_in = dir.path().join("cdp-in");
        let fifo_out = dir.path().join("cdp-out");
        for f in [&fifo_in, &fifo_out] {
            let st = Command::new("mkfifo").arg(f).status().expect("run mkfifo");
            assert!(st.success(), "mkfifo {}", f.display());
        }
        // Opened read+write: on Linux that never blocks, whichever side
        // comes first.
        let open = |p: &PathBuf| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
        };
        let to_browser = open(&fifo_in);
        let mut from = open(&fifo_out);
        let mut flags: Vec<String> = CHROMIUM_FLAGS.iter().map(|s| s.to_string()).collect();
        flags.push(format!(
            "--user-data-dir={}",
            dir.path().join("profile").display()
        ));
        flags.push("--remote-debugging-pipe".to_string());
        flags.push("about:blank".to_string());
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(r#"exec "$@" 3<"$CDP_IN" 4>"$CDP_OUT""#)
            .arg("sh")
            .arg(CHROMIUM)
            .args(&flags)
            .env("CDP_IN", &fifo_in)
            .env("CDP_OUT", &fifo_out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.txt")).expect("stderr file"));
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command.spawn().expect("spawn chromium");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf: Vec<u8> = Vec::new();
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match from.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.iter().position(|&b| b == 0) {
                    let msg: Vec<u8> = buf.drain(..=end).collect();
                    if let Ok(v) = serde_json::from_slice(&msg[..msg.len() - 1]) {
                        if tx.send(v).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let mut b = Browser {
            child: Some(child),
            to_browser,
            from_browser: rx,
            session: String::new(),
            next_id: 0,
            dir,
        };
        let target = b
            .call(
                None,
                "Target.createTarget",
                serde_json::json!({ "url": url }),
            )
            .await;
        let target_id = target["targetId"].as_str().expect("targetId").to_string();
        let attached = b
            .call(
                None,
                "Target.attachToTarget",
                serde_json::json!({ "targetId": target_id, "flatten": true }),
            )
            .await;
        b.session = attached["sessionId"]
            .as_str()
            .expect("sessionId")
            .to_string();
        b
    }

    /// Chromium's stderr so far (for failure messages).
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.txt")).unwrap_or_default()
    }

    async fn call(
        &mut self,
        session: Option<&str>,
        method: &str,
        params: serde_json::Value,
    ) -> serde_json::Value {
        use std::io::Write;
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = serde_json::json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = serde_json::Value::String(s.to_string());
        }
        let mut bytes = serde_json::to_vec(&msg).expect("json");
        bytes.push(0);
        self.to_browser
            .write_all(&bytes)
            .expect("write to chromium");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = tokio::time::timeout_at(deadline, self.from_browser.recv()).await;
            let v = match got {
                Ok(Some(v)) => v,
                Ok(None) | Err(_) => panic!(
                    "no answer from chromium to {method} (it stopped, or took over 30 s); stderr:\n{}",
                    self.stderr()
                ),
            };
            if v["id"].as_u64() == Some(id) {
                if let Some(e) = v.get("error") {
                    panic!("chromium refused {method}: {e}");
                }
                return v["result"].clone();
            }
        }
    }

    /// Evaluates `expression` in the page and returns its value (JSON).
    pub async fn eval(&mut self, expression: &str) -> serde_json::Value {
        let session = self.session.clone();
        let r = self
            .call(
                Some(&session),
                "Runtime.evaluate",
                serde_json::json!({ "expression": expression, "returnByValue": true }),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!("page script failed: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Saves a PNG of the page as it is now to `path` (its folder made);
    /// returns its size in bytes.
    pub async fn screenshot(&mut self, path: &std::path::Path) -> usize {
        use base64::Engine;
        let session = self.session.clone();
        let r = self
            .call(
                Some(&session),
                "Page.captureScreenshot",
                serde_json::json!({ "format": "png", "captureBeyondViewport": true }),
            )
            .await;
        let data = r["data"].as_str().expect("screenshot data");
        let png = (base64::engine::general_purpose::STANDARD)
            .decode(data)
            .expect("base64 PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("artifact folder");
        }
        std::fs::write(path, &png).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        png.len()
    }

    /// Closes the browser and waits (bounded) for it to exit.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            self.call(None, "Browser.close", serde_json::json!({})),
        )
        .await;
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            kill_group(&mut child);
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
    }
}
