"""Model transforms applied before quantization (rotations) and the matrices they use."""
