//! The integration tests that may share a process: one test binary, one
//! module per area (`cargo test --test it quorum_faults::` runs one
//! module), so the harness (`tests/support/`) and lockgate's library are
//! compiled and linked once instead of once per file. libtest runs two
//! tests at a time (two cores), from any modules; a test here must not
//! depend on what else the process is doing. Tests that measure the
//! process itself (its memory, its descriptors) or need the machine to
//! themselves are in `tests/serial/`, one at a time.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod admin_locks;
mod admin_replies;
mod arrival_order;
mod auth_resp3;
mod binary;
mod blocking;
mod clients;
mod cluster_clients;
mod cluster_disputes;
mod cluster_locks;
mod cluster_map;
mod cluster_partition;
mod cluster_quorum;
mod cluster_routing;
mod console;
mod dashboard;
mod differential;
mod event_loops;
mod eviction;
mod faults;
mod fence_watch;
mod fencing;
mod guarded_faults;
mod guarded_writes;
mod kinds_faults;
mod layers;
mod legacy_behaviour;
mod lock_kinds;
mod lock_safety;
mod locks;
mod locks_clients;
mod locks_cross;
mod locks_extend;
mod locks_fast;
mod locks_library;
mod locks_library_release;
mod locks_library_storm;
mod locks_native;
mod locks_noscript;
mod locks_redisson;
mod locks_redlock;
mod locks_release;
mod locks_scriptless;
mod locks_takeover;
mod locks_view;
mod locks_wake;
mod locks_watchdog;
mod ops;
mod ops_keys;
mod ops_lapses;
mod ops_reload;
mod partitions;
mod passthrough;
mod passthrough_payloads;
mod pubsub;
mod quorum;
mod quorum_clock;
mod quorum_faults;
mod quorum_library;
mod quorum_rejoin;
mod quorum_split;
mod replicas_ack;
mod replicas_ack_cluster;
mod replicas_ack_tx;
mod sentinel;
mod session_fuzz;
mod shared_upstream;
mod smoke;
mod storm_connections;
mod storm_fleet;
mod storm_handoff;
mod tls;
mod upstream_safety;
