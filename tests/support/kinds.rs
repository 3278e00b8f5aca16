//! Shared, reentrant and counted locks and multi-key locks as a client of
//! lockgate's API sees them (`LOCKGATE LOCK … SHARED | OWNER`, `LOCKGATE
//! ACQUIRE`, `LOCKGATE LOCK k1 k2 …`): a client ([`Api`]) and the
//! scenarios every store must pass (one Redis, a cluster), each against a
//! running lockgate's address and keys it names (one slot on a cluster).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::resp::Resp;
use super::{RawClient, WAIT};

/// A grant: its token and validity, ms.
pub type Grant = (i64, i64);

/// One connection to lockgate speaking the lock API.
pub struct Api {
    /// The connection.
    pub c: RawClient,
}

impl Api {
    /// A new connection to `addr`.
    pub async fn connect(addr: SocketAddr) -> Api {
        Api {
            c: RawClient::connect(addr).await,
        }
    }

    /// Any command, parsed.
    pub async fn call(&mut self, args: &[&str]) -> Resp {
        Resp::parse(&self.c.call_raw(args).await)
    }

    /// `LOCKGATE <args>` answered by a grant or nil; anything else fails.
    pub async fn grant(&mut self, args: &[&str]) -> Option<Grant> {
        let mut all = vec!["LOCKGATE"];
        all.extend_from_slice(args);
        match self.call(&all).await {
            Resp::Bulk(None) | Resp::Array(None) => None,
            Resp::Array(Some(v)) if v.len() == 2 => Some((v[0].int(), v[1].int())),
            other => panic!("{args:?}: not a grant: {other}"),
        }
    }

    /// `LOCKGATE LOCK key ttl [more…]`.
    pub async fn lock(&mut self, key: &str, ttl: u64, more: &[&str]) -> Option<Grant> {
        let ttl = ttl.to_string();
        let mut args = vec!["LOCK", key, &ttl];
        args.extend_from_slice(more);
        self.grant(&args).await
    }

    /// `LOCKGATE ACQUIRE key permits ttl [more…]`.
    pub async fn acquire(
        &mut self,
        key: &str,
        permits: u64,
        ttl: u64,
        more: &[&str],
    ) -> Option<Grant> {
        let (permits, ttl) = (permits.to_string(), ttl.to_string());
        let mut args = vec!["ACQUIRE", key, &permits, &ttl];
        args.extend_from_slice(more);
        self.grant(&args).await
    }

    /// `LOCKGATE LOCK k1 k2 … ttl [more…]`: the tokens, or none.
    pub async fn lock_all(&mut self, keys: &[&str], ttl: u64, more: &[&str]) -> Option<Vec<i64>> {
        let ttl = ttl.to_string();
        let mut args = vec!["LOCKGATE", "LOCK"];
        args.extend_from_slice(keys);
        args.push(&ttl);
        args.extend_from_slice(more);
        match self.call(&args).await {
            Resp::Bulk(None) | Resp::Array(None) => None,
            Resp::Array(Some(v)) if v.len() == 2 => {
                let tokens: Vec<i64> = v[0].items().iter().map(Resp::int).collect();
                assert_eq!(tokens.len(), keys.len(), "one token per key");
                assert!(v[1].int() > 0, "validity {}", v[1]);
                Some(tokens)
            }
            other => panic!("{args:?}: not a multi-key grant: {other}"),
        }
    }

    /// `LOCKGATE UNLOCK key token`: 1 or 0.
    pub async fn unlock(&mut self, key: &str, token: i64) -> i64 {
        self.call(&["LOCKGATE", "UNLOCK", key, &token.to_string()])
            .await
            .int()
    }

    /// `LOCKGATE EXTEND key token ttl`: 1 or 0.
    pub async fn extend(&mut self, key: &str, token: i64, ttl: u64) -> i64 {
        let (t, ttl) = (token.to_string(), ttl.to_string());
        self.call(&["LOCKGATE", "EXTEND", key, &t, &ttl])
            .await
            .int()
    }
}

/// `lockgate:writers:{key}`'s size: through lockgate (a plain command on
/// the store that holds the locks), or the largest on the quorum's
/// `masters`.
async fn writers_waiting(api: &mut Api, key: &str, masters: &[String]) -> i64 {
    let name = lockgate::lock::kinds::writers_key(key.as_bytes());
    let name = String::from_utf8(name.to_vec()).expect("a UTF-8 key");
    if masters.is_empty() {
        return api.call(&["ZCARD", &name]).await.int();
    }
    let mut most = 0;
    for m in masters {
        let reply = super::resp::direct(m, &["ZCARD", &name]).await;
        most = most.max(super::int(&reply));
    }
    most
}

