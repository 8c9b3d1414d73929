"""Raises ValueError at import naming the first malformed TMS_* variable (src/face/module_env.c). No members."""
