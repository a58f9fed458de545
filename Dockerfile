# syntax=docker/dockerfile:1
#
# idemproxy and the mock booking service, in a runtime image without a shell.
#
#   docker build -t idemproxy .
#   docker run --rm -p 8080:8080 -v "$PWD/config.yaml:/etc/idemproxy/config.yaml:ro" idemproxy
#
# The configuration must listen on 0.0.0.0 (or [::]) to be reachable, and put `admin_listen`
# on port 9090 for the HEALTHCHECK below (see deploy/idemproxy.yaml and docs/operations.md).

ARG RUST_VERSION=1

# ---- Build stage -----------------------------------------------------------------------------
# `--release` (Cargo.toml): whole-program LTO and one codegen unit, the code the load bench
# measures and what `cargo install` builds.
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src

# 1. Dependencies only, cached as long as the manifests and Cargo.lock do not change.
#    The manifest names bench (and maybe test and example) targets whose files are not in the
#    build context (.dockerignore lets in only what the binaries need), and Cargo refuses a
#    manifest whose declared target files are missing. So the [[bench]], [[test]] and
#    [[example]] sections are dropped from the image's copy of the manifest (dependencies,
#    including dev-dependencies, stay, so Cargo.lock still matches and --locked holds), and
#    the library, both binaries and the mock crate (mock/, a workspace member both binaries
#    depend on) get stub sources. The test harness (harness/, a workspace member and a
#    dev-dependency) is never built here: its manifest and an empty stub keep the workspace
#    and Cargo.lock whole.
COPY Cargo.toml Cargo.lock ./
COPY mock/Cargo.toml ./mock/
COPY harness/Cargo.toml ./harness/
RUN set -eu; \
    awk '/^\[/ { skip = ($0 ~ /^\[\[(bench|test|example)\]\]/) } !skip' Cargo.toml > Cargo.toml.bins; \
    mv Cargo.toml.bins Cargo.toml; \
    mkdir -p src/bin/mock-upstream mock/src harness/src; \
    : > src/lib.rs; \
    : > mock/src/lib.rs; \
    : > harness/src/lib.rs; \
    echo 'fn main() {}' > src/main.rs; \
    echo 'fn main() {}' > src/bin/mock-upstream/main.rs; \
    cargo build --release --locked --bins; \
    rm -rf src mock/src

# 2. The real sources. COPY keeps the files' own modification times, which can be older than
#    the stub build above: touch them, or Cargo would take the stubs' artifacts as up to date.
COPY src ./src
COPY mock/src ./mock/src
RUN set -eu; \
    find src mock/src -name '*.rs' -exec touch {} +; \
    cargo build --release --locked --bins; \
    ./target/release/idemproxy --version | grep -q '^idemproxy '; \
    ./target/release/mock-upstream --help | grep -q 'mock'

# ---- Runtime stage ---------------------------------------------------------------------------
# Distroless: glibc, libgcc, CA certificates (/etc/ssl/certs) and a `nonroot` user (65532);
# no shell, no package manager. Both are Debian 12 (bookworm), like the build stage, so the
# binaries find the glibc they were linked against. TLS (https upstreams, rediss://) uses
# rustls with the Mozilla roots compiled in; the system CA bundle is there for
# `store.ca_file`/`upstreams.*.ca_file` pointing at it, and for anything added later.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY --from=build /src/target/release/mock-upstream /usr/local/bin/mock-upstream
COPY config.example.yaml /etc/idemproxy/config.example.yaml

# Never root: uid/gid 65532 ("nonroot" in the distroless image). Nothing is written to disk,
# so the root filesystem can be mounted read-only.
USER 65532:65532

# 8080: the proxy (`listen`). 9090: the admin listener (`admin_listen`: /healthz, /readyz,
# /metrics, /keys) — publish it only on a private network.
EXPOSE 8080 9090

# Exec form, no shell: the binary itself asks the admin listener's GET /healthz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/idemproxy", "health", "--admin", "http://127.0.0.1:9090"]

# SIGTERM starts the graceful drain (up to `shutdown_timeout`); give `docker stop -t` more.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idemproxy"]
CMD ["--config", "/etc/idemproxy/config.yaml"]
