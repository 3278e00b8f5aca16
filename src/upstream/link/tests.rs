//! The link's loop over an in-memory pipe ([`tokio::io::duplex`]) with a
//! lane of the tests' own: order, the owed answered at every end, the
//! stall watch and a lane's room.

use super::*;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::io::{duplex, DuplexStream};
use tokio::sync::Notify;

use crate::protocol::reply::ReplyScanner;

/// Where a job's replies go, one by one.
type Got = mpsc::UnboundedSender<Bytes>;
/// What a job's replies came as.
type Replies = mpsc::UnboundedReceiver<Bytes>;

/// A job: commands, how many replies they get, where those go.
struct Job {
    commands: Bytes,
    replies: usize,
    got: Got,
}

struct Owed {
    left: usize,
    got: Got,
}

/// A lane that hands each whole reply to the job at the front.
#[derive(Default)]
struct TestLane {
    /// What `lock_call_waits` answers.
    locks: bool,
    /// When set, reads wait after each split until it is notified.
    hold: Option<Arc<Notify>>,
    stalls: AtomicU64,
    /// Each end: replies still owed, and why.
    lost: Mutex<Vec<(usize, Option<String>)>>,
}

#[derive(Default)]
struct Scan {
    scanner: ReplyScanner,
    scanned: usize,
}

impl Lane for TestLane {
    type Job = Job;
    type Owed = Owed;
    type Reader = Scan;

    fn queue(&self, job: Job, out: &mut BytesMut, fifo: &mut VecDeque<Owed>) {
        out.extend_from_slice(&job.commands);
        if job.replies > 0 {
            fifo.push_back(Owed {
                left: job.replies,
                got: job.got,
            });
        }
    }

    fn split(
        &self,
        s: &mut Scan,
        buf: &mut BytesMut,
        fifo: &mut VecDeque<Owed>,
        again: &mut Vec<Job>,
    ) -> Result<(), String> {
        loop {
            let (used, end) = (s.scanner.advance(&buf[s.scanned..])).map_err(|_| "malformed")?;
            s.scanned += used;
            if end.is_none() {
                return Ok(());
            }
            let Some(front) = fifo.front_mut() else {
                return Err("a reply nobody is owed".to_string());
            };
            let frame = buf.split_to(s.scanned).freeze();
            s.scanned = 0;
            if let Some(retry) = frame.strip_prefix(b"-AGAIN ".as_slice()) {
                // Written again as the reply says, owed the same.
                let commands = Bytes::copy_from_slice(retry);
                let (replies, got) = (front.left, front.got.clone());
                fifo.pop_front();
                again.push(Job {
                    commands,
                    replies,
                    got,
                });
                continue;
            }
            let _ = front.got.send(frame);
            front.left -= 1;
            if front.left == 0 {
                fifo.pop_front();
            }
        }
    }

    async fn room(&self, _: &mut Scan) {
        if let Some(hold) = &self.hold {
            hold.notified().await;
        }
    }

    fn lock_call_waits(&self, _: &VecDeque<Owed>) -> bool {
        self.locks
    }

    fn stalled(&self) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
    }

    fn lost(&self, _: &Scan, owed: VecDeque<Owed>, why: Option<&str>) {
        let left = owed.iter().map(|o| o.left).sum();
        sync::lock(&self.lost).push((left, why.map(str::to_string)));
    }
}

fn limits(lock_reply_timeout: Option<Duration>) -> Limits {
    Limits {
        per_write: 2,
        read_chunk: 64,
        lock_reply_timeout,
    }
}

fn job(commands: &'static [u8], replies: usize) -> (Job, Replies) {
    let (got, rx) = mpsc::unbounded_channel();
    let job = Job {
        commands: Bytes::from_static(commands),
        replies,
        got,
    };
    (job, rx)
}

/// The next `n` replies of a job, as text (within 10 s).
async fn texts(rx: &mut Replies, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        let next = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        let reply = next.expect("a reply within 10 s").expect("a reply");
        out.push(String::from_utf8_lossy(&reply).into_owned());
    }
    out
}

/// Reads from the server's end until `lines` command lines are in.
async fn read_lines(server: &mut DuplexStream, lines: usize) -> Vec<u8> {
    let mut seen = Vec::new();
    while seen.iter().filter(|&&b| b == b'\n').count() < lines {
        let mut chunk = [0u8; 64];
        let n = server.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the link closed after {seen:?}");
        seen.extend_from_slice(&chunk[..n]);
    }
    seen
}

