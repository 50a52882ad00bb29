import { Component } from "preact";
import { useCallback, useEffect, useMemo, useRef, useState } from "preact/hooks";
import { Code, ConnectError } from "@connectrpc/connect";
import { describe, getToken, isMissing, health, isUnauthenticated, reason, sessions, setToken, type WatchState } from "./api";
import { HealthCheckResponse_ServingStatus as Serving } from "./gen/grpc/health/v1/health_pb";
import { RecoveryStage, type AgentRecovery, type GetSessionStatusResponse } from "./gen/sessiond/v1/session_service_pb";
import type { Event } from "./gen/sessiond/v1/events_pb";
import {
  ExecutorStatus,
  MessageKind,
  MessageRole,
  ResumeReason,
  Runtime,
  SessionState,
  type AgentProfile,
  type Message,
  type TurnUsage,
  type UsageTotals,
  type PermissionRequest,
  type Session,
  type Task,
  type TerminalPart,
  type ToolCallPart,
  type AvailableCommand,
} from "./gen/sessiond/v1/types_pb";
import { executorLabel, executorTone, reasonLabel, roleLabel, runtimeName, stateLabel, stateTone } from "./labels";
import { Workspace } from "./workspace";
import { followShared } from "./shared";
import { Markdown } from "./markdown";
import { DiffView, PermissionPrompts } from "./permissions";

// ------------------------------------------------------------------ routing

type Route =
  | { name: "tasks" }
  | { name: "task"; taskId: string }
  | { name: "session"; taskId: string; sessionId: string };

function parseRoute(hash: string): Route {
  const parts = hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  if (parts[0] === "tasks" && parts[1] && parts[2] === "sessions" && parts[3])
    return { name: "session", taskId: parts[1], sessionId: parts[3] };
  if (parts[0] === "tasks" && parts[1]) return { name: "task", taskId: parts[1] };
  return { name: "tasks" };
}

export const taskHref = (t: string) => `#/tasks/${t}`;
export const sessionHref = (t: string, s: string) => `#/tasks/${t}/sessions/${s}`;

