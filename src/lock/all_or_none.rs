//! `MSETNX` naming lock keys ([`crate::router::Route::AcquireAll`]): one
//! all-or-none acquisition on lockgate's own connection, started once
//! Redis has answered every command the client sent before it (as Redis
//! would have run it after them). Each lock key gets its pattern's lease
//! and an owner record holding a token of this instance issued after the
//! client's connection opened, so that connection (which made no
//! acquisition of the key itself) may release it by `DEL` under the
//! pooled rule (`docs/locks.md`), as may another of this instance's
//! connections already open then that made none; a connection opened
//! since, or one holding another acquisition, is refused, and the lease
//! ends it otherwise.
//!
//! Refused, saying so, for a key whose pattern asks replicas to
//! acknowledge grants (`locks.replicas_ack`): its grant would be answered
//! before they hold it.

use std::sync::Arc;

use bytes::Bytes;

use super::LockService;
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::script::kinds::MSETNX_LOCKS;

impl LockService {
    /// The work that carries out `MSETNX` over `pairs` in database `db`
    /// (see the module doc): `:1` every key set, `:0` none.
    pub(crate) fn acquire_all(
        self: &Arc<Self>,
        pairs: Vec<(Bytes, Bytes)>,
        db: u64,
    ) -> crate::lock::Later {
        let locks = self.clone();
        Box::pin(async move { locks.msetnx(pairs, db).await })
    }

    async fn msetnx(&self, pairs: Vec<(Bytes, Bytes)>, db: u64) -> LocalReply {
        let keys: Vec<Bytes> = pairs.iter().map(|(k, _)| k.clone()).collect();
        let node = &self.store().primary;
        if node.cluster.is_some() && !super::kinds::same_slot(&keys) {
            return LocalReply::Error(Bytes::from_static(
                b"CROSSSLOT Keys in request don't hash to the same slot",
            ));
        }
        let leases: Vec<u64> = (keys.iter())
            .map(|k| match self.is_lock_key(k) {
                true => self.lease_ms(k).max(1),
                false => 0,
            })
            .collect();
        let owners: Vec<Bytes> = (keys.iter().zip(&leases))
            .filter(|(_, &l)| l > 0)
            .map(|(k, _)| super::owner_key(k))
            .collect();
        if let Some(refused) = (keys.iter().zip(&leases))
            .filter(|(_, &l)| l > 0)
            .find_map(|(k, _)| self.acquisition_refused(k))
        {
            return refused;
        }
        let token = self.next_token();
        let lease_text: Vec<String> = leases.iter().map(u64::to_string).collect();
        let numkeys = (keys.len() + owners.len()).to_string();
        let body = match db {
            0 => MSETNX_LOCKS.to_string(),
            db => format!("redis.call('SELECT', {db})\n{MSETNX_LOCKS}"),
        };
        let mut args: Vec<&[u8]> = vec![b"EVAL", body.as_bytes(), numkeys.as_bytes()];
        args.extend(keys.iter().map(|k| &k[..]));
        args.extend(owners.iter().map(|k| &k[..]));
        args.push(&token);
        for ((_, v), lease) in pairs.iter().zip(&lease_text) {
            args.push(v);
            args.push(lease.as_bytes());
        }
        for lease in &leases {
            self.granting(*lease);
        }
        ProxyMetrics::inc(&self.metrics.attempts);
        let reply = match node
            .call(encode::command(&args), self.store().timeout())
            .await
        {
            Ok(reply) => reply,
            Err(e) => return LocalReply::err(format!("lockgate: {e}")),
        };
        match reply.as_ref() {
            b":1\r\n" => {
                ProxyMetrics::inc(&self.metrics.acquired);
                ProxyMetrics::inc(&self.metrics.msetnx_grants);
                LocalReply::Integer(1)
            }
            b":0\r\n" => {
                ProxyMetrics::inc(&self.metrics.contended);
                LocalReply::Integer(0)
            }
            other => super::kinds::node_error(other).unwrap_or_else(|| {
                LocalReply::err("lockgate: MSETNX on lock keys: an unexpected reply from Redis")
            }),
        }
    }

    /// Why an acquisition of `key` is not tried now: replicas to wait
    /// for, a failover's hold
    /// (`:0`, as a held lock answers `MSETNX`), an evicting primary or a
    /// disputed slot.
    fn acquisition_refused(&self, key: &[u8]) -> Option<LocalReply> {
        if self.ack_rule(key).is_some() {
            return Some(LocalReply::err(
                "lockgate: MSETNX on a lock key whose pattern asks replicas to acknowledge grants (locks.replicas_ack) is refused; take it with SET key value NX PX ms",
            ));
        }
        if self.held_after_failover(key) {
            return Some(LocalReply::Integer(0));
        }
        (self.eviction_refusal()).or_else(|| self.refused_for_dispute(key))
    }
}
