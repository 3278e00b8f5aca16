//! The stream a session gets in front of a cluster, written and read as
//! its own socket would be. The write side ([`ClusterWrite`]) frames what
//! it is given (whole commands; the start of an unfinished one waits for
//! the rest; the commands the dispatcher framed already, handed on as
//! [`Frames`], are not parsed again), asks [`route`] where each goes, and
//! sends runs of commands for one node as one [`Job`]: to the node's
//! shared lane, or to a lane of the session's own to it (blocking
//! commands, scripts, transactions, and everything with `proxy.upstream =
//! "dedicated"`). Before a command goes to the other kind of lane than the
//! last one, it waits until nothing is owed on that kind ([`Owed`]): two connections never run one session's
//! commands out of order. The read side ([`ClusterRead`]) hands back each
//! command's reply in the order of the commands, waiting for a slower node
//! when it must.
//!
//! A transaction is kept in one slot as a cluster keeps it
//! ([`TxSlot`]): `WATCH` names its node; a `MULTI` before any key is held
//! with the commands after it until one names a key (or `EXEC` comes),
//! then all go to that node on the session's own connection; a command
//! with a key in another slot is refused with `CROSSSLOT` and `EXEC` then
//! answers `EXECABORT` (the node's side discarded). A subscription pins
//! the session to a connection of its own to one node until it has no
//! subscription left ([`pin`]).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use smallvec::{smallvec, SmallVec};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::PollSender;
use tokio_util::task::AbortOnDropHandle;

use super::lane::{Commands, Job, Owed, Part, Unread};
use super::pin::{self, PinnedRead, PinnedWrite};
use super::{merge, Common};
use crate::cluster::fanout::Fanout;
use crate::cluster::map::SlotMap;
use crate::cluster::route::{route, Dest, TxCommand};
use crate::cluster::split::{Split, CROSSSLOT};
use crate::cluster::tx::{Event, TxSlot, Verdict};
use crate::metrics::ProxyMetrics;
use crate::protocol::encode::{self, LocalReply};
use crate::protocol::frames::Frames;
use crate::protocol::request::{RequestKind, RequestParser};
use crate::tls::Stream;
use crate::upstream::shared::framing_parser;

/// Both halves of a session's stream in front of a cluster.
#[derive(Debug)]
pub struct ClusterStream {
    /// Replies.
    pub read: ClusterRead,
    /// Commands.
    pub write: ClusterWrite,
}

/// What the read side hands back, in the order of the commands.
enum Slot {
    /// Replies now (lockgate's own).
    Ready(Bytes),
    /// A job's replies, once in.
    Job(oneshot::Receiver<Vec<Part>>),
    /// Commands gathered for several nodes: per command (in order) the
    /// job of `jobs` whose next reply is its reply.
    Batch(Box<Batch>),
    /// From here on everything comes from this connection (a
    /// subscription pinned the session to it), until its last
    /// subscription ends.
    Pin(oneshot::Receiver<Result<PinnedRead, String>>),
}

impl ClusterStream {
    pub(super) fn new(common: Arc<Common>, n: usize, dedicated: bool) -> ClusterStream {
        let (out, rx) = mpsc::unbounded_channel();
        let unread = Arc::new(Unread::default());
        ClusterStream {
            read: ClusterRead {
                unread: unread.clone(),
                rx,
                parts: VecDeque::new(),
                waiting: None,
                current: Bytes::new(),
                batch: None,
                pin: None,
                pinned: None,
            },
            write: ClusterWrite {
                common,
                n,
                dedicated,
                out: Some(out),
                pending: BytesMut::new(),
                parser: framing_parser(),
                hints: Frames::default(),
                next: None,
                gathered: None,
                outbox: VecDeque::new(),
                generation: u64::MAX,
                map: None,
                keys: Arc::default(),
                facade: crate::cluster::facade::Facade::new("", "", 0),
                nodes: Vec::new(),
                shared: HashMap::default(),
                own: HashMap::default(),
                owed_shared: Arc::default(),
                owed_own: Arc::default(),
                last_own: None,
                tx: TxSlot::default(),
                tx_node: None,
                held: None,
                state: State::Routing,
                resp3: false,
                id: n as u64 + 1,
                name: None,
                unread,
                stall: None,
            },
        }
    }
}

/// Jobs of one gathering and, per command, which job answers it.
struct Batch {
    jobs: SmallVec<[Option<oneshot::Receiver<Vec<Part>>>; 4]>,
    parts: SmallVec<[VecDeque<Part>; 4]>,
    order: SmallVec<[u8; 32]>,
    /// The next command's place in `order`.
    next: usize,
}

/// The reading half: every command's reply, in order.
pub struct ClusterRead {
    // Unbounded: it holds one entry per command (or run of commands) the
    // session sent and has not read the reply of, which the session's own
    // pipeline limits.
    rx: mpsc::UnboundedReceiver<Slot>,
    /// The session's reply bytes not taken yet (see [`Unread`]).
    unread: Arc<Unread>,
    /// Parts of the job being read.
    parts: VecDeque<Part>,
    /// A job (or redirected part) whose replies are awaited.
    waiting: Option<oneshot::Receiver<Vec<Part>>>,
    /// A reply being copied out.
    current: Bytes,
    /// A batch being read.
    batch: Option<Box<Batch>>,
    pin: Option<oneshot::Receiver<Result<PinnedRead, String>>>,
    pinned: Option<PinnedRead>,
}

impl std::fmt::Debug for ClusterRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterRead")
            .field("pinned", &self.pinned.is_some())
            .finish()
    }
}

