//! `MSETNX` and `MSET` naming lock keys, on one Redis or a cluster (with
//! the quorum they are refused by [`super::quorum`]). Passed on, `MSETNX
//! lock:a 1 lock:b 1` would set both keys with no lease: the lock that
//! never expires, on a path lockgate does not protect. So `MSETNX` is
//! carried out by the lock room as one all-or-none acquisition with a
//! lease and an owner record per lock key
//! ([`crate::lock::LockService::acquire_all`]), and `MSET`, which would
//! overwrite a lock and drop its lease, is refused.

use bytes::Bytes;

use super::{Route, SessionView};
use crate::lock::LockService;
use crate::router::CommandArgs;

/// Whether this `MSET`/`MSETNX` (`args`, name first) names a lock key.
pub(super) fn names_lock_key(args: CommandArgs<'_>, locks: &LockService) -> bool {
    (1..args.len())
        .step_by(2)
        .any(|i| locks.is_lock_key(args.get(i)))
}

/// The route of an `MSET`/`MSETNX` (`args`) that names a lock key (see
/// the module doc); `None` when it names none.
pub(super) fn route(
    args: CommandArgs<'_>,
    view: &SessionView,
    locks: &LockService,
) -> Option<Route> {
    if !names_lock_key(args, locks) {
        return None;
    }
    let name = String::from_utf8_lossy(args.get(0)).to_uppercase();
    if name != "MSETNX" {
        return Some(Route::Refuse(format!(
            "lockgate: {name} would overwrite lock keys and drop their leases; set a lock key alone (SET key value NX PX ms)"
        )));
    }
    // A wrong number of arguments is Redis's to answer.
    if args.len() < 3 || args.len() % 2 == 0 {
        return Some(Route::Forward(super::Expect::One));
    }
    let why = if view.in_multi {
        "inside MULTI"
    } else if locks.scriptless() {
        "on a server that refuses scripts"
    } else {
        let pairs = (1..args.len())
            .step_by(2)
            .map(|i| {
                let (k, v) = (args.get(i), args.get(i + 1));
                (Bytes::copy_from_slice(k), Bytes::copy_from_slice(v))
            })
            .collect();
        return Some(Route::AcquireAll(pairs));
    };
    Some(Route::Refuse(format!(
        "lockgate: MSETNX on lock keys is refused {why}: it is carried out as an all-or-none acquisition, which cannot be here (docs/locks.md)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::{route, tests::parsed, Expect};

    fn routed(line: &str, in_multi: bool) -> Route {
        let locks = LockService::new(&crate::config::Config::default());
        let (p, buf) = parsed(line);
        let args = CommandArgs::new(&p, buf.as_bytes());
        let kind = crate::command::classify(args.get(0), args.get(1), args.get(2));
        let view = SessionView {
            in_multi,
            ..SessionView::default()
        };
        route(kind, args, &view, &locks)
    }

    #[test]
    fn msetnx_on_lock_keys_is_acquired_mset_refused_others_pass() {
        let b = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        assert_eq!(
            routed("MSETNX lock:a 1 user:1 2", false),
            Route::AcquireAll(vec![(b("lock:a"), b("1")), (b("user:1"), b("2"))])
        );
        // A value that looks like a lock key is a value.
        assert_eq!(
            routed("MSETNX a lock:a", false),
            Route::Forward(Expect::One)
        );
        assert_eq!(routed("MSET a 1 b 2", false), Route::Forward(Expect::One));
        assert!(matches!(
            routed("MSET user:1 1 lock:a 2", false),
            Route::Refuse(_)
        ));
        assert!(matches!(routed("MSETNX lock:a 1", true), Route::Refuse(m) if m.contains("MULTI")));
        // Redis answers a wrong number of arguments.
        assert_eq!(routed("MSETNX lock:a", false), Route::Forward(Expect::One));
        assert_eq!(
            routed("MSETNX lock:a 1 lock:b", false),
            Route::Forward(Expect::One)
        );
    }
}
