"""LoRA refit trainer -> rollout engine: adapter-only or merged, bucketed, checksummed, resharded."""
from moerl.refit.engine_process import EngineProcess
from moerl.refit.plan import CorruptBucketError, RefitError
from moerl.refit.refitter import Refitter, make_refitter

__all__ = ["EngineProcess", "Refitter", "make_refitter", "RefitError", "CorruptBucketError"]
