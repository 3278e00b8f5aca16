//! A lease that ran out before its holder released or extended it, shown
//! to operators (issue 45: a legacy holder's lapse gains its key, client
//! and overrun on the page): `LOCKGATE LAPSES` and `/status.json` name the
//! key, the holder's client name and address, how long it held against
//! its lease and the overrun, newest first, at most `admin.recent_lapses`;
//! never the value or a token.

use crate::support;

use support::locks::{exists, m};
use support::ops::{base_config, call, Ops};
use support::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_shown_with_its_key_client_and_overrun() {
    let redis = RedisServer::start();
    let mut config = base_config(&redis.addr());
    config.admin.recent_lapses = 2;
    let lg = Ops::start(config).await;
    let mut direct = support::RawClient::connect(redis.addr()).await;
    let mut app = lg.client().await;
    assert_eq!(
        app.call_s(&["CLIENT", "SETNAME", "billing-worker"]).await,
        "+OK\r\n"
    );
    let mut admin = lg.client().await;
    // Three legacy holders, each outliving a 150 ms lease, then releasing
    // (or, the last, extending): the two latest are kept.
    for (key, then) in [
        ("lock:lapse:a", "DEL"),
        ("lock:lapse:b", "DEL"),
        ("lock:lapse:c", "EXPIRE"),
    ] {
        let set = app
            .call_s(&["SET", key, "secret-value", "NX", "PX", "150"])
            .await;
        assert_eq!(set, "+OK\r\n");
        crate::until!("the lease to run out", !exists(&mut direct, key).await);
        let args: Vec<&str> = match then {
            "DEL" => vec!["DEL", key],
            _ => vec!["EXPIRE", key, "10"],
        };
        assert_eq!(app.call_s(&args).await, ":0\r\n", "{key}");
    }
    assert_eq!(m(&lg.ctx.locks.metrics.lease_expired_before_release), 3);
    let rows = call(&mut admin, &["LOCKGATE", "LAPSES"]).await;
    let keys: Vec<&str> = rows.items().iter().map(|r| r.field("key").text()).collect();
    assert_eq!(keys, ["lock:lapse:c", "lock:lapse:b"], "{rows}");
    let newest = &rows.items()[0];
    assert_eq!(
        newest.field("client_name").text(),
        "billing-worker",
        "{newest}"
    );
    assert_eq!(newest.field("found_by").text(), "extend", "{newest}");
    assert_eq!(rows.items()[1].field("found_by").text(), "release");
    let (held, lease, overrun) = (
        newest.field("held_ms").int(),
        newest.field("lease_ms").int(),
        newest.field("overrun_ms").int(),
    );
    assert_eq!(lease, 150, "{newest}");
    assert!(held > lease && overrun == held - lease, "{newest}");
    assert!(
        !rows.to_string().contains("secret-value"),
        "a value shown: {rows}"
    );
    // The page's JSON says the same.
    let status = lg.status_json().await;
    let lapses = status["lapses"].as_array().expect("lapses");
    assert_eq!(lapses.len(), 2, "{status}");
    assert_eq!(lapses[0]["key"], "lock:lapse:c");
    assert_eq!(lapses[0]["client_name"], "billing-worker");
    assert_eq!(lapses[0]["overrun_ms"].as_u64(), Some(overrun as u64));
    assert!(!status.to_string().contains("secret-value"));
    lg.stop().await;
}
