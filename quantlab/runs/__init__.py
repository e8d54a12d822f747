"""Experiments: TOML files (experiment, tomlwrite), running them (runner), results files (results) and
the environment stamped into every row (envinfo)."""
