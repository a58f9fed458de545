//! A test CA and a server certificate it signed (127.0.0.1, localhost), made with rcgen: for
//! TLS on the proxy's listener, an `https://` upstream and a `rediss://` store.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

/// A test CA and a server certificate it signed, as PEM files in a directory of their own.
pub struct Pki {
    dir: tempfile::TempDir,
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server certificate (127.0.0.1, localhost).
    pub cert: PathBuf,
    /// The server certificate's key.
    pub key: PathBuf,
}

impl Default for Pki {
    /// A fresh CA and server certificate ([`Pki::new`]).
    fn default() -> Pki {
        Pki::new()
    }
}

impl Pki {
    /// A test CA, and a server certificate for 127.0.0.1 and localhost it signed.
    pub fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "idemproxy test CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");
        let key = KeyPair::generate().expect("server key");
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("server params")
            .signed_by(&key, &ca)
            .expect("server certificate");
        let dir = tempfile::tempdir().expect("temp dir");
        let pki = Pki {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
            dir,
        };
        std::fs::write(&pki.ca, ca.pem()).expect("write ca.pem");
        std::fs::write(&pki.cert, cert.pem()).expect("write cert.pem");
        std::fs::write(&pki.key, key.serialize_pem()).expect("write key.pem");
        pki
    }

    /// Writes `text` to a file of this directory and returns its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).expect("write a test file");
        path
    }
}