/// Runs `serve` for `lane` over one end of a pipe; the other end is the
/// server's.
#[allow(clippy::type_complexity)]
fn start(
    lane: Arc<TestLane>,
    mut rx: mpsc::Receiver<Job>,
    held: Vec<Job>,
    limits: Limits,
    stop: CancellationToken,
    ends: impl Future<Output = String> + Send + 'static,
) -> (DuplexStream, tokio::task::JoinHandle<Option<String>>) {
    let (near, server) = duplex(1024);
    let task = tokio::spawn(async move {
        let mut reader = Scan::default();
        let halves = tokio::io::split(near);
        serve(
            &*lane,
            &mut reader,
            halves,
            &mut rx,
            held,
            limits,
            &stop,
            ends,
        )
        .await
    });
    (server, task)
}

async fn ended(task: tokio::task::JoinHandle<Option<String>>) -> Option<String> {
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the link ends within 10 s")
        .expect("the link's task")
}

/// Held jobs go first, then queued ones in batches; replies cut into
/// single bytes still reach each job whole and in order; the queue's
/// close ends the link with nothing owed.
#[tokio::test]
async fn replies_reach_their_jobs_in_order_at_any_cut() {
    let lane = Arc::new(TestLane::default());
    let (tx, rx) = mpsc::channel(8);
    let (held, mut got_a) = job(b"A\r\n", 1);
    let (b, mut got_b) = job(b"B1\r\nB2\r\n", 2);
    let (none, mut got_none) = job(b"\r\n", 0);
    let (c, mut got_c) = job(b"C1\r\nC2\r\nC3\r\n", 3);
    for j in [b, none, c] {
        tx.send(j).await.expect("queued");
    }
    let stop = CancellationToken::new();
    let never = std::future::pending();
    let (mut server, task) = start(lane.clone(), rx, vec![held], limits(None), stop, never);
    let commands = read_lines(&mut server, 7).await;
    assert_eq!(commands, b"A\r\nB1\r\nB2\r\n\r\nC1\r\nC2\r\nC3\r\n");
    let replies = b"+a\r\n:1\r\n$2\r\nb2\r\n*2\r\n:1\r\n:2\r\n-ERR c2\r\n+c3\r\n";
    for byte in replies {
        server.write_all(&[*byte]).await.expect("write");
    }
    assert_eq!(texts(&mut got_a, 1).await, ["+a\r\n"]);
    assert_eq!(texts(&mut got_b, 2).await, [":1\r\n", "$2\r\nb2\r\n"]);
    let c3 = ["*2\r\n:1\r\n:2\r\n", "-ERR c2\r\n", "+c3\r\n"];
    assert_eq!(texts(&mut got_c, 3).await, c3);
    drop(tx);
    assert_eq!(ended(task).await, None);
    assert_eq!(*sync::lock(&lane.lost), [(0, None)]);
    // Nothing was sent to the job that is owed no reply (its sender is
    // gone with it).
    assert_eq!(got_none.recv().await, None);
}

/// The server closing mid-pipeline: what came reaches its job, what is
/// still owed goes to the lane's `lost` with the reason.
#[tokio::test]
async fn a_close_by_the_server_hands_the_owed_to_the_lane() {
    let lane = Arc::new(TestLane::default());
    let (_tx, rx) = mpsc::channel(8);
    let (a, mut got_a) = job(b"A1\r\nA2\r\nA3\r\n", 3);
    let stop = CancellationToken::new();
    let never = std::future::pending();
    let (mut server, task) = start(lane.clone(), rx, vec![a], limits(None), stop, never);
    read_lines(&mut server, 3).await;
    server.write_all(b":1\r\n:2").await.expect("write");
    assert_eq!(texts(&mut got_a, 1).await, [":1\r\n"]);
    drop(server);
    let why = ended(task).await;
    assert_eq!(why.as_deref(), Some("closed by the server"));
    let lost = sync::lock(&lane.lost).clone();
    assert_eq!(lost, [(2, why)]);
}

/// A reply nobody is owed gives the connection up with the lane's reason.
#[tokio::test]
async fn a_reply_nobody_is_owed_ends_the_link() {
    let lane = Arc::new(TestLane::default());
    let (_tx, rx) = mpsc::channel(8);
    let stop = CancellationToken::new();
    let never = std::future::pending();
    let (mut server, task) = start(lane.clone(), rx, Vec::new(), limits(None), stop, never);
    server.write_all(b"+surprise\r\n").await.expect("write");
    let why = ended(task).await;
    assert_eq!(why.as_deref(), Some("a reply nobody is owed"));
}

