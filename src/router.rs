//! The router: a pure function from a parsed command and the session's view
//! of its connection to a [`Route`]. It decides, it does nothing; the session
//! carries the decision out. This is the seam where later layers intercept
//! commands on lock keys: today every command is forwarded.

use crate::command::CommandKind;

/// How many replies Redis will send for a forwarded command, as far as the
/// session must know to keep lockgate's own replies in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly one reply.
    One,
    /// No reply (`*0`, a blank inline line).
    Nothing,
    /// One reply, whose type tells whether the connection now speaks RESP3.
    Hello,
    /// From this command on, replies cannot be counted (subscribed mode,
    /// MONITOR, CLIENT REPLY OFF, replication): bytes are copied as they come
    /// until a `RESET` resynchronises the stream.
    EnterRaw,
    /// `RESET`: one reply; afterwards the connection speaks RESP2 again, and
    /// if replies were not being counted, its `+RESET` reply marks where
    /// counting starts again.
    Reset,
}

/// What to do with one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Send the client's own bytes to the primary.
    Forward(Expect),
}

/// What the router knows about the connection (kept by the session).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionView {
    /// Replies are not being counted (see [`Expect::EnterRaw`]).
    pub raw: bool,
    /// Inside `MULTI`: Redis queues commands and answers `+QUEUED`.
    pub in_multi: bool,
}

/// Decides the route of one non-empty command of kind `kind`.
pub fn route(kind: CommandKind, view: &SessionView) -> Route {
    let expect = if kind == CommandKind::Reset {
        Expect::Reset
    } else if view.raw {
        Expect::Nothing
    } else {
        match kind {
            CommandKind::Subscribe
            | CommandKind::Monitor
            | CommandKind::ClientReplyOff
            | CommandKind::Sync => Expect::EnterRaw,
            CommandKind::Hello if !view.in_multi => Expect::Hello,
            _ => Expect::One,
        }
    };
    Route::Forward(expect)
}

impl SessionView {
    /// The view after `kind` was routed with `expect`.
    pub fn after(self, kind: CommandKind, expect: Expect) -> SessionView {
        let mut next = self;
        match expect {
            Expect::EnterRaw => next.raw = true,
            Expect::Reset => next.raw = false,
            _ => {}
        }
        match kind {
            CommandKind::Multi => next.in_multi = true,
            CommandKind::Exec | CommandKind::Discard | CommandKind::Reset => next.in_multi = false,
            _ => {}
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribe_goes_raw_until_reset() {
        let v = SessionView::default();
        let Route::Forward(e) = route(CommandKind::Subscribe, &v);
        assert_eq!(e, Expect::EnterRaw);
        let v = v.after(CommandKind::Subscribe, e);
        let Route::Forward(e) = route(CommandKind::Other, &v);
        assert_eq!(e, Expect::Nothing);
        let Route::Forward(e) = route(CommandKind::Reset, &v);
        assert_eq!(e, Expect::Reset);
        assert_eq!(v.after(CommandKind::Reset, e), SessionView::default());
    }

    #[test]
    fn multi_tracking() {
        let v = SessionView::default().after(CommandKind::Multi, Expect::One);
        assert!(v.in_multi);
        assert_eq!(route(CommandKind::Hello, &v), Route::Forward(Expect::One));
        assert!(!v.after(CommandKind::Exec, Expect::One).in_multi);
    }
}
