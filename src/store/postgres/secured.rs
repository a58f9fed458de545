//! TLS to PostgreSQL, through rustls: the roots of `store.ca_file` when it is set (and then
//! only those), else the Mozilla set (webpki-roots), and always a verified certificate.
//!
//! Whether a connection uses TLS is the URL's `sslmode` (tokio-postgres reads it): `disable`,
//! or no `sslmode` at all, never sends a TLS request; `prefer` uses TLS when the server offers
//! it; `require` (and libpq's `verify-ca` / `verify-full`, read as `require` at load) refuses a
//! server without it. The connector is built the same way in every case: with `disable` it is
//! simply never asked.
//!
//! The configuration names the ring provider itself, as `crate::tls` does, rather than rely on
//! rustls's process-wide default (ambiguous as soon as a dependency enables a second one).

use std::sync::Arc;

use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// The connector for every connection of the pool.
pub(super) fn connector(ca_pem: Option<&[u8]>) -> Result<MakeRustlsConnect, String> {
    Ok(MakeRustlsConnect::new(client_config(ca_pem)?))
}

/// The rustls client configuration: `ca_pem`'s certificates as the only roots, or the Mozilla
/// roots.
fn client_config(ca_pem: Option<&[u8]>) -> Result<ClientConfig, String> {
    let roots = match ca_pem {
        None => RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        },
        Some(pem) => private_roots(pem)?,
    };
    Ok(
        ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS for PostgreSQL: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Every certificate of `store.ca_file` (checked for a PEM header at load), as roots.
fn private_roots(pem: &[u8]) -> Result<RootCertStore, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, pem::Error>>()
        .map_err(|e| format!("store.ca_file is not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err("store.ca_file holds no certificate".into());
    }
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|e| {
            format!(
                "certificate {} of store.ca_file cannot be a trusted root: {e}",
                i + 1
            )
        })?;
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
    use tokio_rustls::TlsAcceptor;
    use tokio_rustls::rustls::ServerConfig;
    use tokio_rustls::rustls::pki_types::PrivateKeyDer;

    /// A CA (its PEM) and a certificate for 127.0.0.1 it signed, with the key.
    fn pki() -> (String, CertificateDer<'static>, PrivateKeyDer<'static>) {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");
        let key = KeyPair::generate().expect("server key");
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("server params")
            .signed_by(&key, &ca)
            .expect("server certificate");
        let key = PrivateKeyDer::try_from(key.serialize_der()).expect("server key DER");
        (ca.pem(), cert.der().clone(), key)
    }

    /// A TLS server on loopback that answers one byte to whoever completes a handshake.
    async fn tls_server(
        cert: CertificateDer<'static>,
        key: PrivateKeyDer<'static>,
    ) -> std::net::SocketAddr {
        let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .expect("server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    if let Ok(mut tls) = acceptor.accept(tcp).await {
                        let _ = tls.write_all(b"!").await;
                        let _ = tls.flush().await;
                    }
                });
            }
        });
        addr
    }

    /// A handshake through the connector, as tokio-postgres makes it, then one byte read.
    async fn handshake(
        connector: &mut MakeRustlsConnect,
        addr: std::net::SocketAddr,
    ) -> std::io::Result<u8> {
        let tcp = TcpStream::connect(addr).await?;
        let Ok(connect) = <MakeRustlsConnect as MakeTlsConnect<TcpStream>>::make_tls_connect(
            connector,
            "127.0.0.1",
        );
        let mut tls = connect.connect(tcp).await?;
        tls.read_u8().await
    }

    #[tokio::test]
    async fn the_connector_trusts_the_ca_of_ca_file_and_verifies_the_server() {
        let (ca_pem, cert, key) = pki();
        let addr = tls_server(cert, key).await;

        let mut private = connector(Some(ca_pem.as_bytes())).expect("connector");
        assert_eq!(
            handshake(&mut private, addr).await.expect("handshake"),
            b'!'
        );

        // The Mozilla roots do not know the test CA: the certificate is refused, not ignored.
        let mut public = connector(None).expect("connector");
        let refused = handshake(&mut public, addr)
            .await
            .expect_err("unknown issuer");
        assert!(
            refused.to_string().to_lowercase().contains("issuer"),
            "{refused}"
        );

        // Another CA's file: refused as well.
        let (other_ca, _, _) = pki();
        let mut other = connector(Some(other_ca.as_bytes())).expect("connector");
        assert!(handshake(&mut other, addr).await.is_err());
    }

    #[test]
    fn a_ca_file_without_a_usable_certificate_is_an_error() {
        let garbage =
            b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n";
        assert!(connector(Some(garbage)).is_err());
        assert!(connector(Some(b"no pem here")).is_err());
    }
}
