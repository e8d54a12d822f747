"""The floor every room stands on: input validation (checks) and device helpers (device). Imports no other room."""
