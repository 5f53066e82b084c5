"""Optional features over the core: structured output, tool calling, attention sinks, tensor parallel, calibrated int4."""
