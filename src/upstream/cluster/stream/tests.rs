//! The session's stream in front of a cluster, with lanes the tests play
//! (no node, no socket): commands written into [`ClusterWrite`] as the
//! session writes them, each node's lane a task of the test's that logs
//! the jobs it is sent and answers them when the test lets it, and the
//! replies read back from [`ClusterRead`]. What is checked is the
//! stream's own promise: a node's commands go in one job per flush and
//! keep their order, and the replies come back in the order of the
//! commands whichever node answers first, lockgate's own answers in their
//! places.

use std::sync::Mutex;

use redis_protocol::resp2::types::Resp2Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::cluster::slot::key_slot;
use crate::config::Config;
use crate::tls::{Side, TlsStore};
use crate::upstream::testing::{command, framed, read_all, WAIT};
use crate::upstream::Connector;

/// What the lanes were sent: per job answered, its node and its
/// commands' keys; `answered` told at each.
#[derive(Default)]
struct Jobs {
    jobs: Mutex<Vec<(&'static str, Vec<String>)>>,
    answered: tokio::sync::Notify,
}

impl Jobs {
    fn seen(&self) -> Vec<(&'static str, Vec<String>)> {
        self.jobs.lock().expect("the log").clone()
    }
}

type Log = Arc<Jobs>;

/// The three primaries of [`map`] and the slots they serve.
const NODES: [(&str, u16, u16); 3] = [
    ("a:1", 0, 5460),
    ("b:1", 5461, 10922),
    ("c:1", 10923, 16383),
];

/// A command's key (its second argument), or its name.
fn key_of(command: &[u8]) -> String {
    let Ok(Some((frame, _))) = redis_protocol::resp2::decode::decode(command) else {
        panic!("a whole command");
    };
    let redis_protocol::resp2::types::OwnedFrame::Array(args) = frame else {
        panic!("an array");
    };
    let arg = args.get(1).or(args.first()).expect("an argument");
    String::from_utf8(arg.as_bytes().expect("a bulk").to_vec()).expect("text")
}

/// The node serving `key`.
fn node_of(key: &str) -> &'static str {
    let slot = key_slot(key.as_bytes());
    let (node, ..) = NODES
        .iter()
        .find(|(_, first, last)| (*first..=*last).contains(&slot))
        .expect("every slot served");
    node
}

/// A key served by `node`: the first of `k0`, `k1`, … after `skip` others.
fn key_on(node: &str, skip: usize) -> String {
    (0..)
        .map(|i| format!("k{i}"))
        .filter(|k| node_of(k) == node)
        .nth(skip)
        .expect("a key")
}

/// The reply a played lane gives a command: `+node:key`.
fn reply(node: &str, key: &str) -> String {
    format!("+{node}:{key}\r\n")
}

/// A lane played by the test for `node`: each job logged and answered
/// (each command `+node:key`), once `gate` (when given) hands out a
/// permit for it.
fn play(node: &'static str, log: Log, gate: Option<Arc<Semaphore>>) -> mpsc::Sender<Job> {
    play_queue(node, log, gate, 16)
}

/// [`play`] with a queue of `capacity` jobs.
fn play_queue(
    node: &'static str,
    log: Log,
    gate: Option<Arc<Semaphore>>,
    capacity: usize,
) -> mpsc::Sender<Job> {
    let (tx, mut rx) = mpsc::channel::<Job>(capacity);
    tokio::spawn(async move {
        while let Some(job) = rx.recv().await {
            if let Some(gate) = &gate {
                gate.acquire().await.expect("the gate stays open").forget();
            }
            let keys: Vec<String> = job.commands.iter().map(|c| key_of(c)).collect();
            let parts = (keys.iter())
                .map(|k| Part::Reply(Bytes::from(reply(node, k))))
                .collect();
            job.finish(parts);
            log.jobs.lock().expect("the log").push((node, keys));
            log.answered.notify_waiters();
        }
    });
    tx
}

/// A stream over three played lanes; `gated` names the node whose
/// answers wait for the test's permits (and returns that gate).
fn stream(log: &Log, gated: Option<&'static str>) -> (ClusterStream, Option<Arc<Semaphore>>) {
    let config = Config::default();
    let connector = Connector::new(Arc::new(TlsStore::new(&config)), Side::Upstream);
    let common = Common::new(&config, connector, &CancellationToken::new());
    let rows: Vec<(u16, u16, &str, &[&str])> = (NODES.iter())
        .map(|(node, first, last)| (*first, *last, *node, &[][..]))
        .collect();
    *crate::sync::write(&common.map) = (
        Some(Arc::new(super::super::tests::map(&rows))),
        std::time::Instant::now(),
    );
    *crate::sync::write(&common.keys) = Arc::new(crate::cluster::route::tests::table());
    common
        .generation
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let gate = gated.map(|_| Arc::new(Semaphore::new(0)));
    {
        let mut lanes = crate::sync::lock(&common.lanes);
        for (node, ..) in NODES {
            let held = (gated == Some(node)).then(|| gate.clone()).flatten();
            lanes.insert(
                (Arc::from(node), false),
                vec![play(node, log.clone(), held)],
            );
        }
    }
    (ClusterStream::new(Arc::new(common), 0, false), gate)
}

