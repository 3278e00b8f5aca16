//! The writer half over in-memory streams: Redis's side is a
//! `tokio::io::duplex` pipe (or a reader that hands out given pieces, one
//! per read), the client's side another pipe, and the entries come on the
//! channel as the reader half would send them. No socket, no Redis.

use crate::lock::evalsha::Rerun;
use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{duplex, AsyncRead, AsyncReadExt, AsyncWriteExt, DuplexStream, ReadBuf};
use tokio::sync::{mpsc, oneshot};

use super::{write_loop, LockReplies, Setup, WriterEnd};
use crate::command::SubKind;
use crate::lock::{split_reply, LockPending, ReplyOutcome};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::LocalReply;
use crate::session::activity::Activity;
use crate::session::pending::{Deferred, Entries, Pending};

/// The lock room as the tests need it: a lock script's `{reply, facts}`
/// gives the client its reply, unless a parked reply was queued, which
/// the next lock reply then waits for.
#[derive(Default)]
struct FakeLocks {
    parked: Mutex<VecDeque<oneshot::Receiver<LocalReply>>>,
    seen: Mutex<Vec<(LockPending, Bytes)>>,
}

impl LockReplies for FakeLocks {
    fn on_reply(
        &self,
        pending: LockPending,
        _: Option<Rerun>,
        frame: Bytes,
        _: bool,
    ) -> ReplyOutcome {
        self.seen
            .lock()
            .unwrap()
            .push((pending.clone(), frame.clone()));
        if let Some(rx) = self.parked.lock().unwrap().pop_front() {
            return ReplyOutcome::Parked(rx);
        }
        let (reply, _) = split_reply(&frame);
        ReplyOutcome::Reply(frame.slice_ref(reply))
    }
}

fn lock_entry() -> Pending {
    Pending::Lock(Box::new((
        LockPending::Acquire {
            key: Bytes::from_static(b"lock:a"),
            token: Bytes::from_static(b"t:1"),
            value: Bytes::from_static(b"v"),
            shape: crate::lock::ops::Shape::SetNx,
            primary_at: 0,
            park: None,
            db: crate::lock::Database::Zero,
        },
        None,
        None,
    )))
}

fn setup<'a>(
    metrics: &'a ProxyMetrics,
    locks: &'a FakeLocks,
    chunk: usize,
) -> Setup<'a, FakeLocks> {
    Setup {
        chunk,
        grace: Duration::from_millis(500),
        metrics,
        locks,
        activity: Box::leak(Box::new(Activity::new())),
        write_timeout: None,
        max_output: 0,
        opening: None,
        lock_reply_timeout: None,
    }
}

/// Reads the client's side until `want` bytes came (or a second passed).
async fn read_exactly(client: &mut DuplexStream, want: usize) -> Vec<u8> {
    let mut got = vec![0; want];
    let read = tokio::time::timeout(Duration::from_secs(1), client.read_exact(&mut got)).await;
    assert!(
        matches!(read, Ok(Ok(_))),
        "the client did not get {want} bytes"
    );
    got
}

/// Nothing more reaches the client within 50 ms.
async fn nothing_more(client: &mut DuplexStream) {
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_millis(50), client.read(&mut byte)).await;
    assert!(read.is_err(), "unexpected bytes: {:?}", &byte[..]);
}

/// Runs the writer over pipes: sends `entries` as one batch, writes
/// `from_redis`, ends the reader half, and returns how the writer ended and
/// everything the client got.
async fn run(entries: Vec<Pending>, from_redis: &[u8]) -> (WriterEnd, Vec<u8>) {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let (mut client_side, mut writer_client) = duplex(1 << 20);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 20);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    tx.send(entries.into()).await.unwrap();
    redis_side.write_all(from_redis).await.unwrap();
    drop(tx);
    let end = write_loop(
        setup(&metrics, &locks, 4096),
        &mut writer_client,
        &mut writer_upstream,
        rx,
    )
    .await;
    drop(writer_client);
    let mut out = Vec::new();
    client_side.read_to_end(&mut out).await.unwrap();
    drop(redis_side);
    (end, out)
}

#[tokio::test]
async fn replies_are_copied_byte_exact_in_order() {
    let redis = b"+OK\r\n$5\r\nhel\x00o\r\n:42\r\n*2\r\n$1\r\na\r\n$-1\r\n-ERR no\r\n";
    let (end, out) = run(vec![Pending::Upstream(5)], redis).await;
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
    assert_eq!(out, redis);
}

