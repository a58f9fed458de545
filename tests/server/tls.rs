//! TLS at both ends: an `https://` upstream behind a private CA (`upstreams.*.ca_file`), and TLS
//! on the proxy's own listener (`tls:`), with `X-Forwarded-Proto` following the listener.
//!
//! Every certificate is made by the test with rcgen: a CA, and a server certificate for
//! 127.0.0.1 and localhost signed by it. The upstream is the bundled mock booking service behind
//! a TLS-terminating relay written here (so it counts side effects as in every other test); the
//! TLS client is hyper's, trusting the test CA.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::pki::Pki;
use harness::{Env, ProxyProcess, TestProxy, book, eventually, write_config};
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemproxy::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};

/// What the TLS tests do with a [`Pki`].
trait TlsPki {
    fn listener_yaml(&self) -> String;
    fn server_config(&self) -> ServerConfig;
    fn client(&self, h2: bool) -> Client<HttpsConnector<HttpConnector>, Full<Bytes>>;
}

impl TlsPki for Pki {
    /// The `tls:` section that serves this server certificate.
    fn listener_yaml(&self) -> String {
        format!(
            "tls:\n  cert_file: {}\n  key_file: {}\n",
            self.cert.display(),
            self.key.display()
        )
    }

    /// A rustls server configuration for this server certificate, made here rather than by the
    /// code under test.
    fn server_config(&self) -> ServerConfig {
        let chain = CertificateDer::pem_file_iter(&self.cert)
            .expect("open cert.pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("cert.pem");
        let key = tokio_rustls::rustls::pki_types::PrivateKeyDer::from_pem_file(&self.key)
            .expect("key.pem");
        let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("server config");
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }

    /// A TLS client that trusts this CA. With `h2`, it offers h2 and http/1.1 in ALPN and
    /// speaks whichever the server picks; without, HTTP/1.1 only.
    fn client(&self, h2: bool) -> Client<HttpsConnector<HttpConnector>, Full<Bytes>> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).expect("open ca.pem") {
            roots.add(cert.expect("ca.pem")).expect("a root");
        }
        let config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_only();
        let connector = if h2 {
            builder.enable_all_versions().build()
        } else {
            builder.enable_http1().build()
        };
        Client::builder(TokioExecutor::new()).build(connector)
    }
}

/// A TLS-terminating relay in front of `to`: the mock upstream, reached over https.
async fn tls_relay(pki: &Pki, to: SocketAddr) -> SocketAddr {
    let acceptor = TlsAcceptor::from(Arc::new(pki.server_config()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that refuses the certificate ends here, before anything is relayed.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut up) = TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                }
            });
        }
    });
    addr
}

/// A response read whole.
struct Got {
    status: StatusCode,
    version: Version,
    headers: http::HeaderMap,
    body: Bytes,
}

/// `POST https://{addr}/bookings` with a key and a JSON body.
async fn book_tls(
    client: &Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    addr: SocketAddr,
    key: &str,
    body: &str,
) -> Got {
    let req = Request::post(format!("https://{addr}/bookings"))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10s")
        .expect("https request");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("read body").to_bytes();
    Got {
        status: parts.status,
        version: parts.version,
        headers: parts.headers,
        body,
    }
}

/// The proxy's file with its upstream at `https://{relay}` trusting `ca_file` (none: `None`).
fn https_upstream(env: &Env, relay: SocketAddr, ca_file: Option<&Path>) -> String {
    let mut up = format!("url: https://{relay}");
    if let Some(ca) = ca_file {
        up.push_str(&format!("\n    ca_file: {}", ca.display()));
    }
    env.config("")
        .replace(&format!("url: {}", env.mock.url()), &up)
}

