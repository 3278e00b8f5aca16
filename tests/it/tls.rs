//! TLS on both sides, against real redis-server processes (Debian's is
//! built with TLS): clients on lockgate's TLS listener (mTLS too), lockgate
//! to a Redis that has only a TLS port, the lock quorum over TLS, clients
//! that are not TLS or stall, certificate reload and `--check`.
//! Certificates are made with rcgen for each test.

use crate::support;

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use lockgate::config::ClientTlsConfig;
use lockgate::metrics::ProxyMetrics;
use lockgate::Config;
use support::tls::{client_config, s, Issued, Pki, TlsClient, TlsRedis};
use support::{Lockgate, RawClient, RedisServer, WAIT};
use tokio::io::AsyncReadExt;

fn get(c: &AtomicU64) -> u64 {
    ProxyMetrics::get(c)
}

/// lockgate in front of `upstream` with a TLS listener serving `server`.
fn tls_config(upstream: &str, server: &Issued) -> Config {
    let mut c = Config::default();
    c.upstream.addr = upstream.to_string();
    c.proxy.tls.listen = "127.0.0.1:0".to_string();
    c.proxy.tls.cert_file = s(&server.cert);
    c.proxy.tls.key_file = s(&server.key);
    c
}

/// lockgate as a TLS client of Redis: trusts `pki`, presents `client`.
fn client_tls(pki: &Pki, client: &Issued) -> ClientTlsConfig {
    ClientTlsConfig {
        enabled: true,
        ca_file: s(&pki.ca_file()),
        cert_file: s(&client.cert),
        key_file: s(&client.key),
        server_name: String::new(),
    }
}