/// Two keys on each node, interleaved: a1 b1 c1 a2 b2 c2.
fn interleaved_keys() -> Vec<String> {
    (0..2)
        .flat_map(|i| NODES.iter().map(move |(n, ..)| key_on(n, i)))
        .collect()
}

/// The lanes were sent one job per node, with that node's
/// [`interleaved_keys`] in their order.
fn assert_one_job_per_node(log: &Log) {
    let mut jobs = log.seen();
    jobs.sort();
    let expected: Vec<(&str, Vec<String>)> = (NODES.iter())
        .map(|(n, ..)| (*n, vec![key_on(n, 0), key_on(n, 1)]))
        .collect();
    assert_eq!(jobs, expected, "one job per node, its commands in order");
}

/// Waits until the lanes have answered `n` jobs.
async fn answered(log: &Log, n: usize) {
    tokio::time::timeout(WAIT, async {
        loop {
            let told = log.answered.notified();
            if log.jobs.lock().expect("the log").len() >= n {
                return;
            }
            told.await;
        }
    })
    .await
    .expect("the lanes answer");
}

#[tokio::test]
async fn a_nodes_commands_go_as_one_job_per_flush_in_their_order() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    let keys = interleaved_keys();
    let mut bytes = Vec::new();
    for k in &keys {
        bytes.extend(command(&["SET", k, "v"]));
    }
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    let want: String = keys.iter().map(|k| reply(node_of(k), k)).collect();
    read_all(&mut s.read, &want).await;
    assert_one_job_per_node(&log);
}

#[tokio::test]
async fn replies_come_in_command_order_whichever_node_answers_first() {
    let log = Log::default();
    let (mut s, gate) = stream(&log, Some("a:1"));
    let gate = gate.expect("a gate");
    // The first command's node answers last; lockgate answers READONLY
    // itself, between two nodes' replies.
    let (a, b, c) = (key_on("a:1", 0), key_on("b:1", 0), key_on("c:1", 0));
    let mut bytes = command(&["GET", &a]);
    bytes.extend(command(&["GET", &b]));
    bytes.extend(command(&["READONLY"]));
    bytes.extend(command(&["GET", &c]));
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    answered(&log, 2).await;
    // b and c have answered; a has not: nothing can be handed on yet.
    let mut one = [0u8; 1];
    assert!(
        futures_util::FutureExt::now_or_never(s.read.read(&mut one)).is_none(),
        "a reply handed on before the first command's"
    );
    gate.add_permits(1);
    let want = [
        reply("a:1", &a),
        reply("b:1", &b),
        "+OK\r\n".into(),
        reply("c:1", &c),
    ]
    .concat();
    read_all(&mut s.read, &want).await;
}

#[tokio::test]
async fn an_unfinished_command_waits_for_its_rest() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    let k = key_on("b:1", 0);
    let bytes = command(&["SET", &k, "value"]);
    let (head, tail) = bytes.split_at(bytes.len() - 4);
    s.write.write_all(head).await.expect("written");
    s.write.flush().await.expect("flushed");
    // A whole command behind it would go out: none is, so nothing did.
    assert!(log.seen().is_empty(), "half a command sent");
    s.write.write_all(tail).await.expect("written");
    s.write.flush().await.expect("flushed");
    read_all(&mut s.read, &reply("b:1", &k)).await;
    assert_eq!(log.seen(), vec![("b:1", vec![k])], "sent once, whole");
}

#[tokio::test]
async fn a_job_its_lane_dropped_unanswered_is_answered_in_its_place() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    // The lane of b ends with the job unanswered (lockgate shutting
    // down): that command gets an error in its place, the others their
    // replies.
    let (tx, mut rx) = mpsc::channel::<Job>(1);
    tokio::spawn(async move { drop(rx.recv().await) });
    let common = s.write.common.clone();
    crate::sync::lock(&common.lanes).insert((Arc::from("b:1"), false), vec![tx]);
    let (a, b, c) = (key_on("a:1", 0), key_on("b:1", 0), key_on("c:1", 0));
    let mut bytes = command(&["GET", &a]);
    bytes.extend(command(&["GET", &b]));
    bytes.extend(command(&["GET", &c]));
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    let gone = String::from_utf8(merge::gone().to_vec()).expect("text");
    assert!(gone.starts_with("-ERR "), "{gone}");
    let want = [reply("a:1", &a), gone, reply("c:1", &c)].concat();
    read_all(&mut s.read, &want).await;
}

