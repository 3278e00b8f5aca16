//! The integration tests that run one at a time: each takes [`SERIAL`]
//! first, so no other test of this binary runs beside it. They read this
//! process's memory and descriptors (`abusive_clients`, `clients_gone`:
//! lockgate runs in the test's process), or drive storms, quorums and
//! fleets hard enough that two at once on two cores would measure each
//! other (`storm`, `storm_fairness`, `quorum_safety`). Everything else is
//! in `tests/it/`, two at a time. `cargo test --test serial storm::` runs
//! one module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod abusive_clients;
mod clients_gone;
mod quorum_safety;
mod storm;
mod storm_fairness;

/// One test of this binary at a time; every test takes it before anything
/// else (a failed test releases it: no poisoning).
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
