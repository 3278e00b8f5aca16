//! Unit tests of the storm room's own logic, without sockets.
//!
//! `step`, `step_handoff`, `step_queue` and `step_shapes` drive a key's state machine ([`super::key::Key::step`]) with
//! events and made-up times, table-driven. `driver` runs the table and its
//! driver task under `tokio::time::pause()` with a scripted in-memory
//! [`super::Acquirer`]: that fake stands for "acquire on Redis or the quorum", the
//! one call the driver makes outside the lock room, so these tests check
//! the room's rules (order, absorption, probing, bounds) and nothing of
//! Redis. They do not replace the integration tests
//! (`tests/serial/storm*.rs`, `tests/it/storm_{fleet,handoff}.rs`), which
//! run lockgate against real `redis-server` processes.

mod driver;
mod step;
mod step_handoff;
mod step_queue;
mod step_shapes;

use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::Ask;
use crate::lock::lease::ConnLocks;
use crate::lock::ops::Shape;

/// A client connection's lock records.
fn conn() -> Arc<Mutex<ConnLocks>> {
    Arc::new(Mutex::new(ConnLocks::opened(16, 0)))
}

/// A connection of its own: an attempt by nobody else under test.
fn anyone() -> crate::lock::lease::ConnId {
    ConnLocks::new(1).id
}

/// What parking `conn`'s SETNX on `key` with `value` asks for.
fn ask(key: &str, value: &str, conn: &Arc<Mutex<ConnLocks>>) -> Ask {
    let conn_id = crate::sync::lock(conn).id;
    Ask {
        key: Bytes::copy_from_slice(key.as_bytes()),
        value: Bytes::copy_from_slice(value.as_bytes()),
        shape: Shape::SetNx,
        lease_ms: 1_000,
        conn: conn.clone(),
        conn_id,
        check: false,
    }
}