#[tokio::test]
async fn tls_clients_pass_through_and_take_locks() {
    let redis = RedisServer::start();
    let pki = Pki::new("test CA");
    let server = pki.issue("server", "lockgate");
    let lg = Lockgate::start_with_tls(tls_config(&redis.addr(), &server)).await;
    let tls = lg.tls.expect("tls listener");
    let trust = client_config(&pki.ca_file(), None);
    let mut a = TlsClient::connect(tls, trust.clone()).await.expect("tls");
    let mut b = TlsClient::connect(tls, trust).await.expect("tls");
    assert_eq!(a.call(&["SET", "k", "v"]).await, "+OK\r\n");
    assert_eq!(b.call(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(a.call(&["SETNX", "lock:t", "a"]).await, ":1\r\n");
    assert_eq!(b.call(&["SETNX", "lock:t", "b"]).await, ":0\r\n");
    // The lock took a lease, as on the plain port.
    let ttl = a.call(&["PTTL", "lock:t"]).await;
    assert!(support::int(&ttl) > 0, "{ttl}");
    // A large value crosses TLS records both ways.
    let big = "x".repeat(300_000);
    assert_eq!(a.call(&["SET", "big", &big]).await, "+OK\r\n");
    assert_eq!(b.call(&["STRLEN", "big"]).await, ":300000\r\n");
    // The plain port is still served.
    let mut plain = RawClient::connect(lg.addr).await;
    assert_eq!(plain.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(get(&lg.ctx.metrics.tls_handshakes), 2);
    assert_eq!(get(&lg.ctx.metrics.tls_handshake_failures), 0);
    // LOCKGATE STATS shows them (as /metrics does, from the same table).
    let stats = plain.call_s(&["LOCKGATE", "STATS"]).await;
    assert!(stats.contains("$14\r\ntls_handshakes\r\n:2\r\n"), "{stats}");
    lg.stop().await;
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_good_certificate() {
    let redis = RedisServer::start();
    let pki = Pki::new("test CA");
    let server = pki.issue("server", "lockgate");
    let good = pki.issue("client", "app");
    let expired = pki.issue_with("expired", "old app", |p| {
        p.not_before = rcgen::date_time_ymd(2001, 1, 1);
        p.not_after = rcgen::date_time_ymd(2002, 1, 1);
    });
    let stranger_pki = Pki::new("another CA");
    let stranger = stranger_pki.issue("stranger", "stranger");
    let mut config = tls_config(&redis.addr(), &server);
    config.proxy.tls.client_ca_file = s(&pki.ca_file());
    let lg = Lockgate::start_with_tls(config).await;
    let tls = lg.tls.expect("tls listener");
    let ca = pki.ca_file();
    let m = &lg.ctx.metrics;
    for (n, cert) in [(1, None), (2, Some(&expired)), (3, Some(&stranger))] {
        // With TLS 1.3 the client finishes first; the refusal arrives as
        // an alert or a close on its first read.
        let refused = match TlsClient::connect(tls, client_config(&ca, cert)).await {
            Err(_) => true,
            Ok(mut c) => c.try_call(&["PING"]).await.is_err(),
        };
        assert!(refused, "client {n} was served");
        support::eventually("the refusal to be counted", || {
            get(&m.tls_handshake_failures) == n
        })
        .await;
    }
    let mut ok = TlsClient::connect(tls, client_config(&ca, Some(&good)))
        .await
        .expect("good client certificate");
    assert_eq!(ok.call(&["PING"]).await, "+PONG\r\n");
    assert_eq!(get(&m.tls_handshakes), 1);
    lg.stop().await;
}

#[tokio::test]
async fn upstream_tls_to_a_redis_with_only_a_tls_port() {
    let pki = Pki::new("redis CA");
    let redis_cert = pki.issue("redis", "redis");
    let lockgate_cert = pki.issue("lockgate", "lockgate");
    // tls-auth-clients: lockgate must present its client certificate.
    let redis = TlsRedis::start(&pki.ca_file(), &redis_cert, true).await;
    let mut config = Config::default();
    config.upstream.addr = redis.addr();
    config.upstream.tls = client_tls(&pki, &lockgate_cert);
    let lg = Lockgate::start_with(config.clone()).await;
    let mut c = RawClient::connect(lg.addr).await;
    assert_eq!(c.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    assert_eq!(c.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(c.call_s(&["SETNX", "lock:u", "1"]).await, ":1\r\n");
    // The fencing API runs on lockgate's own connection to the primary.
    let lock = c.call_s(&["LOCKGATE", "LOCK", "lock:f", "5000"]).await;
    // A token (above Redis's clock in µs) and a validity.
    let granted = lock.strip_prefix("*2\r\n:").and_then(|rest| {
        let (token, validity) = rest.split_once("\r\n:")?;
        Some(token.parse::<i64>().ok()? > 1 && validity.ends_with("\r\n"))
    });
    assert_eq!(granted, Some(true), "{lock}");
    lg.stop().await;

    // Without its client certificate Redis refuses lockgate. With TLS 1.3
    // that shows on the first reply (the client finishes its handshake
    // first): the client is closed and the upstream error counted.
    config.upstream.tls.cert_file.clear();
    config.upstream.tls.key_file.clear();
    let lg = Lockgate::start_with(config.clone()).await;
    let mut c = RawClient::connect(lg.addr).await;
    c.send(&support::cmd(&["GET", "k"])).await;
    assert!(c.closed_within(WAIT).await, "served without a certificate");
    let m = &lg.ctx.metrics;
    support::eventually("the upstream error counted", || {
        get(&m.errors_upstream) >= 1
    })
    .await;
    lg.stop().await;

    // A CA that did not sign Redis's certificate: refused by lockgate.
    let other = Pki::new("other CA");
    config.upstream.tls = client_tls(&other, &lockgate_cert);
    config.upstream.tls.cert_file.clear();
    config.upstream.tls.key_file.clear();
    let lg = Lockgate::start_with(config).await;
    let mut c = RawClient::connect(lg.addr).await;
    let refused = c.call_s(&["GET", "k"]).await;
    assert!(
        refused.contains("TLS") && refused.contains("UnknownIssuer"),
        "{refused}"
    );
    lg.stop().await;
}

#[tokio::test]
async fn lock_quorum_over_tls() {
    let pki = Pki::new("masters CA");
    let master_cert = pki.issue("master", "master");
    let lockgate_cert = pki.issue("lockgate", "lockgate");
    let mut masters = Vec::new();
    for _ in 0..3 {
        masters.push(TlsRedis::start(&pki.ca_file(), &master_cert, true).await);
    }
    let primary = RedisServer::start();
    let mut config = Config::default();
    config.upstream.addr = primary.addr();
    config.locks.quorum.masters = masters.iter().map(|m| m.addr()).collect();
    config.locks.quorum.rejoin_delay_ms = 300;
    config.locks.quorum.node_timeout_ms = 500;
    config.locks.quorum.tls = Some(client_tls(&pki, &lockgate_cert));
    let lg = Lockgate::start_with(config).await;
    let mut c = RawClient::connect(lg.addr).await;
    // The masters are young at first sight and sit out the rejoin delay.
    until!(
        "the quorum over TLS to grant a lock",
        c.call_s(&["SETNX", "lock:q", "1"]).await == ":1\r\n"
    );
    assert_eq!(c.call_s(&["SETNX", "lock:q", "2"]).await, ":0\r\n");
    // Ordinary keys still go to the plain primary.
    assert_eq!(c.call_s(&["SET", "k", "v"]).await, "+OK\r\n");
    let mut direct = RawClient::connect(primary.addr()).await;
    assert_eq!(direct.call_s(&["GET", "k"]).await, "$1\r\nv\r\n");
    assert_eq!(direct.call_s(&["EXISTS", "lock:q"]).await, ":0\r\n");
    // The lock is on a majority of the masters, read over TLS (a majority:
    // one master may have sat out or answered late on a loaded box, seen
    // in CI with masters[0]).
    let mut holding = 0;
    for m in &masters {
        let mut on_master = TlsClient::connect(
            m.addr(),
            client_config(&pki.ca_file(), Some(&lockgate_cert)),
        )
        .await
        .expect("master");
        if on_master.call(&["GET", "lock:q"]).await == "$1\r\n1\r\n" {
            holding += 1;
        }
    }
    assert!(holding >= 2, "the lock on {holding} of 3 masters");
    lg.stop().await;
}

#[tokio::test]
async fn plaintext_and_stalled_clients_on_the_tls_port_are_closed_alone() {
    let redis = RedisServer::start();
    let pki = Pki::new("test CA");
    let server = pki.issue("server", "lockgate");
    let mut config = tls_config(&redis.addr(), &server);
    config.proxy.tls.handshake_timeout_ms = 300;
    let lg = Lockgate::start_with_tls(config).await;
    let tls = lg.tls.expect("tls listener");
    let trust = client_config(&pki.ca_file(), None);
    let m = &lg.ctx.metrics;
    let mut served = TlsClient::connect(tls, trust.clone()).await.expect("tls");

    // A stalled handshake: connected, sends nothing.
    let mut stalled = tokio::net::TcpStream::connect(tls).await.expect("connect");
    // A plaintext client: RESP on the TLS port.
    let mut plain = RawClient::connect(tls).await;
    plain.send(&support::cmd(&["PING"])).await;
    assert!(
        plain.closed_within(WAIT).await,
        "plaintext client not closed"
    );
    // Meanwhile TLS clients, old and new, are served.
    assert_eq!(served.call(&["PING"]).await, "+PONG\r\n");
    let mut fresh = TlsClient::connect(tls, trust).await.expect("tls");
    assert_eq!(fresh.call(&["PING"]).await, "+PONG\r\n");
    support::eventually("the plaintext client counted", || {
        get(&m.tls_handshake_failures) == 1
    })
    .await;
    // The stalled one is closed after handshake_timeout_ms.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(WAIT, stalled.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "stalled handshake not closed"
    );
    support::eventually("the timeout counted", || {
        get(&m.tls_handshake_timeouts) == 1
    })
    .await;
    assert_eq!(get(&m.tls_handshakes), 2);
    assert_eq!(served.call(&["PING"]).await, "+PONG\r\n");
    lg.stop().await;
}

#[tokio::test]
async fn reload_rotates_the_certificate_and_refuses_a_bad_one() {
    let redis = RedisServer::start();
    let pki = Pki::new("test CA");
    let first = pki.issue("first", "first");
    let second = pki.issue("second", "second");
    // The served files: first's, then overwritten with second's.
    let served = Issued {
        cert: pki.dir.path().join("served.pem"),
        key: pki.dir.path().join("served.key"),
    };
    let copy = |from: &Issued| {
        std::fs::copy(&from.cert, &served.cert).expect("copy cert");
        std::fs::copy(&from.key, &served.key).expect("copy key");
    };
    copy(&first);
    let config = tls_config(&redis.addr(), &served);
    let file = pki.dir.path().join("lockgate.toml");
    std::fs::write(&file, toml::to_string(&config).expect("toml")).expect("write config");
    let lg = Lockgate::start_with_tls(config).await;
    *lockgate::sync::lock(&lg.ctx.reload) = Some(lockgate::context::ReloadHook {
        path: file,
        effective: Box::new(|c| c),
        set_log_filter: Box::new(|_| Ok(())),
    });
    let tls = lg.tls.expect("tls listener");
    let trust = client_config(&pki.ca_file(), None);
    let der = |i: &Issued| {
        use rustls::pki_types::pem::PemObject;
        rustls::pki_types::CertificateDer::from_pem_file(&i.cert)
            .expect("cert")
            .to_vec()
    };
    let mut old = TlsClient::connect(tls, trust.clone()).await.expect("tls");
    assert_eq!(old.peer_cert(), der(&first));

    copy(&second);
    let mut admin = RawClient::connect(lg.addr).await;
    assert_eq!(
        admin.call_s(&["LOCKGATE", "RELOAD"]).await,
        "$8\r\nreloaded\r\n"
    );
    let new = TlsClient::connect(tls, trust.clone()).await.expect("tls");
    assert_eq!(
        new.peer_cert(),
        der(&second),
        "new handshake, new certificate"
    );
    assert_eq!(
        old.call(&["PING"]).await,
        "+PONG\r\n",
        "old connection kept"
    );

    // A key that is not the certificate's: refused, the second stays.
    std::fs::copy(&first.key, &served.key).expect("copy key");
    let refused = admin.call_s(&["LOCKGATE", "RELOAD"]).await;
    assert!(
        refused.starts_with("-") && refused.contains("proxy.tls.key_file"),
        "{refused}"
    );
    std::fs::write(&served.key, "not a key").expect("write");
    let refused = admin.call_s(&["LOCKGATE", "RELOAD"]).await;
    assert!(refused.contains("proxy.tls.key_file"), "{refused}");
    let mut after = TlsClient::connect(tls, trust).await.expect("tls");
    assert_eq!(after.peer_cert(), der(&second));
    assert_eq!(after.call(&["PING"]).await, "+PONG\r\n");
    lg.stop().await;
}

#[test]
fn check_names_the_bad_tls_file() {
    let pki = Pki::new("test CA");
    let a = pki.issue("a", "a");
    let b = pki.issue("b", "b");
    let run = |cert: &std::path::Path, key: &std::path::Path| {
        let file = pki.dir.path().join("check.toml");
        let text = format!(
            "[proxy.tls]\nlisten = \"127.0.0.1:6381\"\ncert_file = {:?}\nkey_file = {:?}\n",
            s(cert),
            s(key)
        );
        std::fs::write(&file, text).expect("write config");
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_lockgate"));
        command.arg("--config").arg(&file).arg("--check");
        support::run_limited(&mut command, Duration::from_secs(10))
    };
    let ok = run(&a.cert, &a.key);
    assert!(ok.status.success(), "{}", support::show(&ok.stderr));
    for (cert, key, named) in [
        (&a.cert, &b.key, "proxy.tls.key_file"),
        (
            &a.cert,
            &pki.dir.path().join("missing.key"),
            "proxy.tls.key_file",
        ),
        (&a.key, &a.key, "proxy.tls.cert_file"),
    ] {
        let out = run(cert, key);
        let err = support::show(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{err}");
        assert!(err.contains(named), "{named} not named: {err}");
    }
}
