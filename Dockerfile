# syntax=docker/dockerfile:1
# Build stage: the release binaries.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bin idemproxy --bin mock-upstream

# Runtime stage: a slim image, an unprivileged user, no shell tools needed.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin idemproxy
COPY --from=build /src/target/release/idemproxy /usr/local/bin/idemproxy
COPY --from=build /src/target/release/mock-upstream /usr/local/bin/mock-upstream
COPY config.example.yaml /etc/idemproxy/config.example.yaml
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/idemproxy"]
CMD ["--config", "/etc/idemproxy/config.yaml"]
