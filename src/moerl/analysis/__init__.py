"""The science layer: everything that turns recorded runs into tables, verdicts and figures.

``results`` loads run directories; ``collapse`` and ``verdicts`` are the rules; ``claims`` (experiment 05),
``dose`` (experiment 07) and ``geometry_report`` / ``routing_geometry`` (experiment 06) apply them;
``plots`` draws one figure per question. The system it measures (trainer, rollout, replay, refit, lora,
models, data, verl_ext) lives in the sibling packages.
"""
