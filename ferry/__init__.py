"""ferry: coalesce many concurrent calls into batched calls (SPEC section 2)."""