/// `stop` ends the link with `None`, `ends` with its reason; either way
/// what is owed goes to `lost`.
#[tokio::test]
async fn stop_and_ends_end_it_with_the_owed_answered() {
    for by_stop in [true, false] {
        let lane = Arc::new(TestLane::default());
        let (_tx, rx) = mpsc::channel(8);
        let (a, _got) = job(b"A\r\n", 1);
        let stop = CancellationToken::new();
        let changed = Arc::new(Notify::new());
        let ends = {
            let changed = changed.clone();
            async move {
                changed.notified().await;
                "the primary changed".to_string()
            }
        };
        let (mut server, task) = start(lane.clone(), rx, vec![a], limits(None), stop.clone(), ends);
        read_lines(&mut server, 1).await;
        match by_stop {
            true => stop.cancel(),
            false => changed.notify_one(),
        }
        let why = ended(task).await;
        let want = (!by_stop).then(|| "the primary changed".to_string());
        assert_eq!(why, want);
        assert_eq!(*sync::lock(&lane.lost), [(1, want)]);
    }
}

/// A silent server with a lock command owed is given up at the bound
/// (counted by the lane); one whose owed commands hold no lock call is
/// not: the clients' own commands wait as they would on Redis.
#[tokio::test]
async fn a_silent_server_is_given_up_only_for_a_lock_call() {
    let bound = Duration::from_millis(40);
    for locks in [true, false] {
        let lane = Arc::new(TestLane {
            locks,
            ..TestLane::default()
        });
        let (_tx, rx) = mpsc::channel(8);
        let (a, _got) = job(b"A\r\n", 1);
        let stop = CancellationToken::new();
        let never = std::future::pending();
        let (mut server, mut task) = start(
            lane.clone(),
            rx,
            vec![a],
            limits(Some(bound)),
            stop.clone(),
            never,
        );
        read_lines(&mut server, 1).await;
        let began = Instant::now();
        if locks {
            let why = ended(task).await;
            assert_eq!(why.as_deref(), Some("a lock command unanswered for 40 ms"));
            assert!(began.elapsed() >= bound);
            assert_eq!(lane.stalls.load(Ordering::Relaxed), 1);
        } else {
            // Ten of the watch's looks, and still open.
            let waited = tokio::time::timeout(bound * 10, &mut task).await;
            assert!(waited.is_err(), "given up without a lock call: {waited:?}");
            stop.cancel();
            assert_eq!(ended(task).await, None);
            assert_eq!(lane.stalls.load(Ordering::Relaxed), 0);
        }
    }
}

/// While the lane holds reads for its room, the server's silence is not a
/// stall; once the room is there, it is again.
#[tokio::test]
async fn a_read_held_for_room_is_not_a_stall() {
    let bound = Duration::from_millis(40);
    let hold = Arc::new(Notify::new());
    let lane = Arc::new(TestLane {
        locks: true,
        hold: Some(hold.clone()),
        ..TestLane::default()
    });
    let (_tx, rx) = mpsc::channel(8);
    let (a, mut got_a) = job(b"A1\r\nA2\r\n", 2);
    let stop = CancellationToken::new();
    let never = std::future::pending();
    let (mut server, mut task) = start(lane.clone(), rx, vec![a], limits(Some(bound)), stop, never);
    read_lines(&mut server, 2).await;
    server.write_all(b":1\r\n").await.expect("write");
    assert_eq!(texts(&mut got_a, 1).await, [":1\r\n"]);
    let waited = tokio::time::timeout(bound * 10, &mut task).await;
    assert!(waited.is_err(), "a held read taken for a stall: {waited:?}");
    assert_eq!(lane.stalls.load(Ordering::Relaxed), 0);
    hold.notify_one();
    let why = ended(task).await;
    assert_eq!(why.as_deref(), Some("a lock command unanswered for 40 ms"));
    assert_eq!(lane.stalls.load(Ordering::Relaxed), 1);
}

/// A reply that asks for its job again has it written at once, and the
/// job's replies come from the second writing, in order with the rest.
#[tokio::test]
async fn a_job_written_again_is_answered_from_there() {
    let lane = Arc::new(TestLane::default());
    let (tx, rx) = mpsc::channel(8);
    let (a, mut got_a) = job(b"A\r\n", 1);
    let stop = CancellationToken::new();
    let never = std::future::pending();
    let (mut server, task) = start(lane.clone(), rx, vec![a], limits(None), stop, never);
    assert_eq!(read_lines(&mut server, 1).await, b"A\r\n");
    let (b, mut got_b) = job(b"B\r\n", 1);
    server.write_all(b"-AGAIN A2\r\n").await.expect("write");
    assert_eq!(read_lines(&mut server, 1).await, b"A2\r\n");
    tx.send(b).await.expect("queued");
    assert_eq!(read_lines(&mut server, 1).await, b"B\r\n");
    server.write_all(b"+a\r\n+b\r\n").await.expect("write");
    assert_eq!(texts(&mut got_a, 1).await, ["+a\r\n"]);
    assert_eq!(texts(&mut got_b, 1).await, ["+b\r\n"]);
    drop(tx);
    assert_eq!(ended(task).await, None);
}
