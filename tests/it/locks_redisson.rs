//! Redisson's read-write lock and fair lock, as their wire shows them
//! (`tests/py/redisson_wire.py`: scripts written after Redisson's
//! documented data model), straight on Redis and through lockgate: the
//! same outcome at every step, in the three connection shapes apps have
//! (each holder on its own connection, a LIFO pool, every holder on one
//! connection). Through lockgate these are client scripts on lock keys:
//! they pass as they came, and the hash lock they take is adopted once
//! they ran (`lock::reconcile`), which must change nothing they see.

use std::time::Duration;

use crate::support;

use support::locks::m;
use support::{python, Lockgate, RedisServer};

async fn outcomes(addr: &str, shape: &str) -> serde_json::Value {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let args = [host.to_string(), port.to_string(), shape.to_string()];
    let out = python("redisson_wire.py", &args, Duration::from_secs(60)).await;
    serde_json::from_str(out.trim()).expect("one JSON object")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redissons_read_write_and_fair_locks_see_through_lockgate_what_they_see_on_redis() {
    let redis = RedisServer::start();
    let lg = Lockgate::start(&redis.addr()).await;
    for shape in ["own", "pool", "one"] {
        let direct = outcomes(&redis.addr(), shape).await;
        // The scenario means something: readers together, the writer kept
        // out, the fair queue's order kept.
        let rw = direct["rwlock"].to_string();
        assert!(rw.contains(r#"["w writes while read","held"]"#), "{rw}");
        let fair = direct["fair"].to_string();
        assert!(fair.contains(r#"["c asks first","held"]"#), "{fair}");
        let adopted = m(&lg.ctx.locks.metrics.script_adoptions);
        let gated = outcomes(&lg.addr.to_string(), shape).await;
        assert_eq!(
            gated, direct,
            "{shape}: through lockgate, then straight on Redis"
        );
        // The hash locks were seen: adopted, as Redisson's hash lock is.
        crate::until!(
            "the hash locks adopted",
            m(&lg.ctx.locks.metrics.script_adoptions) > adopted
        );
    }
    lg.stop().await;
}
