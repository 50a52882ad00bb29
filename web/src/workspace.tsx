import { useEffect, useState } from "preact/hooks";
import { describe, workspace } from "./api";
import { authFailed } from "./app";
import type { BranchCommit, DirEntry, GitStatusResponse, ExecResponse } from "./gen/sessiond/v1/workspace_service_pb";

const text = new TextDecoder();

type Tab = "files" | "git" | "run";

/** Shell, files and git of the session's worktree: usable whenever the
 * executor is ready, whether or not the agent runs. */
export function Workspace(props: { taskId: string; sessionId: string; ready: boolean; branch: string; base: string; refresh: number }) {
  const [tab, setTab] = useState<Tab>("files");
  const session = { taskId: props.taskId, sessionId: props.sessionId };
  return (
    <aside class="workspace card" aria-label="Workspace">
      <div class="tabs" role="tablist">
        {(["files", "git", "run"] as Tab[]).map((t) => (
          <button
            key={t}
            type="button"
            role="tab"
            aria-selected={tab === t}
            class={tab === t ? "tab active" : "tab"}
            onClick={() => setTab(t)}
          >
            {t === "files" ? "Files" : t === "git" ? "Git" : "Run"}
          </button>
        ))}
      </div>
      {!props.ready ? (
        <p class="muted">The workspace is available once the executor is ready.</p>
      ) : tab === "files" ? (
        <Files session={session} refresh={props.refresh} />
      ) : tab === "git" ? (
        <Git session={session} branch={props.branch} base={props.base} />
      ) : (
        <Run session={session} />
      )}
    </aside>
  );
}

type Ref = { taskId: string; sessionId: string };

function useError(): [string, (s: string) => void, (err: unknown) => void] {
  const [error, setError] = useState("");
  return [error, setError, (err) => !authFailed(err) && setError(describe(err))];
}

/** A directory's entries; read again when `refresh` changes (the agent wrote). */
function Dir(props: { session: Ref; path: string; onOpen: (p: string) => void; refresh: number }) {
  const [entries, setEntries] = useState<DirEntry[] | null>(null);
  const [open, setOpen] = useState<Record<string, boolean>>({});
  const [error, , onError] = useError();
  useEffect(() => {
    workspace
      .listDir({ session: props.session, path: props.path })
      .then((r) =>
        setEntries(
          [...r.entries].sort((a, b) => Number(b.isDir) - Number(a.isDir) || a.name.localeCompare(b.name)),
        ),
      )
      .catch(onError);
  }, [props.path, props.refresh]);
  if (error) return <p class="error">{error}</p>;
  if (!entries) return <p class="muted">Loading…</p>;
  return (
    <ul class="tree">
      {entries.map((e) => {
        const p = props.path ? `${props.path}/${e.name}` : e.name;
        return (
          <li key={e.name}>
            {e.isDir ? (
              <>
                <button type="button" class="link" aria-expanded={!!open[e.name]} onClick={() => setOpen({ ...open, [e.name]: !open[e.name] })}>
                  {open[e.name] ? "▾" : "▸"} {e.name}/
                </button>
                {open[e.name] && <Dir session={props.session} path={p} onOpen={props.onOpen} refresh={props.refresh} />}
              </>
            ) : (
              <button type="button" class="link file" onClick={() => props.onOpen(p)}>
                {e.name}
              </button>
            )}
          </li>
        );
      })}
    </ul>
  );
}

function Files(props: { session: Ref; refresh: number }) {
  const [file, setFile] = useState<{ path: string; content: string } | null>(null);
  const [error, setError, onError] = useError();
  const openFile = (path: string) => {
    setError("");
    workspace
      .readFile({ session: props.session, path })
      .then((r) => setFile({ path, content: text.decode(r.content) }))
      .catch(onError);
  };
  // The open file too may have changed.
  useEffect(() => {
    if (props.refresh && file) openFile(file.path);
  }, [props.refresh]);
  return (
    <div class="files" data-refresh={props.refresh}>
      <Dir session={props.session} path="" onOpen={openFile} refresh={props.refresh} />
      {error && <p class="error">{error}</p>}
      {file && (
        <figure class="viewer" data-testid="file-viewer">
          <figcaption>{file.path}</figcaption>
          <pre>{file.content}</pre>
        </figure>
      )}
    </div>
  );
}

/** Git status and diff. For a worktree sessiond created (it has a base),
 * the diff can also be everything the session changed since its base,
 * with the branch's commits: what a reviewer looks at. */
