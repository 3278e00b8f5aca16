//! The integration tests that run one at a time: each takes [`SERIAL`]
//! first, so no other test of this binary runs beside it. They read this
//! process's memory and descriptors (`abusive_clients`, `clients_gone`:
//! lockgate runs in the test's process), or drive storms, quorums and
//! fleets hard enough that two at once on two cores would measure each
//! other (`storm`, `storm_fairness`, `storm_shapes`, `shared_fairness`, `quorum_safety`, and the quorum's
//! chaos and recovery, whose node timeouts of 200 ms are a loaded box's
//! to miss: beside the heaviest tests of `tests/it/` they failed about one
//! run in two; `replicas_failover`, which times how long a failover
//! refuses acquisitions under load). Everything else is in `tests/it/`, two at a time. `cargo
//! test --test serial storm::` runs one module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

/// The chaos test's pieces (`quorum_chaos`, `quorum_recovery`).
mod chaos;

mod abusive_clients;
mod clients_gone;
mod fence_fairness;
mod partitions;
mod quorum_chaos;
mod quorum_recovery;
mod quorum_safety;
mod replicas_cluster_failover;
mod replicas_failover;
mod replicas_shapes;
mod shared_fairness;
mod split_brain;
mod storm;
mod storm_fairness;
mod storm_shapes;

/// One test of this binary at a time; every test takes it before anything
/// else (a failed test releases it: no poisoning).
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