// ---------------------------------------------------------------------------------------------
// An https upstream behind a private CA.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_with_a_private_ca_is_forwarded_to_and_replayed() {
    let pki = Pki::new();
    let env = Env::new(harness::Backend::Memory).await;
    let relay = tls_relay(&pki, env.mock.addr()).await;
    let proxy = TestProxy::start(&https_upstream(&env, relay, Some(&pki.ca))).await;

    let first = book(&proxy, "tls-up-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(first.status, 201, "body: {:?}", first.body);
    assert_eq!(env.mock.calls("tls-up-1"), 1);
    let again = book(&proxy, "tls-up-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body, "the replay is byte-identical");
    assert_eq!(env.mock.calls("tls-up-1"), 1, "the upstream ran it once");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_the_proxy_does_not_trust_is_unavailable_and_the_key_stays_free() {
    let pki = Pki::new();
    let env = Env::new(harness::Backend::Memory).await;
    let relay = tls_relay(&pki, env.mock.addr()).await;
    // No ca_file: the Mozilla roots, which never issued the test CA's certificates.
    let proxy = TestProxy::start(&https_upstream(&env, relay, None)).await;

    let first = book(&proxy, "tls-up-2", r#"{"seat":"12A"}"#).await;
    let doc = first.assert_problem(502, "upstream-unavailable");
    let detail = doc["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("UnknownIssuer"),
        "the detail says why: {detail}"
    );
    // Nothing was sent, so the claim was released: the retry runs again (and fails again)
    // instead of replaying a saved 502 or finding the key in flight.
    let again = book(&proxy, "tls-up-2", r#"{"seat":"12A"}"#).await;
    again.assert_problem(502, "upstream-unavailable");
    assert_eq!(again.header("idempotent-replayed"), "");
    assert_eq!(env.mock.total(), 0, "nothing reached the upstream");
    proxy.stop().await;
}

/// An https upstream that reads the ClientHello and never answers it (a TLS terminator that
/// has stopped serving) until `answering` is set; from then on, a TLS-terminating relay to
/// `to`, like [`tls_relay`]. Counts the connections it held silent.
async fn silent_tls_upstream(
    pki: &Pki,
    to: SocketAddr,
    answering: Arc<std::sync::atomic::AtomicBool>,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    let acceptor = TlsAcceptor::from(Arc::new(pki.server_config()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = held.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            if !answering.load(Ordering::SeqCst) {
                count.fetch_add(1, Ordering::SeqCst);
                // Reads the ClientHello and whatever follows, answers nothing, until the
                // client gives up.
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(1..) = tcp.read(&mut buf).await {}
                });
                continue;
            }
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut up) = TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                }
            });
        }
    });
    (addr, held)
}

