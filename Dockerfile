# syntax=docker/dockerfile:1
#
# tollgate container image.
#
#   docker build -t tollgate .
#   docker run --rm -p 8080:8080 \
#     -v "$PWD/my-tollgate.toml:/etc/tollgate/tollgate.toml:ro" \
#     -v "$PWD/my-rules:/etc/tollgate/rules:ro" tollgate
#   docker run --rm -v ...same mounts... tollgate check      # validate a config, exit 1 on problems
#
# Paths: the config is /etc/tollgate/tollgate.toml and the rules directory
# /etc/tollgate/rules (mount your own over both; the rules directory is
# watched and hot-reloaded, ConfigMap symlink swaps included). The working
# directory is /etc/tollgate, so `tollgate` and `tollgate check` find the
# config without --config. The built-in config is the repository's
# tollgate.toml and rules/, which keep the admin listener on 127.0.0.1: to
# let Prometheus scrape from outside the container, set
# `admin = "0.0.0.0:9090"` in your config and do not publish 9090 publicly.
#
# Ports: 8080 proxy, 9090 admin (/metrics /healthz /readyz /rules).
# The HEALTHCHECK asks http://127.0.0.1:9090/healthz; if your config moves
# the admin port, override it (docker run --health-cmd, or the orchestrator's
# own probe). Logs are JSON lines on stderr (TOLLGATE_LOG_FORMAT=text for
# plain text; RUST_LOG=info,tollgate=debug for a line per rejected request).

# ---- build ---------------------------------------------------------------
FROM rust:1-bookworm AS builder
# The release build is profile-guided (scripts/release): an instrumented
# tollgate is trained under load first, which takes wrk, Redis, curl,
# python3, h2load and openssl in the build stage, two release builds and
# about a minute.
# `--build-arg PGO=0` builds with plain `cargo build --release` instead
# (the same code; more CPU per request, see docs/benchmarks.md).
ARG PGO=1
RUN if [ "$PGO" = 1 ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends wrk redis-server redis-tools curl python3 nghttp2-client openssl \
      && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src
# The whole source tree, filtered by .dockerignore (Cargo.toml names bench
# targets, so cargo needs more than src/ to read the manifest).
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    if [ "$PGO" = 1 ]; then \
      scripts/release --out /usr/local/bin/tollgate; \
    else \
      cargo build --release --locked --bin tollgate \
      && cp target/release/tollgate /usr/local/bin/tollgate; \
    fi

# The demo upstream of the examples (used by examples/docker-compose.yml:
# `docker build --target demo-upstream`). Not part of the default image.
FROM builder AS demo-build
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --example demo_upstream \
    && cp target/release/examples/demo_upstream /usr/local/bin/demo_upstream

FROM debian:bookworm-slim AS demo-upstream
COPY --from=demo-build /usr/local/bin/demo_upstream /usr/local/bin/demo_upstream
USER 65534:65534
EXPOSE 9001
ENTRYPOINT ["/usr/local/bin/demo_upstream"]
CMD ["--addr", "0.0.0.0:9001"]

# ---- runtime (the default target) ----------------------------------------
FROM debian:bookworm-slim AS runtime
# curl for the HEALTHCHECK; ca-certificates for a rediss:// store URL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tollgate \
    && useradd --system --uid 10001 --gid tollgate --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin tollgate
COPY --from=builder /usr/local/bin/tollgate /usr/local/bin/tollgate
COPY tollgate.toml /etc/tollgate/tollgate.toml
COPY rules /etc/tollgate/rules
WORKDIR /etc/tollgate
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
ENV TOLLGATE_LOG_FORMAT=json \
    RUST_LOG=info
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
    CMD curl -fsS -o /dev/null http://127.0.0.1:9090/healthz || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["--config", "/etc/tollgate/tollgate.toml"]
