//! TLS test helpers: certificates made with rcgen into a temp dir, a real
//! redis-server with only a TLS port, and a TLS client.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::{cmd, frame_len, free_port, WAIT};

/// A CA and the files of certificates it signed, in a temp dir.
pub struct Pki {
    pub dir: tempfile::TempDir,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

/// A certificate and its key, as files.
#[derive(Clone)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    /// A fresh CA named `name`.
    pub fn new(name: &str) -> Pki {
        let ca_key = KeyPair::generate().expect("ca key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = params.self_signed(&ca_key).expect("ca cert");
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = Pki { dir, ca, ca_key };
        std::fs::write(pki.ca_file(), pki.ca.pem()).expect("write ca");
        pki
    }

    /// The CA certificate's file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A certificate for localhost and 127.0.0.1 (server and client use),
    /// common name `cn`, written as `<file>.pem` / `<file>.key`.
    pub fn issue(&self, file: &str, cn: &str) -> Issued {
        self.issue_with(file, cn, |_| {})
    }

    /// [`Pki::issue`] with the parameters changed by `tweak` (validity,
    /// say).
    pub fn issue_with(
        &self,
        file: &str,
        cn: &str,
        tweak: impl FnOnce(&mut CertificateParams),
    ) -> Issued {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        tweak(&mut params);
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("sign");
        let issued = Issued {
            cert: self.dir.path().join(format!("{file}.pem")),
            key: self.dir.path().join(format!("{file}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).expect("write cert");
        std::fs::write(&issued.key, key.serialize_pem()).expect("write key");
        issued
    }
}

/// A path as the configuration wants it.
pub fn s(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// A TLS client configuration trusting `ca`, presenting `cert` if given.
pub fn client_config(ca: &Path, cert: Option<&Issued>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).expect("ca file") {
        roots.add(c.expect("ca pem")).expect("add root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let config = match cert {
        None => builder.with_no_client_auth(),
        Some(c) => {
            let chain = CertificateDer::pem_file_iter(&c.cert)
                .expect("cert")
                .collect::<Result<Vec<_>, _>>()
                .expect("cert pem");
            let key = PrivateKeyDer::from_pem_file(&c.key).expect("key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client cert")
        }
    };
    Arc::new(config)
}

/// A TLS connection speaking RESP.
pub struct TlsClient {
    pub stream: TlsStream<TcpStream>,
    buf: BytesMut,
}

impl TlsClient {
    /// Connects to `addr` and completes the handshake (within [`WAIT`]).
    pub async fn connect(
        addr: impl tokio::net::ToSocketAddrs,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<TlsClient> {
        let tcp = tokio::time::timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect in time")?;
        let name = ServerName::try_from("localhost").expect("name");
        let connector = tokio_rustls::TlsConnector::from(config);
        let stream = tokio::time::timeout(WAIT, connector.connect(name, tcp))
            .await
            .expect("handshake in time")?;
        Ok(TlsClient {
            stream,
            buf: BytesMut::new(),
        })
    }

    /// The server's leaf certificate.
    pub fn peer_cert(&self) -> Vec<u8> {
        self.stream
            .get_ref()
            .1
            .peer_certificates()
            .expect("peer certificates")[0]
            .to_vec()
    }

    /// Sends a command and reads its reply as text; `Err` when the
    /// connection fails or closes first (within [`WAIT`]).
    pub async fn try_call(&mut self, args: &[&str]) -> std::io::Result<String> {
        self.stream.write_all(&cmd(args)).await?;
        self.stream.flush().await?;
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(len) = frame_len(&self.buf) {
                let frame = self.buf.split_to(len);
                return Ok(String::from_utf8_lossy(&frame).into_owned());
            }
            self.buf.reserve(4096);
            let read = tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf))
                .await
                .expect("a reply or a close in time")?;
            if read == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// [`TlsClient::try_call`] that must succeed.
    pub async fn call(&mut self, args: &[&str]) -> String {
        self.try_call(args).await.expect("reply")
    }
}

/// A real redis-server with only a TLS port (`--port 0`), killed by PID on
/// drop.
pub struct TlsRedis {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    /// Serves TLS with `server`'s certificate; with `auth_clients`, clients
    /// must present a certificate signed by `ca`.
    pub async fn start(ca: &Path, server: &Issued, auth_clients: bool) -> TlsRedis {
        for _ in 0..5 {
            let port = free_port();
            let dir = tempfile::tempdir().expect("tempdir");
            let child = Command::new("redis-server")
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--tls-cert-file", &s(&server.cert)])
                .args(["--tls-key-file", &s(&server.key)])
                .args(["--tls-ca-cert-file", &s(ca)])
                .args([
                    "--tls-auth-clients",
                    if auth_clients { "yes" } else { "no" },
                ])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            let mut redis = TlsRedis {
                port,
                child,
                _dir: dir,
            };
            let config = client_config(ca, Some(server));
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = redis.child.try_wait() {
                    break;
                }
                if let Ok(mut c) = TlsClient::connect(("127.0.0.1", port), config.clone()).await {
                    if c.try_call(&["PING"]).await.ok().as_deref() == Some("+PONG\r\n") {
                        return redis;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = redis.child.kill();
            let _ = redis.child.wait();
        }
        panic!("redis-server with TLS did not start (built without TLS?)");
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
