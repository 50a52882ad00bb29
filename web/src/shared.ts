// One set of watch streams for all tabs of the origin. A browser allows six
// HTTP/1.1 connections per host, all tabs together, and each watch call
// holds one, so tabs on six sessions would leave no connection for calls.
// Instead one tab, the leader (elected with a Web Lock, which passes to
// another tab when it closes), follows every task or session any tab
// follows in one WatchMany call, keeps what it received, and broadcasts
// each event to the tabs (BroadcastChannel). A tab that
// subscribes gets what the leader kept after its own cursor, then the live
// events; every tab applies each cursor once, so a new leader starting its
// streams from the beginning costs nothing but bandwidth.
//
// Tabs share only with tabs holding the same API token (the channel and the
// lock are named after a hash of it). Without BroadcastChannel or Web Locks
// each tab follows on its own.
import { fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import { follow, getToken, health, isUnauthenticated, sessions, type WatchState } from "./api";
import { EventSchema, type Event } from "./gen/sessiond/v1/events_pb";

/** What a stream is: `task:<id>` or `session:<id>`. */
export type StreamKey = `task:${string}` | `session:${string}`;

// `tab` names one subscription (a tab may follow several streams).
type Msg =
  | { t: "sub"; tab: string; key: StreamKey; after: string }
  | { t: "unsub"; tab: string; key: StreamKey }
  | { t: "ev"; key: StreamKey; to?: string; cursor: string; bytes: Uint8Array }
  | { t: "state"; key: StreamKey; state: WatchState }
  | { t: "leader" };

/** A subscriber says it is alive this often; silent for 3 of them, dropped. */
const HEARTBEAT_MS = 5_000;

function open(key: StreamKey, after: bigint, signal: AbortSignal): AsyncIterable<Event> {
  const [kind, id] = key.split(":", 2) as ["task" | "session", string];
  return kind === "task"
    ? sessions.watchTask({ taskId: id, afterTaskSeq: after }, { signal })
    : sessions.watchSession({ sessionId: id, afterSeq: after }, { signal });
}

function cursorOf(key: StreamKey, e: Event): bigint {
  return key.startsWith("task:") ? e.taskSeq : e.seq;
}

/** FNV-1a of the token: names the channel without revealing the token. */
function tokenTag(): string {
  let h = 0x811c9dc5;
  for (const c of getToken()) {
    h ^= c.charCodeAt(0);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h.toString(16);
}

/** Ids of this tab's subscriptions (no crypto: works on a plain-http LAN address too). */
function newId(): string {
  return Math.random().toString(36).slice(2) + Date.now().toString(36);
}

const supported = typeof BroadcastChannel !== "undefined" && typeof navigator !== "undefined" && !!navigator.locks;
/** Channel names whose leadership this tab has asked for. */
const candidacies = new Set<string>();

type Stream = {
  kept: { cursor: bigint; bytes: Uint8Array }[];
  state: WatchState;
  subs: Map<string, number>;
  /** The last cursor received: where a new call resumes the stream. */
  last: bigint;
  /** Ended for good (deleted, or an id the server refuses): not asked again. */
  done: boolean;
};

/** Targets per WatchMany call (the server's limit). */
const MAX_TARGETS = 64;

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

function target(key: StreamKey, after: bigint) {
  const [kind, id] = key.split(":", 2) as ["task" | "session", string];
  return kind === "task" ? { taskId: id, after } : { sessionId: id, after };
}

/**
 * Runs the leader's side on `name` until the tab closes: every stream any
 * tab follows goes through one WatchMany call (up to 64 per call), so all
 * of the origin's tabs hold one connection for their streams however many
 * sessions they show, and the other five stay free for calls. The call is
 * made anew, from each stream's last cursor, when the set of streams
 * changes.
 */
function lead(name: string) {
  const ch = new BroadcastChannel(name);
  const streams = new Map<StreamKey, Stream>();
  const send = (m: Msg) => ch.postMessage(m);
  const setState = (key: StreamKey, s: Stream, state: WatchState) => {
    if (s.state === state) return;
    s.state = state;
    send({ t: "state", key, state });
  };
  let abort = new AbortController();
  let pending: ReturnType<typeof setTimeout> | undefined;
  // Coalesces the subscriptions of tabs opening together into one new call.
  const resubscribe = () => {
    if (pending !== undefined) return;
    pending = setTimeout(() => {
      pending = undefined;
      abort.abort();
      abort = new AbortController();
      const keys = [...streams].filter(([, s]) => !s.done).map(([k]) => k);
      for (let i = 0; i < keys.length; i += MAX_TARGETS) {
        void run(keys.slice(i, i + MAX_TARGETS), abort.signal);
      }
    }, 20);
  };
  // One call for `keys` until `signal` aborts, again after any end. A key
  // whose stream nobody follows any more (its tabs closed) is dropped from
  // `streams` meanwhile: it is done here too.
  const following = (k: StreamKey) => {
    const s = streams.get(k);
    return s !== undefined && !s.done ? s : undefined;
  };
  const run = async (keys: StreamKey[], signal: AbortSignal) => {
    let attempt = 0;
    while (!signal.aborted) {
      if (attempt > 0) {
        for (const k of keys) {
          const s = following(k);
          if (s) setState(k, s, "reconnecting");
        }
        await new Promise((r) => setTimeout(r, Math.min(250 * 2 ** (attempt - 1), 2000)));
        if (signal.aborted) return;
        try {
          await health.check({}, { signal, timeoutMs: 2000 });
        } catch {
          attempt++;
          continue;
        }
      }
      const live = keys.filter((k) => following(k) !== undefined);
      if (live.length === 0) return;
      for (const k of live) setState(k, streams.get(k)!, "live");
      try {
        const call = sessions.watchMany(
          { targets: live.map((k) => target(k, streams.get(k)!.last)) },
          { signal },
        );
        for await (const answer of call) {
          const key = live[answer.target];
          const s = key && streams.get(key);
          if (!key || !s) continue;
          if (answer.event) {
            const cursor = cursorOf(key, answer.event);
            if (cursor <= s.last) continue;
            s.last = cursor;
            attempt = 0;
            const bytes = toBinary(EventSchema, answer.event);
            s.kept.push({ cursor, bytes });
            send({ t: "ev", key, cursor: cursor.toString(), bytes });
          } else if (answer.ended) {
            // Deleted (NOT_FOUND): nothing more will come. Anything else
            // ends this call, which is made again.
            if (answer.ended.code === Code.NotFound) {
              s.done = true;
              setState(key, s, "missing");
            } else {
              break;
            }
          }
        }
      } catch (err) {
        if (signal.aborted) return;
        if (isUnauthenticated(err)) {
          for (const k of live) {
            const s = streams.get(k);
            if (s) setState(k, s, "unauthenticated");
          }
          return;
        }
        // An id the server refuses is named by its index; the others go on.
        const bad = err instanceof ConnectError && err.code === Code.InvalidArgument
          ? /targets\[(\d+)\]/.exec(err.rawMessage)
          : null;
        const refused = bad ? live[Number(bad[1])] : undefined;
        if (refused) {
          const s = streams.get(refused);
          if (s) {
            s.done = true;
            setState(refused, s, "missing");
          }
          continue;
        }
      }
      attempt++;
    }
  };
  ch.onmessage = (ev: MessageEvent<Msg>) => {
    const m = ev.data;
    if (m.t === "sub") {
      let s = streams.get(m.key);
      if (!s) {
        const id = m.key.split(":", 2)[1];
        const valid = UUID.test(id);
        s = { kept: [], state: valid ? "reconnecting" : "missing", subs: new Map(), last: 0n, done: !valid };
        streams.set(m.key, s);
        if (valid) resubscribe();
      }
      const fresh = !s.subs.has(m.tab);
      s.subs.set(m.tab, Date.now());
      if (fresh) {
        const after = BigInt(m.after);
        for (const k of s.kept) {
          if (k.cursor > after) send({ t: "ev", key: m.key, to: m.tab, cursor: k.cursor.toString(), bytes: k.bytes });
        }
        send({ t: "state", key: m.key, state: s.state });
      }
    } else if (m.t === "unsub") {
      streams.get(m.key)?.subs.delete(m.tab);
    }
  };
  // Streams nobody follows any more (tabs closed or moved on) end.
  setInterval(() => {
    const now = Date.now();
    let dropped = false;
    for (const [key, s] of streams) {
      for (const [tab, seen] of s.subs) if (now - seen > 3 * HEARTBEAT_MS) s.subs.delete(tab);
      if (s.subs.size === 0) {
        streams.delete(key);
        dropped ||= !s.done;
      }
    }
    if (dropped) resubscribe();
  }, HEARTBEAT_MS);
  send({ t: "leader" });
}

/**
 * Like `follow`, for a task's or a session's events, through the tabs'
 * shared streams when the browser allows it.
 */
export function followShared(
  key: StreamKey,
  onEvent: (e: Event) => void,
  onState: (s: WatchState) => void,
): () => void {
  if (!supported) {
    return follow(
      (after, signal) => open(key, after, signal),
      (e) => cursorOf(key, e),
      onEvent,
      onState,
    );
  }
  const name = `sessiond-streams:${tokenTag()}`;
  if (!candidacies.has(name)) {
    candidacies.add(name);
    // Held until the tab closes; then the next tab in line leads.
    void navigator.locks.request(name, () => new Promise<never>(() => lead(name)));
  }
  const ch = new BroadcastChannel(name);
  const me = newId();
  let last = 0n;
  let closed = false;
  const subscribe = () => ch.postMessage({ t: "sub", tab: me, key, after: last.toString() } satisfies Msg);
  ch.onmessage = (ev: MessageEvent<Msg>) => {
    const m = ev.data;
    if (closed) return;
    if (m.t === "leader") {
      subscribe();
    } else if (m.t === "ev" && m.key === key && (m.to === undefined || m.to === me)) {
      const cursor = BigInt(m.cursor);
      if (cursor <= last) return;
      last = cursor;
      onEvent(fromBinary(EventSchema, m.bytes));
    } else if (m.t === "state" && m.key === key) {
      onState(m.state);
    }
  };
  subscribe();
  const beat = setInterval(subscribe, HEARTBEAT_MS);
  return () => {
    closed = true;
    clearInterval(beat);
    ch.postMessage({ t: "unsub", tab: me, key } satisfies Msg);
    ch.close();
  };
}