impl ClusterRead {
    /// The next of a gathering's replies ([`Slot::Batch`]: a pipeline
    /// spread over several nodes), in the order of the commands, into
    /// `buf`: `Continue` to read on, `Break` with what `poll_read` returns.
    fn poll_batch(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        start: usize,
    ) -> ControlFlow<Poll<io::Result<()>>> {
        let Some(batch) = &mut self.batch else {
            return ControlFlow::Continue(());
        };
        if batch.next == 0 {
            // A gathering's replies are handed on once all are in:
            // the session then writes them to its client at once,
            // not one node's share at a time.
            let mut out = false;
            for (j, rx) in batch.jobs.iter_mut().enumerate() {
                let Some(r) = rx else { continue };
                match Pin::new(r).poll(cx) {
                    Poll::Ready(Ok(parts)) => {
                        self.unread.take(&parts);
                        batch.parts[j] = parts.into();
                    }
                    Poll::Ready(Err(_)) => {}
                    Poll::Pending => {
                        out = true;
                        continue;
                    }
                }
                *rx = None;
            }
            if out {
                if buf.filled().len() > start {
                    return ControlFlow::Break(Poll::Ready(Ok(())));
                }
                return ControlFlow::Break(Poll::Pending);
            }
        }
        let Some(&j) = batch.order.get(batch.next) else {
            self.batch = None;
            return ControlFlow::Continue(());
        };
        let j = usize::from(j);
        if let Some(Part::Run(run)) = batch.parts[j].front_mut() {
            // This command's reply, copied out of its run.
            let end = run.ends[run.next] as usize;
            let n = (end - run.pos).min(buf.remaining());
            if n == 0 {
                return ControlFlow::Break(Poll::Ready(Ok(())));
            }
            buf.put_slice(&run.bytes[run.pos..run.pos + n]);
            run.pos += n;
            if run.pos < end {
                return ControlFlow::Break(Poll::Ready(Ok(())));
            }
            run.next += 1;
            batch.next += 1;
            if run.next == run.ends.len() {
                batch.parts[j].pop_front();
            }
            return ControlFlow::Continue(());
        }
        if batch.parts[j].is_empty() {
            if let Some(rx) = &mut batch.jobs[j] {
                match Pin::new(rx).poll(cx) {
                    Poll::Ready(Ok(parts)) => {
                        self.unread.take(&parts);
                        batch.parts[j] = parts.into();
                    }
                    Poll::Ready(Err(_)) => {}
                    Poll::Pending if buf.filled().len() > start => {
                        return ControlFlow::Break(Poll::Ready(Ok(())))
                    }
                    Poll::Pending => return ControlFlow::Break(Poll::Pending),
                }
                batch.jobs[j] = None;
                return ControlFlow::Continue(());
            }
        }
        batch.next += 1;
        match batch.parts[j].pop_front() {
            Some(Part::Reply(b)) => self.current = b,
            // Taken above.
            Some(Part::Run(_)) => {}
            Some(Part::Later(rx)) => self.waiting = Some(rx),
            // Its lane ended before answering.
            None => self.current = merge::gone(),
        }
        ControlFlow::Continue(())
    }
}

impl AsyncRead for ClusterRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let start = buf.filled().len();
        loop {
            if !this.current.is_empty() {
                let n = this.current.len().min(buf.remaining());
                if n == 0 {
                    return Poll::Ready(Ok(()));
                }
                buf.put_slice(&this.current[..n]);
                this.current.advance(n);
                continue;
            }
            if let Some(read) = &mut this.pinned {
                if buf.filled().len() > start {
                    return Poll::Ready(Ok(()));
                }
                match ready!(read.poll_next(cx))? {
                    pin::Read::Bytes(bytes, over) => {
                        this.current = bytes;
                        if over {
                            this.pinned = None;
                        }
                    }
                    pin::Read::Eof => return Poll::Ready(Ok(())),
                }
                continue;
            }
            let pending = || Poll::Pending;
            if let Some(rx) = &mut this.waiting {
                let parts = match Pin::new(rx).poll(cx) {
                    Poll::Ready(Ok(parts)) => {
                        this.unread.take(&parts);
                        parts
                    }
                    Poll::Ready(Err(_)) => vec![Part::Reply(merge::gone())],
                    Poll::Pending if buf.filled().len() > start => return Poll::Ready(Ok(())),
                    Poll::Pending => return pending(),
                };
                this.waiting = None;
                for p in parts.into_iter().rev() {
                    this.parts.push_front(p);
                }
                continue;
            }
            match this.parts.pop_front() {
                Some(Part::Reply(b)) => {
                    this.current = b;
                    continue;
                }
                Some(Part::Run(run)) => {
                    // Every reply of the run at once.
                    this.current = run.bytes.slice(run.pos..);
                    continue;
                }
                Some(Part::Later(rx)) => {
                    this.waiting = Some(rx);
                    continue;
                }
                None => {}
            }
            if this.batch.is_some() {
                match this.poll_batch(cx, buf, start) {
                    ControlFlow::Continue(()) => continue,
                    ControlFlow::Break(polled) => return polled,
                }
            }
            if let Some(rx) = &mut this.pin {
                match Pin::new(rx).poll(cx) {
                    Poll::Ready(Ok(Ok(read))) => {
                        this.pin = None;
                        this.pinned = Some(read);
                        continue;
                    }
                    Poll::Ready(Ok(Err(why))) => {
                        return Poll::Ready(Err(io::Error::new(io::ErrorKind::NotConnected, why)))
                    }
                    Poll::Ready(Err(_)) => {
                        return Poll::Ready(Err(io::ErrorKind::NotConnected.into()))
                    }
                    Poll::Pending if buf.filled().len() > start => return Poll::Ready(Ok(())),
                    Poll::Pending => return pending(),
                }
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(Slot::Ready(b))) => this.current = b,
                Poll::Ready(Some(Slot::Job(rx))) => this.waiting = Some(rx),
                Poll::Ready(Some(Slot::Batch(b))) => this.batch = Some(b),
                Poll::Ready(Some(Slot::Pin(rx))) => this.pin = Some(rx),
                // The write side is gone (shut down, `QUIT`): the end.
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending if buf.filled().len() > start => return Poll::Ready(Ok(())),
                Poll::Pending => return pending(),
            }
        }
    }
}

