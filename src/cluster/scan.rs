//! `SCAN` over a cluster: every primary in turn, with a cursor that says
//! where the walk is. The client's cursor carries the primary's place in
//! the walk (its top 10 bits: up to 1 024 primaries) and that primary's
//! own cursor (the other 54: Redis's cursors stay under 2⁵⁴ for tables of
//! fewer than 2⁵⁴ buckets). A primary's `0` moves on to the next one; the
//! last one's `0` is the client's `0`: the walk is done. The primaries are
//! walked in their address order, so a walk resumed after the map was
//! read again goes on where it was while the primaries stay the same.

/// Bits of the client's cursor for the primary's own cursor.
const NODE_BITS: u32 = 54;

/// Most primaries a walk can carry.
pub const MAX_PRIMARIES: usize = 1 << (64 - NODE_BITS);

/// Where a walk is: the primary's place and its own cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Index of the primary in address order.
    pub primary: usize,
    /// That primary's own cursor.
    pub cursor: u64,
}

/// The place a client's `cursor` stands for; `None` when it cannot be one
/// of lockgate's (Redis answers such a cursor `invalid cursor`).
pub fn place(cursor: u64, primaries: usize) -> Option<Place> {
    let primary = (cursor >> NODE_BITS) as usize;
    (primary < primaries.max(1)).then_some(Place {
        primary,
        cursor: cursor & ((1 << NODE_BITS) - 1),
    })
}

/// The client's cursor after the primary at `at` answered `next` (its own
/// next cursor): the same primary further on, the next primary from its
/// start, or `0` when the last one is done. `None` if `next` is too large
/// to carry (a table of 2⁵⁴ buckets or more).
pub fn next_cursor(at: usize, next: u64, primaries: usize) -> Option<u64> {
    if next >> NODE_BITS != 0 || primaries > MAX_PRIMARIES {
        return None;
    }
    Some(match (next, at + 1 < primaries) {
        (0, true) => ((at + 1) as u64) << NODE_BITS,
        (0, false) => 0,
        (n, _) => ((at as u64) << NODE_BITS) | n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A walk over three primaries, each answering two cursors then 0.
    #[test]
    fn a_walk_visits_every_primary_and_ends_at_zero() {
        let mut cursor = 0;
        let mut visited = Vec::new();
        for _ in 0..20 {
            let p = place(cursor, 3).expect("a cursor of ours");
            visited.push((p.primary, p.cursor));
            // Each primary: 0 → 5 → 9 → 0.
            let next = match p.cursor {
                0 => 5,
                5 => 9,
                _ => 0,
            };
            cursor = next_cursor(p.primary, next, 3).expect("carried");
            if cursor == 0 {
                break;
            }
        }
        assert_eq!(
            visited,
            [
                (0, 0),
                (0, 5),
                (0, 9),
                (1, 0),
                (1, 5),
                (1, 9),
                (2, 0),
                (2, 5),
                (2, 9)
            ]
        );
        assert_eq!(cursor, 0);
    }

    #[test]
    fn cursors_out_of_reach_are_said() {
        assert_eq!(place(3 << NODE_BITS, 3), None);
        assert_eq!(
            place(7, 1),
            Some(Place {
                primary: 0,
                cursor: 7
            })
        );
        assert_eq!(next_cursor(0, 1 << NODE_BITS, 3), None);
        assert_eq!(next_cursor(0, 0, MAX_PRIMARIES + 1), None);
        assert_eq!(next_cursor(2, 0, 3), Some(0));
    }
}
