"""llama.cpp's quantization types as quantlab grids (`format = "q4_k"`), ported bit for bit from ggml-quants.c:
legacy.py (Q4_0 .. Q8_0), kquants.py (Q2_K .. Q6_K), iquants.py (IQ4_NL, IQ4_XS), the registry and row helpers in
registry.py, the contract each type implements in types.py, llama.cpp's per-tensor recipes ("Q4_K_M") in recipes.py.
"""
