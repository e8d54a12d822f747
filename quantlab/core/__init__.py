"""The quantizer core: numerics (primitives, packing), QuantLinear, observers, activation quantizers,
per-layer overrides, the method registry and the lifecycle (prepare -> calibrate -> train -> convert)."""
