"""Evaluation harness: perplexity + KL/top-1 vs a reference, latency, memory."""
from .latency import measure_latency
from .memory import peak_memory_mib, reset_peak_memory, weight_stats
from .perplexity import perplexity, reference_logprobs

__all__ = ["measure_latency", "peak_memory_mib", "reset_peak_memory", "weight_stats", "perplexity", "reference_logprobs"]
