//! Lock libraries' scripts carried out by lockgate itself
//! (`router::library`): redis-py's `Lock`, pottery's `Redlock` and
//! node-redlock release with a script of their own, "delete the key if its
//! value is my token". Recognised by its exact body, it runs as one
//! release by value: answered as the script answers, never reaching Redis
//! as a script, and handing the lock to a parked attempt in the same step
//! (`locks_library_storm.rs` counts that). node-redlock's acquisition
//! script on one key runs as an acquisition of lockgate's.

use std::time::Duration;

use crate::support;

use support::locks::m;
use support::{node, python, Lockgate, RawClient, RedisServer};

/// The installed libraries' release scripts, exactly as they send them:
/// (library, body, how many keys it takes in this test).
async fn bodies() -> Vec<(String, String, usize)> {
    let limit = Duration::from_secs(60);
    let py = python("library_release_bodies.py", &[], limit).await;
    let py: serde_json::Value = serde_json::from_str(py.trim()).expect("one JSON object");
    let js = node("release_body.js", &[], limit).await;
    let js: String = serde_json::from_str(js.trim()).expect("one JSON string");
    let mut out = Vec::new();
    for lib in ["redis-py", "pottery"] {
        let body = py[lib].as_str().expect("a body").to_string();
        out.push((lib.to_string(), body, 1));
    }
    out.push(("node-redlock".to_string(), js, 2));
    out
}

fn sha1(body: &str) -> String {
    sha1_smol::Sha1::from(body).digest().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_librarys_release_script_is_carried_out_by_lockgate() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let mut c = RawClient::connect(lg.addr).await;
    let mut direct = RawClient::connect(redis.addr().as_str()).await;
    let mut carried = 0;
    for (lib, body, n) in bodies().await {
        let keys: Vec<String> = (0..n).map(|i| format!("lock:rel:{lib}:{i}")).collect();
        for k in &keys {
            let set = c.call_s(&["SET", k, "tok-1", "NX", "PX", "10000"]).await;
            assert_eq!(set, "+OK\r\n", "{lib}");
        }
        let eval = |form: &'static str, token: &'static str| {
            let script = match form {
                "EVAL" => body.clone(),
                _ => sha1(&body),
            };
            let mut args = vec![form.to_string(), script, n.to_string()];
            args.extend(keys.iter().cloned());
            args.push(token.to_string());
            args
        };
        // Not the holder's token: nothing released, as the script says.
        let wrong = eval("EVAL", "tok-2");
        let wrong: Vec<&str> = wrong.iter().map(String::as_str).collect();
        assert_eq!(c.call_s(&wrong).await, ":0\r\n", "{lib}");
        assert_eq!(c.call_s(&["GET", &keys[0]]).await, "$5\r\ntok-1\r\n");
        // The holder's, by EVALSHA of a script Redis never loaded: no
        // NOSCRIPT, every key released with its owner record.
        let right = eval("EVALSHA", "tok-1");
        let right: Vec<&str> = right.iter().map(String::as_str).collect();
        assert_eq!(c.call_s(&right).await, format!(":{n}\r\n"), "{lib}");
        carried += 2;
        for k in &keys {
            let owner = format!("lockgate:owner:{{{k}}}");
            let gone = direct.call_s(&["EXISTS", k, &owner]).await;
            assert_eq!(gone, ":0\r\n", "{lib}: {k}");
        }
        // The script itself never reached Redis.
        let loaded = direct.call_s(&["SCRIPT", "EXISTS", &sha1(&body)]).await;
        assert_eq!(loaded, "*1\r\n:0\r\n", "{lib}");
    }
    assert_eq!(m(&lg.ctx.locks.metrics.library_releases), carried);
    lg.stop().await;
}