/// Readers together, a writer alone, a waiting writer holding new readers
/// back until it has had its turn, a legacy `SETNX` finding a shared lock
/// taken, and tokens increasing over every grant. `masters`: the
/// quorum's, where its waiting writers are seen (none: through lockgate).
pub async fn readers_and_writers(addr: SocketAddr, key: &str, masters: &[String]) {
    let (mut r1, mut r2, mut w) = (
        Api::connect(addr).await,
        Api::connect(addr).await,
        Api::connect(addr).await,
    );
    let (t1, v1) = r1.lock(key, 10_000, &["SHARED"]).await.expect("a reader");
    assert!(v1 > 9_000, "validity {v1}");
    let (t2, _) = r2
        .lock(key, 10_000, &["SHARED"])
        .await
        .expect("two readers");
    assert!(t2 > t1, "tokens increase: {t1} then {t2}");
    assert_eq!(
        w.lock(key, 10_000, &[]).await,
        None,
        "a writer with readers"
    );
    assert_eq!(
        w.call(&["SETNX", key, "x"]).await.int(),
        0,
        "SETNX finds it taken"
    );
    // A writer waits: new readers are held back from then on.
    let k = key_owned(key);
    let writer = tokio::spawn(async move {
        let got = w.lock(k, 10_000, &["WAIT", "20000"]).await;
        (w, got)
    });
    let mut probe = Api::connect(addr).await;
    let deadline = Instant::now() + WAIT;
    while writers_waiting(&mut probe, key, masters).await == 0 {
        assert!(Instant::now() < deadline, "the writer never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        probe.lock(key, 10_000, &["SHARED"]).await,
        None,
        "a new reader while a writer waits"
    );
    // The mark is no token: it releases and extends nothing.
    let mark = ["LOCKGATE", "UNLOCK", key, "lockgate:held"];
    assert_eq!(r1.call(&mark).await.int(), 0);
    let mark = ["LOCKGATE", "EXTEND", key, "lockgate:held", "100"];
    assert_eq!(r1.call(&mark).await.int(), 0);
    assert_eq!(r1.unlock(key, t1).await, 1);
    assert!(!writer.is_finished(), "the writer went in beside a reader");
    assert_eq!(r2.unlock(key, t2).await, 1);
    let (mut w, got) = writer.await.expect("writer task");
    let (t3, _) = got.expect("the writer had its turn once the readers left");
    assert!(t3 > t2, "tokens increase over kinds: {t2} then {t3}");
    assert_eq!(
        writers_waiting(&mut probe, key, masters).await,
        0,
        "it left the waiters"
    );
    assert_eq!(
        probe.lock(key, 10_000, &["SHARED", "WAIT", "100"]).await,
        None,
        "a reader beside a writer"
    );
    assert_eq!(
        r1.unlock(key, t1).await,
        0,
        "a released token releases nothing"
    );
    assert_eq!(w.unlock(key, t3).await, 1);
    let (t4, _) = (probe.lock(key, 10_000, &["SHARED"]).await).expect("free again");
    assert!(t4 > t3);
    assert_eq!(probe.unlock(key, t4).await, 1);
    assert_eq!(
        probe.call(&["EXISTS", key]).await.int(),
        0,
        "gone with the last"
    );
}

fn key_owned(key: &str) -> &'static str {
    Box::leak(key.to_string().into_boxed_str())
}

/// `OWNER`: the same owner enters again (same token, a count), another
/// owner waits until the count is back to 0; a stale token does nothing.
pub async fn reentrant_counts(addr: SocketAddr, key: &str) {
    let (mut a, mut b) = (Api::connect(addr).await, Api::connect(addr).await);
    let (t, _) = (a.lock(key, 10_000, &["OWNER", "a"]).await).expect("owner a");
    let (again, _) = (a.lock(key, 10_000, &["OWNER", "a"]).await).expect("a again");
    assert_eq!(again, t, "a reentry is the same holding");
    // From another connection, the owner is who it says it is.
    let (thrice, _) = (b.lock(key, 10_000, &["OWNER", "a"]).await).expect("a thrice");
    assert_eq!(thrice, t);
    assert_eq!(b.lock(key, 10_000, &["OWNER", "b"]).await, None);
    assert_eq!(b.lock(key, 10_000, &["SHARED", "OWNER", "b"]).await, None);
    assert_eq!(a.extend(key, t, 20_000).await, 1);
    for left in [2, 1] {
        assert_eq!(a.unlock(key, t).await, 1);
        assert_eq!(
            b.lock(key, 10_000, &["OWNER", "b"]).await,
            None,
            "{left} entries left"
        );
    }
    assert_eq!(a.unlock(key, t).await, 1, "the last entry");
    assert_eq!(a.unlock(key, t).await, 0, "nothing left to release");
    let (tb, _) = (b.lock(key, 10_000, &["OWNER", "b"]).await).expect("b's turn");
    assert!(tb > t);
    // Owner b holding exclusively cannot also read (no downgrade).
    let err = (b.call(&["LOCKGATE", "LOCK", key, "1000", "SHARED", "OWNER", "b"])).await;
    assert!(
        matches!(&err, Resp::Error(e) if e.contains("another kind")),
        "a reentry as another kind is an error: {err}"
    );
    assert_eq!(b.unlock(key, tb).await, 1);
    assert_eq!(b.call(&["EXISTS", key]).await.int(), 0);
}