#[tokio::test]
async fn local_replies_land_in_their_place_in_resp2() {
    let entries = vec![
        Pending::Local(LocalReply::err("lockgate: refused")),
        Pending::Upstream(1),
        Pending::Local(LocalReply::Null),
        Pending::Upstream(2),
        Pending::Local(LocalReply::Array(vec![
            LocalReply::Integer(3),
            LocalReply::Bulk(Bytes::from_static(b"admin")),
        ])),
    ];
    let (end, out) = run(entries, b":1\r\n:2\r\n:3\r\n").await;
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
    assert_eq!(
        out,
        b"-ERR lockgate: refused\r\n:1\r\n$-1\r\n:2\r\n:3\r\n*2\r\n:3\r\n$5\r\nadmin\r\n"
    );
}

#[tokio::test]
async fn resp3_pushes_stay_before_the_local_reply_after_them() {
    // HELLO 3's map switches the writer to RESP3: lockgate's null is `_`.
    // The invalidation push Redis sent after `:1` (before it read the next
    // command) goes before lockgate's reply to that next command.
    let hello = b"%1\r\n$6\r\nserver\r\n$5\r\nredis\r\n";
    let push = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n";
    let mut redis = hello.to_vec();
    redis.extend_from_slice(b":1\r\n");
    redis.extend_from_slice(push);
    redis.extend_from_slice(b":2\r\n");
    let entries = vec![
        Pending::Hello,
        Pending::Upstream(1),
        Pending::Local(LocalReply::Null),
        Pending::Upstream(1),
    ];
    let (end, out) = run(entries, &redis).await;
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
    let mut want = hello.to_vec();
    want.extend_from_slice(b":1\r\n");
    want.extend_from_slice(push);
    want.extend_from_slice(b"_\r\n:2\r\n");
    assert_eq!(out, want);
}

#[tokio::test]
async fn subscribed_resp2_messages_are_not_counted_as_replies() {
    // A published message arrives between the confirmation and the PING's
    // reply: were it counted, lockgate's error would jump ahead of `pong`.
    let confirm = b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
    let message = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$2\r\nhi\r\n";
    let pong = b"*2\r\n$4\r\npong\r\n$0\r\n\r\n";
    let redis = [&confirm[..], message, pong, message].concat();
    let entries = vec![
        Pending::Sub {
            kind: SubKind::Subscribe,
            args: 1,
            left: None,
        },
        Pending::Upstream(1),
        Pending::Local(LocalReply::err("lockgate: refused")),
    ];
    let (end, out) = run(entries, &redis).await;
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
    // The second message came after `pong`: a message needs no reply slot,
    // so the error for the next command goes right after `pong`.
    let want = [
        &confirm[..],
        message,
        pong,
        b"-ERR lockgate: refused\r\n",
        message,
    ]
    .concat();
    assert_eq!(out, want);
}

/// Redis's side, handing out the given pieces one per read, then nothing
/// (pending forever: the writer ends because the reader half did).
struct Pieces(VecDeque<Vec<u8>>);

impl AsyncRead for Pieces {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Some(mut piece) = self.0.pop_front() else {
            return Poll::Pending;
        };
        let n = piece.len().min(buf.remaining());
        buf.put_slice(&piece[..n]);
        if n < piece.len() {
            self.0.push_front(piece.split_off(n));
        }
        Poll::Ready(Ok(()))
    }
}

