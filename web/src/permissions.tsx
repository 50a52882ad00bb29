import { useState } from "preact/hooks";
import { reason, sessions } from "./api";
import type { PermissionRequest } from "./gen/sessiond/v1/types_pb";

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
  if (props.requests.length === 0) return announced;
  const answer = async (r: PermissionRequest, optionId: string) => {
    setBusy(r.requestId);
    try {
      await sessions.respondToPermission({ taskId: props.taskId, sessionId: props.sessionId, requestId: r.requestId, optionId });
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
    <div class="permissions" data-testid="permissions" role="region" aria-label="Permission requests">
      {props.requests.map((r) => (
        <div key={r.requestId} class="banner info permission" role="group" aria-label="Permission request" data-request={r.requestId}>
          <span>
            The agent asks permission: <strong>{r.toolCall?.title || "a tool call"}</strong>
            {r.expiresAt && (
              <span class="hint" data-testid="permission-expires">
                {" "}
                (rejected by itself at {new Date(Number(r.expiresAt.seconds) * 1000).toLocaleTimeString()})
              </span>
            )}
          </span>
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
      ))}
    </div>
    </>
  );
}
