// Human labels for the API's enums.
import { ExecutorStatus, ResumeReason, Runtime, SessionState, MessageRole } from "./gen/sessiond/v1/types_pb";

export const stateLabel: Record<SessionState, string> = {
  [SessionState.UNSPECIFIED]: "unknown",
  [SessionState.CREATED]: "created",
  [SessionState.STARTING]: "starting",
  [SessionState.RUNNING]: "running",
  [SessionState.WAITING_FOR_INPUT]: "waiting for input",
  [SessionState.COMPLETED]: "completed",
  [SessionState.CANCELLED]: "cancelled",
  [SessionState.ERROR]: "error",
};

export const executorLabel: Record<ExecutorStatus, string> = {
  [ExecutorStatus.UNSPECIFIED]: "no executor",
  [ExecutorStatus.STARTING]: "executor starting",
  [ExecutorStatus.READY]: "executor ready",
  [ExecutorStatus.ERROR]: "executor error",
  [ExecutorStatus.STOPPED]: "executor stopped",
};

export const runtimeLabel: Record<Runtime, string> = {
  [Runtime.UNSPECIFIED]: "default runtime",
  [Runtime.LOCAL_DOCKER]: "docker",
  [Runtime.LOCAL_STANDALONE]: "local",
  [Runtime.REMOTE]: "remote",
  [Runtime.CUSTOM]: "custom runtime",
};

/** A session's runtime as shown: a custom runtime by the name it was registered under. */
export const runtimeName = (runtime: Runtime, name: string): string =>
  runtime === Runtime.CUSTOM && name ? name : runtimeLabel[runtime];

export const reasonLabel: Record<ResumeReason, string> = {
  [ResumeReason.UNSPECIFIED]: "",
  [ResumeReason.AGENT_NOT_RUNNING]: "The agent is not running; it can be resumed.",
  [ResumeReason.NOT_RESUMABLE]: "This agent cannot resume conversations.",
  [ResumeReason.MISSING_RESUME_TOKEN]: "The agent never gave a resume token.",
  [ResumeReason.SESSION_ENDED]: "The session has ended.",
};

export const roleLabel: Record<MessageRole, string> = {
  [MessageRole.UNSPECIFIED]: "",
  [MessageRole.USER]: "you",
  [MessageRole.AGENT]: "agent",
  [MessageRole.SYSTEM]: "system",
};

export function stateTone(s: SessionState): string {
  switch (s) {
    case SessionState.RUNNING:
    case SessionState.WAITING_FOR_INPUT:
      return "ok";
    case SessionState.ERROR:
      return "bad";
    case SessionState.STARTING:
    case SessionState.CREATED:
      return "busy";
    default:
      return "idle";
  }
}

export function executorTone(s: ExecutorStatus): string {
  return s === ExecutorStatus.READY ? "ok" : s === ExecutorStatus.ERROR ? "bad" : s === ExecutorStatus.STARTING ? "busy" : "idle";
}
