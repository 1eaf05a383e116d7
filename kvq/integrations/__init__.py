"""Optional integrations with other tools; each module needs its own extra installed.

Nothing is imported here: importing `kvq.integrations.lm_eval` is what registers the `kvq`
model type with lm-evaluation-harness (`pip install kvq-live[eval]`).
"""