/// One session's replies, errors by their first word (a script's error
/// names the script that failed).
async fn replies(addr: &str, body: &str, node_body: &str, side: &str) -> Vec<String> {
    let mut a = RawClient::connect(addr).await;
    let mut b = RawClient::connect(addr).await;
    let (x, h) = (format!("lock:val:{side}:x"), format!("lock:val:{side}:h"));
    let (p, q) = (format!("lock:val:{side}:p"), format!("lock:val:{side}:q"));
    let mut out = Vec::new();
    let calls: Vec<(bool, Vec<&str>)> = vec![
        // Nothing held: nothing released.
        (false, vec!["EVAL", body, "1", &x, "t1"]),
        (false, vec!["SET", &x, "t1", "NX", "PX", "10000"]),
        (false, vec!["EVAL", body, "1", &x, "t2"]),
        (false, vec!["GET", &x]),
        // Released by value from another connection (a pool's).
        (true, vec!["EVAL", body, "1", &x, "t1"]),
        (false, vec!["EXISTS", &x]),
        (false, vec!["SET", &x, "t3", "NX", "PX", "10000"]),
        (false, vec!["EVAL", body, "1", &x, "t3"]),
        (false, vec!["EVAL", body, "1", &x, "t3"]),
        // Not a string: the script's GET fails.
        (false, vec!["HSET", &h, "f", "1"]),
        (false, vec!["EVAL", body, "1", &h, "t1"]),
        (false, vec!["TYPE", &h]),
        // Several keys, one of them the token's.
        (false, vec!["SET", &p, "t4", "NX", "PX", "10000"]),
        (false, vec!["SET", &q, "other", "NX", "PX", "10000"]),
        (false, vec!["EVAL", node_body, "2", &p, &q, "t4"]),
        (false, vec!["EXISTS", &p, &q]),
        (false, vec!["EVAL", node_body, "3", &p, &q, &p, "other"]),
        (false, vec!["EXISTS", &q]),
    ];
    for (other, args) in calls {
        let c = if other { &mut b } else { &mut a };
        let reply = c.call_s(&args).await;
        let reply = match reply.strip_prefix('-') {
            Some(e) => format!("-{}", e.split(' ').next().unwrap_or("")),
            None => reply,
        };
        out.push(format!("{} -> {reply:?}", args[0]));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_by_value_answers_as_the_library_script_does() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let all = bodies().await;
    let (body, node_body) = (&all[0].1, &all[2].1);
    let straight = replies(&redis.addr(), body, node_body, "direct").await;
    let through = replies(&lg.addr.to_string(), body, node_body, "lg").await;
    assert_eq!(through, straight);
    // Each release was lockgate's own (the key that is not a string
    // included: it failed as the script fails).
    assert_eq!(m(&lg.ctx.locks.metrics.library_releases), 8);
    lg.stop().await;
}

/// A LIFO pool sends the holder's release on whichever connection it lends
/// it: released by value there, the holding ends on the connection that
/// acquired too, and `LOCKGATE LOCKS` stops listing it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_another_pool_connection_ends_the_holding_where_it_began() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let body = bodies().await.remove(0).1;
    let (mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    let mut admin = RawClient::connect(lg.addr).await;
    let key = "lock:pool:held";
    let set = a.call_s(&["SET", key, "tok-a", "NX", "PX", "10000"]).await;
    assert_eq!(set, "+OK\r\n");
    let listed = admin.call_s(&["LOCKGATE", "LOCKS", key]).await;
    assert!(listed.contains(key), "held by a: {listed:?}");
    assert_eq!(
        b.call_s(&["EVAL", &body, "1", key, "tok-a"]).await,
        ":1\r\n"
    );
    let listed = admin.call_s(&["LOCKGATE", "LOCKS", key]).await;
    assert!(!listed.contains(key), "released: {listed:?}");
    // The connection that acquired tries again: a newcomer's attempt on a
    // free lock, acquired.
    let again = a.call_s(&["SET", key, "tok-c", "NX", "PX", "10000"]).await;
    assert_eq!(again, "+OK\r\n");
    lg.stop().await;
}

/// node-redlock's acquisition is its own script, adopted once it ran (see
/// `locks_redlock.rs`); its release sent on another connection (a pool's,
/// or another process of the same app) ends the adopted holding there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_holding_ends_when_the_library_releases_it_elsewhere() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let release = bodies().await.remove(2).1;
    // node-redlock's acquisition: `SET key value PX ms` for each key.
    let acquire =
        "for _, k in ipairs(KEYS) do redis.call('SET', k, ARGV[1], 'PX', ARGV[2]) end return #KEYS";
    let (mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    let mut admin = RawClient::connect(lg.addr).await;
    let key = "lock:pool:adopted";
    let value = "0123456789abcdef0123456789abcdef";
    let reply = a.call_s(&["EVAL", acquire, "1", key, value, "20000"]).await;
    assert_eq!(reply, ":1\r\n");
    let adopted = || m(&lg.ctx.locks.metrics.script_adoptions);
    crate::until!("the key adopted", adopted() == 1);
    let listed = admin.call_s(&["LOCKGATE", "LOCKS", key]).await;
    assert!(listed.contains(key), "held by a: {listed:?}");
    let reply = b.call_s(&["EVAL", &release, "1", key, value]).await;
    assert_eq!(reply, ":1\r\n");
    let listed = admin.call_s(&["LOCKGATE", "LOCKS", key]).await;
    assert!(!listed.contains(key), "released: {listed:?}");
    lg.stop().await;
}

/// node-redlock's acquisition script, exactly as the installed package
/// sends it.
async fn acquire_body() -> String {
    let js = node(
        "release_body.js",
        &["acquire".to_string()],
        Duration::from_secs(60),
    )
    .await;
    serde_json::from_str(js.trim()).expect("one JSON string")
}

/// One session's replies to node-redlock's acquisition, errors by their
/// first word, leases as present or not.
async fn acquisitions(addr: &str, body: &str, side: &str) -> Vec<String> {
    let mut a = RawClient::connect(addr).await;
    let mut b = RawClient::connect(addr).await;
    let (x, h) = (format!("lock:acq:{side}:x"), format!("lock:acq:{side}:h"));
    let calls: Vec<(bool, Vec<&str>)> = vec![
        // Free: taken, with the token and the lease asked.
        (false, vec!["EVAL", body, "1", &x, "t1", "10000"]),
        (false, vec!["GET", &x]),
        (false, vec!["PTTL", &x]),
        // Held: refused to anyone, its holder's re-entry included.
        (true, vec!["EVAL", body, "1", &x, "t2", "10000"]),
        (false, vec!["EVAL", body, "1", &x, "t1", "10000"]),
        (false, vec!["GET", &x]),
        // A key of another type exists: refused, as `EXISTS` finds it.
        (false, vec!["HSET", &h, "f", "1"]),
        (true, vec!["EVAL", body, "1", &h, "t1", "10000"]),
        (false, vec!["TYPE", &h]),
        // Released by its holder: free again; a lease Redis refuses is the
        // script's error (it passes on as the script).
        (false, vec!["DEL", &x]),
        (true, vec!["EVAL", body, "1", &x, "t1", "0"]),
        (true, vec!["EVAL", body, "1", &x, "t1", "-1"]),
        (true, vec!["EVAL", body, "1", &x, "t3", "10000"]),
        (false, vec!["GET", &x]),
    ];
    let mut out = Vec::new();
    for (other, args) in calls {
        let c = if other { &mut b } else { &mut a };
        let reply = c.call_s(&args).await;
        let reply = match (reply.strip_prefix('-'), args[0]) {
            (Some(e), _) => format!("-{}", e.split(' ').next().unwrap_or("")),
            (None, "PTTL") => format!(
                "lease {}",
                reply
                    .trim_start_matches(':')
                    .trim()
                    .parse::<i64>()
                    .is_ok_and(|ms| ms > 9_000 && ms <= 10_000)
            ),
            (None, _) => reply,
        };
        out.push(format!("{} -> {reply:?}", args[0]));
    }
    out
}

/// node-redlock's one-key acquisition through lockgate answers as its
/// script does, is held (`LOCKGATE LOCKS`, with an owner record) and
/// never reaches Redis as a script, `EVALSHA` of a script Redis never
/// loaded included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_redlocks_acquisition_script_is_an_acquisition_of_lockgates() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let body = acquire_body().await;
    // First, by EVALSHA of a script Redis never loaded: no NOSCRIPT;
    // held, with an owner record. (The differential below loads it:
    // the lease Redis refuses passes on as the script.)
    let mut c = RawClient::connect(lg.addr).await;
    let mut admin = RawClient::connect(lg.addr).await;
    let mut direct = RawClient::connect(redis.addr().as_str()).await;
    let key = "lock:acq:sha";
    let reply = c
        .call_s(&["EVALSHA", &sha1(&body), "1", key, "tok-1", "10000"])
        .await;
    assert_eq!(reply, ":1\r\n");
    let listed = admin.call_s(&["LOCKGATE", "LOCKS", key]).await;
    assert!(listed.contains(key), "held: {listed:?}");
    assert!(!listed.contains("tok-1"), "the token shown: {listed:?}");
    let owner = format!("lockgate:owner:{{{key}}}");
    assert_eq!(direct.call_s(&["EXISTS", key, &owner]).await, ":2\r\n");
    let loaded = direct.call_s(&["SCRIPT", "EXISTS", &sha1(&body)]).await;
    assert_eq!(loaded, "*1\r\n:0\r\n");
    // Then each reply as the script's.
    let straight = acquisitions(&redis.addr(), &body, "direct").await;
    let through = acquisitions(&lg.addr.to_string(), &body, "lg").await;
    assert_eq!(through, straight);
    // None but the two with a lease Redis refuses was a client script
    // lockgate had to follow.
    let followed = m(&lg.ctx.locks.metrics.script_reconciles);
    assert!(followed <= 2, "{followed} scripts followed");
    lg.stop().await;
}