/// The same session, every reply split at each byte boundary in turn
/// (two reads), and once one byte per read: the client gets the same
/// bytes every time.
#[tokio::test]
async fn a_reply_split_at_every_byte_boundary_reads_the_same() {
    let confirm = b"*3\r\n$9\r\nsubscribe\r\n$2\r\nch\r\n:1\r\n";
    let unsub = b"*3\r\n$11\r\nunsubscribe\r\n$2\r\nch\r\n:0\r\n";
    let redis = [
        &b"$5\r\nhello\r\n"[..],
        b"*3\r\n:1\r\n:1\r\n:30000\r\n", // a lock script's {reply, facts}
        b"*2\r\n$1\r\na\r\n*1\r\n:7\r\n",
        confirm,
        unsub,
        b"-ERR x\r\n",
    ]
    .concat();
    let entries = || {
        vec![
            Pending::Upstream(1),
            Pending::Local(LocalReply::Integer(-1)),
            lock_entry(),
            Pending::Local(LocalReply::Status("QUEUED")),
            Pending::Upstream(1),
            Pending::Sub {
                kind: SubKind::Subscribe,
                args: 1,
                left: None,
            },
            Pending::Sub {
                kind: SubKind::Unsubscribe,
                args: 0,
                left: None,
            },
            Pending::Upstream(1),
            Pending::Local(LocalReply::err("end")),
        ]
    };
    let want = [
        &b"$5\r\nhello\r\n:-1\r\n:1\r\n+QUEUED\r\n*2\r\n$1\r\na\r\n*1\r\n:7\r\n"[..],
        confirm,
        unsub,
        b"-ERR x\r\n-ERR end\r\n",
    ]
    .concat();
    // A read of 0 bytes is an end of file: the pieces are never empty.
    let mut splits: Vec<Vec<Vec<u8>>> = (1..redis.len())
        .map(|i| vec![redis[..i].to_vec(), redis[i..].to_vec()])
        .collect();
    splits.push(redis.iter().map(|&b| vec![b]).collect());
    for pieces in splits {
        let sizes: Vec<usize> = pieces.iter().map(Vec::len).collect();
        let metrics = ProxyMetrics::default();
        let locks = FakeLocks::default();
        let (mut client_side, mut writer_client) = duplex(1 << 16);
        let mut upstream = Pieces(pieces.into());
        let (tx, rx) = mpsc::channel::<Entries>(8);
        tx.send(entries().into()).await.unwrap();
        drop(tx);
        let end = tokio::time::timeout(
            Duration::from_secs(5),
            write_loop(
                setup(&metrics, &locks, 16),
                &mut writer_client,
                &mut upstream,
                rx,
            ),
        )
        .await;
        assert!(matches!(end, Ok(WriterEnd::Drained)), "{sizes:?}: {end:?}");
        drop(writer_client);
        let mut out = Vec::new();
        client_side.read_to_end(&mut out).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&want),
            "pieces {sizes:?}"
        );
        let seen = locks.seen.lock().unwrap();
        assert_eq!(seen.len(), 1, "pieces {sizes:?}");
        assert_eq!(&seen[0].1[..], b"*3\r\n:1\r\n:1\r\n:30000\r\n");
        assert_eq!(ProxyMetrics::get(&metrics.unexpected_replies), 0);
    }
}

/// Redis sends one reply and closes while `owed` are expected: how the
/// writer ends, and what the client got.
async fn close_after_one_reply(owed: u32) -> (WriterEnd, Vec<u8>) {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let (mut client_side, mut writer_client) = duplex(1 << 16);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    tx.send(smallvec::smallvec![Pending::Upstream(owed)])
        .await
        .unwrap();
    redis_side.write_all(b":1\r\n").await.unwrap();
    drop(redis_side);
    let end = write_loop(
        setup(&metrics, &locks, 4096),
        &mut writer_client,
        &mut writer_upstream,
        rx,
    )
    .await;
    drop(writer_client);
    let mut out = Vec::new();
    client_side.read_to_end(&mut out).await.unwrap();
    drop(tx);
    (end, out)
}

#[tokio::test]
async fn upstream_close_with_replies_owed_is_reported() {
    let (end, out) = close_after_one_reply(2).await;
    assert!(
        matches!(end, WriterEnd::UpstreamClosed { owed: true }),
        "{end:?}"
    );
    assert_eq!(out, b":1\r\n");
}

#[tokio::test]
async fn upstream_close_with_nothing_owed_is_not_a_loss() {
    let (end, out) = close_after_one_reply(1).await;
    assert!(
        matches!(end, WriterEnd::UpstreamClosed { owed: false }),
        "{end:?}"
    );
    assert_eq!(out, b":1\r\n");
}

/// The reader found the client gone after Redis answered one of `owed`
/// replies and went quiet (a slow reply): how the writer ends, at once,
/// with Redis still silent.
async fn gone_after_one_reply(owed: u32) -> WriterEnd {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let activity = Activity::new();
    let (mut client_side, mut writer_client) = duplex(1 << 16);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    tx.send(smallvec::smallvec![Pending::Upstream(owed)])
        .await
        .unwrap();
    redis_side.write_all(b":1\r\n").await.unwrap();
    let setup = Setup {
        activity: &activity,
        ..setup(&metrics, &locks, 4096)
    };
    let writer = write_loop(setup, &mut writer_client, &mut writer_upstream, rx);
    let reader = async {
        assert_eq!(read_exactly(&mut client_side, 4).await, b":1\r\n");
        // As the reader half does: the flag, then its end.
        activity.client_gone();
        drop(tx);
        std::future::pending::<()>().await
    };
    let end = tokio::time::timeout(Duration::from_secs(1), async {
        tokio::select! {
            end = writer => end,
            _ = reader => unreachable!("the reader never ends first"),
        }
    })
    .await
    .expect("the writer ends at once, not at Redis's next reply");
    drop(redis_side);
    end
}