/// A node's address as [`Common::intern`] gave it: one pointer per
/// address, so compared and hashed by pointer (every command is matched
/// to its lane; `perf` at `-P 16`: comparing and hashing the addresses
/// was 2 % of lockgate's CPU).
#[derive(Debug, Clone)]
struct Node(Arc<str>);

impl PartialEq for Node {
    fn eq(&self, other: &Node) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Node {}

impl std::hash::Hash for Node {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (Arc::as_ptr(&self.0) as *const u8 as usize).hash(state);
    }
}

impl std::ops::Deref for Node {
    type Target = Arc<str>;
    fn deref(&self) -> &Arc<str> {
        &self.0
    }
}

/// A lane a session sends to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Lane {
    /// The node's shared lane of a protocol (RESP3: true).
    Shared(Node, bool),
    /// The session's own lane to the node; redirections followed (plain
    /// commands with `proxy.upstream = "dedicated"`) or not.
    Own(Node, bool),
}

impl Lane {
    fn own(&self) -> bool {
        matches!(self, Lane::Own(..))
    }

    fn follow(&self) -> bool {
        !matches!(self, Lane::Own(_, false))
    }

    fn node(&self) -> &Node {
        match self {
            Lane::Shared(n, _) | Lane::Own(n, _) => n,
        }
    }
}

/// Most commands gathered before they are sent.
const MAX_GATHERED: usize = 512;

/// Commands gathered for lanes of one kind (shared, or the session's
/// own), sent together as one job per lane: a node's commands keep their
/// order, commands for different nodes have none between them (as a
/// cluster client's pipelines to several nodes).
struct Gathered {
    own: bool,
    lanes: SmallVec<[(Lane, Commands); 4]>,
    /// Per command, its lane's index in `lanes`.
    order: SmallVec<[u8; 32]>,
    /// The replies of the lanes sent so far (a flush may stop half way,
    /// waiting for room).
    sent: SmallVec<[Option<oneshot::Receiver<Vec<Part>>>; 4]>,
}

/// A transaction's `MULTI` and the commands after it, held until one
/// names a key (its node) or `EXEC` comes. lockgate answered them itself
/// (`+OK`, `+QUEUED`: a client waits for those before it sends more), so
/// the node's replies to them are dropped.
struct Held {
    commands: Commands,
}

/// Where the write side is.
enum State {
    /// Commands are routed.
    Routing,
    /// A subscription's own connection being opened; the read side gets
    /// its reading half through `to_read`.
    Pinning(
        AbortOnDropHandle<Result<Stream, String>>,
        Option<oneshot::Sender<Result<PinnedRead, String>>>,
    ),
    /// Everything goes to this connection until no subscription is left.
    Pinned(PinnedWrite),
    /// After `QUIT`: nothing more is sent.
    Quit,
    /// The session is ending.
    Failed,
}

/// What one command does (see [`ClusterWrite::decide`]).
enum Action {
    /// Into the run for this lane.
    Run(Lane),
    /// Answered by lockgate with these bytes.
    Reply(Bytes),
    Split(Split),
    Fanout(Fanout),
    Scan,
    /// Pins the session to this node.
    Subscribe(Node),
    Quit,
    /// `MULTI` before any key: held.
    StartHold,
    /// Held with the transaction.
    Hold,
    /// The held transaction and this command, to this node.
    Release(Node),
    /// `EXEC` after a refused command: the node's side discarded,
    /// `EXECABORT` answered.
    Abort,
    /// `HELLO`: answered here, the protocol switched (`None`: kept).
    Hello(Option<u8>),
    /// `CLIENT SETNAME` (`Some`) or `GETNAME`: answered here.
    ClientName(Option<Bytes>),
}

/// A command's action and the transaction's state once it is carried out.
struct Decided {
    action: Action,
    tx: TxSlot,
    /// The node the transaction is bound to after it.
    tx_node: Option<Node>,
}

/// The writing half: commands, sent as the module doc says.
pub struct ClusterWrite {
    common: Arc<Common>,
    /// This session's number (which shared lane of a node it uses).
    n: usize,
    /// `proxy.upstream = "dedicated"`: plain commands on lanes of its own.
    dedicated: bool,
    out: Option<mpsc::UnboundedSender<Slot>>,
    pending: BytesMut,
    parser: RequestParser,
    /// The commands at the front of `pending` as the dispatcher framed
    /// them: `parser` frames only what comes after.
    hints: Frames,
    /// Frames for the next write ([`ClusterWrite::frames`]).
    next: Option<Frames>,
    gathered: Option<Gathered>,
    /// Jobs made but not yet sent (room on their lane), in order.
    outbox: VecDeque<(Lane, Job)>,
    /// The map generation `map`, `nodes` and `shared` are of.
    generation: u64,
    map: Option<Arc<SlotMap>>,
    /// The nodes' key specifications and lockgate's face to cluster-aware
    /// clients, as of `generation`.
    keys: Arc<crate::cluster::keys::KeyTable>,
    facade: crate::cluster::facade::Facade,
    /// Each shard's primary, by shard index.
    nodes: Vec<Node>,
    shared: HashMap<(Node, bool), PollSender<Job>, ahash::RandomState>,
    own: HashMap<Node, (PollSender<Job>, AbortOnDropHandle<()>), ahash::RandomState>,
    owed_shared: Arc<Owed>,
    owed_own: Arc<Owed>,
    /// The kind of lane the last job went to (own: true).
    last_own: Option<bool>,
    tx: TxSlot,
    tx_node: Option<Node>,
    held: Option<Held>,
    state: State,
    /// The client said `HELLO 3`: RESP3 from now on, on connections
    /// that speak it.
    resp3: bool,
    /// `HELLO`'s client id.
    id: u64,
    /// The name `CLIENT SETNAME` gave the session (`CLIENT GETNAME`).
    name: Option<Bytes>,
    /// The session's reply bytes not taken yet (see [`Unread`]).
    unread: Arc<Unread>,
    /// While past [`Common::reply_half`]: the deadline for the client to
    /// take a reply, and the bytes taken when it was set.
    stall: Option<(Pin<Box<tokio::time::Sleep>>, u64)>,
}

