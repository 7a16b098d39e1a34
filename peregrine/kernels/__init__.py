"""Triton kernels, each tested against the pure-torch function of the same job in reference.py.

Modules: store_kv, decode_attention (flash-decoding), extend_attention (paged prefill),
rmsnorm (rms_norm), rotary (apply_rope), activation (silu_and_mul).
Import them directly: this package itself imports no triton.
"""
