//! Commands framed once. The session's dispatcher parses every command it
//! reads; an upstream that looks at each command again (the shared
//! connections' framing, a cluster's routing by slot) would parse the same
//! bytes a second time. [`Frames`] carries what the first parse found,
//! where each whole command ends and where its arguments are, beside the
//! bytes (callgrind, `SET -c 50 -P 16` in front of a cluster: the second
//! parse and the gathering of its arguments were about 430 of 4 270
//! instructions per command).
//!
//! Frames describe a prefix of the bytes they are handed with, command by
//! command from the first byte; the commands after it (a lock command
//! lockgate rewrote, an inline one, an empty one) are framed again by the
//! reader, as before. A frame is used only where its bytes are (see
//! [`Frames::bytes`]), so a hint that does not line up is dropped, never
//! followed.

use std::ops::Range;

use smallvec::SmallVec;

/// Arguments of a command written from the stack in one copy; a command
/// with more is written word by word.
const INLINE_ARGS: usize = 8;

/// Whole commands of one stream, in order: per command its length, its
/// argument count and each argument's start and end, in bytes from the
/// command's start. Consumed from the front ([`Frames::pop`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Frames {
    words: Vec<u32>,
    /// The front command's first word in `words`.
    at: usize,
    /// Bytes the commands not popped take, in all.
    bytes: usize,
}

/// The front command of [`Frames`].
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// The command's length in bytes.
    pub len: usize,
    /// Start and end of each argument, in turn.
    bounds: &'a [u32],
}

impl Frame<'_> {
    /// Number of arguments, name included.
    pub fn argc(&self) -> usize {
        self.bounds.len() / 2
    }

    /// Every argument of the command at the front of `buf`, name first.
    pub fn args<'b>(&self, buf: &'b [u8]) -> SmallVec<[&'b [u8]; 8]> {
        (0..self.argc()).map(|i| self.arg(buf, i)).collect()
    }

    /// Argument `i` of the command at the front of `buf` (empty when out
    /// of range).
    pub fn arg<'b>(&self, buf: &'b [u8], i: usize) -> &'b [u8] {
        let (Some(&start), Some(&end)) = (self.bounds.get(2 * i), self.bounds.get(2 * i + 1))
        else {
            return &[];
        };
        buf.get(start as usize..end as usize).unwrap_or(&[])
    }
}

impl Frames {
    /// Adds the command of `len` bytes whose arguments are at `args`
    /// (from its start); false, and nothing added, for one past 4 GiB.
    pub fn push(&mut self, len: usize, args: &[Range<usize>]) -> bool {
        let Ok(n) = u32::try_from(len) else {
            return false;
        };
        // A parser's ranges rise: the last one inside the command puts
        // them all there (and `Frame::arg` checks each against the bytes).
        if args.last().is_some_and(|a| a.end > len) {
            return false;
        }
        if self.words.capacity() == 0 {
            // A pipeline's worth at once: a batch of 16 three-argument
            // commands takes 128 words.
            self.words.reserve(128);
        }
        // At most `len`, as every offset below.
        let argc = args.len() as u32;
        if args.len() <= INLINE_ARGS {
            // Written in one copy: pushing word by word checked the
            // capacity each time (callgrind: about 120 instructions per
            // command).
            let mut words = [0u32; 2 + 2 * INLINE_ARGS];
            words[0] = n;
            words[1] = argc;
            for (pair, a) in words[2..].chunks_exact_mut(2).zip(args) {
                pair[0] = a.start as u32;
                pair[1] = a.end as u32;
            }
            self.words.extend_from_slice(&words[..2 + 2 * args.len()]);
        } else {
            self.words.extend([n, argc]);
            (self.words).extend(args.iter().flat_map(|a| [a.start as u32, a.end as u32]));
        }
        self.bytes += len;
        true
    }

    /// Bytes the commands described take, in all: a reader holding
    /// exactly these bytes unframed may append more frames.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// True when no command is described.
    pub fn is_empty(&self) -> bool {
        self.at == self.words.len()
    }

