"""moerl: LoRA GRPO on MoE models with Router Replay, LoRA refit and mismatch ablations."""
