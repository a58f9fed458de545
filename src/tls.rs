//! TLS material, read and checked at load: the listener's certificate chain and key (`tls:`),
//! and the roots each upstream trusts (`upstreams.*.ca_file`, else the Mozilla set).
//!
//! Everything is parsed and assembled into rustls configurations during validation, so
//! `--check` reports an unreadable file, a file without a certificate or a key that does not
//! match its certificate, and serving only clones an `Arc`.
//!
//! Every configuration names the ring provider itself instead of relying on rustls's
//! process-wide default: that default is chosen from crate features, and becomes ambiguous (a
//! panic at the first connection) as soon as any dependency enables a second provider.

use std::fmt;
use std::io::Read;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

/// What the listener offers in ALPN, h2 first so that a client able to speak it does. hyper's
/// auto builder serves both whatever was negotiated: it tells them apart by the preface.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

/// The largest PEM file read: a full public CA bundle is about 250 KB. The bound keeps a
/// mistaken path (a device, a log file) from being read whole at start.
const MAX_PEM_BYTES: u64 = 4 * 1024 * 1024;

fn read(path: &str) -> Result<Vec<u8>, String> {
    let cannot = |e: std::io::Error| format!("cannot read {path}: {e}");
    let mut pem = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_BYTES + 1).read_to_end(&mut pem))
        .map_err(cannot)?;
    if pem.len() as u64 > MAX_PEM_BYTES {
        return Err(format!(
            "{path} is larger than {} MiB: not a PEM file",
            MAX_PEM_BYTES / 1024 / 1024
        ));
    }
    Ok(pem)
}

/// A SHA-256 over DER items, each length-prefixed: what a configuration compares to tell
/// whether the material its files held has changed (a reload that renews a certificate under
/// the same file name is a change).
fn digest<'a>(items: impl IntoIterator<Item = &'a [u8]>) -> [u8; 32] {
    let mut h = Sha256::new();
    for item in items {
        h.update((item.len() as u64).to_be_bytes());
        h.update(item);
    }
    h.finalize().into()
}

/// Every certificate in a PEM file, in order; at least one.
fn certificates(path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, pem::Error>>()
        .map_err(|e| format!("{path} is not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "no certificate in {path}: expected PEM (-----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(certs)
}

/// The first private key in a PEM file: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
fn private_key(path: &str) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "no private key in {path}: expected an unencrypted PEM key (-----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY)"
        ),
        e => format!("{path} is not valid PEM: {e}"),
    })
}

/// Which file of the `tls:` section an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsFile {
    /// `tls.cert_file`.
    Cert,
    /// `tls.key_file`.
    Key,
}

/// The listener's TLS: a certificate chain and its key, offering h2 and http/1.1.
#[derive(Clone)]
pub struct ServerTls {
    cert_file: String,
    key_file: String,
    /// [`digest`] of the chain and the key, for [`PartialEq`].
    material: [u8; 32],
    config: Arc<ServerConfig>,
}

/// Equal when both name the same files and read the same chain and key from them.
impl PartialEq for ServerTls {
    fn eq(&self, other: &ServerTls) -> bool {
        self.cert_file == other.cert_file
            && self.key_file == other.key_file
            && self.material == other.material
    }
}

impl ServerTls {
    /// Reads and checks both files. Every problem found is returned, each with its file: an
    /// unreadable file, no certificate, no key, a key that does not match the first
    /// certificate.
    pub(crate) fn load(
        cert_file: &str,
        key_file: &str,
    ) -> Result<ServerTls, Vec<(TlsFile, String)>> {
        let chain = certificates(cert_file).map_err(|m| (TlsFile::Cert, m));
        let key = private_key(key_file).map_err(|m| (TlsFile::Key, m));
        let (chain, key) = match (chain, key) {
            (Ok(chain), Ok(key)) => (chain, key),
            (chain, key) => return Err(chain.err().into_iter().chain(key.err()).collect()),
        };
        let material = digest(chain.iter().map(|c| c.as_ref()).chain([key.secret_der()]));
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| vec![(TlsFile::Cert, format!("cannot set up TLS: {e}"))])?;
        // `with_single_cert` parses the key and compares its public half with the first
        // certificate's, so a mismatched pair is refused here rather than at the first
        // handshake.
        let mut config = builder
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| {
                vec![match e {
                    rustls::Error::InconsistentKeys(_) => (
                        TlsFile::Key,
                        format!(
                            "the key in {key_file} does not match the certificate in {cert_file}"
                        ),
                    ),
                    rustls::Error::InvalidCertificate(e) => (
                        TlsFile::Cert,
                        format!("the first certificate in {cert_file} is invalid: {e}"),
                    ),
                    e => (
                        TlsFile::Key,
                        format!("the key in {key_file} cannot be used: {e}"),
                    ),
                }]
            })?;
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(ServerTls {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            material,
            config: Arc::new(config),
        })
    }

    /// An acceptor over this configuration (cheap: it shares it).
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.clone())
    }
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

/// What an upstream's TLS trusts: the certificates of `ca_file` when it is set — and then only
/// those, so a private upstream is reached only with a certificate its own CA issued — or else
/// the Mozilla root set (webpki-roots).
#[derive(Clone)]
pub struct ClientTls {
    ca_file: Option<String>,
    /// [`digest`] of the roots `ca_file` held (`None`: the Mozilla set), for [`PartialEq`].
    material: Option<[u8; 32]>,
    config: Arc<ClientConfig>,
}

/// Equal when both trust the same roots: the Mozilla set, or the same certificates read from
/// the same file.
impl PartialEq for ClientTls {
    fn eq(&self, other: &ClientTls) -> bool {
        self.ca_file == other.ca_file && self.material == other.material
    }
}

impl ClientTls {
    /// The Mozilla roots.
    pub(crate) fn public_roots() -> Result<ClientTls, String> {
        let roots = RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        ClientTls::with_roots(None, None, roots)
    }

    /// The certificates of a PEM file (one or more), instead of the Mozilla roots.
    pub(crate) fn private_roots(ca_file: &str) -> Result<ClientTls, String> {
        let mut roots = RootCertStore::empty();
        let certs = certificates(ca_file)?;
        let material = digest(certs.iter().map(|c| c.as_ref()));
        for (i, cert) in certs.into_iter().enumerate() {
            roots.add(cert).map_err(|e| {
                format!(
                    "certificate {} in {ca_file} cannot be a trusted root: {e}",
                    i + 1
                )
            })?;
        }
        ClientTls::with_roots(Some(ca_file.to_owned()), Some(material), roots)
    }

    fn with_roots(
        ca_file: Option<String>,
        material: Option<[u8; 32]>,
        roots: RootCertStore,
    ) -> Result<ClientTls, String> {
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(ClientTls {
            ca_file,
            material,
            config: Arc::new(config),
        })
    }

    /// The file the roots came from (`None`: the Mozilla set).
    pub fn ca_file(&self) -> Option<&str> {
        self.ca_file.as_deref()
    }

    /// A copy of the configuration, for a connector (which sets its own ALPN on it).
    pub(crate) fn client_config(&self) -> ClientConfig {
        (*self.config).clone()
    }
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}
