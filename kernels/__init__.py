"""Compute kernels: each Triton kernel sits beside a plain-torch reference with the same signature.

`hibana_core` calls the dispatching functions exported here; on the CPU they run the references.
"""

from kernels.attention import paged_attention, store_kv

__all__ = ["paged_attention", "store_kv"]
