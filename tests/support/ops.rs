//! Shared by `tests/it/ops.rs` and `tests/it/ops_reload.rs`: lockgate in-process
//! with its admin HTTP listener (both on port 0), a tiny HTTP/1.1 client
//! over a `TcpStream`, a Prometheus text parser for the numbers, the Python
//! `prometheus_client` parsers as the independent judge of the format. The
//! status page's browser is in [`super::browser`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;

use lockgate::{Config, ServerContext};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::resp::Resp;
use crate::support::{cmd, run_limited_async, show, Lockgate, RawClient, WAIT};

/// lockgate in this process: the RESP listener and the admin HTTP listener
/// on port 0, stopped (and its admin listener with it) on drop.
pub struct Ops {
    /// Where clients connect (RESP).
    pub addr: SocketAddr,
    /// The admin HTTP listener.
    pub admin: SocketAddr,
    /// The shared context.
    pub ctx: Arc<ServerContext>,
    lg: Lockgate,
}

/// The fields of a `LOCKGATE LOCKS` record, in order.
pub const LOCK_FIELDS: [&str; 13] = [
    "key",
    "acquisition",
    "holder",
    "client_addr",
    "client_name",
    "held_ms",
    "lease_left_ms",
    "waiters",
    "oldest_wait_ms",
    "kind",
    "holders",
    "entries",
    "writers_waiting",
];

/// The fields of a `LOCKGATE HOTKEYS` record, in order.
pub const HOTKEY_FIELDS: [&str; 7] = [
    "key",
    "attempts",
    "attempts_per_sec",
    "acquired",
    "absorbed",
    "parked",
    "holder",
];

/// A configuration for tests in front of `upstream`: a fixed instance id,
/// fast reconnects, a short drain.
pub fn base_config(upstream: &str) -> Config {
    let mut c = Config::default();
    c.upstream.addr = upstream.to_string();
    c.upstream.reconnect_interval_ms = 50;
    c.proxy.shutdown_grace_ms = 300;
    c.locks.instance_id = "ops-test".to_string();
    c
}

impl Ops {
    /// Starts lockgate with `config` (validated first; its listen
    /// addresses are ignored: both listeners are on port 0).
    pub async fn start(config: Config) -> Ops {
        let lg = Lockgate::start_with_admin(config).await;
        Ops {
            addr: lg.addr,
            admin: lg.admin.expect("an admin listener"),
            ctx: lg.ctx.clone(),
            lg,
        }
    }

    /// A new client connection.
    pub async fn client(&self) -> RawClient {
        RawClient::connect(self.addr).await
    }

    /// `GET path` on the admin listener.
    pub async fn get(&self, path: &str) -> HttpReply {
        http_get(self.admin, path).await
    }

    /// `/metrics`, checked for status and content type, parsed.
    pub async fn metrics(&self) -> Metrics {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, 200, "/metrics answered {}: {}", r.status, r.body);
        let ct = r.header("content-type").unwrap_or("");
        assert!(
            ct.starts_with("application/openmetrics-text") || ct.starts_with("text/plain"),
            "/metrics content-type {ct:?}"
        );
        Metrics::parse(&r.body)
    }

    /// `/status.json`, parsed.
    pub async fn status_json(&self) -> serde_json::Value {
        let r = self.get("/status.json").await;
        assert_eq!(r.status, 200, "/status.json answered {}", r.status);
        serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("/status.json is not JSON ({e}): {}", r.body))
    }

    /// Signals shutdown and waits (bounded) until lockgate returned.
    pub async fn stop(self) {
        self.lg.stop().await
    }
}

/// One HTTP response.
#[derive(Debug, Clone)]
pub struct HttpReply {
    /// The status code.
    pub status: u16,
    /// Header names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked), as text.
    pub body: String,
}

