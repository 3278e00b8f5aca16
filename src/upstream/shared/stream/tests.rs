//! The session's stream in shared mode, with the shared connection played
//! by the test (no Redis, no socket): commands written into
//! [`SharedWrite`] as the session writes them, the batches the shared
//! connection would be sent taken off its queue and answered into the
//! session's inbox, and the replies read back from [`SharedRead`]. What is
//! checked is the stream's own promise: whole commands only, one batch
//! per flush with the count of replies it is owed, replies in order with
//! lockgate's own answers in their places.

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::*;
use crate::upstream::testing::{command, framed, read_all, WAIT};

/// A stream whose shared connection is the returned queue.
fn stream() -> (SharedStream, mpsc::Receiver<Batch>) {
    let (tx, rx) = mpsc::channel(4);
    let common = Arc::new(Common::for_tests());
    (SharedStream::new(common, PollSender::new(tx)), rx)
}

/// The next batch the shared connection is sent.
async fn batch(rx: &mut mpsc::Receiver<Batch>) -> Batch {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a batch comes")
        .expect("the queue is open")
}

#[tokio::test]
async fn whole_commands_go_as_one_batch_per_flush_owed_a_reply_each() {
    let (mut s, mut rx) = stream();
    let mut bytes = command(&["SET", "a", "1"]);
    bytes.extend(command(&["GET", "a"]));
    // Half of a third command: it waits for its rest.
    let third = command(&["INCR", "n"]);
    bytes.extend(&third[..5]);
    s.write.write_all(&bytes).await.expect("written");
    s.write.flush().await.expect("flushed");
    let first = batch(&mut rx).await;
    assert_eq!(first.replies, 2, "two whole commands");
    assert!(first.first, "the session's first batch");
    assert_eq!(&first.bytes[..], &bytes[..bytes.len() - 5]);
    s.write.write_all(&third[5..]).await.expect("written");
    s.write.flush().await.expect("flushed");
    let second = batch(&mut rx).await;
    assert_eq!((second.replies, second.first), (1, false));
    assert_eq!(&second.bytes[..], &third[..]);
    // Replies as the shared connection hands them on: in pieces, a reply
    // split across two deliveries.
    first.inbox.deliver(Bytes::from_static(b"+OK\r\n$1\r"), 1);
    first.inbox.deliver(Bytes::from_static(b"\n1\r\n"), 1);
    second.inbox.deliver(Bytes::from_static(b":1\r\n"), 1);
    read_all(&mut s.read, "+OK\r\n$1\r\n1\r\n:1\r\n").await;
}

#[tokio::test]
async fn a_wait_after_shared_writes_is_refused_in_its_place() {
    let (mut s, mut rx) = stream();
    let mut bytes = command(&["SET", "a", "1"]);
    bytes.extend(command(&["WAIT", "1", "0"]));
    bytes.extend(command(&["GET", "a"]));
    s.write.write_all(&bytes).await.expect("written");
    set_wait_get_answered(&mut s, &mut rx).await;
}

/// `SET a 1`, `WAIT 1 0`, `GET a` written (not flushed): the flush waits
/// for the SET's reply before it answers the WAIT, so the shared
/// connection answers while it waits; the WAIT is refused in its place.
async fn set_wait_get_answered(s: &mut SharedStream, rx: &mut mpsc::Receiver<Batch>) {
    let answer = async {
        let set = batch(rx).await;
        assert_eq!(set.replies, 1, "the SET alone");
        set.inbox.deliver(Bytes::from_static(b"+OK\r\n"), 1);
        let get = batch(rx).await;
        assert_eq!(get.replies, 1, "the GET after the refusal");
        assert_eq!(&get.bytes[..], &command(&["GET", "a"])[..]);
        get.inbox.deliver(Bytes::from_static(b"$1\r\n1\r\n"), 1);
    };
    let (flushed, ()) = tokio::join!(s.write.flush(), answer);
    flushed.expect("flushed");
    let mut refusal = BytesMut::new();
    LocalReply::err(WAIT_REFUSED).encode(false, &mut refusal);
    let want = format!("+OK\r\n{}$1\r\n1\r\n", String::from_utf8_lossy(&refusal));
    read_all(&mut s.read, &want).await;
}

#[tokio::test]
async fn the_shared_connections_gone_fails_the_session() {
    let (mut s, rx) = stream();
    drop(rx);
    s.write
        .write_all(&command(&["GET", "a"]))
        .await
        .expect("taken");
    let err = s.write.flush().await.expect_err("nothing can answer");
    assert_eq!(err.kind(), io::ErrorKind::NotConnected);
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(WAIT, s.read.read(&mut buf))
        .await
        .expect("the read side ends");
    assert!(read.is_err(), "the read side fails too: {read:?}");
}

#[tokio::test]
async fn commands_framed_by_the_dispatcher_go_as_unframed_ones_do() {
    let (mut s, mut rx) = stream();
    let (bytes, frames) = framed(&[&["SET", "a", "1"], &["WAIT", "1", "0"], &["GET", "a"]]);
    s.write.frames(frames);
    s.write.write_all(&bytes).await.expect("written");
    set_wait_get_answered(&mut s, &mut rx).await;
    assert!(s.write.hints.is_empty(), "every frame used");
    // Frames that do not line up (more bytes than written) are dropped.
    let (_, long) = framed(&[&["GET", "a"], &["GET", "b"]]);
    s.write.frames(long);
    s.write
        .write_all(&command(&["GET", "a"]))
        .await
        .expect("written");
    s.write.flush().await.expect("flushed");
    assert!(s.write.hints.is_empty(), "no frame kept");
    let get = batch(&mut rx).await;
    assert_eq!(get.replies, 1);
}
