"""Router Replay: routing traces, their transfer form, engine-output parsing, replay sessions, diagnostics."""
from moerl.replay.diagnostics import ReplayViolation, routing_agreement, routing_metrics  # noqa: F401
from moerl.replay.session import RoutingSession, routing_session  # noqa: F401
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype  # noqa: F401