impl std::fmt::Debug for ClusterWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterWrite")
            .field("pending", &self.pending.len())
            .finish()
    }
}

const EXECABORT: &str = "EXECABORT Transaction discarded because of previous errors.";

impl ClusterWrite {
    /// `reply` in the session's protocol.
    fn encoded(&self, reply: &LocalReply) -> Bytes {
        merge::encode_as(reply, self.resp3)
    }

    /// The command of `len` bytes at the front of `pending`, taken off.
    fn take_front(&mut self, len: usize) -> Bytes {
        self.hints.pop(len);
        self.pending.split_to(len).freeze()
    }

    /// The command of `len` bytes at the front of `pending`, dropped.
    fn skip_front(&mut self, len: usize) {
        self.hints.pop(len);
        self.pending.advance(len);
    }

    /// What the dispatcher framed of the next write (see
    /// [`crate::protocol::frames`]).
    pub(crate) fn frames(&mut self, frames: Frames) {
        self.next = Some(frames);
    }

    /// Takes the frames of the next write, `written`, if they line up:
    /// everything before it in `pending` is framed too.
    fn take_frames(&mut self, written: usize) {
        if let Some(frames) = self.next.take() {
            self.hints.follow_with(frames, self.pending.len(), written);
        }
    }

    /// Takes the map in force if it changed since the last command.
    fn follow_map(&mut self) {
        let generation = self.common.generation();
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        self.map = self.common.map();
        self.keys = self.common.keys();
        self.facade = crate::sync::read(&self.common.facade).clone();
        self.nodes = self
            .map
            .iter()
            .flat_map(|m| {
                m.shards()
                    .iter()
                    .map(|s| Node(self.common.intern(&s.primary)))
            })
            .collect();
        self.shared.clear();
    }

    /// The node serving `slot` (`None`: this session's keyless node).
    fn node_of(&self, slot: Option<u16>) -> Result<Node, Bytes> {
        let Some(map) = &self.map else {
            return Err(self.encoded(&merge::no_map()));
        };
        let i = match slot {
            Some(s) => map.shard_index(s),
            None => (!self.nodes.is_empty()).then(|| self.n % self.nodes.len()),
        };
        match i.and_then(|i| self.nodes.get(i)) {
            Some(node) => Ok(node.clone()),
            None => Err(self.encoded(&merge::unserved())),
        }
    }

    /// The lane for a plain command to `node`.
    fn plain(&self, node: Node) -> Lane {
        match self.dedicated {
            true => Lane::Own(node, true),
            false => Lane::Shared(node, self.resp3),
        }
    }

    /// What the command `args` does, given the transaction's state (pure
    /// but for reading the map in force).
    fn decide(&self, args: &[&[u8]]) -> Decided {
        let dest = route(args, &self.keys, &self.facade);
        let d = Decided {
            action: Action::Hold,
            tx: self.tx,
            tx_node: self.tx_node.clone(),
        };
        if self.tx.in_multi {
            return self.decide_in_multi(&dest, d);
        }
        self.decide_outside_multi(dest, d)
    }

    /// [`Self::decide`] inside `MULTI`: the transaction's state machine
    /// (`crate::cluster::tx`) says whether the command is queued on the
    /// node the transaction is bound to, held until a key binds it, or
    /// aborts it.
    fn decide_in_multi(&self, dest: &Dest, mut d: Decided) -> Decided {
        let node = |slot| self.node_of(slot);
        let event = match &dest {
            Dest::Tx(TxCommand::Exec) | Dest::Tx(TxCommand::Discard) => {
                let exec = *dest == Dest::Tx(TxCommand::Exec);
                let (tx, verdict) = self.tx.step(Event::End, exec);
                d.tx = tx;
                d.tx_node = None;
                d.action = match (verdict, &self.tx_node) {
                    (Verdict::Abort, _) => Action::Abort,
                    (_, Some(bound)) => Action::Run(Lane::Own(bound.clone(), false)),
                    (_, None) => match node(None) {
                        Ok(any) => Action::Release(any),
                        Err(e) => Action::Reply(e),
                    },
                };
                return d;
            }
            Dest::Quit => {
                d.action = Action::Quit;
                return d;
            }
            Dest::Node(s) | Dest::Own(s) | Dest::Subscribe(s) => Ok(*s),
            Dest::Split(_) => Err(()),
            Dest::Local(LocalReply::Error(e)) if e.starts_with(b"CROSSSLOT") => Err(()),
            Dest::Local(LocalReply::Error(e)) => {
                // Refused as it is queued: `EXEC` aborts, as Redis does.
                d.tx.failed = true;
                d.action = Action::Reply(self.encoded(&LocalReply::Error(e.clone())));
                return d;
            }
            // Queued on the node as sent (it answers them at `EXEC`).
            _ => Ok(None),
        };
        let (tx, verdict) = self.tx.step(Event::Queue(event), false);
        d.tx = tx;
        d.action = match verdict {
            Verdict::CrossSlot => Action::Reply(self.encoded(&LocalReply::Error(CROSSSLOT.into()))),
            Verdict::Abort => Action::Abort,
            Verdict::Go(slot) => match (&self.tx_node, slot) {
                (Some(bound), _) => Action::Run(Lane::Own(bound.clone(), false)),
                (None, None) => Action::Hold,
                (None, Some(s)) => match node(Some(s)) {
                    Ok(n) => {
                        d.tx_node = Some(n.clone());
                        Action::Release(n)
                    }
                    Err(e) => {
                        d.tx.failed = true;
                        Action::Reply(e)
                    }
                },
            },
        };
        d
    }

