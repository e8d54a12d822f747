"""Quantization-aware training: the training loop and its settings, LSQ, the trainable modules, checkpoints."""
