//! Wake-ups between lockgate instances. Instances whose attempts on a
//! lock key failed wait in the key's queue in the store that holds the
//! lock (see [`crate::script::ACQUIRE`]); a release, through whichever
//! instance, wakes the queue's head alone with `PUBLISH
//! lockgate:wake:<prefix> key` (the release scripts do it themselves, on
//! that store). Every instance subscribes to its own channel there, so a
//! release costs the store one message to one subscriber, however many
//! instances wait. An instance woken for a key it no longer waits on
//! passes the turn ([`crate::script::PASS`]: it leaves the queue and the
//! next head is woken); one whose callers tried moments ago without
//! parking (a multiplexed connection's) passes it only if none tries
//! within the window ([`super::storm::Announced::Unless`]). A wake-up is lost only while the subscription is
//! down, and once it is back every key this instance waits on asks the
//! store again; the head also probes once per probe interval, and any
//! instance renewing its place on a free lock wakes the head again.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::evalsha::Call;
use super::storm::{Announced, Storm};
use super::{owner_key, places_key, queue_key, WAKE_PREFIX};
use crate::script::Script;
use crate::upstream::backoff::{self, Backoff};
use crate::upstream::node::{handshake, messages, Node, NodeConfig};

/// Where wake-ups come from and turns are passed: one lock store.
pub struct Store {
    /// How to subscribe there.
    pub config: NodeConfig,
    /// lockgate's own connection there, for passes.
    pub node: Node,
    /// This instance's prefix (`instance_id:`): its channel's name.
    pub prefix: String,
}

/// Subscribes to this instance's wake-up channel on `store` until `stop`.
pub fn spawn(store: Store, storm: Arc<Storm>, stop: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = listen(store, storm) => {}
        }
    });
}

async fn listen(store: Store, storm: Arc<Storm>) {
    let mut backoff = Backoff::new(backoff::OWN_FIRST);
    loop {
        let (now, generation) = store.config.resolve().await;
        tokio::select! {
            end = subscribed(&now, &store, &storm, &mut backoff) => if let Err(e) = end {
                tracing::debug!(node = %now.addr, error = %e, "wake-ups interrupted");
            },
            // The primary changed: subscribe on the new one.
            _ = store.config.replaced(generation) => backoff.at_once(),
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

async fn subscribed(
    node: &NodeConfig,
    store: &Store,
    storm: &Arc<Storm>,
    backoff: &mut Backoff,
) -> Result<(), String> {
    let stream = handshake(node).await?;
    let channel = format!("{WAKE_PREFIX}{}", store.prefix);
    // Wake-ups sent while this instance was not subscribed are lost:
    // every key it waits on asks the store again once it is.
    let subscribed = || storm.resubscribed();
    messages(stream, channel.as_bytes(), backoff, subscribed, |key| {
        match storm.announced(key) {
            Announced::Waits => {}
            Announced::Pass => pass(&store.node, &store.prefix, key, node.connect_timeout),
            // A caller that never parks tried moments ago: its next attempt
            // takes the turn; if none comes in the window, the turn goes on
            // then (bounded, not at the place's lapse).
            Announced::Unless(window) => {
                let (storm, node_handle) = (storm.clone(), store.node.clone());
                let (prefix, key) = (store.prefix.clone(), bytes::Bytes::copy_from_slice(key));
                let timeout = node.connect_timeout;
                tokio::spawn(async move {
                    tokio::time::sleep(window).await;
                    if !storm.attempted_since_wakeup(&key, window) {
                        pass(&node_handle, &prefix, &key, timeout);
                    }
                });
            }
        }
    })
    .await
}

/// Passes the turn on `key`: queued on lockgate's own connection now, its
/// answer not awaited (a lost pass costs the next head one renewal).
fn pass(node: &Node, prefix: &str, key: &[u8], timeout: Duration) {
    let (owner, queue, places) = (owner_key(key), queue_key(key), places_key(key));
    let call = Call::new(
        Script::Pass,
        &[key, &owner, &queue, &places],
        &[prefix.as_bytes()],
    );
    drop(node.send(call.request(), timeout));
}
