//! The pure rules of reading a cluster's slot map: when to read it again,
//! a rule of time alone ([`refresh_due`]), and how a server that does not
//! know `CLUSTER SHARDS` (before Redis 7) refuses it
//! ([`unknown_subcommand`]). The reading itself, on connections, is
//! `crate::upstream::cluster::topology`.

use std::time::{Duration, Instant};

/// Whether `reply` is a server's refusal of a `CLUSTER` subcommand it does
/// not know (`CLUSTER SHARDS` before Redis 7).
pub fn unknown_subcommand(reply: &[u8]) -> bool {
    reply.first() == Some(&b'-')
        && memchr::memmem::find(&reply.to_ascii_lowercase(), b"unknown subcommand").is_some()
}

/// Whether the slot map read at `last` is to be read again at `now`: every
/// `interval`, or at once after a redirection (`redirected`: a node
/// answered `MOVED`), but never twice within `min_gap` (a storm of
/// redirections reads it once per gap).
pub fn refresh_due(
    last: Instant,
    now: Instant,
    interval: Duration,
    min_gap: Duration,
    redirected: bool,
) -> bool {
    let since = now.saturating_duration_since(last);
    since >= min_gap && (redirected || since >= interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_is_read_again_on_time_or_after_a_redirection_not_faster() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // (ms since the last read, redirected) → due, with an interval of
        // 5 000 ms and a gap of 100 ms.
        for (since, redirected, due) in [
            (0, false, false),
            (0, true, false),
            (99, true, false),
            (100, true, true),
            (4_999, false, false),
            (5_000, false, true),
            (60_000, true, true),
        ] {
            assert_eq!(
                refresh_due(t0, t0 + ms(since), ms(5_000), ms(100), redirected),
                due,
                "{since} ms, redirected {redirected}"
            );
        }
        // A clock read before the last refresh is no time at all.
        assert!(!refresh_due(t0 + ms(10), t0, ms(5_000), ms(100), true));
    }

    #[test]
    fn an_unknown_subcommand_is_told_from_other_errors() {
        assert!(unknown_subcommand(
            b"-ERR Unknown subcommand or wrong number of arguments for 'SHARDS'. Try CLUSTER HELP.\r\n"
        ));
        assert!(unknown_subcommand(
            b"-ERR unknown subcommand 'shards'. Try CLUSTER HELP.\r\n"
        ));
        assert!(!unknown_subcommand(
            b"-ERR This instance has cluster support disabled\r\n"
        ));
        assert!(!unknown_subcommand(b"*0\r\n"));
    }
}
