"""Raises ValueError at import naming the first malformed TMS_* variable (src/module_env.c). No members."""