impl HttpReply {
    /// The first header called `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` over HTTP/1.1 with `Connection: close`, read to EOF (bounded
/// by [`WAIT`]).
pub async fn http_get(addr: SocketAddr, path: &str) -> HttpReply {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    http_exchange(addr, path, req).await
}

/// `POST path` with the JSON `body` over HTTP/1.1, `Connection: close`,
/// read to EOF (bounded by [`WAIT`]).
pub async fn http_post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> HttpReply {
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    http_exchange(addr, path, req).await
}

/// Sends the whole request `req` for `path` and reads the response to EOF
/// (bounded by [`WAIT`]).
async fn http_exchange(addr: SocketAddr, path: &str, req: String) -> HttpReply {
    let exchange = async {
        let mut s = TcpStream::connect(addr).await.expect("connect admin");
        s.write_all(req.as_bytes()).await.expect("write request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.expect("read response");
        raw
    };
    let raw = tokio::time::timeout(WAIT, exchange)
        .await
        .unwrap_or_else(|_| panic!("{path}: no whole response within {WAIT:?}"));
    parse_http(&raw, path)
}

/// Like [`http_get`], but `None` when nothing listens yet (or the
/// connection fails before a whole response).
pub async fn try_http_get(addr: SocketAddr, path: &str) -> Option<HttpReply> {
    let exchange = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        Some(raw)
    };
    let raw = tokio::time::timeout(WAIT, exchange).await.ok()??;
    raw.windows(4)
        .any(|w| w == b"\r\n\r\n")
        .then(|| parse_http(&raw, path))
}

fn parse_http(raw: &[u8], path: &str) -> HttpReply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("GET {path}: no header end in {:?}", show(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    assert_eq!(
        parts.next(),
        Some("HTTP/1.1"),
        "GET {path}: status line {status_line:?}"
    );
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("GET {path}: status line {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let header = |n: &str| headers.iter().find(|(h, _)| h == n).map(|(_, v)| v.clone());
    if header("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        body = dechunk(&body, path);
    } else if let Some(len) = header("content-length") {
        let len: usize = len.parse().expect("content-length");
        assert_eq!(body.len(), len, "GET {path}: body length vs content-length");
    }
    let body = String::from_utf8(body)
        .unwrap_or_else(|e| panic!("GET {path}: body not UTF-8: {:?}", show(e.as_bytes())));
    HttpReply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8], path: &str) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .unwrap_or_else(|| panic!("GET {path}: bad chunk header"));
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .unwrap_or_else(|_| panic!("GET {path}: bad chunk size {size_text:?}"));
        data = &data[eol + 2..];
        if size == 0 {
            return out;
        }
        assert!(data.len() >= size + 2, "GET {path}: truncated chunk");
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// One sample line of the exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The sample name (`…_total`, `…_bucket`, …).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// A scrape of `/metrics`.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// The text as served.
    pub text: String,
    /// Every sample line, in order.
    pub samples: Vec<Sample>,
}

impl Metrics {
    /// Parses the sample lines of the Prometheus / OpenMetrics text format
    /// (comments skipped; panics on a line it cannot read).
    pub fn parse(text: &str) -> Metrics {
        let samples = text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(parse_sample)
            .collect();
        Metrics {
            text: text.to_string(),
            samples,
        }
    }

    /// The value of the sample `name` with exactly `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }

    /// Like [`Self::get`], panicking with the sample names when absent.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or_else(|| {
            let names: std::collections::BTreeSet<&str> =
                self.samples.iter().map(|s| s.name.as_str()).collect();
            panic!("no sample {name}{labels:?} in /metrics; names: {names:?}")
        })
    }

    /// A counter or gauge without labels, as an integer.
    pub fn int(&self, name: &str) -> i64 {
        let v = self.value(name, &[]);
        assert_eq!(v.fract(), 0.0, "{name} = {v} is not an integer");
        v as i64
    }

    /// Every sample called `name`.
    pub fn series(&self, name: &str) -> Vec<&Sample> {
        self.samples.iter().filter(|s| s.name == name).collect()
    }
}

fn parse_sample(line: &str) -> Sample {
    let bad = |why: &str| -> ! { panic!("cannot read sample line ({why}): {line:?}") };
    let name_end = line.find(['{', ' ']).unwrap_or_else(|| bad("no value"));
    let name = line[..name_end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let end = loop {
            let mut key = String::new();
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                bad("label value not quoted");
            }
            let mut value = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('n') => value.push('\n'),
                        Some(c) => value.push(c),
                        None => bad("dangling escape"),
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                bad("unterminated label value");
            }
            labels.insert(key, value);
            match chars.next() {
                Some((i, '}')) => break i + 1,
                Some((_, ',')) => {
                    if let Some(&(i, '}')) = chars.peek() {
                        break i + 1;
                    }
                }
                _ => bad("expected , or }"),
            }
        };
        rest = &after[end..];
    }
    let value_text = rest
        .split_whitespace()
        .next()
        .unwrap_or_else(|| bad("no value"));
    let value: f64 = value_text.parse().unwrap_or_else(|_| bad("bad value"));
    Sample {
        name,
        labels,
        value,
    }
}