    /// [`Self::decide`] outside `MULTI`: the lane (shared or own) of the
    /// node that serves the command's slot, or what is done here instead.
    fn decide_outside_multi(&self, dest: Dest, mut d: Decided) -> Decided {
        let node = |slot| self.node_of(slot);
        d.action = match dest {
            Dest::Tx(TxCommand::Multi) => {
                let (tx, _) = self.tx.step(Event::Multi, false);
                d.tx = tx;
                match &self.tx_node {
                    Some(bound) => Action::Run(Lane::Own(bound.clone(), false)),
                    None => Action::StartHold,
                }
            }
            Dest::Tx(TxCommand::Watch(Ok(Some(slot)))) => {
                match self.tx.step(Event::Watch(Ok(slot)), false) {
                    (tx, Verdict::Go(_)) => match (&self.tx_node, node(Some(slot))) {
                        (Some(bound), _) => {
                            d.tx = tx;
                            Action::Run(Lane::Own(bound.clone(), false))
                        }
                        (None, Ok(n)) => {
                            d.tx = tx;
                            d.tx_node = Some(n.clone());
                            Action::Run(Lane::Own(n, false))
                        }
                        (None, Err(e)) => Action::Reply(e),
                    },
                    _ => Action::Reply(self.encoded(&LocalReply::Error(CROSSSLOT.into()))),
                }
            }
            Dest::Tx(TxCommand::Watch(Ok(None))) => match node(None) {
                Ok(n) => Action::Run(self.plain(n)),
                Err(e) => Action::Reply(e),
            },
            Dest::Tx(TxCommand::Watch(Err(()))) => {
                Action::Reply(self.encoded(&LocalReply::Error(CROSSSLOT.into())))
            }
            Dest::Tx(TxCommand::Exec | TxCommand::Discard | TxCommand::Unwatch) => {
                let (tx, _) = self.tx.step(Event::End, false);
                d.tx = tx;
                d.tx_node = None;
                match (&self.tx_node, node(None)) {
                    (Some(bound), _) => Action::Run(Lane::Own(bound.clone(), false)),
                    (None, Ok(n)) => Action::Run(self.plain(n)),
                    (None, Err(e)) => Action::Reply(e),
                }
            }
            Dest::Node(slot) => match node(slot) {
                Ok(n) => Action::Run(self.plain(n)),
                Err(e) => Action::Reply(e),
            },
            Dest::Own(slot) => match node(slot) {
                Ok(n) => Action::Run(Lane::Own(n, false)),
                Err(e) => Action::Reply(e),
            },
            Dest::Split(s) => Action::Split(s),
            Dest::Fanout(f) => Action::Fanout(f),
            Dest::Scan => Action::Scan,
            Dest::Subscribe(slot) => match node(slot) {
                Ok(n) => Action::Subscribe(n),
                Err(e) => Action::Reply(e),
            },
            Dest::Local(reply) => {
                if matches!(&reply, LocalReply::Error(e) if e.starts_with(b"CROSSSLOT")) {
                    ProxyMetrics::inc(&self.common.metrics.crossslot);
                } else {
                    ProxyMetrics::inc(&self.common.metrics.local);
                }
                Action::Reply(self.encoded(&reply))
            }
            Dest::Quit => Action::Quit,
            Dest::Hello(version) => Action::Hello(version),
            Dest::ClientName(name) => {
                ProxyMetrics::inc(&self.common.metrics.local);
                Action::ClientName(name)
            }
            Dest::Auth(a) => {
                // Answered here, as the facade's replies are.
                ProxyMetrics::inc(&self.common.metrics.local);
                let node = &self.common.node;
                let (user, pass) = (&node.username, &node.password);
                match crate::cluster::auth::check(a.user.as_deref(), &a.pass, user, pass) {
                    Ok(()) if a.hello.is_some() => Action::Hello(a.hello),
                    Ok(()) => Action::Reply(self.encoded(&LocalReply::Status("OK"))),
                    Err(e) => Action::Reply(self.encoded(&e)),
                }
            }
        };
        d
    }

