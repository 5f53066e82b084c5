"""Optional features over the core: structured output, tool calling, the interactive chat, attention sinks, tensor
parallel, calibrated int4."""
