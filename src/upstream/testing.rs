//! What the session-stream tests of `shared/` and `cluster/` share: a
//! command in RESP and a bounded read of exactly the replies expected.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// How long a test waits for what must come (a loaded box: generous).
pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// `args…` in RESP.
pub(crate) fn command(args: &[&str]) -> Vec<u8> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    crate::protocol::encode::command(&args).to_vec()
}

/// Reads exactly `want`'s length from `read` (within [`WAIT`]) and checks
/// it is `want`.
pub(crate) async fn read_all<R: AsyncRead + Unpin>(read: &mut R, want: &str) {
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(WAIT, read.read_exact(&mut got))
        .await
        .expect("the replies come")
        .expect("read");
    assert_eq!(String::from_utf8_lossy(&got), want);
}

/// `commands` in RESP, one after another, and the frames the dispatcher
/// would hand on with them (see [`crate::protocol::frames`]).
pub(crate) fn framed(commands: &[&[&str]]) -> (Vec<u8>, crate::protocol::frames::Frames) {
    let mut bytes = Vec::new();
    let mut frames = crate::protocol::frames::Frames::default();
    let mut parser = crate::upstream::shared::framing_parser();
    for args in commands {
        let one = command(args);
        let request = parser.parse(&one).expect("parsed").expect("whole");
        let ranges = parser.arg_ranges().expect("a multibulk");
        assert!(frames.push(request.len, ranges), "framed");
        bytes.extend(one);
    }
    (bytes, frames)
}