    /// Ready once a job may go to `lane`: what is owed on the other kind
    /// of lane is in, and the lane's queue has room. `true`: the room is
    /// reserved; `false`: the queue had room when looked at, and
    /// [`Self::send`] tries it without a reservation (callgrind, `SET
    /// -P 16` in front of a cluster: the reservation's future was about
    /// 500 instructions per job, a job per node per pipeline).
    fn poll_lane(&mut self, cx: &mut Context<'_>, lane: &Lane) -> Poll<io::Result<bool>> {
        let own = lane.own();
        if self.last_own.is_some_and(|last| last != own) {
            let other = match own {
                true => &self.owed_shared,
                false => &self.owed_own,
            };
            ready!(other.poll_none(cx));
        }
        let sender = self.sender(lane);
        if sender
            .get_ref()
            .is_some_and(|tx| !tx.is_closed() && tx.capacity() > 0)
        {
            // A reservation begun when the queue was full is dropped, so
            // that it holds no room it will not use (cheap when none is).
            sender.abort_send();
            return Poll::Ready(Ok(false));
        }
        match ready!(sender.poll_reserve(cx)) {
            Ok(()) => Poll::Ready(Ok(true)),
            Err(_) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the cluster connections stopped",
            ))),
        }
    }

    /// The sender of `lane`, started on first use.
    fn sender(&mut self, lane: &Lane) -> &mut PollSender<Job> {
        match lane {
            Lane::Shared(node, resp3) => {
                let (common, n) = (&self.common, self.n);
                self.shared
                    .entry((node.clone(), *resp3))
                    .or_insert_with(|| PollSender::new(common.lane(node, n, *resp3)))
            }
            Lane::Own(node, _) => {
                let (common, resp3) = (&self.common, self.resp3);
                let (tx, _) = self.own.entry(node.clone()).or_insert_with(|| {
                    let (tx, handle) = common.spawn_lane(node.0.clone(), false, resp3);
                    (PollSender::new(tx), AbortOnDropHandle::new(handle))
                });
                tx
            }
        }
    }

    /// Sends `job` to `lane`, whose room [`Self::poll_lane`] reserved
    /// (`reserved`) or saw. Room seen can be gone by now (a session on
    /// another thread took it): the job then waits at the outbox's front,
    /// before anything this session sends after it.
    fn send(&mut self, lane: &Lane, mut job: Job, reserved: bool) {
        let owed = match lane.own() {
            true => &self.owed_own,
            false => &self.owed_shared,
        };
        job.owed = Some(owed.add());
        self.last_own = Some(lane.own());
        let sender = self.sender(lane);
        if reserved {
            // A lane gone (shutting down): the job's part answers so.
            let _ = sender.send_item(job);
            return;
        }
        let Some(tx) = sender.get_ref() else {
            // Closed: dropped unsent, the job's part answers so; it is not
            // owed (a count left up would hold the next switch of lane
            // kind for good).
            job.unsent();
            return;
        };
        match tx.try_send(job) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(mut job)) => {
                job.unsent();
                self.outbox.push_front((lane.clone(), job));
            }
            // A lane gone: as above.
            Err(mpsc::error::TrySendError::Closed(mut job)) => job.unsent(),
        }
    }

    fn push(&self, slot: Slot) {
        if let Some(out) = &self.out {
            let _ = out.send(slot);
        }
    }

    /// Sends what was gathered, one job per lane, and queues its replies.
    fn poll_flush_gathered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let Some(g) = &self.gathered else {
                return Poll::Ready(Ok(()));
            };
            let i = g.sent.len();
            let Some((lane, _)) = g.lanes.get(i) else {
                break;
            };
            let lane = lane.clone();
            let reserved = ready!(self.poll_lane(cx, &lane))?;
            let Some(g) = &mut self.gathered else {
                return Poll::Ready(Ok(()));
            };
            let commands = std::mem::take(&mut g.lanes[i].1);
            let (mut job, rx) = Job::new(commands, lane.follow());
            job.unread = Some(self.unread.clone());
            g.sent.push(Some(rx));
            self.send(&lane, job, reserved);
        }
        let Some(mut g) = self.gathered.take() else {
            return Poll::Ready(Ok(()));
        };
        if g.sent.len() == 1 {
            if let Some(rx) = g.sent.pop().flatten() {
                self.push(Slot::Job(rx));
            }
        } else {
            let parts = g.sent.iter().map(|_| VecDeque::new()).collect();
            self.push(Slot::Batch(Box::new(Batch {
                jobs: g.sent,
                parts,
                order: g.order,
                next: 0,
            })));
        }
        Poll::Ready(Ok(()))
    }

    /// Ready while the replies waiting for the client are at most
    /// [`Common::reply_half`] (back-pressure, see [`Unread`]); an error once
    /// the client has taken none of them for `proxy.shared_reply_stall_ms`
    /// (it is closed, counted in `cluster_session_output_limit`).
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.unread.poll_room(cx, self.common.reply_half).is_ready() {
            self.stall = None;
            return Poll::Ready(Ok(()));
        }
        let (taken, wait) = (self.unread.taken(), self.common.reply_stall);
        let (sleep, at) = self
            .stall
            .get_or_insert_with(|| (Box::pin(tokio::time::sleep(wait)), taken));
        if *at != taken {
            // It reads, slowly: a new deadline.
            *at = taken;
            sleep.as_mut().reset(tokio::time::Instant::now() + wait);
        }
        ready!(sleep.as_mut().poll(cx));
        ProxyMetrics::inc(&self.common.metrics.output_limit);
        self.state = State::Failed;
        Poll::Ready(Err(io::Error::other(format!(
            "the client took none of its replies for {} ms while more than {} bytes waited (proxy.shared_reply_stall_ms, proxy.shared_session_reply_bytes)",
            wait.as_millis(),
            self.common.reply_half
        ))))
    }

    /// Sends the jobs made for a split, a fan-out or a held transaction,
    /// in order.
    fn poll_outbox(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((lane, _)) = self.outbox.front() {
            let lane = lane.clone();
            let reserved = ready!(self.poll_lane(cx, &lane))?;
            if let Some((lane, job)) = self.outbox.pop_front() {
                self.send(&lane, job, reserved);
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Routes and sends what `pending` holds as far as it can: Ready once
    /// only the start of an unfinished command (or nothing) is left.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match &mut self.state {
                State::Routing => {}
                State::Pinning(opening, to_read) => {
                    let opened = match ready!(Pin::new(opening).poll(cx)) {
                        Ok(result) => result,
                        Err(e) => Err(e.to_string()),
                    };
                    let to_read = to_read.take();
                    match opened {
                        Ok(stream) => {
                            let (read, write) = pin::pin(self.common.clone(), stream);
                            if let Some(tx) = to_read {
                                let _ = tx.send(Ok(read));
                            }
                            self.state = State::Pinned(write);
                        }
                        Err(why) => {
                            if let Some(tx) = to_read {
                                let _ = tx.send(Err(why.clone()));
                            }
                            self.state = State::Failed;
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::NotConnected,
                                why,
                            )));
                        }
                    }
                    continue;
                }
                State::Pinned(write) => {
                    // Written as they come: the pinned connection frames
                    // them itself.
                    self.hints.clear();
                    if !ready!(write.poll_send(cx, &mut self.pending, &mut self.parser))? {
                        return Poll::Ready(Ok(()));
                    }
                    // No subscription left: routed again.
                    self.state = State::Routing;
                    continue;
                }
                State::Quit => {
                    self.pending.clear();
                    self.hints.clear();
                    return Poll::Ready(Ok(()));
                }
                State::Failed => return Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
            }
            ready!(self.poll_outbox(cx))?;
            if !self.pending.is_empty() {
                ready!(self.poll_room(cx))?;
            }
            self.follow_map();
            let (len, decided) = match self.hints.front() {
                // Framed by the dispatcher already.
                Some(f) => (f.len, self.decide(&f.args(&self.pending))),
                None => {
                    let request = match self.parser.parse(&self.pending) {
                        Ok(Some(request)) => request,
                        Ok(None) => return self.poll_flush_gathered(cx),
                        Err(e) => {
                            return Poll::Ready(Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                e.to_string(),
                            )))
                        }
                    };
                    if request.kind == RequestKind::Empty {
                        // No reply, nothing done: Redis ignores it too.
                        self.skip_front(request.len);
                        continue;
                    }
                    let rest = &self.pending[..];
                    let args: SmallVec<[&[u8]; 8]> = (0..self.parser.argc())
                        .map(|i| self.parser.arg(rest, i))
                        .collect();
                    (request.len, self.decide(&args))
                }
            };
            if let Action::Run(lane) = decided.action {
                // One kind of lane per gathering, and a bounded one.
                if let Some(g) = &self.gathered {
                    // One job per connection: a lane that differs only in
                    // following redirections is the same connection, and
                    // its commands must not be reordered.
                    let split =
                        (g.lanes.iter()).any(|(l, _)| l.node() == lane.node() && *l != lane);
                    if split
                        || g.own != lane.own()
                        || g.order.len() >= MAX_GATHERED
                        || g.lanes.len() >= 255
                    {
                        ready!(self.poll_flush_gathered(cx))?;
                        continue;
                    }
                }
                let command = self.take_front(len);
                let g = self.gathered.get_or_insert_with(|| Gathered {
                    own: lane.own(),
                    lanes: SmallVec::new(),
                    order: SmallVec::new(),
                    sent: SmallVec::new(),
                });
                let at = match g.lanes.iter().position(|(l, _)| *l == lane) {
                    Some(at) => at,
                    None => {
                        g.lanes.push((lane, Commands::new()));
                        g.lanes.len() - 1
                    }
                };
                g.lanes[at].1.push(command);
                g.order.push(at as u8);
                self.tx = decided.tx;
                self.tx_node = decided.tx_node;
                continue;
            }
            if self.gathered.is_some() {
                ready!(self.poll_flush_gathered(cx))?;
                continue;
            }
            // Carried out with the transaction's state before it (an
            // abort discards where the transaction was bound).
            self.carry_out(decided.action, len)?;
            self.tx = decided.tx;
            self.tx_node = decided.tx_node;
        }
    }

    /// Carries out an action other than a run for the command of `len`
    /// bytes at the front of `pending` (a run is flushed before).
    fn carry_out(&mut self, action: Action, len: usize) -> io::Result<()> {
        match action {
            Action::Run(_) => {}
            Action::Reply(bytes) => {
                self.skip_front(len);
                self.push(Slot::Ready(bytes));
            }
            Action::Quit => {
                self.pending.clear();
                self.hints.clear();
                self.push(Slot::Ready(Bytes::from_static(b"+OK\r\n")));
                self.out = None;
                self.state = State::Quit;
            }
            Action::StartHold => {
                let command = self.take_front(len);
                self.held = Some(Held {
                    commands: smallvec![command],
                });
                self.push(Slot::Ready(Bytes::from_static(b"+OK\r\n")));
            }
            Action::Hold => {
                let command = self.take_front(len);
                if let Some(held) = &mut self.held {
                    held.commands.push(command);
                }
                self.push(Slot::Ready(Bytes::from_static(b"+QUEUED\r\n")));
            }
            Action::Release(node) => {
                let command = self.take_front(len);
                self.release(node, command);
            }
            Action::Abort => {
                self.skip_front(len);
                let discard = encode::command(&[b"DISCARD"]);
                // A held transaction never reached a node: dropped.
                if self.held.take().is_none() {
                    if let Some(bound) = self.tx_node.take() {
                        let (mut job, _ignored) = Job::new(smallvec![discard], false);
                        job.skip_front = 1;
                        self.outbox.push_back((Lane::Own(bound, false), job));
                    }
                }
                self.tx_node = None;
                self.push(Slot::Ready(
                    self.encoded(&LocalReply::Error(EXECABORT.into())),
                ));
            }
            Action::Split(split) => {
                self.skip_front(len);
                let Some(map) = self.map.clone() else {
                    self.push(Slot::Ready(self.encoded(&merge::no_map())));
                    return Ok(());
                };
                match merge::split_plan(&map, &split) {
                    Ok(plan) => {
                        ProxyMetrics::inc(&self.common.metrics.splits);
                        let parts = self.send_each(plan);
                        self.spawn_merge(merge::split_reply(split, parts, self.resp3));
                    }
                    Err(e) => self.push(Slot::Ready(self.encoded(&e))),
                }
            }
            Action::Fanout(how) => {
                let command = self.take_front(len);
                let Some(map) = self.map.clone() else {
                    self.push(Slot::Ready(self.encoded(&merge::no_map())));
                    return Ok(());
                };
                ProxyMetrics::inc(&self.common.metrics.fanouts);
                let plan = merge::primaries(&map)
                    .into_iter()
                    .map(|p| (p, command.clone()))
                    .collect();
                let parts = self.send_each(plan);
                self.spawn_merge(merge::fanout_reply(how, parts, self.resp3));
            }
            Action::Scan => {
                let command = self.take_front(len);
                let Some(map) = self.map.clone() else {
                    self.push(Slot::Ready(self.encoded(&merge::no_map())));
                    return Ok(());
                };
                let primaries = merge::primaries(&map);
                let args = match self.parser.parse(&command) {
                    Ok(Some(_)) => (0..self.parser.argc())
                        .map(|i| self.parser.arg(&command, i))
                        .collect::<Vec<&[u8]>>(),
                    _ => return Err(io::ErrorKind::InvalidData.into()),
                };
                match merge::scan_plan(&args, &primaries) {
                    Ok((at, sent)) => {
                        ProxyMetrics::inc(&self.common.metrics.fanouts);
                        let node = primaries[at].clone();
                        let mut parts = self.send_each(vec![(node, sent)]);
                        let rx = parts.remove(0);
                        self.spawn_merge(merge::scan_reply(rx, at, primaries.len(), self.resp3));
                    }
                    Err(e) => self.push(Slot::Ready(e)),
                }
            }
            Action::Hello(version) => {
                self.skip_front(len);
                if let Some(v) = version {
                    let resp3 = v == 3;
                    if resp3 != self.resp3 {
                        // Connections speak one protocol: the session's own
                        // are opened again in the new one when next used.
                        self.resp3 = resp3;
                        self.own.clear();
                    }
                }
                let reply = self.hello_reply();
                self.push(Slot::Ready(reply));
            }
            Action::ClientName(Some(name)) => {
                self.skip_front(len);
                self.name = Some(name);
                self.push(Slot::Ready(Bytes::from_static(b"+OK\r\n")));
            }
            Action::ClientName(None) => {
                self.skip_front(len);
                let reply = match &self.name {
                    Some(name) => LocalReply::Bulk(name.clone()),
                    None => LocalReply::Null,
                };
                self.push(Slot::Ready(self.encoded(&reply)));
            }
            Action::Subscribe(node) => {
                // Sent as written once pinned: `pending` keeps it.
                let (to_read, rx) = oneshot::channel();
                let (common, resp3) = (self.common.clone(), self.resp3);
                let opening = tokio::spawn(async move { common.open(&node, false, resp3).await });
                self.push(Slot::Pin(rx));
                self.state = State::Pinning(AbortOnDropHandle::new(opening), Some(to_read));
            }
        }
        Ok(())
    }

    /// `HELLO`'s reply, as a cluster node gives it, in the protocol now in
    /// use (a map under RESP3: the session learns the switch from it).
    fn hello_reply(&self) -> Bytes {
        let text = |t: &str| LocalReply::Bulk(Bytes::copy_from_slice(t.as_bytes()));
        let version = crate::sync::read(&self.common.version).clone();
        let reply = LocalReply::Map(vec![
            (text("server"), text("redis")),
            (text("version"), text(&version)),
            (
                text("proto"),
                LocalReply::Integer(if self.resp3 { 3 } else { 2 }),
            ),
            (text("id"), LocalReply::Integer(self.id as i64)),
            (text("mode"), text("cluster")),
            (text("role"), text("master")),
            (text("modules"), LocalReply::Array(Vec::new())),
        ]);
        self.encoded(&reply)
    }

    /// The held transaction and `command` after it to `node` on the
    /// session's own lane: the node's replies to what was held dropped
    /// (lockgate answered those), the command's taking its place.
    fn release(&mut self, node: Node, command: Bytes) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        let skip = held.commands.len();
        held.commands.push(command);
        let (mut job, rx) = Job::new(held.commands, false);
        job.skip_front = skip;
        job.unread = Some(self.unread.clone());
        self.outbox.push_back((Lane::Own(node, false), job));
        self.push(Slot::Job(rx));
    }

    /// One job per `(node, command)` onto the outbox (plain lanes); their
    /// replies' receivers, in order.
    fn send_each(&mut self, plan: Vec<(String, Bytes)>) -> Vec<oneshot::Receiver<Vec<Part>>> {
        plan.into_iter()
            .map(|(node, command)| {
                let (job, rx) = Job::new(smallvec![command], true);
                // Merged replies are read as RESP2 and written in the
                // session's protocol.
                let lane = Lane::Shared(Node(self.common.intern(&node)), false);
                self.outbox.push_back((lane, job));
                rx
            })
            .collect()
    }

    /// Runs a merge away from the session; its reply takes the command's
    /// place.
    fn spawn_merge(&self, merged: impl Future<Output = Bytes> + Send + 'static) {
        let (done, rx) = oneshot::channel();
        let unread = self.unread.clone();
        tokio::spawn(async move {
            let parts = vec![Part::Reply(merged.await)];
            unread.add(&parts);
            let _ = done.send(parts);
        });
        self.push(Slot::Job(rx));
    }
}

impl AsyncWrite for ClusterWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        // Taken whole; sent by the flush that follows (or the next write).
        this.take_frames(buf.len());
        this.pending.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        match &mut this.state {
            State::Pinned(write) => write.poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    /// The client's half-close: what is whole is sent; the read side ends
    /// once every reply owed is in.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        match &mut this.state {
            State::Pinned(write) => write.poll_shutdown(cx),
            _ => {
                this.out = None;
                Poll::Ready(Ok(()))
            }
        }
    }
}

#[cfg(test)]
mod tests;
