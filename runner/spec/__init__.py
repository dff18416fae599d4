"""The job spec: frozen Pydantic models with their defaults and ranges (types), YAML loading with file:line
errors and `--set` overrides (load, yaml_lines), paths relative to the spec file (paths) and the user code a
spec may import (usercode). Imports only the package root and runner.models' table; never TensorFlow.
"""
