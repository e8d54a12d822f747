"""What calibrated methods share, none of it a method: the block-by-block driver and module-call replay (blocks),
folding per-channel scales into producers and consumers (smoothing), and AWQ's scale and clip searches as pure
functions (awq_search)."""
