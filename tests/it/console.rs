//! The on-call person's console (docs/operations.md, "Operators' view"):
//! after a spin storm, the status page in a real headless Chromium shows
//! the storm and its absorption in charts drawn by its own script (client
//! attempts far above those sent to Redis), the rates from the first
//! paint, and the locks table with the holder; a screenshot is kept
//! under `target/test-artifacts/`. The page's release button's endpoint
//! frees a lock only with the admin password and only while the
//! acquisition shown holds it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support;

use support::browser::Browser;
use support::ops::{base_config, http_post_json, Ops};
use support::{RawClient, RedisServer};

/// The page's state: each chart's series with their point counts, the
/// header's rates, the locks table's cells.
const PAGE: &str = r#"(() => {
  const charts = Array.from(document.querySelectorAll('#charts figure')).map(f => ({
    title: f.querySelector('figcaption').firstChild.textContent,
    series: Object.fromEntries(Array.from(f.querySelectorAll('polyline'))
      .map(p => [p.dataset.series, p.getAttribute('points').split(' ').length])),
  }));
  const rows = id => Array.from(document.querySelectorAll(`#${id} tr`))
    .map(tr => Array.from(tr.cells).map(td => td.textContent));
  const locks = rows('locks');
  const guards = rows('guards');
  const text = id => { const e = document.getElementById(id); return e ? e.textContent : null; };
  return {charts, locks, guards, attempts: text('attempts'), sent: text('sent'),
    unsafe: text('unsafe'),
    last: (typeof hist !== 'undefined' && hist.length) ? hist[hist.length - 1] : null,
    samples: (typeof hist !== 'undefined') ? hist.length : 0};
})()"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_the_storm_absorbed_and_who_holds_the_lock() {
    let redis = RedisServer::start();
    let mut c = base_config(&redis.addr());
    c.admin.history_interval_ms = 250;
    c.admin.history_seconds = 60;
    c.admin.password = "pw".into();
    // A guard on the lock's data: its counters are on the page too.
    c.locks.guards = vec![lockgate::config::GuardConfig {
        lock: "lock:storm:{id}".into(),
        data: vec!["storm:{id}".into()],
        // Report: on a server that refuses scripts (scripts/noscript-tests.sh)
        // the write passes unchecked instead of checked.
        mode: lockgate::config::GuardMode::Report,
        unlocked_writers: lockgate::config::UnlockedWriters::Allow,
    }];
    let lg = Ops::start(c).await;
    crate::until!(
        "the command table",
        !lg.ctx.locks.guard_table.get().is_empty()
    );
    let key = "lock:storm:1";
    let mut holder = lg.client().await;
    assert_eq!(
        holder.call_s(&["CLIENT", "SETNAME", "the-holder"]).await,
        "+OK\r\n"
    );
    assert_eq!(holder.call_s(&["SETNX", key, "h"]).await, ":1\r\n");
    assert_eq!(holder.call_s(&["SET", "storm:1", "x"]).await, "+OK\r\n");
    // The incident's shape: clients spinning on SETNX of a held lock.
    let stop = Arc::new(AtomicBool::new(false));
    let mut spinners = Vec::new();
    for _ in 0..8 {
        let (addr, stop) = (lg.addr, stop.clone());
        spinners.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr).await;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                assert_eq!(c.call_s(&["SETNX", key, "spin"]).await, ":0\r\n");
                n += 1;
            }
            n
        }));
    }
    // Two seconds of storm: eight history samples.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let url = format!("http://{}/", lg.admin);
    let mut browser = Browser::open(&url).await;
    let deadline = tokio::time::Instant::now() + support::WAIT;
    let state = loop {
        let s = browser.eval(PAGE).await;
        let attempts = &s["charts"][0]["series"];
        let drawn = attempts["attempts_per_sec"].as_u64().unwrap_or(0) >= 4
            && attempts["sent_per_sec"].as_u64().unwrap_or(0) >= 4;
        let locked = (s["locks"].as_array().into_iter().flatten())
            .any(|r| r[0] == key && r[5].as_str().is_some_and(|c| c.contains("the-holder")));
        // The guard's row: its lock pattern, its mode, the one write
        // (applied, or unchecked where the server refuses scripts).
        let guarded = (s["guards"].as_array().into_iter().flatten()).any(|r| {
            r[0] == "lock:storm:{id}" && r[1] == "report" && (r[2] == "1") != (r[6] == "1")
        });
        if drawn && locked && guarded {
            break s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the page never showed the storm, the lock and the guard: {s}\n{}",
            browser.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("../test-artifacts/console-after-storm.png");
    let bytes = browser.screenshot(&shot).await;
    assert!(bytes > 10_000, "a screenshot of {bytes} bytes");
    stop.store(true, Ordering::Relaxed);
    let mut spun = 0;
    for s in spinners {
        spun += s.await.expect("spinner");
    }
    assert!(spun > 100, "the storm: {spun} attempts");

    // The test's Redis runs without an append-only file: named.
    assert_eq!(state["unsafe"], "no_aof", "{state}");
    // Six charts, each with every series drawn.
    let charts = state["charts"].as_array().expect("charts");
    assert_eq!(charts.len(), 6, "{state}");
    // The storm absorbed, visibly: the last sample's attempts far above
    // those sent to Redis, and the header says the same from the start.
    let last = &state["last"];
    let (attempts, sent) = (
        last["attempts_per_sec"].as_f64().expect("attempts"),
        last["sent_per_sec"].as_f64().expect("sent"),
    );
    assert!(attempts > 50.0 && sent * 10.0 < attempts, "{last}");
    let header: f64 = state["attempts"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("a rate");
    assert_eq!(
        header,
        attempts.round(),
        "the header's rate is the last sample's"
    );
    // The locks table: the key, its kind, its acquisition, this instance,
    // no holders' count (one holder, by its owner record), the holder.
    let row = (state["locks"].as_array().into_iter().flatten())
        .find(|r| r[0] == key)
        .expect("the lock's row");
    assert_eq!(row[1], "exclusive", "{row}");
    assert_eq!(row[2].as_str().map(str::len), Some(16), "{row}");
    assert_eq!(row[3], "this instance");
    assert_eq!(row[4], "—");
    let acquisition = row[2].as_str().expect("acquisition").to_string();
    browser.close().await;

    // The release button's endpoint: the password first, then the
    // acquisition shown, once.
    let post = |password: &str, acq: &str| serde_json::json!({"key": key, "acquisition": acq, "password": password});
    let r = http_post_json(lg.admin, "/locks/release", &post("nope", &acquisition)).await;
    assert_eq!(r.status, 403, "{}", r.body);
    let r = http_post_json(lg.admin, "/locks/release", &post("pw", "zz")).await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("16 hex digits"), "{}", r.body);
    let r = http_post_json(lg.admin, "/locks/release", &post("pw", &acquisition)).await;
    assert_eq!((r.status, r.body.as_str()), (200, r#"{"released":true}"#));
    let r = http_post_json(lg.admin, "/locks/release", &post("pw", &acquisition)).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(
        r.body.contains("no longer held by acquisition"),
        "{}",
        r.body
    );
    assert_eq!(
        lg.ctx
            .locks
            .metrics
            .operator_released
            .load(Ordering::Relaxed),
        1
    );
    // Freed: the next attempt takes it.
    let mut next = lg.client().await;
    assert_eq!(next.call_s(&["SETNX", key, "n"]).await, ":1\r\n");
    lg.stop().await;
}
