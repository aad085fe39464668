"""Which ``model.*`` keys each model family reads (``moerl.models.presets.build_hf_config``).

A key a family never reads would be ignored silently while still naming the run and changing its identity
(``model.first_k_dense=4`` on qwen3_moe retrained a warm start whose layers were all still MoE). The config
loader refuses such a key when it is set away from its default (a recorded run's config.yaml holds every
key at its default, which must keep loading), and ``--print-config`` shows only the keys the family reads.

To add a family: give it a row of ``FAMILY_KEYS`` (the keys its builder reads) and a reason in
``WHY_UNREAD`` for each key it does not read that another family does.
"""
from __future__ import annotations

# Read by every family's builder.
COMMON = ("preset", "hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size", "num_heads",
          "head_dim", "init_std", "experts_implementation", "router_aux_loss_coef", "overrides")

FAMILY_KEYS: dict[str, frozenset[str]] = {
    "qwen3_moe": frozenset(COMMON + ("num_kv_heads",)),
    "mixtral": frozenset(COMMON + ("num_kv_heads",)),
    # MLA projects keys and values for every head: num_kv_heads is not read.
    "deepseek_v3": frozenset(COMMON + ("first_k_dense", "n_shared_experts", "n_group", "topk_group")),
}

# Why a family does not read a key (shown in the refusal); keys not listed get the generic reason.
WHY_UNREAD: dict[tuple[str, str], str] = {
    ("deepseek_v3", "num_kv_heads"): "model.preset=deepseek_v3 projects keys and values for every head (MLA)",
}


def keys_read(preset: str) -> frozenset[str]:
    """The ``model.*`` keys family ``preset`` reads (none known for a family without a row)."""
    return FAMILY_KEYS.get(preset, frozenset())


def why_unread(preset: str, key: str) -> str:
    """The reason a refusal of ``model.<key>`` on ``preset`` gives."""
    if (preset, key) in WHY_UNREAD:
        return WHY_UNREAD[(preset, key)]
    readers = sorted(p for p, keys in FAMILY_KEYS.items() if key in keys)
    return f"model.preset={preset} (only {', '.join(readers) or 'no family'} reads it)"


def unread_keys(preset: str, all_keys) -> list[str]:
    """The keys of ``all_keys`` that some family reads but family ``preset`` does not, in their order ([] for
    a family without a row: nothing is known to be unread). Keys no row names (``model.path``,
    ``model.trust_remote_code``: where the model comes from, not how a family builds it) are left to the
    config's own rules."""
    if preset not in FAMILY_KEYS:
        return []
    read, known = FAMILY_KEYS[preset], frozenset().union(*FAMILY_KEYS.values())
    return [k for k in all_keys if k in known and k not in read]
