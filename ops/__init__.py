"""Device-specific products and kernels: int4/int8 layouts, one-row CPU products, batch-invariant ops."""
