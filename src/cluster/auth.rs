//! A client's `AUTH` (or `HELLO … AUTH`) in front of a cluster. The
//! connections to the nodes are shared and already authenticated as
//! lockgate's own user (`upstream.username`/`password`), so a client's
//! credentials cannot be carried to them; what lockgate can do is check
//! them against its own, so an unchanged app that authenticates with the
//! same credentials lockgate was given (the common case: the app and its
//! sidecar configured with one Redis password) works, a wrong password is
//! refused as Redis refuses it, and another user is refused with the
//! reason. Pure, table-tested ([`check`]).

use crate::protocol::encode::LocalReply;

/// Redis's answer to a wrong password.
pub const WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

/// Redis's answer to `AUTH password` when the default user has none.
pub const NO_PASSWORD: &str = "ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?";

/// The answer to a client's `AUTH [user] pass` given lockgate's own
/// `user` (empty: `default`) and `pass` (empty: none): `Ok` when the
/// client named lockgate's credentials, else the error to send.
pub fn check(
    client_user: Option<&[u8]>,
    client_pass: &[u8],
    user: &str,
    pass: &str,
) -> Result<(), LocalReply> {
    let own_user = if user.is_empty() { "default" } else { user };
    let named = client_user.unwrap_or(b"default");
    if named != own_user.as_bytes() {
        return Err(LocalReply::err(format!(
            "lockgate: AUTH as '{}' is not served in front of a cluster: its connections to the nodes are shared and authenticated as '{own_user}' (upstream.username); authenticate with lockgate's credentials, or leave AUTH out (docs/cluster.md)",
            String::from_utf8_lossy(named)
        )));
    }
    if pass.is_empty() {
        // No password: `AUTH pass` is an error on Redis, `AUTH default
        // any` succeeds (a user without a password takes any).
        return match client_user {
            None => Err(LocalReply::Error(bytes::Bytes::from_static(
                NO_PASSWORD.as_bytes(),
            ))),
            Some(_) => Ok(()),
        };
    }
    match client_pass == pass.as_bytes() {
        true => Ok(()),
        false => Err(LocalReply::Error(bytes::Bytes::from_static(
            WRONGPASS.as_bytes(),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_lockgates_or_refused() {
        /// (client user, client password, lockgate's user, lockgate's
        /// password, Ok or the error's start)
        type Row<'a> = (
            Option<&'a str>,
            &'a str,
            &'a str,
            &'a str,
            Result<(), &'a str>,
        );
        let table: &[Row] = &[
            (None, "s3cret", "", "s3cret", Ok(())),
            (Some("default"), "s3cret", "", "s3cret", Ok(())),
            (None, "nope", "", "s3cret", Err("WRONGPASS")),
            (Some("app"), "pw", "app", "pw", Ok(())),
            (Some("app"), "bad", "app", "pw", Err("WRONGPASS")),
            (
                None,
                "pw",
                "app",
                "pw",
                Err("ERR lockgate: AUTH as 'default'"),
            ),
            (
                Some("other"),
                "pw",
                "app",
                "pw",
                Err("ERR lockgate: AUTH as 'other'"),
            ),
            (None, "x", "", "", Err("ERR AUTH <password> called")),
            (Some("default"), "x", "", "", Ok(())),
        ];
        for (i, (cu, cp, u, p, want)) in table.iter().enumerate() {
            let got = check(cu.map(str::as_bytes), cp.as_bytes(), u, p);
            match (want, got) {
                (Ok(()), Ok(())) => {}
                (Err(start), Err(LocalReply::Error(e))) => {
                    assert!(e.starts_with(start.as_bytes()), "row {i}: {e:?}")
                }
                (want, got) => panic!("row {i}: want {want:?}, got {got:?}"),
            }
        }
    }
}