/// What the Python `prometheus_client` parsers made of a text: every
/// sample as (family, family type, sample name, labels, value).
#[derive(Debug)]
pub struct PyParsed {
    /// `prometheus_client.parser` (the Prometheus text format).
    pub prometheus: Vec<PySample>,
    /// `prometheus_client.openmetrics.parser` (the format the endpoint's
    /// content type announces), or its error.
    pub openmetrics: Result<Vec<PySample>, String>,
}

/// One sample as a Python parser saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct PySample {
    /// The family name.
    pub family: String,
    /// The family type (counter, gauge, histogram, unknown, …).
    pub kind: String,
    /// The sample name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

const PY_PARSE: &str = r#"
import json, sys
try:
    from prometheus_client.parser import text_string_to_metric_families as prom
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
except ImportError as e:
    sys.stderr.write("cannot import prometheus_client: %s\n" % e)
    sys.exit(3)
text = sys.stdin.read()
def dump(families):
    return [{"family": f.name, "kind": f.type, "name": s.name, "labels": s.labels,
             "value": repr(float(s.value))} for f in families for s in f.samples]
out = {"prometheus": dump(prom(text))}
try:
    out["openmetrics"] = dump(om(text))
except Exception as e:
    out["openmetrics_error"] = repr(e)
print(json.dumps(out))
"#;

/// Runs the Python `prometheus_client` parsers over `text`. Fails the test
/// with how to install the module when it is missing, and with Python's
/// error when the Prometheus text parser refuses the text.
pub async fn python_parse(text: &str) -> PyParsed {
    let mut command = Command::new("python3");
    command.args(["-c", PY_PARSE]);
    let out = run_limited_async(command, Some(text.as_bytes().to_vec()), WAIT).await;
    if out.status.code() == Some(3) {
        panic!(
            "python3 has no prometheus_client module ({}); this test needs it: \
             `python3 -m pip install prometheus_client` (scripts/test.sh installs it)",
            show(&out.stderr).trim()
        );
    }
    assert!(
        out.status.success(),
        "prometheus_client.parser refused /metrics ({}):\n{}\n--- text ---\n{text}",
        out.status,
        show(&out.stderr)
    );
    // Values travel as Python's repr and are parsed here: serde_json's
    // own float parsing is not always correctly rounded.
    #[derive(serde::Deserialize)]
    struct RawSample {
        family: String,
        kind: String,
        name: String,
        labels: BTreeMap<String, String>,
        value: String,
    }
    #[derive(serde::Deserialize)]
    struct Raw {
        prometheus: Vec<RawSample>,
        openmetrics: Option<Vec<RawSample>>,
        openmetrics_error: Option<String>,
    }
    let raw: Raw = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("python output not JSON ({e}): {}", show(&out.stdout)));
    let samples = |v: Vec<RawSample>| -> Vec<PySample> {
        v.into_iter()
            .map(|s| PySample {
                value: s
                    .value
                    .parse()
                    .unwrap_or_else(|_| panic!("python value {:?}", s.value)),
                family: s.family,
                kind: s.kind,
                name: s.name,
                labels: s.labels,
            })
            .collect()
    };
    PyParsed {
        prometheus: samples(raw.prometheus),
        openmetrics: match (raw.openmetrics, raw.openmetrics_error) {
            (Some(s), _) => Ok(samples(s)),
            (None, e) => Err(e.unwrap_or_default()),
        },
    }
}

/// Sends `args` and returns the reply as text, adding the bytes each way
/// to `io` (sent, received).
pub async fn counted(c: &mut RawClient, args: &[&str], io: &mut (u64, u64)) -> String {
    let req = cmd(args);
    c.send(&req).await;
    let reply = c.read_raw().await;
    io.0 += req.len() as u64;
    io.1 += reply.len() as u64;
    show(&reply)
}

/// Sends `args` and decodes the reply.
pub async fn call(c: &mut RawClient, args: &[&str]) -> Resp {
    Resp::parse(&c.call_raw(args).await)
}
