"""The run config: its sections (dataclasses), loading (YAML + ``key=value`` overrides), the
load-time checks (names, ranges, cross-field rules), the generated reference and the built-in
recipe. Nothing here starts a process or touches a device."""
