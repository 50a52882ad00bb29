# The agentctl executor image, for users with a registry: agentctl, the demo
# ACP agent, git and a shell. `sessiond`'s Docker executor runs it as a
# non-root user with no capabilities, a read-only root filesystem and (by
# default) no network, the worktree at /workspace and its run directory at
# /run/sessiond, where agentctl listens on a Unix socket. Without a registry, `cargo xtask docker-image` builds the same
# image (`sessiond-agentctl:dev`) offline with `docker import`.
#
#   docker build -t sessiond-agentctl:dev .

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p agentctl -p acp-demo-agent

FROM debian:bookworm-slim
# safe.directory: worktrees are bind-mounted from the host and owned by its users.
RUN apt-get update \
 && apt-get install -y --no-install-recommends git ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && printf '[safe]\n\tdirectory = *\n' > /etc/gitconfig \
 && mkdir -p /workspace /run/sessiond
COPY --from=build /src/target/release/agentctl /src/target/release/acp-demo-agent /usr/local/bin/
ENV HOME=/root
WORKDIR /workspace
CMD ["/usr/local/bin/agentctl", "--help"]