#[tokio::test]
async fn a_client_gone_with_replies_owed_ends_the_writer_at_once() {
    let end = gone_after_one_reply(2).await;
    assert!(matches!(end, WriterEnd::ClientGone), "{end:?}");
}

#[tokio::test]
async fn a_client_gone_with_nothing_owed_is_drained() {
    let end = gone_after_one_reply(1).await;
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
}

/// The client gone while a lock command's reply is on its way: the writer
/// reads on until the lock room has its outcome (what the client took is
/// then known, and released at the close), writes nothing, and ends
/// without waiting for the replies after it.
#[tokio::test]
async fn a_client_gone_before_a_lock_reply_waits_for_its_outcome_only() {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let activity = Activity::new();
    let (mut client_side, mut writer_client) = duplex(1 << 16);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    tx.send(smallvec::smallvec![
        Pending::Upstream(1),
        lock_entry(),
        Pending::Upstream(1),
    ])
    .await
    .unwrap();
    redis_side.write_all(b":1\r\n").await.unwrap();
    let setup = Setup {
        activity: &activity,
        ..setup(&metrics, &locks, 4096)
    };
    let writer = write_loop(setup, &mut writer_client, &mut writer_upstream, rx);
    let script = async {
        assert_eq!(read_exactly(&mut client_side, 4).await, b":1\r\n");
        activity.client_gone();
        drop(tx);
        // Still reading Redis: the lock's reply comes late.
        nothing_more(&mut client_side).await;
        redis_side
            .write_all(b"*3\r\n:1\r\n:1\r\n:30000\r\n")
            .await
            .unwrap();
        std::future::pending::<()>().await
    };
    let end = tokio::time::timeout(Duration::from_secs(1), async {
        tokio::select! {
            end = writer => end,
            _ = script => unreachable!("the script never ends first"),
        }
    })
    .await
    .expect("the writer ends once the lock's outcome is in");
    assert!(matches!(end, WriterEnd::ClientGone), "{end:?}");
    assert_eq!(locks.seen.lock().unwrap().len(), 1, "the outcome was read");
    drop(writer_client);
    let mut rest = Vec::new();
    client_side.read_to_end(&mut rest).await.unwrap();
    assert!(
        rest.is_empty(),
        "written to a client that is gone: {rest:?}"
    );
}

/// A deferred reply (a job's, a parked lock attempt's) holds back every
/// reply after it, though Redis's are already in; a silent one is awaited
/// and dropped.
#[tokio::test]
async fn a_deferred_reply_keeps_its_place() {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let (parked_tx, parked_rx) = oneshot::channel();
    locks.parked.lock().unwrap().push_back(parked_rx);
    let (mut client_side, mut writer_client) = duplex(1 << 16);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    let (job_tx, job_rx) = oneshot::channel();
    let (silent_tx, silent_rx) = oneshot::channel();
    let script = async {
        tx.send(smallvec::smallvec![
            Pending::Upstream(1),
            Pending::Deferred(Deferred(job_rx, None)),
            Pending::Upstream(1),
            lock_entry(),
            Pending::Silent(Deferred(silent_rx, None)),
            Pending::Upstream(1),
        ])
        .await
        .unwrap();
        redis_side
            .write_all(b":1\r\n:2\r\n*3\r\n:0\r\n:0\r\n:100\r\n:3\r\n")
            .await
            .unwrap();
        assert_eq!(read_exactly(&mut client_side, 4).await, b":1\r\n");
        nothing_more(&mut client_side).await;
        job_tx.send(LocalReply::Integer(7)).unwrap();
        // The job's reply, then Redis's `:2`; the parked attempt holds the rest.
        assert_eq!(read_exactly(&mut client_side, 8).await, b":7\r\n:2\r\n");
        nothing_more(&mut client_side).await;
        parked_tx.send(LocalReply::Integer(1)).unwrap();
        assert_eq!(read_exactly(&mut client_side, 4).await, b":1\r\n");
        // The silent job's reply is never written, and `:3` waits for it.
        nothing_more(&mut client_side).await;
        silent_tx.send(LocalReply::Integer(9)).unwrap();
        assert_eq!(read_exactly(&mut client_side, 4).await, b":3\r\n");
        drop(tx);
        nothing_more(&mut client_side).await;
    };
    let (end, ()) = tokio::join!(
        write_loop(
            setup(&metrics, &locks, 4096),
            &mut writer_client,
            &mut writer_upstream,
            rx,
        ),
        script
    );
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
}