function Git(props: { session: Ref; branch: string; base: string }) {
  const [status, setStatus] = useState<GitStatusResponse | null>(null);
  const [diff, setDiff] = useState("");
  const [againstBase, setAgainstBase] = useState(false);
  const [commits, setCommits] = useState<BranchCommit[] | null>(null);
  const [error, setError, onError] = useError();
  const load = () => {
    setError("");
    workspace.gitStatus({ session: props.session }).then(setStatus).catch(onError);
    workspace
      .gitDiff({ session: props.session, againstBase })
      .then((r) => setDiff(r.diff))
      .catch(onError);
    if (againstBase) {
      workspace
        .listBranchCommits({ session: props.session })
        .then((r) => setCommits(r.commits))
        .catch(onError);
    } else {
      setCommits(null);
    }
  };
  useEffect(load, [againstBase]);
  return (
    <div class="git">
      <div class="row">
        <strong>{status ? `branch ${status.branch || "(detached)"}` : ""}</strong>
        {props.base && (
          <label class="inline">
            <input type="checkbox" name="against-base" checked={againstBase} onChange={(e) => setAgainstBase((e.target as HTMLInputElement).checked)} />
            changes since {props.base}
          </label>
        )}
        <button type="button" class="secondary" onClick={load}>
          Refresh
        </button>
      </div>
      {error && <p class="error">{error}</p>}
      {status && (
        <ul class="list compact" data-testid="git-status">
          {status.files.length === 0 && <li class="muted">clean</li>}
          {status.files.map((f) => (
            <li key={f.path}>
              <code>{f.code}</code> {f.path}
            </li>
          ))}
        </ul>
      )}
      {commits && (
        <ul class="list compact" data-testid="branch-commits">
          {commits.length === 0 && <li class="muted">no commits since {props.base}</li>}
          {commits.map((c) => (
            <li key={c.sha}>
              <code>{c.sha.slice(0, 10)}</code> {c.subject} <span class="muted">({c.author})</span>
            </li>
          ))}
        </ul>
      )}
      <pre class="diff" data-testid="git-diff">
        {diff.split("\n").map((line, i) => (
          <span key={i} class={line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : ""}>
            {line + "\n"}
          </span>
        ))}
      </pre>
    </div>
  );
}

function Run(props: { session: Ref }) {
  const [command, setCommand] = useState("");
  // The command line the result (or the run under way) is of.
  const [ran, setRan] = useState("");
  const [result, setResult] = useState<ExecResponse | null>(null);
  const [busy, setBusy] = useState(false);
  const [error, setError, onError] = useError();
  return (
    <div class="run">
      <form
        class="row"
        onSubmit={async (e) => {
          e.preventDefault();
          // The previous command's output goes: it would read as this one's.
          setResult(null);
          setRan(command);
          setBusy(true);
          setError("");
          try {
            // One command line, run by the worktree's shell.
            setResult(await workspace.exec({ session: props.session, command: "sh", args: ["-c", command], timeoutMs: 60000n }));
          } catch (err) {
            onError(err);
          } finally {
            setBusy(false);
          }
        }}
      >
        <label class="grow">
          <span class="sr">Command</span>
          <input name="command" placeholder="ls -la" value={command} onInput={(e) => setCommand((e.target as HTMLInputElement).value)} required />
        </label>
        <button type="submit" disabled={busy}>
          Run
        </button>
      </form>
      {error && <p class="error">{error}</p>}
      {busy && (
        <p class="muted" data-testid="exec-running" role="status">
          running <code>{ran}</code>…
        </p>
      )}
      {result && (
        <div data-testid="exec-result">
          <p>
            <code>{ran}</code>: {result.exitCode !== undefined
              ? `exit ${result.exitCode}`
              : result.signal !== undefined
                ? `killed by signal ${result.signal}`
                : "no exit code"}
            {result.timedOut ? " (timed out)" : ""}
          </p>
          <pre class="stdout">{text.decode(result.stdout)}</pre>
          {result.stdoutTruncated && (
            <p class="banner warn" data-testid="exec-truncated">
              The output was cut at {result.stdout.length.toLocaleString()} bytes: the command printed more. Send it to a
              file and open that file to see it all.
            </p>
          )}
          {result.stderr.length > 0 && <pre class="stderr">{text.decode(result.stderr)}</pre>}
          {result.stderrTruncated && (
            <p class="banner warn" data-testid="exec-truncated">
              Its errors were cut at {result.stderr.length.toLocaleString()} bytes.
            </p>
          )}
        </div>
      )}
    </div>
  );
}
