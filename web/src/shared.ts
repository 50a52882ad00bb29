// One set of watch streams for all tabs of the origin. A browser allows six
// HTTP/1.1 connections per host and each watch stream holds one, so a
// seventh tab would never load. Instead one tab, the leader (elected with a
// Web Lock, which passes to another tab when it closes), holds one stream
// per task or session any tab follows, keeps what it received, and
// broadcasts each event to the tabs (BroadcastChannel). A tab that
// subscribes gets what the leader kept after its own cursor, then the live
// events; every tab applies each cursor once, so a new leader starting its
// streams from the beginning costs nothing but bandwidth.
//
// Tabs share only with tabs holding the same API token (the channel and the
// lock are named after a hash of it). Without BroadcastChannel or Web Locks
// each tab follows on its own.
import { fromBinary, toBinary } from "@bufbuild/protobuf";
import { follow, getToken, sessions, type WatchState } from "./api";
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
  stop: () => void;
  kept: { cursor: bigint; bytes: Uint8Array }[];
  state: WatchState;
  subs: Map<string, number>;
};

/** Runs the leader's side on `name` until the tab closes. */
function lead(name: string) {
  const ch = new BroadcastChannel(name);
  const streams = new Map<StreamKey, Stream>();
  const send = (m: Msg) => ch.postMessage(m);
  ch.onmessage = (ev: MessageEvent<Msg>) => {
    const m = ev.data;
    if (m.t === "sub") {
      let s = streams.get(m.key);
      if (!s) {
        const key = m.key;
        const stream: Stream = { stop: () => {}, kept: [], state: "reconnecting", subs: new Map() };
        streams.set(key, stream);
        stream.stop = follow(
          (after, signal) => open(key, after, signal),
          (e) => cursorOf(key, e),
          (e) => {
            const bytes = toBinary(EventSchema, e);
            const cursor = cursorOf(key, e);
            stream.kept.push({ cursor, bytes });
            send({ t: "ev", key, cursor: cursor.toString(), bytes });
          },
          (state) => {
            stream.state = state;
            send({ t: "state", key, state });
          },
        );
        s = stream;
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
    for (const [key, s] of streams) {
      for (const [tab, seen] of s.subs) if (now - seen > 3 * HEARTBEAT_MS) s.subs.delete(tab);
      if (s.subs.size === 0) {
        s.stop();
        streams.delete(key);
      }
    }
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
