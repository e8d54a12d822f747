"""Per-layer sensitivity, the mixed-precision solver under a budget, and the sensitivity plot."""