/// A release by the value an attempt just lost with is answered 0 without
/// Redis (pottery releases after every attempt it lost), on the attempt's
/// connection or another (a pool's); once an attempt with that value wins
/// (redis-py polls with one token), a release by it is real.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_by_a_value_that_just_lost_is_answered_without_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    let body = bodies().await.remove(0).1;
    let sha = sha1(&body);
    let (mut holder, mut a, mut b) = (
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
        RawClient::connect(lg.addr).await,
    );
    let key = "lock:lost:value";
    let set = |v: &'static str| ["SET", key, v, "NX", "PX", "10000"];
    assert_eq!(holder.call_s(&set("tok-h")).await, "+OK\r\n");
    let answered = || m(&lg.ctx.locks.metrics.library_releases_answered);
    // `a` tries with t1 and loses; its clean-up, on `a` and then on `b`.
    assert_eq!(a.call_s(&set("t1")).await, "$-1\r\n");
    let release = |v: &'static str| ["EVALSHA", sha.as_str(), "1", key, v];
    assert_eq!(a.call_s(&release("t1")).await, ":0\r\n");
    assert_eq!(b.call_s(&release("t1")).await, ":0\r\n");
    assert_eq!(answered(), 2);
    // A value nobody tried goes to Redis (and finds another value there).
    assert_eq!(b.call_s(&release("t9")).await, ":0\r\n");
    assert_eq!(answered(), 2);
    // The holder releases; `a` tries with t1 again, wins and closes (a
    // pool dropping the connection): a release by t1, from `b`, is real.
    assert_eq!(holder.call_s(&release("tok-h")).await, ":1\r\n");
    assert_eq!(a.call_s(&set("t1")).await, "+OK\r\n");
    let open = lg.ctx.locks.conns.len();
    drop(a);
    crate::until!("a's close seen", lg.ctx.locks.conns.len() < open);
    assert_eq!(b.call_s(&release("t1")).await, ":1\r\n");
    assert_eq!(answered(), 2);
    let mut direct = RawClient::connect(redis.addr().as_str()).await;
    assert_eq!(direct.call_s(&["EXISTS", key]).await, ":0\r\n");
    lg.stop().await;
}
