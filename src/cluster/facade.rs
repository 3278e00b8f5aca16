//! What a cluster-aware client (redis-py's `RedisCluster`, `redis-cli
//! -c`) is answered when it asks lockgate about the cluster: a
//! cluster of one node, lockgate itself at its own listen address, serving
//! all 16 384 slots, so the client sends everything to lockgate, which
//! routes each command to the node that serves it. Pure: the replies are
//! built from lockgate's address and node id, and table-tested by reading
//! them back as a client would. A session's cluster stream answers with
//! them (`crate::upstream::cluster`).

use bytes::Bytes;

use super::slot::{key_slot, SLOTS};
use crate::protocol::encode::LocalReply;

/// lockgate as the one node of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facade {
    /// Its node id: 40 hex digits, stable for an instance.
    pub id: String,
    /// The host clients reach it at.
    pub host: String,
    /// The port clients reach it at.
    pub port: u16,
}

fn bulk(s: &str) -> LocalReply {
    LocalReply::Bulk(Bytes::copy_from_slice(s.as_bytes()))
}

impl Facade {
    /// The node at `host:port`, its id derived from `instance` (the lock
    /// room's instance id), so it stays the same across restarts.
    pub fn new(instance: &str, host: &str, port: u16) -> Facade {
        Facade {
            id: sha1_smol::Sha1::from(instance.as_bytes())
                .digest()
                .to_string(),
            host: host.to_string(),
            port,
        }
    }

    /// `CLUSTER SLOTS`: one range, every slot, this node.
    pub fn slots(&self) -> LocalReply {
        let node = LocalReply::Array(vec![
            bulk(&self.host),
            LocalReply::Integer(i64::from(self.port)),
            bulk(&self.id),
            LocalReply::Array(Vec::new()),
        ]);
        LocalReply::Array(vec![LocalReply::Array(vec![
            LocalReply::Integer(0),
            LocalReply::Integer(i64::from(SLOTS - 1)),
            node,
        ])])
    }

    /// `CLUSTER SHARDS`: one shard, every slot, this node its primary.
    pub fn shards(&self) -> LocalReply {
        let node = LocalReply::Map(vec![
            (bulk("id"), bulk(&self.id)),
            (bulk("port"), LocalReply::Integer(i64::from(self.port))),
            (bulk("ip"), bulk(&self.host)),
            (bulk("endpoint"), bulk(&self.host)),
            (bulk("role"), bulk("master")),
            (bulk("replication-offset"), LocalReply::Integer(0)),
            (bulk("health"), bulk("online")),
        ]);
        let slots = LocalReply::Array(vec![
            LocalReply::Integer(0),
            LocalReply::Integer(i64::from(SLOTS - 1)),
        ]);
        LocalReply::Array(vec![LocalReply::Map(vec![
            (bulk("slots"), slots),
            (bulk("nodes"), LocalReply::Array(vec![node])),
        ])])
    }

    /// `CLUSTER NODES`: this node's line, as Redis writes it.
    pub fn nodes(&self) -> LocalReply {
        bulk(&format!(
            "{} {}:{}@{} myself,master - 0 0 1 connected 0-{}\n",
            self.id,
            self.host,
            self.port,
            u32::from(self.port) + 10_000,
            SLOTS - 1
        ))
    }

    /// `CLUSTER INFO`: a healthy cluster of one node.
    pub fn info(&self) -> LocalReply {
        let lines = [
            "cluster_enabled:1".to_string(),
            "cluster_state:ok".to_string(),
            format!("cluster_slots_assigned:{SLOTS}"),
            format!("cluster_slots_ok:{SLOTS}"),
            "cluster_slots_pfail:0".to_string(),
            "cluster_slots_fail:0".to_string(),
            "cluster_known_nodes:1".to_string(),
            "cluster_size:1".to_string(),
            "cluster_current_epoch:1".to_string(),
            "cluster_my_epoch:1".to_string(),
        ];
        bulk(&(lines.join("\r\n") + "\r\n"))
    }

    /// The answer to `CLUSTER <sub> …` (`args` from the subcommand on),
    /// when lockgate answers it itself; `None` for a subcommand it does
    /// not (what it means on the nodes behind is the router's to decide).
    pub fn cluster(&self, args: &[&[u8]]) -> Option<LocalReply> {
        let sub = args.first()?.to_ascii_uppercase();
        Some(match (sub.as_slice(), args.len()) {
            (b"SLOTS", 1) => self.slots(),
            (b"SHARDS", 1) => self.shards(),
            (b"NODES", 1) => self.nodes(),
            (b"INFO", 1) => self.info(),
            (b"MYID", 1) | (b"MYSHARDID", 1) => bulk(&self.id),
            (b"KEYSLOT", 2) => LocalReply::Integer(i64::from(key_slot(args[1]))),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::map::SlotMap;

    fn facade() -> Facade {
        Facade::new("pod-7", "10.1.2.3", 6380)
    }

    /// What a cluster-aware client reads from the replies: one node,
    /// lockgate, serving every slot; in RESP2 and RESP3 alike.
    #[test]
    fn a_client_reads_a_cluster_of_one_node_serving_every_slot() {
        let f = facade();
        assert_eq!(f.id.len(), 40);
        assert_eq!(Facade::new("pod-7", "h", 1).id, f.id, "stable per instance");
        for reply in [f.slots(), f.shards()] {
            let bytes = reply.to_bytes(false);
            let map = SlotMap::from_slots(&bytes, "x:1")
                .or_else(|_| SlotMap::from_shards(&bytes, "x:1"))
                .expect("a slot map");
            assert_eq!(map.unserved(), 0);
            assert_eq!(map.shards().len(), 1);
            assert_eq!(map.shards()[0].primary, "10.1.2.3:6380");
        }
        assert!(f.shards().to_bytes(true).starts_with(b"*1\r\n%2\r\n"));
        let LocalReply::Bulk(nodes) = f.nodes() else {
            panic!("CLUSTER NODES is a bulk string");
        };
        let fields: Vec<&str> = std::str::from_utf8(&nodes).unwrap().split(' ').collect();
        assert_eq!(fields.len(), 9, "{fields:?}");
        assert_eq!(fields[1], "10.1.2.3:6380@16380");
        assert_eq!(fields[8], "0-16383\n");
        let LocalReply::Bulk(info) = f.info() else {
            panic!("CLUSTER INFO is a bulk string");
        };
        assert!(std::str::from_utf8(&info)
            .unwrap()
            .contains("cluster_state:ok\r\n"));
    }

    #[test]
    fn subcommands_are_answered_or_left_to_the_nodes() {
        let f = facade();
        assert_eq!(
            f.cluster(&[b"keyslot", b"foo"]),
            Some(LocalReply::Integer(12_182))
        );
        assert_eq!(f.cluster(&[b"MYID"]), Some(bulk(&f.id)));
        assert_eq!(f.cluster(&[b"slots"]), Some(f.slots()));
        assert_eq!(f.cluster(&[b"KEYSLOT"]), None, "arity: left to the nodes");
        assert_eq!(f.cluster(&[b"COUNTKEYSINSLOT", b"1"]), None);
        assert_eq!(f.cluster(&[]), None);
    }
}
