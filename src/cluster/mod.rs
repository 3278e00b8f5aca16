//! Redis Cluster behind lockgate (issue 27, in progress): the pieces that
//! know what a cluster is, with no socket of their own. [`slot`] computes
//! a key's hash slot as Redis does; [`map`] reads which node serves each
//! slot from a node's `CLUSTER SHARDS` or `CLUSTER SLOTS` reply. Routing
//! clients' commands by slot is not built yet: lockgate still speaks to
//! one primary (docs/cluster.md).

pub mod map;
pub mod slot;