    /// The front command.
    pub fn front(&self) -> Option<Frame<'_>> {
        let len = *self.words.get(self.at)? as usize;
        let argc = *self.words.get(self.at + 1)? as usize;
        let bounds = self.words.get(self.at + 2..self.at + 2 + 2 * argc)?;
        Some(Frame { len, bounds })
    }

    /// Drops the front command, which took `len` bytes; a `len` that is
    /// not the front command's drops every frame (they no longer line up
    /// with the bytes).
    pub fn pop(&mut self, len: usize) {
        match self.front() {
            Some(f) if f.len == len => {
                self.at += 2 + 2 * f.argc();
                self.bytes -= len;
                if self.is_empty() {
                    self.clear();
                }
            }
            _ => self.clear(),
        }
    }

    /// Takes `next`, the frames of a write of `written` bytes, after
    /// these, if they line up: these describe exactly the `held` bytes
    /// before the write, and `next` no more than the write. Frames that
    /// do not line up are dropped (the bytes are parsed instead).
    pub fn follow_with(&mut self, next: Frames, held: usize, written: usize) {
        if self.bytes != held || next.bytes > written {
            return;
        }
        match self.is_empty() {
            true => *self = next,
            false => self.append(&next),
        }
    }

    /// Appends `more`, which describe the bytes after these.
    pub fn append(&mut self, more: &Frames) {
        if self.is_empty() {
            self.clear();
        }
        self.words.extend_from_slice(&more.words[more.at..]);
        self.bytes += more.bytes;
    }

    /// Forgets every command.
    pub fn clear(&mut self) {
        self.words.clear();
        self.at = 0;
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_pop_in_order_and_drop_when_out_of_line() {
        let buf = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n";
        let mut f = Frames::default();
        assert!(f.push(20, &[8..11, 17..18]));
        assert!(f.push(14, std::slice::from_ref(&(8..12))));
        assert_eq!(f.bytes(), 34);
        let front = f.front().unwrap();
        assert_eq!((front.len, front.argc()), (20, 2));
        assert_eq!(front.arg(buf, 0), b"GET");
        assert_eq!(front.arg(buf, 1), b"k");
        assert_eq!(front.arg(buf, 2), b"");
        f.pop(20);
        let front = f.front().unwrap();
        assert_eq!(front.arg(&buf[20..], 0), b"PING");
        assert_eq!(f.bytes(), 14);
        let mut more = Frames::default();
        assert!(more.push(14, std::slice::from_ref(&(8..12))));
        f.append(&more);
        assert_eq!(f.bytes(), 28);
        // A length that is not the front's: every frame dropped.
        f.pop(13);
        assert!(f.is_empty());
        assert_eq!(f.bytes(), 0);
        assert!(f.front().is_none());
    }

    #[test]
    fn a_command_of_many_arguments_is_framed_as_one_of_few() {
        let args: Vec<Range<usize>> = (0..20).map(|i| 4 + 3 * i..5 + 3 * i).collect();
        let mut f = Frames::default();
        assert!(f.push(70, &args));
        assert!(f.push(10, &args[..1]));
        let front = f.front().unwrap();
        assert_eq!((front.len, front.argc()), (70, 20));
        let buf: Vec<u8> = (0..70u8).collect();
        assert_eq!(front.arg(&buf, 19), &[61u8][..]);
        f.pop(70);
        assert_eq!(f.front().unwrap().arg(&buf, 0), &[4u8][..]);
    }

    #[test]
    fn frames_follow_only_bytes_they_line_up_with() {
        let mut next = Frames::default();
        assert!(next.push(14, std::slice::from_ref(&(8..12))));
        let mut f = Frames::default();
        // Nothing held, the write as long as the frames: taken.
        f.follow_with(next.clone(), 0, 14);
        assert_eq!(f.bytes(), 14);
        // 14 held and framed, a longer write: taken after them.
        f.follow_with(next.clone(), 14, 20);
        assert_eq!(f.bytes(), 28);
        // Unframed bytes held before the write: dropped.
        f.follow_with(next.clone(), 30, 14);
        assert_eq!(f.bytes(), 28);
        // Frames longer than the write: dropped.
        f.follow_with(next, 28, 10);
        assert_eq!(f.bytes(), 28);
    }

    #[test]
    fn an_argument_outside_its_command_is_not_framed() {
        let mut f = Frames::default();
        assert!(!f.push(10, &[2..4, 8..12]));
        assert!(f.is_empty());
        assert_eq!(f.bytes(), 0);
    }
}
