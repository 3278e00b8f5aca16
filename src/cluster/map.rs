//! The slot map: which node serves each hash slot, as a cluster node
//! describes it, from `CLUSTER SHARDS` (Redis 7, Valkey) or `CLUSTER
//! SLOTS` (every version). A node's address as it is reached: where the
//! reply gives no usable endpoint (empty, or `?` when the node does not
//! know it), the address of the node that was asked.

use redis_protocol::resp2::types::OwnedFrame;

use super::slot::{key_slot, SLOTS};

/// Why a slot map could not be read from a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    /// Upstream: the node answered an error (the command refused, or not a
    /// cluster node).
    #[error("the node answered {0}")]
    Refused(String),
    /// Upstream: the reply is not the shape the command returns.
    #[error("unreadable slot map: {0}")]
    Malformed(&'static str),
}

/// One shard: its primary's address and its replicas'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// `HOST:PORT` of the primary.
    pub primary: String,
    /// `HOST:PORT` of each replica (online or not, as reported).
    pub replicas: Vec<String>,
}

/// Which shard serves each slot. Two maps are equal when every slot has
/// the same primary and replicas, whatever order the reply named them in.
#[derive(Clone)]
pub struct SlotMap {
    shards: Vec<Shard>,
    /// Per slot, the index in `shards` (`NONE`: no shard serves it).
    owner: Box<[u16]>,
}

impl std::fmt::Debug for SlotMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotMap")
            .field("shards", &self.shards)
            .field("unserved", &self.unserved())
            .finish()
    }
}

impl PartialEq for SlotMap {
    fn eq(&self, other: &SlotMap) -> bool {
        (0..SLOTS).all(|s| self.shard_of_slot(s) == other.shard_of_slot(s))
    }
}

impl Eq for SlotMap {}

const NONE: u16 = u16::MAX;

impl SlotMap {
    fn empty() -> SlotMap {
        SlotMap {
            shards: Vec::new(),
            owner: vec![NONE; usize::from(SLOTS)].into_boxed_slice(),
        }
    }

    /// The shard of `primary`, added if new.
    fn shard(&mut self, primary: String, mut replicas: Vec<String>) -> u16 {
        replicas.sort();
        if let Some(i) = self.shards.iter().position(|s| s.primary == primary) {
            return i as u16;
        }
        self.shards.push(Shard { primary, replicas });
        (self.shards.len() - 1) as u16
    }

    /// A map of `ranges` (first slot, last slot, primary, replicas), for
    /// tests elsewhere.
    #[cfg(test)]
    pub(crate) fn from_ranges(ranges: &[(u16, u16, &str, &[&str])]) -> SlotMap {
        let mut map = SlotMap::empty();
        for (first, last, primary, replicas) in ranges {
            let replicas = replicas.iter().map(|r| r.to_string()).collect();
            let shard = map.shard(primary.to_string(), replicas);
            let _ = map.serve(i64::from(*first), i64::from(*last), shard);
        }
        map
    }

    fn serve(&mut self, first: i64, last: i64, shard: u16) -> Result<(), MapError> {
        let range = 0..i64::from(SLOTS);
        if !range.contains(&first) || !range.contains(&last) || first > last {
            return Err(MapError::Malformed("a slot range outside 0-16383"));
        }
        for slot in first..=last {
            self.owner[slot as usize] = shard;
        }
        Ok(())
    }

    /// The map `CLUSTER SLOTS` describes (`reply` in RESP2), asked of the
    /// node at `asked` (`HOST:PORT`).
    pub fn from_slots(reply: &[u8], asked: &str) -> Result<SlotMap, MapError> {
        let mut map = SlotMap::empty();
        for range in array(decode(reply)?)? {
            let parts = array(range)?;
            let (Some(first), Some(last)) = (int(parts.first()), int(parts.get(1))) else {
                return Err(MapError::Malformed("a slot range without its bounds"));
            };
            let mut nodes = parts.into_iter().skip(2).map(|n| slots_node(n, asked));
            let primary = nodes
                .next()
                .ok_or(MapError::Malformed("a slot range without its primary"))??;
            let replicas = nodes.collect::<Result<Vec<_>, _>>()?;
            let shard = map.shard(primary, replicas);
            map.serve(first, last, shard)?;
        }
        Ok(map)
    }

