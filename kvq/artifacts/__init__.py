"""Artifacts: a folder with `manifest.json` and `tensors.safetensors` (docs/artifact-format.md).

    store.py    write (atomic) and read (every field, tensor and hash verified)
    compat.py   refuse an artifact for another model; `load_artifact` = read + check
    paths.py    atomic folders and files, crash leftovers, --overwrite's rules

Exports to other engines' formats live in `kvq.exporters`.
"""
