// Clients of sessiond's API over gRPC-web, on the page's own origin.
import { Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";
import { SessionService } from "./gen/sessiond/v1/session_service_pb";
import { WorkspaceService } from "./gen/sessiond/v1/workspace_service_pb";
import { Health } from "./gen/grpc/health/v1/health_pb";
import type { Event } from "./gen/sessiond/v1/events_pb";

const TOKEN_KEY = "sessiond.token";

// The API token lives in sessionStorage: this tab only, gone when it closes.
export function getToken(): string {
  return sessionStorage.getItem(TOKEN_KEY) ?? "";
}
export function setToken(token: string) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

const auth: Interceptor = (next) => (req) => {
  const token = getToken();
  if (token) req.header.set("authorization", `Bearer ${token}`);
  return next(req);
};

const transport = createGrpcWebTransport({
  baseUrl: location.origin,
  interceptors: [auth],
});

export const sessions = createClient(SessionService, transport);
export const workspace = createClient(WorkspaceService, transport);
export const health = createClient(Health, transport);

/** The stable reason sessiond puts in `sessiond-error` metadata. */
export function reason(err: unknown): string {
  if (err instanceof ConnectError) return err.metadata.get("sessiond-error") ?? "";
  return "";
}

export function describe(err: unknown): string {
  if (err instanceof ConnectError) {
    const r = reason(err);
    return `${Code[err.code]}${r ? ` (${r})` : ""}: ${err.rawMessage}`;
  }
  return String(err);
}

export function isUnauthenticated(err: unknown): boolean {
  return err instanceof ConnectError && err.code === Code.Unauthenticated;
}

/** `missing`: the task or session does not exist (or its id is malformed): nothing to wait for. */
export type WatchState = "live" | "reconnecting" | "unauthenticated" | "missing";

/** NOT_FOUND or INVALID_ARGUMENT: what was asked for does not exist; retrying cannot help. */
export function isMissing(err: unknown): boolean {
  return err instanceof ConnectError && (err.code === Code.NotFound || err.code === Code.InvalidArgument);
}

/**
 * Follows a watch stream forever: on any end (OK, UNAVAILABLE at shutdown,
 * a dropped connection) it subscribes again after the last cursor it
 * applied, so nothing is missed and nothing is applied twice.
 */
export function follow(
  open: (after: bigint, signal: AbortSignal) => AsyncIterable<Event>,
  cursor: (e: Event) => bigint,
  onEvent: (e: Event) => void,
  onState: (s: WatchState) => void,
): () => void {
  const abort = new AbortController();
  let last = 0n;
  let attempt = 0;
  (async () => {
    while (!abort.signal.aborted) {
      if (attempt > 0) {
        onState("reconnecting");
        await new Promise((r) => setTimeout(r, Math.min(250 * 2 ** (attempt - 1), 2000)));
        if (abort.signal.aborted) return;
        try {
          // The server answers again (SERVING or not): subscribe anew.
          await health.check({}, { signal: abort.signal, timeoutMs: 2000 });
        } catch {
          attempt++;
          continue;
        }
      }
      onState("live");
      try {
        for await (const e of open(last, abort.signal)) {
          const c = cursor(e);
          if (c <= last) continue;
          last = c;
          attempt = 0;
          onEvent(e);
        }
      } catch (err) {
        if (abort.signal.aborted) return;
        if (isUnauthenticated(err)) {
          onState("unauthenticated");
          return;
        }
        if (isMissing(err)) {
          onState("missing");
          return;
        }
      }
      attempt++;
    }
  })();
  return () => abort.abort();
}