    /// The map `CLUSTER SHARDS` describes (`reply` in RESP2), asked of the
    /// node at `asked`: each shard's slots go to its primary that is not
    /// marked failed.
    pub fn from_shards(reply: &[u8], asked: &str) -> Result<SlotMap, MapError> {
        let mut map = SlotMap::empty();
        for shard in array(decode(reply)?)? {
            let fields = pairs(array(shard)?)?;
            let slots = array(field(&fields, "slots")?.clone())?;
            let mut primary = None;
            let mut replicas = Vec::new();
            for node in array(field(&fields, "nodes")?.clone())? {
                let node = pairs(array(node)?)?;
                let addr = shards_node(&node, asked)?;
                let role = text(field(&node, "role")?);
                let failed = field(&node, "health").map(text).ok().as_deref() == Some("failed");
                match role.as_str() {
                    "master" if !failed => primary = Some(addr),
                    _ => replicas.push(addr),
                }
            }
            if slots.is_empty() {
                continue;
            }
            let primary = primary.ok_or(MapError::Malformed("a shard without a primary"))?;
            let index = map.shard(primary, replicas);
            for pair in slots.chunks(2) {
                let (Some(first), Some(last)) = (int(pair.first()), int(pair.get(1))) else {
                    return Err(MapError::Malformed("a shard's slots not in pairs"));
                };
                map.serve(first, last, index)?;
            }
        }
        Ok(map)
    }

    /// The shard that serves `slot`.
    pub fn shard_of_slot(&self, slot: u16) -> Option<&Shard> {
        let i = *self.owner.get(usize::from(slot))?;
        self.shards.get(usize::from(i))
    }

    /// The index in [`SlotMap::shards`] of the shard that serves `slot`.
    pub fn shard_index(&self, slot: u16) -> Option<usize> {
        let i = *self.owner.get(usize::from(slot))?;
        (i != NONE).then_some(usize::from(i))
    }

    /// The shard that serves `key`'s slot.
    pub fn shard_of_key(&self, key: &[u8]) -> Option<&Shard> {
        self.shard_of_slot(key_slot(key))
    }

    /// Every shard that serves a slot, in the order the reply named them.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// How many slots no shard serves (0 for a cluster whose state is ok).
    pub fn unserved(&self) -> usize {
        self.owner.iter().filter(|&&o| o == NONE).count()
    }

    /// The ranges of slots each shard serves, as `(first, last, shard)`.
    pub fn ranges(&self) -> Vec<(u16, u16, &Shard)> {
        let mut out: Vec<(u16, u16, &Shard)> = Vec::new();
        for (slot, &owner) in self.owner.iter().enumerate() {
            let Some(shard) = self.shards.get(usize::from(owner)) else {
                continue;
            };
            match out.last_mut() {
                Some(last) if last.1 as usize + 1 == slot && std::ptr::eq(last.2, shard) => {
                    last.1 = slot as u16;
                }
                _ => out.push((slot as u16, slot as u16, shard)),
            }
        }
        out
    }
}

fn decode(reply: &[u8]) -> Result<OwnedFrame, MapError> {
    match redis_protocol::resp2::decode::decode(reply) {
        Ok(Some((OwnedFrame::Error(e), _))) => Err(MapError::Refused(e)),
        Ok(Some((frame, _))) => Ok(frame),
        _ => Err(MapError::Malformed("not a whole RESP2 reply")),
    }
}

fn array(frame: OwnedFrame) -> Result<Vec<OwnedFrame>, MapError> {
    match frame {
        OwnedFrame::Array(items) => Ok(items),
        _ => Err(MapError::Malformed("an array expected")),
    }
}

fn int(frame: Option<&OwnedFrame>) -> Option<i64> {
    match frame? {
        OwnedFrame::Integer(n) => Some(*n),
        _ => None,
    }
}

fn text(frame: &OwnedFrame) -> String {
    match frame {
        OwnedFrame::BulkString(b) | OwnedFrame::SimpleString(b) => {
            String::from_utf8_lossy(b).into_owned()
        }
        OwnedFrame::Integer(n) => n.to_string(),
        _ => String::new(),
    }
}

/// A flat `name, value, …` array as pairs.
fn pairs(items: Vec<OwnedFrame>) -> Result<Vec<(String, OwnedFrame)>, MapError> {
    if items.len() % 2 != 0 {
        return Err(MapError::Malformed("a map with an odd number of fields"));
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((text(&k), v));
    }
    Ok(out)
}

fn field<'a>(fields: &'a [(String, OwnedFrame)], name: &str) -> Result<&'a OwnedFrame, MapError> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .ok_or(MapError::Malformed("a field missing"))
}

