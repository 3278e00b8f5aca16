//! A client's transaction on a cluster: `WATCH`, `MULTI` … `EXEC` run on
//! one node, so every key they name must be in one slot. The first key
//! named (by `WATCH` or a queued command) fixes the slot; a command with a
//! key elsewhere is refused as it is queued with Redis Cluster's own
//! `CROSSSLOT` error, and `EXEC` then aborts the whole transaction
//! (`EXECABORT`), as Redis does after a command refused at queue time.
//! A rule of events alone, table-tested ([`TxSlot::step`]).

/// What happens in a client's transaction, as far as slots go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// `WATCH` of keys in this slot (`Err`: its keys span slots).
    Watch(Result<u16, ()>),
    /// `MULTI`.
    Multi,
    /// A command inside `MULTI`: its keys' one slot (`Ok(None)`: no
    /// keys; `Err`: its keys span slots).
    Queue(Result<Option<u16>, ()>),
    /// `EXEC` or `DISCARD` (also `UNWATCH` outside `MULTI`, `RESET`).
    End,
}

/// The answer to an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Carry it out (in `Some(slot)`'s node when it names one).
    Go(Option<u16>),
    /// Refuse it with `CROSSSLOT`.
    CrossSlot,
    /// `EXEC` after a refusal: `EXECABORT`, nothing runs.
    Abort,
}

/// The slot a connection's transaction is bound to, and whether a
/// command of it was refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxSlot {
    /// The slot every key must be in (none named yet: `None`).
    pub slot: Option<u16>,
    /// Inside `MULTI`.
    pub in_multi: bool,
    /// A command was refused while queued: `EXEC` aborts.
    pub failed: bool,
}

impl TxSlot {
    /// The state after `event`, and what to do with it. `exec`: the event
    /// is `EXEC` (`End` for `DISCARD` and the rest).
    pub fn step(self, event: Event, exec: bool) -> (TxSlot, Verdict) {
        let bind = |slot: u16| match self.slot {
            None => Some(slot),
            Some(s) if s == slot => Some(s),
            Some(_) => None,
        };
        match event {
            Event::Watch(Err(())) => (self, Verdict::CrossSlot),
            Event::Watch(Ok(slot)) => match bind(slot) {
                Some(s) => (
                    TxSlot {
                        slot: Some(s),
                        ..self
                    },
                    Verdict::Go(Some(s)),
                ),
                None => (self, Verdict::CrossSlot),
            },
            Event::Multi => (
                TxSlot {
                    in_multi: true,
                    failed: false,
                    ..self
                },
                Verdict::Go(self.slot),
            ),
            Event::Queue(keys) => {
                let refused = TxSlot {
                    failed: true,
                    ..self
                };
                match keys {
                    Err(()) => (refused, Verdict::CrossSlot),
                    Ok(None) => (self, Verdict::Go(self.slot)),
                    Ok(Some(slot)) => match bind(slot) {
                        Some(s) => (
                            TxSlot {
                                slot: Some(s),
                                ..self
                            },
                            Verdict::Go(Some(s)),
                        ),
                        None => (refused, Verdict::CrossSlot),
                    },
                }
            }
            Event::End => {
                let verdict = match exec && self.in_multi && self.failed {
                    true => Verdict::Abort,
                    false => Verdict::Go(self.slot),
                };
                (TxSlot::default(), verdict)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences of events and what each gets, as a cluster answers them.
    #[test]
    fn a_transaction_stays_in_one_slot_as_on_a_cluster() {
        use Event::*;
        use Verdict::*;
        // (name, steps: event, is EXEC, verdict)
        type Steps<'a> = &'a [(Event, bool, Verdict)];
        let rows: &[(&str, Steps)] = &[
            (
                "MULTI SET a SET {a}x EXEC",
                &[
                    (Multi, false, Go(None)),
                    (Queue(Ok(Some(7))), false, Go(Some(7))),
                    (Queue(Ok(Some(7))), false, Go(Some(7))),
                    (End, true, Go(Some(7))),
                ],
            ),
            (
                "MULTI SET a SET b EXEC: refused, then aborted",
                &[
                    (Multi, false, Go(None)),
                    (Queue(Ok(Some(7))), false, Go(Some(7))),
                    (Queue(Ok(Some(9))), false, CrossSlot),
                    (End, true, Abort),
                ],
            ),
            (
                "WATCH a MULTI GET b: the watched slot binds",
                &[
                    (Watch(Ok(7)), false, Go(Some(7))),
                    (Multi, false, Go(Some(7))),
                    (Queue(Ok(Some(9))), false, CrossSlot),
                    (Queue(Ok(None)), false, Go(Some(7))),
                    (End, true, Abort),
                ],
            ),
            (
                "WATCH a b across slots, then a fresh transaction",
                &[
                    (Watch(Err(())), false, CrossSlot),
                    (Multi, false, Go(None)),
                    (Queue(Ok(Some(9))), false, Go(Some(9))),
                    (End, true, Go(Some(9))),
                ],
            ),
            (
                "MGET a b inside MULTI, then DISCARD: no abort, the next is fresh",
                &[
                    (Multi, false, Go(None)),
                    (Queue(Err(())), false, CrossSlot),
                    (End, false, Go(None)),
                    (Multi, false, Go(None)),
                    (Queue(Ok(Some(3))), false, Go(Some(3))),
                    (End, true, Go(Some(3))),
                ],
            ),
        ];
        for (name, steps) in rows {
            let mut tx = TxSlot::default();
            for (i, &(event, exec, want)) in steps.iter().enumerate() {
                let (next, got) = tx.step(event, exec);
                assert_eq!(got, want, "{name}, step {i}");
                tx = next;
            }
        }
    }
}
