"""Router Replay: routing traces, their transfer form, engine-output parsing, replay sessions, diagnostics."""
from moerl.replay.diagnostics import (ReplayViolation, replay_plan, pick_trace, routing_agreement,  # noqa: F401
                                      routing_metrics)
from moerl.replay.session import RoutingSession, routing_session  # noqa: F401
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype  # noqa: F401