/// `HOST:PORT` of `host` (empty or `?`: the host of `asked`) and `port`.
fn addr(host: &str, port: i64, asked: &str) -> String {
    let host = match host {
        "" | "?" => asked.rsplit_once(':').map_or(asked, |(h, _)| h),
        h => h,
    };
    match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// A node of a `CLUSTER SLOTS` range: `[host, port, id, …]`.
fn slots_node(node: OwnedFrame, asked: &str) -> Result<String, MapError> {
    let parts = array(node)?;
    let port = int(parts.get(1)).ok_or(MapError::Malformed("a node without its port"))?;
    Ok(addr(
        &parts.first().map(text).unwrap_or_default(),
        port,
        asked,
    ))
}

/// A node of a `CLUSTER SHARDS` shard: its endpoint (else its ip) and port.
fn shards_node(node: &[(String, OwnedFrame)], asked: &str) -> Result<String, MapError> {
    let port = field(node, "port").ok().and_then(|p| int(Some(p)));
    let port = port.ok_or(MapError::Malformed("a node without its port"))?;
    let endpoint = field(node, "endpoint").map(text).unwrap_or_default();
    let host = match endpoint.as_str() {
        "" | "?" => field(node, "ip").map(text).unwrap_or_default(),
        e => e.to_string(),
    };
    Ok(addr(&host, port, asked))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> String {
        format!("${}\r\n{s}\r\n", s.len())
    }

    #[test]
    fn cluster_slots_and_shards_give_the_same_map() {
        // Two shards: 0-8191 on :7000 (replica :7003), 8192-16383 on
        // :7001, whose endpoint is unknown (`?`: the asked host).
        let slots = format!(
            "*2\r\n*4\r\n:0\r\n:8191\r\n*3\r\n{}:7000\r\n{}*3\r\n{}:7003\r\n{}\
             *3\r\n:8192\r\n:16383\r\n*3\r\n{}:7001\r\n{}",
            bulk("127.0.0.1"),
            bulk("a"),
            bulk("127.0.0.1"),
            bulk("d"),
            bulk("?"),
            bulk("b"),
        );
        let node = |id: &str, endpoint: &str, port: u16, role: &str, health: &str| {
            format!(
                "*10\r\n{}{}{}:{port}\r\n{}{}{}{}{}{}",
                bulk("id"),
                bulk(id),
                bulk("port"),
                bulk("endpoint"),
                bulk(endpoint),
                bulk("role"),
                bulk(role),
                bulk("health"),
                bulk(health),
            )
        };
        let shards = format!(
            "*2\r\n*4\r\n{}*2\r\n:0\r\n:8191\r\n{}*2\r\n{}{}\
             *4\r\n{}*2\r\n:8192\r\n:16383\r\n{}*1\r\n{}",
            bulk("slots"),
            bulk("nodes"),
            node("a", "127.0.0.1", 7000, "master", "online"),
            node("d", "127.0.0.1", 7003, "replica", "online"),
            bulk("slots"),
            bulk("nodes"),
            node("b", "?", 7001, "master", "online"),
        );
        let a = SlotMap::from_slots(slots.as_bytes(), "10.0.0.9:7000").unwrap();
        let b = SlotMap::from_shards(shards.as_bytes(), "10.0.0.9:7000").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.unserved(), 0);
        assert_eq!(a.shard_of_slot(8191).unwrap().primary, "127.0.0.1:7000");
        assert_eq!(a.shard_of_slot(8191).unwrap().replicas, ["127.0.0.1:7003"]);
        assert_eq!(a.shard_of_slot(8192).unwrap().primary, "10.0.0.9:7001");
        // "foo" is slot 12182.
        assert_eq!(a.shard_of_key(b"foo").unwrap().primary, "10.0.0.9:7001");
        let ranges: Vec<(u16, u16)> = a.ranges().iter().map(|r| (r.0, r.1)).collect();
        assert_eq!(ranges, [(0, 8191), (8192, 16383)]);
    }

    #[test]
    fn unserved_slots_and_bad_replies_are_said() {
        let part = format!("*1\r\n*3\r\n:0\r\n:99\r\n*2\r\n{}:7000\r\n", bulk("h"));
        let map = SlotMap::from_slots(part.as_bytes(), "h:7000").unwrap();
        assert_eq!(map.unserved(), 16_384 - 100);
        assert!(map.shard_of_slot(100).is_none());
        assert_eq!(
            SlotMap::from_slots(
                b"-ERR This instance has cluster support disabled\r\n",
                "h:1"
            ),
            Err(MapError::Refused(
                "ERR This instance has cluster support disabled".into()
            ))
        );
        let out_of_range = format!("*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n{}:7000\r\n", bulk("h"));
        assert!(SlotMap::from_slots(out_of_range.as_bytes(), "h:1").is_err());
        assert!(SlotMap::from_slots(b"*1\r\n", "h:1").is_err());
    }
}