#[tokio::test]
async fn commands_framed_by_the_dispatcher_go_as_unframed_ones_do() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    let keys = interleaved_keys();
    let mut commands: Vec<Vec<&str>> = keys.iter().map(|k| vec!["SET", k, "v"]).collect();
    // lockgate's own answer after them.
    commands.push(vec!["READONLY"]);
    let commands: Vec<&[&str]> = commands.iter().map(|c| &c[..]).collect();
    let (bytes, frames) = framed(&commands);
    s.write.frames(frames);
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    assert!(s.write.hints.is_empty(), "every frame used");
    let mut want: Vec<String> = keys.iter().map(|k| reply(node_of(k), k)).collect();
    want.push("+OK\r\n".into());
    read_all(&mut s.read, &want.concat()).await;
    assert_one_job_per_node(&log);
}

#[tokio::test]
async fn frames_are_followed_only_where_their_bytes_are() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    let (a, b) = (key_on("a:1", 0), key_on("b:1", 0));
    // A frame that says the key of `SET b a` is where `a` is: followed,
    // it routes to a's node (what shows the frame is used, not a second
    // parse). The dispatcher's frames never lie; this one is the test's.
    let bytes = command(&["SET", &b, &a]);
    let mut parser = crate::upstream::shared::framing_parser();
    let request = parser.parse(&bytes).expect("parsed").expect("whole");
    let r = parser.arg_ranges().expect("a multibulk").to_vec();
    let mut lying = Frames::default();
    assert!(lying.push(request.len, &[r[0].clone(), r[2].clone(), r[1].clone()]));
    s.write.frames(lying);
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    read_all(&mut s.read, &reply("a:1", &b)).await;
    // Half a command written unframed: the frames of the next write do
    // not line up with `pending` and are dropped; it is framed again.
    let whole = command(&["GET", &b]);
    let (head, tail) = whole.split_at(5);
    s.write.write_all(head).await.expect("written");
    s.write.flush().await.expect("flushed");
    let (mut rest, frames) = framed(&[&["GET", &a]]);
    rest.splice(0..0, tail.iter().copied());
    s.write.frames(frames);
    s.write.write_all(&rest).await.expect("written");
    s.write.flush().await.expect("flushed");
    assert!(s.write.hints.is_empty(), "no frame kept");
    read_all(&mut s.read, &[reply("b:1", &b), reply("a:1", &a)].concat()).await;
}

#[tokio::test]
async fn a_full_lane_queue_holds_the_jobs_back_in_their_order() {
    let log = Log::default();
    let (mut s, _) = stream(&log, None);
    // b's lane queues one job and answers each only when the test lets
    // it: the later flushes find its queue full and wait.
    let gate = Arc::new(Semaphore::new(0));
    let tx = play_queue("b:1", log.clone(), Some(gate.clone()), 1);
    let common = s.write.common.clone();
    crate::sync::lock(&common.lanes).insert((Arc::from("b:1"), false), vec![tx]);
    let keys: Vec<String> = (0..3).map(|i| key_on("b:1", i)).collect();
    let writes = async {
        for k in &keys {
            s.write
                .write_all(&command(&["GET", k]))
                .await
                .expect("written");
            s.write.flush().await.expect("flushed");
        }
    };
    let answer = async {
        for n in 1..=3 {
            gate.add_permits(1);
            answered(&log, n).await;
        }
    };
    tokio::time::timeout(WAIT, async { tokio::join!(writes, answer) })
        .await
        .expect("every flush goes out as room comes");
    let want: String = keys.iter().map(|k| reply("b:1", k)).collect();
    read_all(&mut s.read, &want).await;
    let sent: Vec<Vec<String>> = log.seen().into_iter().map(|(_, k)| k).collect();
    assert_eq!(
        sent,
        keys.iter().map(|k| vec![k.clone()]).collect::<Vec<_>>()
    );
}

#[test]
fn a_job_taken_back_unsent_is_no_longer_owed() {
    let owed = Arc::new(Owed::default());
    let (mut job, _rx) = Job::new(smallvec![Bytes::from(command(&["GET", "k"]))], true);
    job.owed = Some(owed.add());
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(owed.poll_none(&mut cx).is_pending(), "owed while sent");
    job.unsent();
    assert!(owed.poll_none(&mut cx).is_ready(), "given back");
}

#[test]
fn a_job_dropped_unanswered_is_no_longer_owed() {
    // A lane that ends with jobs still in its queue drops them unanswered
    // (the session's part answers that the lane is gone): their count must
    // come down, or the session's next switch of lane kind waits for good.
    let owed = Arc::new(Owed::default());
    let (tx, rx) = mpsc::channel(4);
    for key in ["a", "b"] {
        let (mut job, _rx) = Job::new(smallvec![Bytes::from(command(&["GET", key]))], true);
        job.owed = Some(owed.add());
        tx.try_send(job).unwrap_or_else(|_| panic!("room"));
    }
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(owed.poll_none(&mut cx).is_pending(), "owed while queued");
    drop(rx);
    assert!(
        owed.poll_none(&mut cx).is_ready(),
        "given back with the queue"
    );
}