/// A client that half-closes after its commands: Redis answers them all
/// and closes while lockgate's own reply for an earlier command is still
/// being made. Found by the session fuzzer: the writer ended at Redis's
/// close and dropped the job's reply and every reply buffered behind it.
#[tokio::test]
async fn replies_behind_a_deferred_one_outlive_the_upstream_close() {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let (mut client_side, mut writer_client) = duplex(1 << 16);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    let (job_tx, job_rx) = oneshot::channel();
    let script = async {
        tx.send(smallvec::smallvec![
            Pending::Upstream(1),
            Pending::Deferred(Deferred(job_rx, None)),
            Pending::Upstream(1),
            Pending::ClientEof,
        ])
        .await
        .unwrap();
        drop(tx);
        redis_side.write_all(b":1\r\n:2\r\n").await.unwrap();
        redis_side.shutdown().await.unwrap();
        assert_eq!(read_exactly(&mut client_side, 4).await, b":1\r\n");
        nothing_more(&mut client_side).await;
        job_tx.send(LocalReply::Integer(7)).unwrap();
        assert_eq!(read_exactly(&mut client_side, 8).await, b":7\r\n:2\r\n");
    };
    let (end, ()) = tokio::join!(
        write_loop(
            setup(&metrics, &locks, 4096),
            &mut writer_client,
            &mut writer_upstream,
            rx,
        ),
        script
    );
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
}

#[tokio::test]
async fn a_close_entry_ends_after_what_came_before() {
    let entries = vec![
        Pending::Upstream(1),
        Pending::Local(LocalReply::err("Protocol error: bad")),
        Pending::Close,
        Pending::Upstream(1),
    ];
    let (end, out) = run(entries, b"+OK\r\n:2\r\n").await;
    assert!(matches!(end, WriterEnd::Closed), "{end:?}");
    assert_eq!(out, b"+OK\r\n-ERR Protocol error: bad\r\n");
}

/// Replies read ahead while the client was slow to read (with
/// `max_client_output_bytes` set), whose entries the writer takes only
/// afterwards: when those entries start with a reply of lockgate's own
/// (an attempt answered before Redis, say), it goes before Redis's next
/// reply, not after it.
#[tokio::test]
async fn entries_taken_after_a_read_ahead_keep_a_local_reply_first() {
    let metrics = ProxyMetrics::default();
    let locks = FakeLocks::default();
    let mut with_bound = setup(&metrics, &locks, 4096);
    with_bound.max_output = 1 << 16;
    // An 8-byte pipe: the first reply waits for the client to read.
    let (mut client_side, mut writer_client) = duplex(8);
    let (mut redis_side, mut writer_upstream) = duplex(1 << 16);
    let (tx, rx) = mpsc::channel::<Entries>(8);
    tx.send(smallvec::smallvec![Pending::Upstream(1)])
        .await
        .unwrap();
    let first = format!("$64\r\n{}\r\n", "x".repeat(64));
    redis_side.write_all(first.as_bytes()).await.unwrap();
    let script = async {
        // The writer is stuck on the full pipe by now: the next batch's
        // entries come, then Redis's reply to its forwarded command.
        tx.send(smallvec::smallvec![
            Pending::Local(LocalReply::Integer(7)),
            Pending::Upstream(1)
        ])
        .await
        .unwrap();
        redis_side.write_all(b"+B\r\n").await.unwrap();
        let got = read_exactly(&mut client_side, first.len() + 8).await;
        drop(tx);
        got
    };
    let (end, got) = tokio::join!(
        write_loop(with_bound, &mut writer_client, &mut writer_upstream, rx),
        script
    );
    let want = format!("{first}:7\r\n+B\r\n");
    assert_eq!(String::from_utf8_lossy(&got), want);
    assert_eq!(ProxyMetrics::get(&metrics.unexpected_replies), 0);
    assert!(matches!(end, WriterEnd::Drained), "{end:?}");
}