/// SPEC §4.4: a TLS handshake that does not finish within `connect_timeout` sent nothing: the
/// claim is released and the client gets `502 upstream-unavailable` at the connect timeout, on
/// an idempotent route and a pass-through one alike; once the upstream answers, the retry runs
/// once. (`connect_timeout` covered the TCP connect only: the handshake hung until the
/// response `timeout`, and the `504` was saved and replayed though nothing had been sent.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_handshake_that_hangs_is_released_as_a_502_never_saved_as_a_504() {
    use std::sync::atomic::Ordering;
    let pki = Pki::new();
    let env = Env::new(harness::Backend::Memory).await;
    let answering = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (upstream, held) = silent_tls_upstream(&pki, env.mock.addr(), answering.clone()).await;
    let yaml = https_upstream(&env, upstream, Some(&pki.ca)).replace(
        "    connect_timeout: 1s\n    timeout: 5s\n",
        "    connect_timeout: 500ms\n    timeout: 3s\n",
    );
    assert!(
        yaml.contains("timeout: 3s"),
        "the harness's upstream lines moved"
    );
    let proxy = TestProxy::start(&yaml).await;

    for attempt in 0..2 {
        let started = Instant::now();
        let r = book(&proxy, "tls-silent", r#"{"seat":"12A"}"#).await;
        let doc = r.assert_problem(502, "upstream-unavailable");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains("connect_timeout"),
            "attempt {attempt}: {detail}"
        );
        assert_eq!(
            r.header("idempotent-replayed"),
            "",
            "attempt {attempt}: not saved"
        );
        assert!(
            started.elapsed() < Duration::from_millis(2500),
            "attempt {attempt}: at the connect timeout, before the response timeout ({:?})",
            started.elapsed()
        );
    }
    let passed = harness::send(harness::client().get(proxy.url("/inventory"))).await;
    passed.assert_problem(502, "upstream-unavailable");
    assert!(
        held.load(Ordering::SeqCst) >= 3,
        "the handshakes reached the upstream"
    );
    assert_eq!(env.mock.total(), 0, "nothing reached the service");

    answering.store(true, Ordering::SeqCst);
    let now = book(&proxy, "tls-silent", r#"{"seat":"12A"}"#).await;
    assert_eq!(now.status, 201, "the retry runs: {:?}", now.body);
    assert_eq!(now.header("idempotent-replayed"), "");
    let again = book(&proxy, "tls-silent", r#"{"seat":"12A"}"#).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, now.body);
    assert_eq!(env.mock.calls("tls-silent"), 1, "the upstream ran it once");
    proxy.stop().await;
}

// ---------------------------------------------------------------------------------------------
// TLS on the listener.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_listener_forwards_and_replays_over_http1_and_h2() {
    let pki = Pki::new();
    let env = Env::new(harness::Backend::Memory).await;
    let proxy = TestProxy::start(&format!("{}{}", pki.listener_yaml(), env.config(""))).await;

    for (h2, key) in [(false, "tls-listen-1"), (true, "tls-listen-2")] {
        let client = pki.client(h2);
        let first = book_tls(&client, proxy.addr, key, r#"{"seat":"1A"}"#).await;
        assert_eq!(first.status, StatusCode::CREATED, "body: {:?}", first.body);
        let want = if h2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        assert_eq!(first.version, want, "h2: {h2}");
        let seen = env.mock.last_request().expect("the upstream saw it");
        assert_eq!(seen.headers["x-forwarded-proto"], "https");

        let again = book_tls(&client, proxy.addr, key, r#"{"seat":"1A"}"#).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.headers["idempotent-replayed"], "true");
        assert_eq!(again.body, first.body, "the replay is byte-identical");
        assert_eq!(env.mock.calls(key), 1, "the upstream ran it once");
    }
    proxy.stop().await;

    // The same upstream behind a plain listener is told `http`.
    let plain = TestProxy::start(&env.config("")).await;
    let reply = book(&plain, "tls-listen-3", r#"{"seat":"1A"}"#).await;
    assert_eq!(reply.status, 201);
    let seen = env.mock.last_request().expect("the upstream saw it");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    plain.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_is_closed_within_header_read_timeout_and_blocks_no_one() {
    let pki = Pki::new();
    let env = Env::new(harness::Backend::Memory).await;
    let yaml = format!(
        "{}limits:\n  header_read_timeout: 1500ms\n{}",
        pki.listener_yaml(),
        env.config("")
    );
    let proxy = TestProxy::start(&yaml).await;
    let opened = Instant::now();
    // One client says nothing; another sends the first bytes of a ClientHello and stops.
    let mut silent = TcpStream::connect(proxy.addr).await.expect("connect");
    let mut partial = TcpStream::connect(proxy.addr).await.expect("connect");
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .expect("write");

    // Meanwhile a well-behaved client is served at once: the handshakes run in their
    // connections' own tasks, not in the accept loop.
    let served = book_tls(
        &pki.client(false),
        proxy.addr,
        "tls-stall",
        r#"{"seat":"2B"}"#,
    )
    .await;
    assert_eq!(served.status, StatusCode::CREATED);
    assert!(
        opened.elapsed() < Duration::from_millis(1500),
        "served while the stalled handshakes were pending, in {:?}",
        opened.elapsed()
    );

    for (what, stream) in [("silent", &mut silent), ("partial", &mut partial)] {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(8), stream.read(&mut buf)).await;
        let closed_after = opened.elapsed();
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "{what}: the proxy closes the connection ({read:?})"
        );
        assert!(
            closed_after >= Duration::from_millis(1400) && closed_after < Duration::from_secs(5),
            "{what}: closed after {closed_after:?}, expected about 1.5s"
        );
    }
    proxy.stop().await;
}

#[tokio::test]
async fn the_proxy_logs_its_https_address() {
    let pki = Pki::new();
    let yaml = format!(
        "{}listen: 127.0.0.1:0\nupstreams:\n  booking:\n    url: http://127.0.0.1:9\nroutes:\n  - name: rest\n    path: /*\n    upstream: booking\n",
        pki.listener_yaml()
    );
    let proxy = ProxyProcess::spawn(&yaml);
    let want = format!("https://{}", proxy.addr);
    let logged = eventually(Duration::from_secs(5), || proxy.log().contains(&want)).await;
    assert!(logged, "no {want} in the log:\n{}", proxy.log());
}

// ---------------------------------------------------------------------------------------------
// Files that are refused at load (the simple rows — missing files, garbage — are in
// tests/cli/config.rs; these need real certificates).

const BASE: &str = "listen: 127.0.0.1:8080
upstreams:
  booking:
    url: https://127.0.0.1:8443
routes:
  - name: rest
    path: /*
    upstream: booking
";

/// The errors of a file that must be refused, as `path: message` lines.
fn refused(yaml: &str) -> Vec<String> {
    match Config::from_yaml(yaml) {
        Ok(_) => panic!("this configuration must be refused:\n{yaml}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

fn listener(cert: &Path, key: &Path) -> String {
    format!(
        "tls:\n  cert_file: {}\n  key_file: {}\n{BASE}",
        cert.display(),
        key.display()
    )
}

fn ca_file(ca: &Path) -> String {
    BASE.replace(
        "url: https://127.0.0.1:8443\n",
        &format!(
            "url: https://127.0.0.1:8443\n    ca_file: {}\n",
            ca.display()
        ),
    )
}

/// Asserts one error starts with `field: ` and contains every word.
fn assert_error(errors: &[String], field: &str, words: &[&str]) {
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with(&format!("{field}: ")) && words.iter().all(|w| e.contains(w))),
        "no {field} error containing {words:?} in {errors:#?}"
    );
}

#[test]
fn tls_files_are_checked_at_load() {
    let pki = Pki::new();
    let other = Pki::new();

    // The good files load, at both ends; cert and key may share one file.
    let c = Config::from_yaml(&listener(&pki.cert, &pki.key)).expect("a valid listener");
    assert!(c.tls.is_some());
    assert_eq!(c.upstreams["booking"].forwarded_proto.as_str(), "https");
    let both = pki.file(
        "both.pem",
        &format!(
            "{}{}",
            std::fs::read_to_string(&pki.cert).expect("cert"),
            std::fs::read_to_string(&pki.key).expect("key")
        ),
    );
    Config::from_yaml(&listener(&both, &both)).expect("one file with the chain and the key");
    let c = Config::from_yaml(&ca_file(&pki.ca)).expect("a valid ca_file");
    assert_eq!(
        c.upstreams["booking"].tls.ca_file(),
        pki.ca.to_str(),
        "the CA file is the upstream's trust"
    );
    assert_eq!(c.upstreams["booking"].forwarded_proto.as_str(), "http");

    // A key that is not the certificate's.
    let errors = refused(&listener(&pki.cert, &other.key));
    assert_error(&errors, "tls.key_file", &["does not match", "cert.pem"]);
    // The files swapped: no certificate in the one, no key in the other.
    let errors = refused(&listener(&pki.key, &pki.cert));
    assert_error(&errors, "tls.cert_file", &["no certificate", "key.pem"]);
    assert_error(&errors, "tls.key_file", &["no private key", "cert.pem"]);
    // PEM markers around garbage.
    let garbage = pki.file(
        "garbage.pem",
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
    );
    assert_error(
        &refused(&listener(&garbage, &pki.key)),
        "tls.cert_file",
        &["not valid PEM"],
    );
    // Well-formed PEM around bytes that are no certificate.
    let not_der = pki.file(
        "not-der.pem",
        "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
    );
    assert_error(
        &refused(&listener(&not_der, &pki.key)),
        "tls.cert_file",
        &["invalid"],
    );
    assert_error(
        &refused(&ca_file(&not_der)),
        "upstreams.booking.ca_file",
        &["cannot be a trusted root"],
    );
    assert_error(
        &refused(&ca_file(&pki.key)),
        "upstreams.booking.ca_file",
        &["no certificate"],
    );
    // A path that is no file at all is not read whole.
    assert_error(
        &refused(&ca_file(Path::new("/dev/zero"))),
        "upstreams.booking.ca_file",
        &["larger than 4 MiB"],
    );
}

#[test]
fn check_names_the_tls_field_of_a_mismatched_key() {
    let pki = Pki::new();
    let other = Pki::new();
    let file = write_config(&listener(&pki.cert, &other.key));
    let out = Command::new(harness::binary())
        .arg("--check")
        .arg("--config")
        .arg(file.path())
        .output()
        .expect("run idemproxy --check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("tls.key_file: ") && stderr.contains("does not match"),
        "{stderr}"
    );
}