/// A semaphore: at most `permits` holders; a holder that dies frees its
/// permit when its lease ends, never another's; a lock call on it is an
/// error.
pub async fn permits_with_dying_holders(addr: SocketAddr, key: &str) {
    let mut c = Api::connect(addr).await;
    let (dies, _) = (c.acquire(key, 2, 2_000, &[]).await).expect("permit 1");
    let (lives, _) = (c.acquire(key, 2, 20_000, &[]).await).expect("permit 2");
    assert!(lives > dies);
    assert_eq!(
        c.acquire(key, 2, 20_000, &[]).await,
        None,
        "two permits only"
    );
    let err = c.call(&["LOCKGATE", "LOCK", key, "1000", "SHARED"]).await;
    assert!(
        matches!(&err, Resp::Error(e) if e.starts_with("WRONGTYPE")),
        "a lock on a semaphore: {err}"
    );
    // The first holder never releases: its permit comes back with its
    // lease, and only its.
    let (third, _) =
        (c.acquire(key, 2, 20_000, &["WAIT", "10000"]).await).expect("the dead holder's permit");
    assert!(third > lives);
    assert_eq!(
        c.extend(key, lives, 20_000).await,
        1,
        "the live holder kept its permit"
    );
    assert_eq!(
        c.unlock(key, dies).await,
        0,
        "the dead holder's token holds nothing"
    );
    assert_eq!(c.acquire(key, 2, 20_000, &[]).await, None);
    // Reentrant permits: one owner, one permit, counted.
    assert_eq!(c.unlock(key, third).await, 1);
    let (o, _) = (c.acquire(key, 2, 20_000, &["OWNER", "o"]).await).expect("owner's permit");
    let (o2, _) = (c.acquire(key, 2, 20_000, &["OWNER", "o"]).await).expect("reentered");
    assert_eq!(o, o2);
    assert_eq!(
        c.acquire(key, 2, 20_000, &[]).await,
        None,
        "still two holders"
    );
    for _ in 0..2 {
        assert_eq!(c.unlock(key, o).await, 1);
    }
    assert_eq!(c.unlock(key, lives).await, 1);
    assert_eq!(
        c.call(&["EXISTS", key]).await.int(),
        0,
        "gone with the last"
    );
}

/// Multi-key locks: all or none, each key its own exclusive lock, and two
/// callers on overlapping keys both get through, never both at once.
pub async fn multi_key_all_or_none(addr: SocketAddr, keys: [&str; 3]) {
    let [a, b, c3] = keys;
    let mut one = Api::connect(addr).await;
    let (ta, _) = (one.lock(a, 10_000, &[]).await).expect("a alone");
    assert_eq!(one.lock_all(&[a, b], 10_000, &[]).await, None);
    assert_eq!(
        one.call(&["EXISTS", b]).await.int(),
        0,
        "none taken of a part"
    );
    assert_eq!(one.unlock(a, ta).await, 1);
    let tokens = (one.lock_all(&[a, b], 10_000, &[]).await).expect("both");
    assert!(tokens[0] > ta, "a's tokens increase");
    for (k, t) in [a, b].iter().zip(&tokens) {
        assert_eq!(one.call(&["GET", k]).await.text(), t.to_string());
    }
    assert_eq!(one.extend(b, tokens[1], 20_000).await, 1);
    assert_eq!(one.unlock(a, tokens[0]).await, 1);
    assert_eq!(one.unlock(b, tokens[1]).await, 1);
    // Two callers on overlapping keys, each twenty times: no deadlock, and
    // the shared key is never theirs at once.
    let inside = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for set in [[a, b], [b, c3]] {
        let inside = inside.clone();
        let set: [&'static str; 2] = set.map(key_owned);
        tasks.push(tokio::spawn(async move {
            let mut c = Api::connect(addr).await;
            for _ in 0..20 {
                let tokens = (c.lock_all(&set, 10_000, &["WAIT", "10000"]).await)
                    .expect("a turn within the wait");
                assert!(!inside.swap(true, std::sync::atomic::Ordering::SeqCst));
                tokio::task::yield_now().await;
                inside.store(false, std::sync::atomic::Ordering::SeqCst);
                for (k, t) in set.iter().zip(tokens) {
                    assert_eq!(c.unlock(k, t).await, 1);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("a multi-key caller");
    }
}
