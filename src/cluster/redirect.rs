//! A cluster node's redirections: `-MOVED slot host:port` (the slot lives
//! elsewhere now: refresh the map, send there) and `-ASK slot host:port`
//! (the slot is migrating: send this one command there, after `ASKING`).

/// Where a node redirected a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// `ASK` (this command only) rather than `MOVED`.
    pub ask: bool,
    /// The key's slot.
    pub slot: u16,
    /// `HOST:PORT` of the node to ask (an empty host: the node that
    /// redirected, on that port, as Redis sends when it knows no endpoint).
    pub addr: String,
}

/// The redirection `reply` says, if it is one. `from`: the address of the
/// node that answered (for a redirection that names no host).
pub fn redirect(reply: &[u8], from: &str) -> Option<Redirect> {
    let (ask, rest) = if let Some(rest) = reply.strip_prefix(b"-MOVED ") {
        (false, rest)
    } else {
        (true, reply.strip_prefix(b"-ASK ")?)
    };
    let text = std::str::from_utf8(rest).ok()?.trim_end();
    let (slot, addr) = text.split_once(' ')?;
    let slot: u16 = slot.parse().ok().filter(|&s| s < super::slot::SLOTS)?;
    let (host, port) = addr.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let addr = match host {
        "" => {
            let from_host = from.rsplit_once(':').map_or(from, |(h, _)| h);
            format!("{from_host}:{port}")
        }
        _ => addr.to_string(),
    };
    Some(Redirect { ask, slot, addr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirections_are_read_as_redis_sends_them() {
        let moved = redirect(b"-MOVED 3999 127.0.0.1:6381\r\n", "127.0.0.1:6380");
        assert_eq!(
            moved,
            Some(Redirect {
                ask: false,
                slot: 3999,
                addr: "127.0.0.1:6381".into()
            })
        );
        let ask = redirect(b"-ASK 12182 10.0.0.2:7002\r\n", "x:1").unwrap();
        assert!(ask.ask);
        assert_eq!((ask.slot, ask.addr.as_str()), (12182, "10.0.0.2:7002"));
        // No endpoint known: the port on the redirecting node's host.
        let bare = redirect(b"-MOVED 1 :7003\r\n", "10.0.0.9:7000").unwrap();
        assert_eq!(bare.addr, "10.0.0.9:7003");
        let v6 = redirect(b"-MOVED 5 ::1:7003\r\n", "x:1").unwrap();
        assert_eq!(v6.addr, "::1:7003");
        for not in [
            &b"-ERR MOVED 1 h:1\r\n"[..],
            b"-MOVED 16384 h:1\r\n",
            b"-MOVED x h:1\r\n",
            b"-MOVED 1 h\r\n",
            b"+OK\r\n",
        ] {
            assert_eq!(
                redirect(not, "x:1"),
                None,
                "{}",
                String::from_utf8_lossy(not)
            );
        }
    }
}
