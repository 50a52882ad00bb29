import { useEffect, useRef, useState } from "preact/hooks";
import { reason, sessions } from "./api";
import type { FileDiff, PermissionRequest, ToolCallPart } from "./gen/sessiond/v1/types_pb";

/** Lines of a change, each `[" " | "-" | "+", text]`: a longest-common-subsequence diff (plain old/new beyond 400 lines a side). */
export function lineDiff(oldText: string | undefined, newText: string): [string, string][] {
  const a = oldText === undefined ? [] : oldText.split("\n");
  const b = newText.split("\n");
  if (a.length > 400 || b.length > 400) return [...a.map((l): [string, string] => ["-", l]), ...b.map((l): [string, string] => ["+", l])];
  // lcs[i][j]: common lines of a[i..] and b[j..].
  const lcs = Array.from({ length: a.length + 1 }, () => new Array<number>(b.length + 1).fill(0));
  for (let i = a.length - 1; i >= 0; i--)
    for (let j = b.length - 1; j >= 0; j--) lcs[i][j] = a[i] === b[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
  const out: [string, string][] = [];
  let [i, j] = [0, 0];
  while (i < a.length || j < b.length) {
    if (i < a.length && j < b.length && a[i] === b[j]) out.push([" ", a[i++]]), j++;
    // Removals before additions, as unified diffs show them.
    else if (i < a.length && (j === b.length || lcs[i + 1][j] >= lcs[i][j + 1])) out.push(["-", a[i++]]);
    else out.push(["+", b[j++]]);
  }
  return out;
}

/** Unchanged lines kept around each change; longer runs fold into one line. */
const CONTEXT = 3;

/** A diff's rows: changed lines with CONTEXT lines around them, each longer
 * unchanged run as a count. */
function foldDiff(lines: [string, string][]): ([string, string] | number)[] {
  const near = lines.map(() => false);
  lines.forEach(([sign], i) => {
    if (sign === " ") return;
    for (let j = Math.max(0, i - CONTEXT); j <= Math.min(lines.length - 1, i + CONTEXT); j++) near[j] = true;
  });
  const out: ([string, string] | number)[] = [];
  for (let i = 0; i < lines.length; i++) {
    if (near[i]) out.push(lines[i]);
    else if (typeof out[out.length - 1] === "number") (out[out.length - 1] as number)++;
    else out.push(1);
  }
  return out;
}

/** A file change as a unified diff, from its old and new text. Text only:
 * nothing in a file becomes markup. */
export function DiffView(props: { diff: FileDiff; testid?: string }) {
  const d = props.diff;
  const rows = foldDiff(lineDiff(d.oldText, d.newText));
  const added = rows.filter((r) => typeof r !== "number" && r[0] === "+").length;
  const removed = rows.filter((r) => typeof r !== "number" && r[0] === "-").length;
  return (
    <figure class="viewer">
      <figcaption>
        {d.oldText === undefined ? "new file " : "change of "}
        {d.path}
        <span class="muted">
          {" "}
          +{added} −{removed}
        </span>
      </figcaption>
      <pre class="diff" data-testid={props.testid ?? "permission-diff"} tabIndex={0}>
        {rows.map((r, i) =>
          typeof r === "number" ? (
            <div key={i} class="fold">
              ⋯ {r} unchanged line{r === 1 ? "" : "s"}
            </div>
          ) : (
            <div key={i} class={r[0] === "+" ? "add" : r[0] === "-" ? "del" : ""}>
              {r[0]} {r[1]}
            </div>
          ),
        )}
      </pre>
    </figure>
  );
}

/** The command a tool call runs, from its raw input (`command`, as text or argv). */
function commandOf(t: ToolCallPart | undefined): string {
  if (!t?.rawInputJson) return "";
  try {
    const input = JSON.parse(t.rawInputJson);
    const c = input?.command ?? input?.cmd;
    return Array.isArray(c) ? c.join(" ") : typeof c === "string" ? c : "";
  } catch {
    return "";
  }
}

/** What a permission request would approve: the command, the file changes. */
function Approves(props: { toolCall?: ToolCallPart }) {
  const command = commandOf(props.toolCall);
  const diffs = (props.toolCall?.content ?? []).flatMap((c) => (c.content.case === "diff" ? [c.content.value] : []));
  return (
    <>
      {command && (
        <pre class="command" data-testid="permission-command">
          {"$ "}
          {command}
        </pre>
      )}
      {diffs.map((d, i) => (
        <DiffView key={i} diff={d} />
      ))}
    </>
  );
}

/**
 * The agent's pending permission requests (profile policy `ask`), one
 * prompt each with a button per option the agent offered. The list comes
 * from GetSessionStatus (so a reload or reconnect shows what still waits)
 * and the `permission.requested`/`permission.resolved` events.
 */
export function PermissionPrompts(props: {
  taskId: string;
  sessionId: string;
  requests: PermissionRequest[];
  onGone: (requestId: string) => void;
  onError: (err: unknown) => void;
}) {
  const [busy, setBusy] = useState<string>("");
  // Always in the page, so screen readers announce what appears in it.
  const announced = (
    <p class="sr" aria-live="assertive" data-testid="permissions-live">
      {props.requests.map((r) => `The agent asks permission: ${r.toolCall?.title || "a tool call"}.`).join(" ")}
    </p>
  );
  // A request that appears needs an answer: it is brought into view, clear
  // of the composer pinned below it (the page's `scroll-padding-bottom`).
  const region = useRef<HTMLDivElement>(null);
  const ids = props.requests.map((r) => r.requestId).join(",");
  useEffect(() => {
    if (ids) region.current?.scrollIntoView({ block: "nearest" });
  }, [ids]);
  if (props.requests.length === 0) return announced;
  const answer = async (r: PermissionRequest, optionId: string, contentJson = "") => {
    setBusy(r.requestId);
    try {
      await sessions.respondToPermission({ taskId: props.taskId, sessionId: props.sessionId, requestId: r.requestId, optionId, contentJson });
    } catch (err) {
      // Answered, timed out or cancelled meanwhile: the prompt is stale.
      const why = reason(err);
      if (why === "permission_resolved" || why === "permission_not_found") props.onGone(r.requestId);
      else props.onError(err);
    } finally {
      setBusy("");
    }
  };
  return (
    <>
    {announced}
    <div class="permissions" data-testid="permissions" role="region" aria-label="Permission requests" ref={region}>
      {props.requests.map((r) =>
        r.elicitation ? (
          <Question key={r.requestId} request={r} busy={busy === r.requestId} answer={answer} />
        ) : (
        <div key={r.requestId} class="banner info permission" role="group" aria-label="Permission request" data-request={r.requestId}>
          <span>
            The agent asks permission: <strong>{r.toolCall?.title || "a tool call"}</strong>
            {r.expiresAt && (
              <span class="hint" data-testid="permission-expires">
                {" "}
                (rejected automatically at {new Date(Number(r.expiresAt.seconds) * 1000).toLocaleTimeString()} unless you answer)
              </span>
            )}
          </span>
          <Approves toolCall={r.toolCall} />
          <span class="row">
            {r.options.map((o) => (
              <button
                key={o.optionId}
                type="button"
                class={o.kind.startsWith("reject") ? "secondary" : ""}
                data-option={o.optionId}
                disabled={busy === r.requestId}
                onClick={() => answer(r, o.optionId)}
              >
                {o.name || o.optionId}
              </button>
            ))}
          </span>
        </div>
        ),
      )}
    </div>
    </>
  );
}

/** One field of an elicitation's form, as its JSON Schema describes it. */
type Field = { name: string; label: string; type: string; options: string[]; required: boolean };

function fieldsOf(schemaJson: string): Field[] {
  let schema: { properties?: Record<string, Record<string, unknown>>; required?: string[] } = {};
  try {
    schema = JSON.parse(schemaJson || "{}");
  } catch {
    return [];
  }
  const required = new Set(schema.required ?? []);
  return Object.entries(schema.properties ?? {}).map(([name, p]) => ({
    name,
    label: typeof p.title === "string" ? p.title : name,
    type: typeof p.type === "string" ? p.type : "string",
    options: Array.isArray(p.enum) ? p.enum.map(String) : [],
    required: required.has(name),
  }));
}

/**
 * A question the agent asks (ACP elicitation): its form, answered with the
 * values (Submit), or declined, or cancelled; a URL question links its page.
 */
function Question(props: {
  request: PermissionRequest;
  busy: boolean;
  answer: (r: PermissionRequest, optionId: string, contentJson?: string) => void;
}) {
  const r = props.request;
  const q = r.elicitation!;
  const fields = fieldsOf(q.requestedSchemaJson);
  const [values, setValues] = useState<Record<string, string | boolean>>({});
  const submit = (e: Event) => {
    e.preventDefault();
    const content: Record<string, unknown> = {};
    for (const f of fields) {
      const v = values[f.name];
      if (v === undefined || v === "") continue;
      content[f.name] = f.type === "number" || f.type === "integer" ? Number(v) : v;
    }
    props.answer(r, "accept", JSON.stringify(content));
  };
  return (
    <form class="banner info permission question" aria-label="The agent asks" data-request={r.requestId} data-testid="question" onSubmit={submit}>
      <span>
        The agent asks: <strong>{q.message}</strong>
      </span>
      {q.mode === "url" && q.url && (
        // Only a web page is a link: an agent's `javascript:` (or any other
        // scheme) URL would run in this tab, which holds the API token.
        /^https?:\/\//i.test(q.url) ? (
          <a href={q.url} target="_blank" rel="noopener noreferrer">
            {q.url}
          </a>
        ) : (
          <span data-testid="unlinked-url">
            <code>{q.url}</code> (not a web address: not linked)
          </span>
        )
      )}
      {fields.map((f) => (
        <label key={f.name} class="row">
          <span>
            {f.label}
            {f.required ? " *" : ""}
          </span>
          {f.type === "boolean" ? (
            <input type="checkbox" name={f.name} checked={!!values[f.name]} onChange={(e) => setValues({ ...values, [f.name]: (e.target as HTMLInputElement).checked })} />
          ) : f.options.length > 0 ? (
            <select name={f.name} required={f.required} value={String(values[f.name] ?? "")} onChange={(e) => setValues({ ...values, [f.name]: (e.target as HTMLSelectElement).value })}>
              <option value="" />
              {f.options.map((o) => (
                <option key={o} value={o}>
                  {o}
                </option>
              ))}
            </select>
          ) : (
            <input
              type={(f.type === "number" || f.type === "integer" ? "number" : "text") as "text"}
              name={f.name}
              required={f.required}
              value={String(values[f.name] ?? "")}
              onInput={(e) => setValues({ ...values, [f.name]: (e.target as HTMLInputElement).value })}
            />
          )}
        </label>
      ))}
      <span class="row">
        <button type="submit" data-option="accept" disabled={props.busy}>
          Submit
        </button>
        <button type="button" class="secondary" data-option="decline" disabled={props.busy} onClick={() => props.answer(r, "decline")}>
          Decline
        </button>
        <button type="button" class="secondary" data-option="cancel" disabled={props.busy} onClick={() => props.answer(r, "cancel")}>
          Cancel
        </button>
      </span>
    </form>
  );
}
