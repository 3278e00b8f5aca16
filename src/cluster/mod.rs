//! Redis Cluster behind lockgate, the pure parts: [`slot`] computes a
//! key's hash slot as Redis does; [`map`] reads which node serves each
//! slot from a node's `CLUSTER SHARDS` or `CLUSTER SLOTS` reply;
//! [`topology`] says when to ask the nodes for it again;
//! [`redirect`] reads `MOVED` and `ASK`; [`keys`] finds a command's keys
//! from the server's own key specifications; [`route`] says where one
//! command goes; [`split`] splits a multi-key command per slot and merges
//! the answers; [`tx`] keeps a transaction in one slot; [`scan`] composes
//! `SCAN`'s cursor over every primary; [`subs`] follows a session's
//! subscriptions to see when it leaves subscribed mode; [`fanout`]
//! spreads and merges keyspace-wide commands; [`facade`] answers a
//! cluster-aware client as a cluster of one node, lockgate; [`auth`]
//! checks a client's `AUTH` against lockgate's own credentials. Nothing
//! here opens a connection: reading the map from the nodes, the
//! connections to them and the sessions' streams over them are
//! `crate::upstream::cluster`
//! (docs/cluster.md).

pub mod auth;
pub mod facade;
pub mod fanout;
pub mod keys;
pub mod map;
pub mod redirect;
pub mod route;
pub mod scan;
pub mod slot;
pub mod split;
pub mod subs;
pub mod topology;
pub mod tx;