function useRoute(): Route {
  const [route, setRoute] = useState(() => parseRoute(location.hash));
  useEffect(() => {
    const on = () => setRoute(parseRoute(location.hash));
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return route;
}

// -------------------------------------------------------------- auth state

let onAuthFailure: () => void = () => {};
/** Reports UNAUTHENTICATED to the app (which shows sign-in); true if it was. */
export function authFailed(err: unknown): boolean {
  if (!isUnauthenticated(err)) return false;
  onAuthFailure();
  return true;
}

// ------------------------------------------------------------------- shell

type Backend = "serving" | "recovering" | "unreachable" | "unknown";

function useBackendHealth(): Backend {
  const [state, setState] = useState<Backend>("unknown");
  useEffect(() => {
    let stopped = false;
    let timer = 0;
    const poll = async () => {
      let next: Backend;
      try {
        const r = await health.check({}, { timeoutMs: 3000 });
        next = r.status === Serving.SERVING ? "serving" : "recovering";
      } catch {
        next = "unreachable";
      }
      if (stopped) return;
      setState(next);
      timer = window.setTimeout(poll, next === "serving" ? 5000 : 1000);
    };
    poll();
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }, []);
  return state;
}

export function App() {
  const route = useRoute();
  // A new page moves focus to its heading, so keyboard and screen reader
  // users start there (as a page load would).
  const where = JSON.stringify(route);
  useEffect(() => {
    const frame = requestAnimationFrame(() => {
      const h1 = document.querySelector<HTMLElement>("main h1");
      if (!h1) return;
      h1.tabIndex = -1;
      h1.focus({ preventScroll: true });
    });
    return () => cancelAnimationFrame(frame);
  }, [where]);
  const [signIn, setSignIn] = useState<"none" | "needed">("none");
  const [generation, setGeneration] = useState(0);
  const backend = useBackendHealth();
  onAuthFailure = () => setSignIn("needed");

  const submitToken = (token: string) => {
    setToken(token);
    setSignIn("none");
    setGeneration((g) => g + 1);
  };

  return (
    <div class="shell">
      <header class="top">
        <a class="brand" href="#/">sessiond</a>
        <nav aria-label="breadcrumb" class="crumbs">
          {route.name !== "tasks" && <a href="#/">Tasks</a>}
          {route.name === "session" && <a href={taskHref(route.taskId)}>Task</a>}
        </nav>
        <button type="button" class="link" onClick={() => setSignIn("needed")}>
          {getToken() ? "Change API token" : "API token"}
        </button>
      </header>
      {backend === "recovering" && (
        <div class="banner warn" role="status" data-testid="banner-recovering">
          sessiond is recovering its sessions; they will be back in a moment.
        </div>
      )}
      {backend === "unreachable" && (
        <div class="banner warn" role="status" data-testid="banner-unreachable">
          Cannot reach sessiond; reconnecting…
        </div>
      )}
      <main key={generation}>
        {signIn === "needed" ? (
          <SignIn onSubmit={submitToken} onCancel={getToken() ? () => setSignIn("none") : undefined} />
        ) : route.name === "tasks" ? (
          <TasksView />
        ) : route.name === "task" ? (
          <TaskView taskId={route.taskId} backend={backend} />
        ) : (
          <SessionView key={route.sessionId} taskId={route.taskId} sessionId={route.sessionId} backend={backend} />
        )}
      </main>
    </div>
  );
}

function SignIn(props: { onSubmit: (t: string) => void; onCancel?: () => void }) {
  const [token, setTokenText] = useState("");
  const had = getToken();
  return (
    <form
      class="card signin"
      onSubmit={(e) => {
        e.preventDefault();
        props.onSubmit(token.trim());
      }}
    >
      <h1>Sign in</h1>
      <p role="alert" data-testid="signin-message">
        {had
          ? "sessiond rejected this API token (UNAUTHENTICATED). Enter a valid token."
          : "This sessiond needs an API token (SESSIOND_API_TOKENS)."}
      </p>
      <label>
        API token
        <input
          type="password"
          name="token"
          autoComplete="off"
          value={token}
          onInput={(e) => setTokenText((e.target as HTMLInputElement).value)}
          autoFocus
        />
      </label>
      <p class="hint">Kept for this tab only (sessionStorage); closing the tab forgets it.</p>
      <div class="row">
        <button type="submit">Sign in</button>
        {props.onCancel && (
          <button type="button" class="secondary" onClick={props.onCancel}>
            Cancel
          </button>
        )}
      </div>
    </form>
  );
}

/** What a route names does not exist: say so, with the way back. */
function Missing(props: { what: string; error: string; back: string; backLabel: string }) {
  return (
    <section class="missing" data-testid="not-found">
      <h1>{props.what} not found</h1>
      <p class="muted">{props.error}</p>
      <a href={props.back}>{props.backLabel}</a>
    </section>
  );
}

function ErrorLine(props: { error: string }) {
  return props.error ? (
    <p class="error" role="alert">
      {props.error}
    </p>
  ) : null;
}

function Badge(props: { tone: string; children: any; testid?: string }) {
  return (
    <span class={`badge ${props.tone}`} data-testid={props.testid}>
      {props.children}
    </span>
  );
}

function fail(setError: (s: string) => void) {
  return (err: unknown) => {
    if (!authFailed(err)) setError(describe(err));
  };
}

// ------------------------------------------------------------------- tasks

function TasksView() {
  const [tasks, setTasks] = useState<Task[] | null>(null);
  const [title, setTitle] = useState("");
  const [error, setError] = useState("");
  const [busy, setBusy] = useState(false);
  // Asked again every 2 s until it answers: a page opened while sessiond
  // is down fills in once it is back.
  useEffect(() => {
    let timer = 0;
    let stopped = false;
    const load = () =>
      sessions
        .listTasks({ pageSize: 1000 })
        .then((r) => {
          setTasks(r.tasks);
          setError("");
        })
        .catch((err) => {
          fail(setError)(err);
          if (!stopped && !authFailed(err)) timer = window.setTimeout(load, 2000);
        });
    load();
    return () => {
      stopped = true;
      clearTimeout(timer);
    };
  }, []);

  return (
    <section>
      <h1>Tasks</h1>
      <form
        class="row"
        onSubmit={async (e) => {
          e.preventDefault();
          setBusy(true);
          setError("");
          try {
            const r = await sessions.createTask({ title: title.trim() });
            setTitle("");
            location.hash = taskHref(r.task!.id);
          } catch (err) {
            fail(setError)(err);
          } finally {
            setBusy(false);
          }
        }}
      >
        <label class="grow">
          <span class="sr">New task title</span>
          <input
            name="title"
            placeholder="New task title"
            value={title}
            onInput={(e) => setTitle((e.target as HTMLInputElement).value)}
            required
          />
        </label>
        <button type="submit" disabled={busy}>
          Create task
        </button>
      </form>
      <ErrorLine error={error} />
      {tasks === null ? (
        <p class="muted">Loading…</p>
      ) : tasks.length === 0 ? (
        <p class="muted">No tasks yet.</p>
      ) : (
        <ul class="list" data-testid="tasks">
          {tasks.map((t) => (
            <li key={t.id}>
              <a href={taskHref(t.id)}>{t.title}</a>
            </li>
          ))}
        </ul>
      )}
    </section>
  );
}

// -------------------------------------------------------------------- task

type SessionRow = { session: Session; executor: ExecutorStatus };

/** Whether a task event changes what the list shows of its session beyond
 * state and executor: its title (the first prompt, the agent's
 * `session_info_update`) or its cost (a turn's end). */
function renames(rows: Map<string, SessionRow>, e: Event): boolean {
  const p = e.payload;
  if (p.case === "turnEnded") return true;
  if (p.case !== "messageAdded" && p.case !== "messageUpdated") return false;
  const m = p.value.message;
  if (!m) return false;
  if (m.role === MessageRole.USER) return !rows.get(e.sessionId)?.session.title;
  return m.part.case === "other" && m.part.value.updateKind === "session_info_update";
}

function applyTaskEvent(rows: Map<string, SessionRow>, e: Event): boolean {
  const row = rows.get(e.sessionId);
  if (!row) return false;
  const p = e.payload;
  let next: SessionRow | null = null;
  switch (p.case) {
    case "stateChanged":
      next = { ...row, session: { ...row.session, state: p.value.to, errorMessage: p.value.errorMessage } as Session };
      if (p.value.to === SessionState.COMPLETED || p.value.to === SessionState.CANCELLED)
        next.executor = ExecutorStatus.STOPPED;
      break;
    case "agentctlStarting":
      next = { ...row, executor: ExecutorStatus.STARTING };
      break;
    case "agentctlReady":
      next = { ...row, executor: ExecutorStatus.READY };
      break;
    case "agentctlError":
      next = { ...row, executor: ExecutorStatus.ERROR };
      break;
  }
  if (next) rows.set(e.sessionId, next);
  return true;
}

/** A session's short label: the random end of its id (its start is a
 * timestamp, the same for sessions made the same minute). */
function shortId(id: string): string {
  return id.slice(-8);
}

/** How long ago, coarsely: `just now`, `5 min ago`, `3 h ago`, `2 d ago`. */
function age(seconds: bigint | undefined): string {
  if (seconds === undefined) return "";
  const s = Math.max(0, Date.now() / 1000 - Number(seconds));
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

function TaskView(props: { taskId: string; backend: Backend }) {
  const { taskId } = props;
  const [task, setTask] = useState<Task | null>(null);
  const [profiles, setProfiles] = useState<AgentProfile[]>([]);
  const [rows, setRows] = useState<Map<string, SessionRow> | null>(null);
  const [watch, setWatch] = useState<WatchState>("live");
  const [error, setError] = useState("");
  const [missing, setMissing] = useState("");
  const [query, setQuery] = useState("");
  const [stateFilter, setStateFilter] = useState("all");
  const [confirming, setConfirming] = useState("");
  // A session whose delete was refused for the work in its worktree: the
  // user picks what becomes of that work.
  const [withWork, setWithWork] = useState("");
  const rowsRef = useRef(new Map<string, SessionRow>());
  const pending = useRef<Event[]>([]);
  const loaded = useRef(false);

  useEffect(() => {
    // What failed to load (sessiond down when the page opened) is asked
    // again by the poll below until it answers.
    let taskLoaded = false;
    let profilesLoaded = false;
    let listFailed = false;
    const loadMeta = () => {
      if (!taskLoaded)
        sessions
          .getTask({ taskId })
          .then((r) => {
            taskLoaded = true;
            setTask(r.task ?? null);
          })
          .catch((err) => {
            if (!isMissing(err)) return fail(setError)(err);
            taskLoaded = true;
            setMissing(describe(err));
          });
      if (!profilesLoaded)
        sessions
          .listAgentProfiles({})
          .then((r) => {
            profilesLoaded = true;
            setProfiles(r.profiles);
          })
          .catch(fail(setError));
    };
    loadMeta();
    let refetching = false;
    let frame = 0;
    let renameTimer = 0;
    // When the list was last asked for (server clock as the events carry
    // it): replayed events older than the list are in it already.
    let listedAt = 0;
    const publish = () => {
      frame = 0;
      setRows(new Map(rowsRef.current));
    };
    const schedule = () => {
      if (!frame) frame = requestAnimationFrame(publish);
    };
    // The list is the base; the task's events (replayed from its first, then
    // live) move each session's state and executor badges. An event of a
    // session the list does not have yet (created elsewhere) refetches it.
    const refetch = () => {
      if (refetching) return;
      refetching = true;
      listedAt = Date.now() / 1000 - 2;
      sessions
        .listSessions({ taskId })
        .then((r) => {
          const next = new Map<string, SessionRow>();
          for (const s of r.sessions) {
            const old = rowsRef.current.get(s.id);
            next.set(s.id, { session: s, executor: old?.executor ?? ExecutorStatus.UNSPECIFIED });
          }
          rowsRef.current = next;
          loaded.current = true;
          if (listFailed) {
            listFailed = false;
            setError("");
          }
          const queued = pending.current;
          pending.current = [];
          for (const e of queued) applyTaskEvent(next, e);
          schedule();
        })
        .catch((err) => {
          listFailed = true;
          fail(setError)(err);
        })
        .finally(() => (refetching = false));
    };
    refetch();
    const stop = followShared(
      `task:${taskId}`,
      (e) => {
        if (!loaded.current || refetching) {
          pending.current.push(e);
          return;
        }
        if (!applyTaskEvent(rowsRef.current, e)) {
          pending.current.push(e);
          refetch();
        } else if (renames(rowsRef.current, e) && Number(e.createdAt?.seconds ?? 0n) >= listedAt) {
          // Titles and costs come with the list: ask again, once per burst.
          clearTimeout(renameTimer);
          const again = () => (refetching ? (renameTimer = window.setTimeout(again, 300)) : refetch());
          renameTimer = window.setTimeout(again, 300);
        }
        schedule();
      },
      (s) => {
        if (s === "unauthenticated") onAuthFailure();
        setWatch(s);
      },
    );
    // A session being brought back (a restart) says so in the list, and
    // no event says when it is back: ask again while one is.
    const poll = window.setInterval(() => {
      if (!refetching && (listFailed || [...rowsRef.current.values()].some((r) => r.session.recovering))) refetch();
      if (!taskLoaded || !profilesLoaded) loadMeta();
    }, 2000);
    return () => {
      stop();
      cancelAnimationFrame(frame);
      clearTimeout(renameTimer);
      clearInterval(poll);
    };
  }, [taskId]);

  const profileName = useMemo(() => new Map(profiles.map((p) => [p.id, p.name])), [profiles]);
  if (missing || watch === "missing") {
    return <Missing what="Task" error={missing || `no task ${taskId}`} back="#/" backLabel="All tasks" />;
  }
  const all = rows ? [...rows.values()].sort((a, b) => Number((b.session.createdAt?.seconds ?? 0n) - (a.session.createdAt?.seconds ?? 0n)) || (a.session.id < b.session.id ? 1 : -1)) : null;
  // Search (id, agent, branch, state) and a state filter.
  const needle = query.trim().toLowerCase();
  const list =
    all?.filter(({ session: s }) => {
      if (stateFilter !== "all" && String(s.state) !== stateFilter) return false;
      if (!needle) return true;
      const hay = [s.title, s.id, profileName.get(s.agentProfileId) ?? "", s.worktree?.branch ?? "", stateLabel[s.state]].join(" ").toLowerCase();
      return hay.includes(needle);
    }) ?? null;
  const remove = async (id: string, work: "" | "discard" | "keep" = "") => {
    setError("");
    try {
      await sessions.deleteSession({ taskId, sessionId: id, discardWorktree: work === "discard", keepWorktree: work === "keep" });
      rowsRef.current.delete(id);
      setRows(new Map(rowsRef.current));
      setWithWork("");
    } catch (err) {
      fail(setError)(err);
      if (reason(err) === "worktree_has_work") setWithWork(id);
    } finally {
      setConfirming("");
    }
  };

  return (
    <section>
      <h1>{task?.title ?? "Task"}</h1>
      {watch === "reconnecting" && props.backend !== "unreachable" && (
        <p class="banner warn" role="status" data-testid="reconnecting">
          reconnecting…
        </p>
      )}
      <ErrorLine error={error} />
      <div class="split">
        <div>
          <h2>Sessions</h2>
          {all !== null && all.length > 0 && (
            <div class="row filters">
              <label class="grow">
                <span class="sr">Search sessions</span>
                <input name="search" type="search" placeholder="Search: title, id, agent, branch, state" value={query} onInput={(e) => setQuery((e.target as HTMLInputElement).value)} />
              </label>
              <label>
                <span class="sr">State</span>
                <select name="state-filter" value={stateFilter} onChange={(e) => setStateFilter((e.target as HTMLSelectElement).value)}>
                  <option value="all">every state</option>
                  {[SessionState.STARTING, SessionState.RUNNING, SessionState.WAITING_FOR_INPUT, SessionState.ERROR, SessionState.COMPLETED, SessionState.CANCELLED].map((st) => (
                    <option value={String(st)}>{stateLabel[st]}</option>
                  ))}
                </select>
              </label>
            </div>
          )}
          {list === null ? (
            <p class="muted">Loading…</p>
          ) : all?.length === 0 ? (
            <p class="muted">No sessions yet.</p>
          ) : list.length === 0 ? (
            <p class="muted" data-testid="no-match">No session matches.</p>
          ) : (
            <ul class="list sessions" data-testid="sessions">
              {list.map(({ session: s, executor }) => (
                <li key={s.id} data-session={s.id}>
                  <a href={sessionHref(taskId, s.id)} data-testid="session-link">
                    <span data-testid="title">{s.title || "Untitled session"}</span> <span class="muted mono">{shortId(s.id)}</span>
                  </a>
                  <span class="badges">
                    <Badge tone={stateTone(s.state)} testid="state">{stateLabel[s.state]}</Badge>
                    <Badge tone={executorTone(executor)} testid="executor">{executorLabel[executor]}</Badge>
                    {s.recovering && <Badge tone="warn" testid="recovering">recovering</Badge>}
                    <Badge tone="idle">{profileName.get(s.agentProfileId) ?? "agent"}</Badge>
                    <Badge tone="idle">{runtimeName(s.runtime, s.runtimeName)}</Badge>
                    {s.worktree?.repository && (
                      <Badge tone="idle" testid="branch">
                        {s.worktree.branch}
                      </Badge>
                    )}
                    {s.usage && s.usage.costs.length > 0 && (
                      <Badge tone="idle" testid="cost">
                        {costsText(s.usage.costs)}
                      </Badge>
                    )}
                    <span class="muted" data-testid="age">
                      {age(s.createdAt?.seconds)}
                    </span>
                  </span>
                  {withWork === s.id ? (
                    <span class="row">
                      <button type="button" class="danger" data-testid="delete-discard" onClick={() => remove(s.id, "discard")}>
                        Delete and discard the work
                      </button>
                      <button type="button" class="secondary" data-testid="delete-keep-worktree" onClick={() => remove(s.id, "keep")}>
                        Delete, keep the worktree
                      </button>
                      <button type="button" class="secondary" onClick={() => setWithWork("")}>
                        Keep the session
                      </button>
                    </span>
                  ) : confirming === s.id ? (
                    <span class="row">
                      <button type="button" class="danger" data-testid="confirm-delete" onClick={() => remove(s.id)}>
                        Delete for good
                      </button>
                      <button type="button" class="secondary" onClick={() => setConfirming("")}>
                        Keep
                      </button>
                    </span>
                  ) : (
                    <button type="button" class="link" data-testid="delete" onClick={() => setConfirming(s.id)} aria-label={`Delete session ${s.title || shortId(s.id)}`}>
                      Delete
                    </button>
                  )}
                </li>
              ))}
            </ul>
          )}
        </div>
        <NewSession
          taskId={taskId}
          profiles={profiles}
          repositories={[...new Set((list ?? []).map(({ session: s }) => s.worktree?.repository ?? "").filter(Boolean))]}
        />
      </div>
    </section>
  );
}

/** Where a new session works: a worktree sessiond creates from a
 * repository (isolated, on a branch of its own), or a directory the user made. */
type Where = "repository" | "directory";

function NewSession(props: { taskId: string; profiles: AgentProfile[]; repositories: string[] }) {
  const [profile, setProfile] = useState("");
  const [runtime, setRuntime] = useState<Runtime>(Runtime.UNSPECIFIED);
  const [where, setWhere] = useState<Where>("repository");
  const [repository, setRepository] = useState("");
  const [base, setBase] = useState("main");
  const [path, setPath] = useState("");
  const [branch, setBranch] = useState("");
  // The server's configured repositories, then those the task used.
  const [configured, setConfigured] = useState<string[]>([]);
  useEffect(() => {
    sessions
      .listRepositories({})
      .then((r) => setConfigured(r.repositories))
      .catch(() => setConfigured([]));
  }, []);
  const offered = [...new Set([...configured, ...props.repositories])];
  const [remote, setRemote] = useState({ url: "", secret: "", executorId: "" });
  // The chosen repository's branches, offered as the base (typed when the
  // server cannot list them: no repository yet, or a remote host whose
  // agentctl is not named yet).
  const [branches, setBranches] = useState<string[]>([]);
  useEffect(() => {
    const repo = repository.trim();
    const remoteNamed = remote.url !== "" && remote.secret !== "" && remote.executorId !== "";
    if (where !== "repository" || !repo.startsWith("/") || (runtime === Runtime.REMOTE && !remoteNamed)) {
      setBranches([]);
      return;
    }
    let live = true;
    const t = setTimeout(() => {
      sessions
        .listRepositoryBranches({
          repository: repo,
          runtime,
          ...(runtime === Runtime.REMOTE ? { remoteUrl: remote.url, remoteSecret: remote.secret, remoteExecutorId: remote.executorId } : {}),
        })
        .then((r) => {
          if (!live) return;
          setBranches(r.branches);
          setBase((b) => (r.branches.includes(b) ? b : r.current || r.branches[0] || b));
        })
        .catch(() => live && setBranches([]));
    }, 250);
    return () => {
      live = false;
      clearTimeout(t);
    };
  }, [repository, runtime, where, remote]);
  // Only the runtimes this server can use (Docker when configured).
  const [runtimes, setRuntimes] = useState<Runtime[] | null>(null);
  useEffect(() => {
    sessions
      .listRuntimes({})
      .then((r) => setRuntimes(r.runtimes))
      .catch(() => setRuntimes(null));
  }, []);
  const can = (r: Runtime) => runtimes === null || runtimes.includes(r);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState("");
  const val = (f: (v: string) => void) => (e: any) => f((e.target as HTMLInputElement).value);
  return (
    <form
      class="card"
      data-testid="new-session"
      onSubmit={async (e) => {
        e.preventDefault();
        setBusy(true);
        setError("");
        try {
          const r = await sessions.createSession({
            taskId: props.taskId,
            agentProfile: profile,
            runtime,
            worktree:
              where === "repository"
                ? { repository: repository.trim(), base: base.trim(), branch: branch.trim() }
                : { path: path.trim(), branch: branch.trim() },
            remoteUrl: remote.url,
            remoteSecret: remote.secret,
            remoteExecutorId: remote.executorId,
          });
          location.hash = sessionHref(props.taskId, r.session!.id);
        } catch (err) {
          fail(setError)(err);
        } finally {
          setBusy(false);
        }
      }}
    >
      <h2>New session</h2>
      <label>
        Agent profile
        <select name="profile" value={profile} onChange={val(setProfile)}>
          <option value="">default</option>
          {props.profiles.map((p) => (
            <option key={p.id} value={p.name}>
              {p.name}
              {p.supportsSessionResume ? "" : " (cannot resume)"}
            </option>
          ))}
        </select>
      </label>
      <label>
        Runtime
        <select name="runtime" value={String(runtime)} onChange={val((v) => setRuntime(Number(v)))}>
          <option value={String(Runtime.UNSPECIFIED)}>server default</option>
          {can(Runtime.LOCAL_STANDALONE) && <option value={String(Runtime.LOCAL_STANDALONE)}>local process</option>}
          {can(Runtime.LOCAL_DOCKER) && <option value={String(Runtime.LOCAL_DOCKER)}>docker</option>}
          {can(Runtime.REMOTE) && <option value={String(Runtime.REMOTE)}>remote host</option>}
        </select>
      </label>
      <fieldset class="where">
        <legend>Works in</legend>
        <label class="inline">
          <input type="radio" name="where" value="repository" checked={where === "repository"} onChange={() => setWhere("repository")} />
          a new worktree of a repository
        </label>
        <label class="inline">
          <input type="radio" name="where" value="directory" checked={where === "directory"} onChange={() => setWhere("directory")} />
          an existing directory
        </label>
      </fieldset>
      {where === "repository" ? (
        <>
          <label>
            Repository (a git repository on the executor's host)
            <input name="repository" required list="repositories" placeholder="/home/me/project" value={repository} onInput={val(setRepository)} />
            <datalist id="repositories">
              {offered.map((r) => (
                <option key={r} value={r} />
              ))}
            </datalist>
          </label>
          <label>
            Base branch
            {branches.length > 0 ? (
              <select name="base" value={base} onChange={val(setBase)}>
                {branches.map((b) => (
                  <option key={b} value={b}>
                    {b}
                  </option>
                ))}
              </select>
            ) : (
              <input name="base" required placeholder="main" value={base} onInput={val(setBase)} />
            )}
          </label>
          <label>
            New branch (optional; default sessiond/&lt;id&gt;-&lt;task&gt;)
            <input name="branch" value={branch} onInput={val(setBranch)} />
          </label>
        </>
      ) : (
        <>
          <label>
            Worktree path (absolute, on the executor's host)
            <input name="worktree" required placeholder="/home/me/project" value={path} onInput={val(setPath)} />
          </label>
          <label>
            Branch (optional)
            <input name="branch" value={branch} onInput={val(setBranch)} />
          </label>
        </>
      )}
      {runtime === Runtime.REMOTE && (
        <fieldset>
          <legend>Remote agentctl</legend>
          <label>
            URL
            <input name="remote-url" value={remote.url} onInput={val((url) => setRemote({ ...remote, url }))} />
          </label>
          <label>
            Secret
            <input name="remote-secret" type="password" value={remote.secret} onInput={val((secret) => setRemote({ ...remote, secret }))} />
          </label>
          <label>
            Executor id
            <input name="remote-executor" value={remote.executorId} onInput={val((executorId) => setRemote({ ...remote, executorId }))} />
          </label>
        </fieldset>
      )}
      <button type="submit" disabled={busy}>
        {busy ? <Spinner label="Starting the agent…" /> : "Start session"}
      </button>
      <ErrorLine error={error} />
    </form>
  );
}

/** Where recovery stands in bringing a session's agent back, in words. */
function recoveryText(r: AgentRecovery): string {
  const attempt = r.maxAttempts > 1 ? ` (attempt ${r.attempt} of ${r.maxAttempts})` : "";
  let what: string;
  switch (r.stage) {
    case RecoveryStage.QUEUED:
      what = r.queueLength > 0 ? `Waiting to relaunch the agent: ${r.queuePosition} of ${r.queueLength} in line` : "Waiting to relaunch the agent";
      break;
    case RecoveryStage.RESUMING:
      what = r.replayed > 0n ? `Reopening the conversation (${r.replayed} updates replayed)` : "Reopening the conversation";
      break;
    case RecoveryStage.WAITING_TO_RETRY:
      what = `Trying again in ${Math.max(1, Math.round(Number(r.retryInMs) / 1000))} s`;
      break;
    default:
      what = "Starting the agent";
  }
  return what + attempt;
}

function Spinner(props: { label: string }) {
  return (
    <span class="spinner-wrap" role="status" data-testid="spinner">
      <span class="spinner" aria-hidden="true" />
      {props.label}
    </span>
  );
}

// ----------------------------------------------------------------- session

// Costs per currency: `0.5 USD + 3 credits`.
function costsText(costs: { amount: number; currency: string }[]): string {
  return costs.map((c) => `${Number(c.amount.toFixed(4))} ${c.currency}`).join(" + ");
}

// A session's totals in a badge: `3 turns · 450 tokens · 0.75 USD`.
function usageText(u: UsageTotals): string {
  const cost = u.costs.length ? ` · ${costsText(u.costs)}` : "";
  return `${u.turns} turn${u.turns === 1n ? "" : "s"} · ${u.totalTokens} tokens${cost}`;
}

// One turn's usage under its prompt.
function turnUsageText(u: TurnUsage): string {
  const parts: string[] = [];
  if (u.totalTokens !== undefined || u.inputTokens !== undefined) {
    parts.push(`${u.totalTokens ?? (u.inputTokens ?? 0n) + (u.outputTokens ?? 0n)} tokens (${u.inputTokens ?? 0n} in, ${u.outputTokens ?? 0n} out)`);
  }
  if (u.contextUsed !== undefined && u.contextSize !== undefined) parts.push(`context ${u.contextUsed}/${u.contextSize}`);
  if (u.cost) parts.push(`cost ${costsText([u.cost])}`);
  return parts.join(", ");
}

function parseJson(text: string): unknown {
  try {
    return text ? JSON.parse(text) : undefined;
  } catch {
    return text;
  }
}

// A tool's raw output as text: a string, content blocks' texts, or an
// output-like field (agents name it differently).
function outputText(v: unknown): string | undefined {
  if (typeof v === "string") return v;
  if (Array.isArray(v)) {
    const texts = v.flatMap((i) => (i && typeof i.text === "string" ? [i.text] : []));
    return texts.length ? texts.join("\n") : undefined;
  }
  if (v && typeof v === "object") {
    const o = v as Record<string, unknown>;
    for (const k of ["formatted_output", "aggregated_output", "output", "stdout"]) {
      if (typeof o[k] === "string") return (o[k] as string) + (k === "stdout" && typeof o.stderr === "string" ? o.stderr : "");
    }
    return outputText(o.content);
  }
  return undefined;
}

// What a tool call's raw input and output say it did: the command and its
// cwd, the exit code, the output's last lines.
function toolDetail(rawInput: string, rawOutput: string): string {
  const lines: string[] = [];
  const input = parseJson(rawInput) as Record<string, unknown> | undefined;
  const command = input && typeof input === "object" ? input.command : undefined;
  if (typeof command === "string" || Array.isArray(command)) {
    const cwd = typeof input!.cwd === "string" ? `  (in ${input!.cwd})` : "";
    lines.push(`$ ${Array.isArray(command) ? command.join(" ") : command}${cwd}`);
  }
  const output = parseJson(rawOutput);
  if (output && typeof output === "object" && !Array.isArray(output)) {
    const o = output as Record<string, unknown>;
    const code = o.exit_code ?? o.exitCode;
    if (typeof code === "number") lines.push(`exit ${code}`);
  }
  const text = outputText(output);
  if (text) {
    const all = text.split("\n");
    if (all.length > 10) lines.push("...");
    lines.push(...all.slice(-10));
  }
  return lines.length ? "\n" + lines.join("\n") : "";
}

// An activity part (tool call, plan, ...) as one readable line; the text
// of a reply or a thought as is.
function partText(m: Message): string {
  const p = m.part;
  switch (p.case) {
    case "unparsed":
      return `unparsed ${p.value.updateKind || p.value.method}: ${p.value.error}`;
    case "plan":
      return "plan:\n" + p.value.entries.map((e) => `[${e.status}] ${e.content}`).join("\n");
    case "availableCommands":
      return "commands: " + p.value.commands.map((c) => "/" + c.name).join(" ");
    case "currentMode":
      return "mode: " + p.value.modeId;
    case "other":
      return p.value.updateKind;
    case "terminal":
      return `terminal: ${m.content} (${terminalState(p.value)})`;
    case "permission": {
      const r = p.value;
      const chosen = r.options.find((o) => o.optionId === r.optionId);
      const outcome = r.status === "pending" ? "waiting for an answer" : `${r.status.replace("_", " ")}${chosen ? `: ${chosen.name}` : r.optionId ? `: ${r.optionId}` : ""}`;
      return `permission asked for ${r.toolCall?.title || "a tool call"} (${outcome})`;
    }
    default:
      return m.content;
  }
}

// How a terminal stands: running, exit N, signal S, released.
function terminalState(t: TerminalPart): string {
  if (!t.exited) return t.released ? "released" : "running";
  if (t.exitCode !== undefined) return `exit ${t.exitCode}`;
  return t.signal ? `signal ${t.signal}` : "exited";
}

// A terminal's command and output, inside the tool call that runs it (or
// alone when no tool call names it).
function TerminalView(props: { terminal: TerminalPart }) {
  const t = props.terminal;
  return (
    <div class="terminal" data-testid="terminal">
      <div class="terminal-head">
        {"$ "}
        {[t.command, ...t.args].join(" ")}
        <span class="terminal-state" data-testid="terminal-state">
          {" · "}
          {terminalState(t)}
          {t.truncated ? " · earlier output dropped" : ""}
        </span>
      </div>
      {t.output && (
        <pre class="terminal-output" data-testid="terminal-output" tabIndex={0}>
          {t.output}
        </pre>
      )}
    </div>
  );
}

// How a turn that did not end normally is marked on its user message.
const stopLabel: Record<string, string> = {
  cancelled: "cancelled",
  error: "failed",
  interrupted: "interrupted",
  refusal: "refused by the agent",
  max_tokens: "stopped: max tokens",
  max_turn_requests: "stopped: max turn requests",
};

const planMark: Record<string, string> = { completed: "☑", in_progress: "◐", pending: "☐" };

/** A tool call as a card: what it does and how it stands, the files it
 * touches, its text output, each file change as a diff, and what its raw
 * input and output say it ran. */
function ToolCard(props: { tool: ToolCallPart }) {
  const t = props.tool;
  const texts = t.content.flatMap((c) => (c.content.case === "text" ? [c.content.value] : []));
  const diffs = t.content.flatMap((c) => (c.content.case === "diff" ? [c.content.value] : []));
  const detail = toolDetail(t.rawInputJson, t.rawOutputJson).trim();
  return (
    <div class={`tool tool-${t.status}`} data-testid="tool-call" data-status={t.status} data-kind={t.toolKind}>
      <div class="tool-head">
        tool {t.toolKind || "other"}: <strong>{t.title}</strong> <span class="tool-status">({t.status.replace("_", " ")})</span>
      </div>
      {t.locations.length > 0 && (
        <div class="muted tool-where">
          {t.locations.map((l) => (l.line !== undefined ? `${l.path}:${l.line}` : l.path)).join(", ")}
        </div>
      )}
      {texts.map((x, i) => (
        <div key={i} class="tool-text">
          {x}
        </div>
      ))}
      {diffs.map((d, i) => (
        <DiffView key={i} diff={d} testid="tool-diff" />
      ))}
      {detail && <pre class="command">{detail}</pre>}
    </div>
  );
}

/** What a message shows: an agent's reply as Markdown, a thought folded
 * away, the plan as a checklist, a tool call as a card, other parts as one line. */
function MessageBody(props: { message: Message }) {
  const m = props.message;
  if (m.part.case === "toolCall") return <ToolCard tool={m.part.value} />;
  if (m.part.case === "plan") {
    return (
      <ul class="plan" data-testid="plan" aria-label="The agent's plan">
        {m.part.value.entries.map((e, i) => (
          <li key={i} class={`plan-${e.status}`} data-status={e.status}>
            <span aria-hidden="true">{planMark[e.status] ?? "☐"} </span>
            {e.content}
            <span class="sr"> ({e.status.replace("_", " ")})</span>
          </li>
        ))}
      </ul>
    );
  }
  if (m.kind === MessageKind.THOUGHT) {
    return (
      <details class="thought" data-testid="thought">
        <summary>Thinking{m.complete ? "" : "…"}</summary>
        <p>{m.content}</p>
      </details>
    );
  }
  if (!m.part.case && m.role === MessageRole.AGENT) return <Markdown text={m.content} />;
  return <>{partText(m)}</>;
}

/** Parts the conversation does not show: the agent's session metadata
 * (`session_info_update`) and its config options (`config_option_update`,
 * shown by the selectors) describe the session, not the conversation. */
function hidden(m: Message): boolean {
  return m.part.case === "other" && (m.part.value.updateKind === "session_info_update" || m.part.value.updateKind === "config_option_update");
}

type MessageProps = { message: Message; stop?: string; terminals?: TerminalPart[] };

function sameTerminals(a?: TerminalPart[], b?: TerminalPart[]): boolean {
  return (a?.length ?? 0) === (b?.length ?? 0) && (a ?? []).every((t, i) => t === b?.[i]);
}

class MessageView extends Component<MessageProps> {
  shouldComponentUpdate(next: MessageProps) {
    return (
      next.message !== this.props.message ||
      next.stop !== this.props.stop ||
      !sameTerminals(next.terminals, this.props.terminals)
    );
  }
  render() {
    const { message: m, stop, terminals } = this.props;
    const label = stop && stop !== "end_turn" ? (stopLabel[stop] ?? stop) : "";
    return (
      <li class={`msg role-${m.role}${m.complete || m.part.case ? "" : " streaming"}`} data-seq={String(m.seq)}>
        <span class="who">
          {roleLabel[m.role]}
          {label && (
            <span class={`turn-stop stop-${stop}`} data-testid="turn-stop">
              {" · turn "}
              {label}
            </span>
          )}
        </span>
        <div class={m.part.case ? "text part" : "text"}>
          <MessageBody message={m} />
        </div>
        {m.part.case === "terminal" && <TerminalView terminal={m.part.value} />}
        {terminals?.map((t) => <TerminalView key={t.terminalId} terminal={t} />)}
        {m.usage && (
          <div class="muted turn-usage" data-testid="turn-usage">
            {turnUsageText(m.usage)}
          </div>
        )}
      </li>
    );
  }
}

function SessionView(props: { taskId: string; sessionId: string; backend: Backend }) {
  const { taskId, sessionId } = props;
  const [status, setStatus] = useState<GetSessionStatusResponse | null>(null);
  const [statusError, setStatusError] = useState("");
  const [missing, setMissing] = useState("");
  const [messages, setMessages] = useState<Message[]>([]);
  // Stop reason of each ended turn, by the id of its user message.
  const [stops, setStops] = useState<ReadonlyMap<string, string>>(new Map());
  const [cancelling, setCancelling] = useState(false);
  // Stop ends the session for good: asked once more, as Delete is.
  const [stopping, setStopping] = useState(false);
  // The agent's permission requests that wait for an answer: those of the
  // last status plus those asked since, less those resolved since (by id).
  const [asked, setAsked] = useState<ReadonlyMap<string, PermissionRequest>>(new Map());
  const [resolved, setResolved] = useState<ReadonlySet<string>>(new Set());
  const [watch, setWatch] = useState<WatchState>("live");
  const [resuming, setResuming] = useState(false);
  const [resumeError, setResumeError] = useState<{ reason: string; message: string } | null>(null);
  const [draft, setDraft] = useState("");
  // The last send that failed: its text and idempotency key.
  const unsent = useRef<{ content: string; requestId: string } | null>(null);
  const [error, setError] = useState("");
  const [starting, setStarting] = useState(false);
  const [retrying, setRetrying] = useState(false);
  const [profileName, setProfileName] = useState("");
  // The session's title (null until read) and, while renaming, the draft.
  const [title, setTitle] = useState<string | null>(null);
  const [renaming, setRenaming] = useState<string | null>(null);
  const [titleError, setTitleError] = useState("");
  const titleRef = useRef("");
  // Slash-command completion: the highlighted match; closed by Escape
  // until the draft changes.
  const [pick, setPick] = useState(0);
  const [slashClosed, setSlashClosed] = useState(false);
  const list = useRef<HTMLOListElement>(null);
  const stick = useRef(true);

  const loadTitle = useCallback(() => {
    sessions
      .getSession({ taskId, sessionId })
      .then((r) => {
        titleRef.current = r.session?.title ?? "";
        setTitle(titleRef.current);
      })
      .catch(() => {});
  }, [taskId, sessionId]);

  const refresh = useCallback(() => {
    sessions
      .getSessionStatus({ taskId, sessionId })
      .then((s) => {
        setStatus(s);
        setStatusError("");
      })
      .catch((err) => {
        if (authFailed(err)) return;
        // While sessiond restarts, the banner says so; not an error here.
        if (err instanceof ConnectError && err.code === Code.Unavailable) return;
        if (isMissing(err)) {
          setMissing(describe(err));
          return;
        }
        setStatusError(describe(err));
      });
  }, [taskId, sessionId]);

  // The end of startup recovery: the agent may have come back without an
  // event of its own (agentctl_ready comes before the agent's resume).
  useEffect(() => {
    if (props.backend === "serving") refresh();
  }, [props.backend, refresh]);

  useEffect(() => {
    refresh();
    loadTitle();
    let titleTimer = 0;
    const byId = new Map<string, number>();
    let acc: Message[] = [];
    const stopAcc = new Map<string, string>();
    const askedAcc = new Map<string, PermissionRequest>();
    const resolvedAcc = new Set<string>();
    let frame = 0;
    let statusTimer = 0;
    const publish = () => {
      frame = 0;
      setMessages(acc.slice());
      setStops(new Map(stopAcc));
      setAsked(new Map(askedAcc));
      setResolved(new Set(resolvedAcc));
    };
    const stop = followShared(
      `session:${sessionId}`,
      (e) => {
        const p = e.payload;
        if (p.case === "messageAdded" || p.case === "messageUpdated") {
          const m = p.value.message!;
          const at = byId.get(m.id);
          if (at === undefined) {
            byId.set(m.id, acc.length);
            acc.push(m);
          } else acc[at] = m;
          if (!frame) frame = requestAnimationFrame(publish);
          // The first prompt or the agent names the session: read its title.
          if ((m.role === MessageRole.USER && !titleRef.current) || (m.part.case === "other" && m.part.value.updateKind === "session_info_update")) {
            clearTimeout(titleTimer);
            titleTimer = window.setTimeout(loadTitle, 200);
          }
          // The mode or the options changed (set here, in another tab, by
          // sessionctl, or by the agent): the selectors read the status.
          if (m.part.case === "currentMode" || (m.part.case === "other" && m.part.value.updateKind === "config_option_update")) {
            clearTimeout(statusTimer);
            statusTimer = window.setTimeout(refresh, 50);
          }
        } else {
          if (p.case === "turnEnded") {
            stopAcc.set(p.value.turnId, p.value.stopReason);
            // Whatever turn was being cancelled has ended: the next one
            // (a queued message) can be cancelled again.
            setCancelling(false);
            if (!frame) frame = requestAnimationFrame(publish);
          } else if (p.case === "permissionRequested" && p.value.request) {
            askedAcc.set(p.value.request.requestId, p.value.request);
            if (!frame) frame = requestAnimationFrame(publish);
            // A prompt and nothing else: the status need not be asked again.
            return;
          } else if (p.case === "permissionResolved") {
            resolvedAcc.add(p.value.requestId);
            askedAcc.delete(p.value.requestId);
            if (!frame) frame = requestAnimationFrame(publish);
            return;
          }
          // State and executor changes: ask for the session's status again.
          clearTimeout(statusTimer);
          statusTimer = window.setTimeout(refresh, 50);
        }
      },
      (s) => {
        if (s === "unauthenticated") onAuthFailure();
        if (s === "live") refresh();
        setWatch(s);
      },
    );
    return () => {
      stop();
      cancelAnimationFrame(frame);
      clearTimeout(titleTimer);
      clearTimeout(statusTimer);
    };
  }, [sessionId, refresh, loadTitle]);

  // Right after a restart the session may not be recovered yet; a recovery
  // that finds everything as it was emits no event, so ask again.
  useEffect(() => {
    if (!status?.recovering) return;
    const t = window.setTimeout(refresh, 1000);
    return () => clearTimeout(t);
  }, [status, refresh]);

  useEffect(() => {
    if (!status) return;
    sessions
      .listAgentProfiles({})
      .then((r) => setProfileName(r.profiles.find((p) => p.id === status.agentProfileId)?.name ?? ""))
      .catch(() => {});
  }, [status?.agentProfileId]);

  useEffect(() => {
    const el = list.current;
    if (el && stick.current) el.scrollTop = el.scrollHeight;
  }, [messages]);

  const resume = async () => {
    setResuming(true);
    setResumeError(null);
    try {
      await sessions.resumeSession({ taskId, sessionId });
    } catch (err) {
      if (!authFailed(err)) setResumeError({ reason: reason(err), message: err instanceof ConnectError ? err.rawMessage : String(err) });
    } finally {
      setResuming(false);
      refresh();
    }
  };

  const startNew = async () => {
    if (!status) return;
    setStarting(true);
    setError("");
    try {
      const r = await sessions.createSession({
        taskId,
        agentProfile: status.agentProfileId,
        runtime: status.runtime,
        runtimeName: status.runtimeName,
        // A worktree sessiond made is the old session's own: the new one
        // gets a fresh worktree from the same repository and base.
        worktree: status.worktreeRepository
          ? { repository: status.worktreeRepository, base: status.worktreeBase }
          : { path: status.worktreePath, branch: status.worktreeBranch },
      });
      location.hash = sessionHref(taskId, r.session!.id);
    } catch (err) {
      fail(setError)(err);
    } finally {
      setStarting(false);
    }
  };

  const send = async () => {
    const typed = draft;
    const content = typed.trim();
    if (!content || !(canSend || canQueue)) return;
    setError("");
    // Sending the same text again after a failure repeats that request:
    // if the first reached sessiond after all, it answers with that
    // message instead of sending it twice.
    const requestId = unsent.current?.content === content ? unsent.current.requestId : newRequestId();
    unsent.current = { content, requestId };
    try {
      // While a turn runs, sessiond queues it behind the turn.
      await sessions.sendMessage({ taskId, sessionId, content, requestId });
      unsent.current = null;
      // Clear only what was sent: the next message may already be typed.
      setDraft((d) => (d === typed ? "" : d));
      stick.current = true;
    } catch (err) {
      fail(setError)(err);
    }
  };

  // Queued messages being removed: a second click on one is not a second
  // request (which found it gone and showed NOT_FOUND).
  const [unqueuing, setUnqueuing] = useState<ReadonlySet<string>>(new Set());
  const unqueue = async (messageId: string) => {
    if (unqueuing.has(messageId)) return;
    setError("");
    setUnqueuing((s) => new Set(s).add(messageId));
    try {
      await sessions.cancelQueuedMessage({ taskId, sessionId, messageId });
    } catch (err) {
      fail(setError)(err);
    } finally {
      setUnqueuing((s) => {
        const next = new Set(s);
        next.delete(messageId);
        return next;
      });
    }
  };

  // The last turn ended interrupted (a crash left it unknown whether the
  // agent ran it; sessiond never re-sends such a turn): the user may retry.
  const last = messages[messages.length - 1];
  const interrupted = !!last && last.role === MessageRole.SYSTEM && last.content.startsWith("the turn was interrupted");
  const retry = async () => {
    setError("");
    setRetrying(true);
    try {
      await sessions.retryTurn({ taskId, sessionId });
      stick.current = true;
    } catch (err) {
      fail(setError)(err);
    } finally {
      setRetrying(false);
    }
  };

  // Cancels the running turn; it ends on the event stream (the reply so far
  // stays, a system message and the turn's mark say it was cancelled).
  const cancelTurn = async () => {
    setError("");
    setCancelling(true);
    try {
      await sessions.cancelTurn({ taskId, sessionId });
    } catch (err) {
      // The turn ended meanwhile: nothing to cancel, not an error.
      if (reason(err) !== "invalid_state") {
        fail(setError)(err);
        setCancelling(false);
      }
      refresh();
    }
  };

  const stopSession = async () => {
    setError("");
    try {
      await sessions.stopSession({ taskId, sessionId });
      refresh();
    } catch (err) {
      fail(setError)(err);
    } finally {
      setStopping(false);
    }
  };

  // The agent's slash commands (its latest list), offered while the draft
  // is `/` and a command name being typed.
  const commands = useMemo(() => {
    for (let i = messages.length - 1; i >= 0; i--) {
      const p = messages[i].part;
      if (p.case === "availableCommands") return p.value.commands;
    }
    return [] as AvailableCommand[];
  }, [messages]);
  const typed = /^\/(\S*)$/.exec(draft)?.[1];
  const matches = typed === undefined ? [] : commands.filter((c) => c.name.startsWith(typed));
  const exact = typed !== undefined && commands.some((c) => c.name === typed);
  const showSlash = matches.length > 0 && !slashClosed && !(exact && matches.length === 1);
  const picked = matches.length ? matches[pick % matches.length] : undefined;
  const complete = (c: AvailableCommand) => {
    setDraft(`/${c.name} `);
    setPick(0);
  };

  // The agent's finished writes (tool calls that edit, delete or move, or
  // carry a diff) refresh the Files tree, once per burst.
  const writes = useMemo(
    () =>
      messages.filter((m) => {
        if (m.part.case !== "toolCall" || m.part.value.status !== "completed") return false;
        const t = m.part.value;
        return ["edit", "delete", "move"].includes(t.toolKind) || t.content.some((c) => c.content.case === "diff");
      }).length,
    [messages],
  );
  const [filesKey, setFilesKey] = useState(0);
  useEffect(() => {
    if (!writes) return;
    const t = window.setTimeout(() => setFilesKey(writes), 300);
    return () => clearTimeout(t);
  }, [writes]);

  const rename = async (next: string) => {
    setTitleError("");
    try {
      const r = await sessions.setSessionTitle({ taskId, sessionId, title: next });
      titleRef.current = r.session?.title ?? "";
      setTitle(titleRef.current);
      setRenaming(null);
    } catch (err) {
      if (!authFailed(err)) setTitleError(describe(err));
    }
  };

  const s = status;
  // Terminals shown inside the tool call that names them, by tool call
  // message id; those are not shown again on their own.
  const [toolTerminals, shownInToolCall] = useMemo(() => {
    const byId = new Map<string, TerminalPart>();
    for (const m of messages) if (m.part.case === "terminal") byId.set(m.part.value.terminalId, m.part.value);
    const perTool = new Map<string, TerminalPart[]>();
    const shown = new Set<string>();
    for (const m of messages) {
      if (m.part.case !== "toolCall") continue;
      const ts = m.part.value.content.flatMap((c) => {
        const t = c.content.case === "terminalId" ? byId.get(c.content.value) : undefined;
        return t ? [t] : [];
      });
      if (ts.length) {
        perTool.set(m.id, ts);
        ts.forEach((t) => shown.add(t.terminalId));
      }
    }
    return [perTool, shown] as const;
  }, [messages]);
  const pendingPermissions = useMemo(() => {
    const all = new Map<string, PermissionRequest>();
    for (const r of status?.pendingPermissions ?? []) all.set(r.requestId, r);
    for (const [id, r] of asked) all.set(id, r);
    return [...all.values()].filter((r) => !resolved.has(r.requestId));
  }, [status, asked, resolved]);
  const ended = s && (s.state === SessionState.COMPLETED || s.state === SessionState.CANCELLED);
  const recovering = !!s?.recovering;
  const notResumable =
    s &&
    !ended &&
    !recovering &&
    !s.isAgentRunning &&
    !s.needsResume &&
    (s.state === SessionState.ERROR || s.resumeReason === ResumeReason.NOT_RESUMABLE || s.resumeReason === ResumeReason.MISSING_RESUME_TOKEN);
  const failedResume = resumeError && resumeError.reason !== "" ? resumeError : null;
  const showNewSession = !!(notResumable || ended || (failedResume && !s?.isAgentRunning));
  const workspaceOnly = s && s.executorStatus === ExecutorStatus.READY && !s.isAgentRunning;
  const turnRunning = !!s && s.isAgentRunning && s.state === SessionState.RUNNING;
  const offline = props.backend === "unreachable";
  // One turn at a time: Send waits for the running one to end (Esc cancels it).
  const canSend = !!s && s.isAgentRunning && s.state === SessionState.WAITING_FOR_INPUT && !offline && s.queuedMessages.length === 0;
  // sessiond is bringing the agent back (a restart, an agent that exited):
  // a message sent meanwhile is queued at once and sent once it is back.
  const bringingBack =
    !!s && !!s.agentRecovery && (s.state === SessionState.WAITING_FOR_INPUT || s.state === SessionState.RUNNING || s.state === SessionState.STARTING);
  // A message sent while the agent works waits in the session's queue.
  const canQueue =
    !!s && !offline && (s.state === SessionState.RUNNING || (s.state === SessionState.WAITING_FOR_INPUT && s.queuedMessages.length > 0) || bringingBack);
  // A cancel is done once the turn has ended (the session left RUNNING).
  useEffect(() => {
    if (!turnRunning) setCancelling(false);
  }, [turnRunning]);
  // The offer to retry an interrupted turn is brought into view, clear of
  // the pinned composer, as a permission request is.
  const offerRetry = !!interrupted && canSend && s?.state === SessionState.WAITING_FOR_INPUT;
  const retryBanner = useRef<HTMLDivElement>(null);
  useEffect(() => {
    if (offerRetry) retryBanner.current?.scrollIntoView({ block: "nearest" });
  }, [offerRetry]);

  if (missing || watch === "missing") {
    return (
      <Missing what="Session" error={missing || `no session ${sessionId} in this task`} back={`#/tasks/${taskId}`} backLabel="Back to the task" />
    );
  }
  return (
    <section class="session">
      <div class="session-head">
        <h1 data-testid="session-title">{title || `Session ${shortId(sessionId)}`}</h1>
        {title && <span class="muted mono">{shortId(sessionId)}</span>}
        {renaming === null && (
          <button type="button" class="link" data-testid="rename" onClick={() => setRenaming(title ?? "")}>
            Rename
          </button>
        )}
        {s && (
          <span
            class={offline ? "badges stale" : "badges"}
            data-testid="session-badges"
            title={offline ? "as last seen: sessiond is unreachable" : undefined}
          >
            <Badge tone={stateTone(s.state)} testid="state">{stateLabel[s.state]}</Badge>
            <Badge tone={executorTone(s.executorStatus)} testid="executor">{executorLabel[s.executorStatus]}</Badge>
            {recovering && <Badge tone="warn" testid="recovering">recovering</Badge>}
            {workspaceOnly && <Badge tone="warn" testid="workspace-only">workspace only</Badge>}
            {profileName && <Badge tone="idle">{profileName}</Badge>}
            <Badge tone="idle">{runtimeName(s.runtime, s.runtimeName)}</Badge>
            {s.usage && s.usage.turns > 0n && (
              <Badge tone="idle" testid="usage">
                {usageText(s.usage)}
              </Badge>
            )}
          </span>
        )}
        {s && !ended && !stopping && (
          <button type="button" class="secondary" data-testid="stop" onClick={() => setStopping(true)}>
            Stop
          </button>
        )}
        {s && !ended && stopping && (
          <span class="row">
            <button type="button" class="danger" data-testid="confirm-stop" onClick={stopSession} title="The session ends for good; its messages and workspace stay">
              End the session for good
            </button>
            <button type="button" class="secondary" onClick={() => setStopping(false)}>
              Keep it
            </button>
          </span>
        )}
      </div>
      {renaming !== null && (
        <form
          class="row rename"
          data-testid="rename-form"
          onSubmit={(e) => {
            e.preventDefault();
            rename(renaming);
          }}
        >
          <label class="grow">
            <span class="sr">Session title</span>
            <input
              name="session-title"
              value={renaming}
              maxLength={200}
              placeholder="A title for this session"
              autoFocus
              onInput={(e) => setRenaming((e.target as HTMLInputElement).value)}
              onKeyDown={(e) => {
                if (e.key === "Escape") {
                  setRenaming(null);
                  setTitleError("");
                }
              }}
            />
          </label>
          <button type="submit">Save</button>
          <button
            type="button"
            class="secondary"
            onClick={() => {
              setRenaming(null);
              setTitleError("");
            }}
          >
            Cancel
          </button>
        </form>
      )}
      <ErrorLine error={titleError} />
      {s && !ended && (s.modes?.available.length || s.configOptions.length) ? (
        <div class="session-config" data-testid="session-config">
          {s.modes && s.modes.available.length > 0 && (
            <label>
              Mode
              <select
                data-testid="mode-select"
                value={s.modes.currentModeId}
                onChange={(e) => {
                  const modeId = (e.target as HTMLSelectElement).value;
                  sessions
                    .setSessionMode({ taskId, sessionId, modeId })
                    .then(refresh)
                    .catch((err) => setStatusError(describe(err)));
                }}
              >
                {s.modes.available.map((m) => (
                  <option key={m.id} value={m.id} title={m.description}>
                    {m.name || m.id}
                  </option>
                ))}
              </select>
            </label>
          )}
          {s.configOptions.map((o) => {
            const set = (value: string) =>
              sessions
                .setSessionConfigOption({ taskId, sessionId, configId: o.id, value })
                .then(refresh)
                .catch((err) => setStatusError(describe(err)));
            return (
              <label key={o.id} title={o.description}>
                {o.name || o.id}
                {o.type === "boolean" ? (
                  <input
                    type="checkbox"
                    data-testid={`config-${o.id}`}
                    checked={o.currentValue === "true"}
                    onChange={(e) => set(String((e.target as HTMLInputElement).checked))}
                  />
                ) : (
                  <select data-testid={`config-${o.id}`} value={o.currentValue} onChange={(e) => set((e.target as HTMLSelectElement).value)}>
                    {o.values.map((v) => (
                      <option key={v.value} value={v.value} title={v.description}>
                        {v.name || v.value}
                      </option>
                    ))}
                  </select>
                )}
              </label>
            );
          })}
        </div>
      ) : null}
      {/* One banner at a time: the page's own says when sessiond is unreachable. */}
      {watch === "reconnecting" && !offline && (
        <p class="banner warn" role="status" data-testid="reconnecting">
          reconnecting…
        </p>
      )}
      <ErrorLine error={statusError} />
      {s?.agentRecovery && !ended && (
        <div class="banner info" role="status" data-testid="agent-recovery">
          <Spinner label={recoveryText(s.agentRecovery) + "… the workspace is usable meanwhile."} />
          {s.agentRecovery.lastError && <span class="muted"> Last attempt: {s.agentRecovery.lastError}</span>}
        </div>
      )}
      {/* While startup recovery runs it resumes the agent by itself. */}
      {s && s.needsResume && !resuming && props.backend !== "recovering" && (
        <div class="banner info" data-testid="needs-resume">
          <span>{reasonLabel[s.resumeReason] || "The agent is not running."}</span>
          <button type="button" onClick={resume}>
            Resume
          </button>
        </div>
      )}
      {resuming && (
        <div class="banner info">
          <Spinner label="Resuming the agent…" />
        </div>
      )}
      {showNewSession && (
        <div class="banner bad" role="alert" data-testid="not-resumable">
          <span>
            {failedResume
              ? `${failedResume.reason}: ${failedResume.message}`
              : ended
                ? reasonLabel[ResumeReason.SESSION_ENDED]
                : s?.errorMessage || reasonLabel[s!.resumeReason] || "The agent cannot be resumed."}
          </span>
          <button type="button" onClick={startNew} disabled={starting}>
            {starting ? <Spinner label="Starting…" /> : "Start a new session"}
          </button>
        </div>
      )}
      <div class="session-body">
        <div class="conversation">
          <ol
            // While its agent is brought back, a reply cut by the restart
            // is not streaming (it is settled once the agent is back).
            class={s?.agentRecovery && !ended ? "messages agent-down" : "messages"}
            ref={list}
            data-testid="messages"
            aria-live="polite"
            aria-label="Conversation"
            // Focusable, so the keyboard scrolls it (arrows, Page Up/Down, Home/End).
            tabIndex={0}
            onScroll={(e) => {
              const el = e.currentTarget as HTMLElement;
              stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 40;
            }}
          >
            {messages.map((m) =>
              hidden(m) || (m.part.case === "terminal" && shownInToolCall.has(m.part.value.terminalId)) ? null : (
                <MessageView
                  key={m.id}
                  message={m}
                  stop={m.role === MessageRole.USER ? stops.get(m.id) : undefined}
                  terminals={m.part.case === "toolCall" ? toolTerminals.get(m.id) : undefined}
                />
              ),
            )}
          </ol>
          <PermissionPrompts
            taskId={taskId}
            sessionId={sessionId}
            requests={pendingPermissions}
            onGone={(id) => setResolved((r) => new Set(r).add(id))}
            onError={fail(setError)}
          />
          {offerRetry && (
            <div class="banner warn" data-testid="interrupted" ref={retryBanner}>
              <span>The last turn was interrupted and not sent again; the agent may have run part of it.</span>
              <button type="button" onClick={retry} disabled={retrying}>
                Retry it
              </button>
            </div>
          )}
          {s && s.queuedMessages.length > 0 && (
            <div class="queued" data-testid="queued" role="region" aria-label="Queued messages">
              <span class="muted">
                {s.queueHeld
                  ? "Queued, held because the last turn was interrupted: Retry it first, or send a new message to go on without it:"
                  : bringingBack
                    ? "Queued, sent one turn at a time once the agent is back:"
                    : "Queued, sent one turn at a time after the running turn:"}
              </span>
              <ol>
                {s.queuedMessages.map((q) => (
                  <li key={q.id} data-queued={q.id}>
                    <span class="grow">{q.content}</span>
                    <button type="button" class="secondary" disabled={unqueuing.has(q.id)} onClick={() => unqueue(q.id)} aria-label={`Remove the queued message: ${q.content}`}>
                      Remove
                    </button>
                  </li>
                ))}
              </ol>
            </div>
          )}
          <form
            class="composer"
            onSubmit={(e) => {
              e.preventDefault();
              send();
            }}
          >
            {showSlash && (
              <ul class="slash" role="listbox" id="slash-commands" data-testid="slash-commands" aria-label="The agent's commands">
                {matches.map((c) => (
                  <li
                    key={c.name}
                    id={`slash-${c.name}`}
                    role="option"
                    aria-selected={c === picked}
                    onMouseDown={(e) => {
                      e.preventDefault();
                      complete(c);
                    }}
                  >
                    <code>/{c.name}</code> <span class="muted">{c.description}{c.inputHint ? ` (${c.inputHint})` : ""}</span>
                  </li>
                ))}
              </ul>
            )}
            <label class="grow">
              <span class="sr">Message</span>
              <textarea
                name="message"
                rows={2}
                aria-autocomplete="list"
                aria-controls={showSlash ? "slash-commands" : undefined}
                aria-activedescendant={showSlash && picked ? `slash-${picked.name}` : undefined}
                placeholder={
                  canSend
                    ? "Message the agent (Enter sends, Shift+Enter new line)"
                    : offline
                      ? "sessiond is unreachable; sending resumes once it is back"
                      : canQueue
                        ? bringingBack
                          ? "The agent is being brought back: Enter queues your message, sent once it is back"
                          : "The agent is answering: Enter queues your message for after it (Esc cancels the turn)"
                        : "The agent is not running"
                }
                value={draft}
                onInput={(e) => {
                  setDraft((e.target as HTMLTextAreaElement).value);
                  setSlashClosed(false);
                }}
                onKeyDown={(e) => {
                  if (showSlash && picked && (e.key === "Tab" || (e.key === "Enter" && !e.shiftKey && !exact))) {
                    e.preventDefault();
                    complete(picked);
                  } else if (showSlash && (e.key === "ArrowDown" || e.key === "ArrowUp")) {
                    e.preventDefault();
                    setPick((i) => (i + (e.key === "ArrowDown" ? 1 : matches.length - 1)) % matches.length);
                  } else if (showSlash && e.key === "Escape") {
                    e.preventDefault();
                    setSlashClosed(true);
                  } else if (e.key === "Enter" && !e.shiftKey) {
                    e.preventDefault();
                    send();
                  } else if (e.key === "Escape" && turnRunning && !cancelling) {
                    e.preventDefault();
                    cancelTurn();
                  }
                }}
              />
            </label>
            {turnRunning && (
              <button type="button" class="secondary" data-testid="cancel-turn" onClick={cancelTurn} disabled={cancelling} title="Cancel the turn (Esc)">
                {cancelling ? "Cancelling…" : "Cancel turn"}
              </button>
            )}
            <button type="submit" disabled={!(canSend || canQueue)} data-testid="send">
              {canSend || !canQueue ? "Send" : "Queue"}
            </button>
          </form>
          <ErrorLine error={error} />
        </div>
        <Workspace
          taskId={taskId}
          sessionId={sessionId}
          ready={s?.executorStatus === ExecutorStatus.READY}
          branch={s?.worktreeBranch ?? ""}
          base={s?.worktreeBase ?? ""}
          refresh={filesKey}
        />
      </div>
    </section>
  );
}

/** A fresh idempotency key for SendMessage (random, works without a secure context). */
function newRequestId(): string {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
